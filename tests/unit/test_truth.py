"""The simulator's ground truth (SIMULATED): sampled lengths, engines, pipelines, memory, links."""
import csv
import math
from dataclasses import replace

import numpy as np
import pytest

from nereus.models.spec import preset
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, ParallelConfig, SequenceSpec
from nereus.simulator.trace import constant_trace
from nereus.simulator.truth import network
from nereus.simulator.truth.corpus import CORPUS, tables_for
from nereus.simulator.truth.engine import _simulate, generation_times
from nereus.simulator.truth.lengths import LengthSampler
from nereus.simulator.truth.machine import GroundTruth
from nereus.simulator.truth.pipeline import _forward_pipeline, _one_f_one_b

H100 = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=1)
JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=32, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=1024, response_len_max=4096))


def _plan(gen_tp: int = 2, mb: int = 1, recompute: bool = True, zero: int = 3) -> Plan:
    st = [StagePlacement(name="actor/generation", config=ParallelConfig(tp=gen_tp, dp=8 // gen_tp), pool=0,
                         first_gpu=0, gpus=8)]
    for ms in ("actor/inference", "ref/inference", "actor/training"):
        st.append(StagePlacement(name=ms, config=ParallelConfig(dp=8, micro_batch=mb, zero=zero,
                                                                recompute=recompute and ms.endswith("training")),
                                 pool=0, first_gpu=0, gpus=8))
    return Plan(stages=tuple(st))


def test_sampled_lengths_follow_the_row_and_pile_up_at_the_cap():
    s = LengthSampler(prompts=128, samples=8, seed=3)
    x = s.sample(np.arange(4), np.array([3000.0, 3000, 6000, 6000]), np.full(4, np.nan), np.full(4, 8192.0))
    assert x.shape == (4, 1024) and x.max() <= 8192 and x.min() >= 1
    assert abs(x[:2].mean() / 3000 - 1) < 0.08 and abs(x[2:].mean() / 6000 - 1) < 0.08
    assert (x[2:] == 8192).mean() > 0.1 > (x[:2] == 8192).mean()  # a mean near the cap truncates more
    again = s.sample(np.arange(4), np.array([3000.0, 3000, 6000, 6000]), np.full(4, np.nan), np.full(4, 8192.0))
    assert (again == x).all() and not (x[0] == x[1]).all()  # seeded per step: same step, same lengths


def test_engine_closed_form_equals_the_event_simulation_when_everything_fits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 3000, size=(3, 64)).astype(np.int32)
    a = np.linspace(0.0, 0.02, 300)
    a[0] = 0.0

    def prefill(tokens, prompt):
        return 1e-5 * np.asarray(tokens, float)

    closed, pre = generation_times(lengths, np.full(3, 256.0), 2, a, 1e-8, 1e9, prefill, 256)
    reps = lengths.reshape(3, 2, 32).reshape(6, 32)
    event, _ = _simulate(reps, np.full(6, 256.0), a, 1e-8, 1e9, prefill, 256)
    assert pre.sum() == 0
    assert closed == pytest.approx(event.reshape(3, 2).max(axis=1), rel=1e-9)


def test_a_small_kv_budget_preempts_and_slows_the_engine():
    lengths = np.random.default_rng(1).integers(500, 4000, size=(2, 64)).astype(np.int32)
    a = np.full(300, 0.01)
    a[0] = 0.0

    def prefill(tokens, prompt):
        return 1e-5 * np.asarray(tokens, float)

    roomy, p0 = generation_times(lengths, np.full(2, 256.0), 1, a, 1e-7, 1e9, prefill, 256)
    tight, p1 = generation_times(lengths, np.full(2, 256.0), 1, a, 1e-7, 40_000, prefill, 256)
    assert p0.sum() == 0 and p1.sum() > 0 and (tight > roomy).all()


def test_one_f_one_b_makespan_is_the_textbook_one_for_equal_micro_batches():
    for pp, m in ((2, 4), (4, 8), (4, 2)):
        f = np.full((1, m), 1.0)
        done = _one_f_one_b(f, 2 * f, np.zeros((1, m)), pp)
        assert done[0] == pytest.approx((m + pp - 1) * 3.0)


def _one_f_one_b_reference(f, b, p2p, pp):
    """The event loop the truth ran before its columns were made contiguous: [X, m] arrays read by
    column, readiness by NaN (the reference ``_one_f_one_b`` must equal bit for bit)."""
    x, m = f.shape
    ops = []
    for s in range(pp):
        w = min(pp - s - 1, m)
        seq = [("F", i) for i in range(w)]
        for j in range(m - w):
            seq += [("F", w + j), ("B", j)]
        ops.append(seq + [("B", m - w + j) for j in range(w)])
    f_end, b_end = np.full((pp, m, x), np.nan), np.full((pp, m, x), np.nan)
    free, ptr = np.zeros((pp, x)), [0] * pp
    remaining = sum(len(o) for o in ops)
    while remaining:
        for s in range(pp):
            while ptr[s] < len(ops[s]):
                kind, i = ops[s][ptr[s]]
                if kind == "F":
                    dep = np.zeros(x) if s == 0 else f_end[s - 1, i] + p2p[:, i]
                else:
                    dep = f_end[s, i] if s == pp - 1 else b_end[s + 1, i] + p2p[:, i]
                if np.isnan(dep[0]):
                    break
                end = np.maximum(free[s], dep) + (f[:, i] if kind == "F" else b[:, i])
                (f_end if kind == "F" else b_end)[s, i] = end
                free[s] = end
                ptr[s] += 1
                remaining -= 1
    return free.max(axis=0)


def _forward_reference(f, p2p, pp):
    x, m = f.shape
    end = np.zeros((pp, x))
    for i in range(m):
        prev = np.zeros(x)
        for s in range(pp):
            end[s] = np.maximum(end[s], prev) + f[:, i]
            prev = end[s] + p2p[:, i]
    return end[-1]


@pytest.mark.parametrize("seed", range(6))
def test_pipelines_equal_the_column_by_column_event_loop_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        x, m, pp = int(rng.integers(1, 200)), int(rng.integers(1, 30)), int(rng.integers(1, 9))
        f, b, p2p = rng.random((x, m)), 3 * rng.random((x, m)), 0.1 * rng.random((x, m))
        f[rng.random((x, m)) < 0.2] = 0.0  # empty micro-batches
        assert np.array_equal(_one_f_one_b(f, b, p2p, pp), _one_f_one_b_reference(f, b, p2p, pp))
        assert np.array_equal(_forward_pipeline(f, p2p, pp), _forward_reference(f, p2p, pp))


def test_an_out_of_memory_step_is_a_crash_with_lost_time():
    long = replace(JOB.workload(), response_len_mean=14000.0, response_len_max=16384)
    short = JOB.workload()
    big = _plan(mb=2, recompute=False, zero=3)
    for w, fits in ((short, True), (long, False)):
        gt = GroundTruth(JOB, H100, constant_trace(w, 8, 4), seed=0)
        obs = gt.observe(big, 0)
        assert obs.feasible == fits, (w.response_len_mean, obs.violations)
        if not fits:
            assert obs.oom_stage and obs.lost_s > 0 and math.isinf(obs.step_s) and "SIMULATED" in obs.violations[0]
    # the same long workload fits with the micro-batch and memory savings a user would turn on
    gt = GroundTruth(JOB, H100, constant_trace(long, 8, 4), seed=0)
    assert gt.observe(_plan(mb=1, recompute=True, zero=3), 0).feasible


def test_transitions_replay_on_ports_and_a_new_engine_costs_a_start():
    links = network.Links.of(H100, tables_for("h100-80gb"))
    one = links.transfer_s(0, 1, 1e9)
    assert network.replay([(0, 1, 1e9), (0, 2, 1e9)], links) == pytest.approx(2 * one)  # one sender: in turn
    assert network.replay([(0, 1, 1e9), (2, 3, 1e9)], links) == pytest.approx(one)  # disjoint ports: together
    gt = GroundTruth(JOB, H100, constant_trace(JOB.workload(), 8, 4), schedule_fn=lambda a, b: [(0, 1, 1e9)])
    a, b = _plan(gen_tp=2), _plan(gen_tp=4)
    assert gt.transition_s(a, a) == 0.0
    assert gt.transition_s(a, b) == pytest.approx(one + network.COMM_REBUILD_S + network.ENGINE_START_S)


def test_generation_tp_changes_the_truth_and_every_stage_has_a_time():
    gt = GroundTruth(JOB, H100, constant_trace(JOB.workload(), 8, 8), seed=0)
    times = {tp: gt.step_times(_plan(gen_tp=tp), np.arange(8)) for tp in (1, 2, 4)}
    assert all(np.isfinite(t).all() for t in times.values())
    assert len({round(float(t.mean()), 3) for t in times.values()}) == 3
    obs = gt.observe(_plan(), 0)
    assert set(obs.stage_s) == set(JOB.model_stages()) and all(v > 0 for v in obs.stage_s.values())
    assert 0 < obs.response_len_mean <= obs.response_len_max <= 4096


def test_tables_are_built_from_the_fit_split_only():
    split = {}
    for name in ("decode", "prefill", "collectives", "training"):
        with open(CORPUS / f"{name}.csv", newline="") as fh:
            split.update({r["id"]: r["split"] for r in csv.DictReader(fh)})
    for gpu in ("h100-80gb", "h200", "a100-80gb"):
        tab = tables_for(gpu)
        ids = [i for _, row in tab.source_rows for i in row.split()]
        assert ids and all(split[i] == "fit" for i in ids), gpu
        assert 1.0 < tab.decode_m(1.0) < tab.decode_m(256.0)  # bigger batches cost more per iteration
        assert 0 < tab.kv_eff <= 0.9 and 0 < float(tab.train_hfu(8192)) < 1
