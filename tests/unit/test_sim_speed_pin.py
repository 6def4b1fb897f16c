"""The simulator's speed work changes no result (SIMULATED): the ground truth's step times of a small
world are pinned to the numbers the code gave before it (commit 9691135; tests/data holds that
matrix, and the cells must agree to 1e-12 relative: a byte-exact pin broke with nothing but a newer
numpy, whose vectorised math differs in the last bit, and 9691135's own code moved with it), generation runs shared
between engines that differ only in their KV budget equal runs made for each budget alone, and
``engine.covers`` admits exactly the budgets under which a run is the same."""
import json
from pathlib import Path

import numpy as np
import pytest

from nereus.models.spec import preset
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import (GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, ParallelConfig, RolloutSpec,
                                  SequenceSpec)
from nereus.simulator import oracle as offline
from nereus.simulator.trace import parse_trace
from nereus.simulator.truth import machine
from nereus.simulator.truth.engine import _simulate, covers

H100 = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=2)
JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=2048, response_len_max=8192),
              rollout=RolloutSpec(max_num_seqs=48))
"""512 responses per step and 48 slots per engine: replicas wait for slots, and long steps press the KV."""
TRACE = ("step,response_len_mean,response_len_max,gpus,response_len_cap\n0,900,4096,8,4096\n10,2500,8192,8,8192\n"
         "20,5200,8192,16,8192\n36,6500,8192,16,8192\n47,7000,8192,16,8192\n")
PINNED = Path(__file__).resolve().parents[1] / "data/sim_speed_pin_9691135.json"
"""``step_time_matrix`` of ``_plans()`` on this world made by the code at commit 9691135 (before the
speed work); null where the plan cannot run the step."""


def _pinned() -> np.ndarray:
    rows = json.loads(PINNED.read_text())["matrix"]
    return np.array([[np.inf if x is None else x for x in r] for r in rows], dtype=float)


def _plan(gpus: int, gen_tp: int = 2, zero: int = 1, mb: int = 1, pp: int = 1, split: bool = False) -> Plan:
    """Colocated (or ``split``: generation on one half, the trainers on the other). The ZeRO stage sets
    what the actor's states leave the engine: plans that differ in it differ only in KV budget."""
    g0, gn, t0, tn = (0, gpus // 2, gpus // 2, gpus // 2) if split else (0, gpus, 0, gpus)
    st = [StagePlacement(name="actor/generation", config=ParallelConfig(tp=gen_tp, dp=gn // gen_tp), pool=0,
                         first_gpu=g0, gpus=gn)]
    for ms in ("actor/inference", "ref/inference", "actor/training"):
        train = ms.endswith("training")
        st.append(StagePlacement(name=ms, config=ParallelConfig(pp=pp if train else 1, dp=tn // (pp if train else 1),
                                                                micro_batch=mb, zero=zero, recompute=train),
                                 pool=1 if split else 0, first_gpu=t0, gpus=tn))
    return Plan(stages=tuple(st))


def _plans() -> list[Plan]:
    out = []
    for gpus in (8, 16):
        out += [_plan(gpus, tp, zero) for tp in (1, 2, 4) for zero in (0, 1, 3)]
        out += [_plan(gpus, 2, 1, mb=2, pp=2), _plan(gpus, 1, 0, split=True)]
    return out


def _truth(trace) -> machine.GroundTruth:
    return machine.GroundTruth(JOB, H100, trace, seed=5, block=16)


def _matrix(gt, trace, plans) -> np.ndarray:
    gpus = np.array([r.gpus for r in trace.rows])
    return offline.step_time_matrix(gt, plans, offline.usable_steps(plans, gpus), len(trace))


@pytest.fixture(scope="module")
def trace():
    return parse_trace(TRACE, "pin")


def test_the_truths_step_times_are_the_ones_before_the_speed_work(trace):
    m = _matrix(_truth(trace), trace, _plans())
    pinned = _pinned()
    assert m.shape == pinned.shape == (48, 22) and np.isfinite(m).sum() == 192
    assert np.array_equal(np.isfinite(m), np.isfinite(pinned))
    np.testing.assert_allclose(m[np.isfinite(m)], pinned[np.isfinite(pinned)], rtol=1e-12, atol=0)


def test_runs_shared_between_kv_budgets_equal_each_budgets_own(trace, monkeypatch):
    """One truth scoring every plan (engines of one TP/DP share runs) against a fresh truth per plan
    (nothing shared): the same matrix, and the shared one simulated fewer replicas."""
    rows = []

    def counting(reps, *a, **k):
        rows.append(len(reps))
        return _simulate(reps, *a, **k)

    monkeypatch.setattr(machine, "_simulate", counting)
    plans = _plans()
    shared = _matrix(_truth(trace), trace, plans)
    n_shared = sum(rows)
    backwards = _matrix(_truth(trace), trace, plans[::-1])[:, ::-1]  # tight budgets first this time
    rows.clear()
    alone = np.concatenate([_matrix(_truth(trace), trace, [p]) for p in plans], axis=1)
    assert np.array_equal(shared, alone) and np.array_equal(backwards, alone)
    assert 0 < n_shared < sum(rows)


def _a(n: int = 64) -> np.ndarray:
    a = 0.01 + 1e-5 * np.arange(n, dtype=float)
    a[0] = 0.0
    return a


def _prefill(tokens, prompt):
    return 1e-6 * np.asarray(tokens, float) + 1e-9 * np.asarray(tokens, float) * np.asarray(prompt, float)


@pytest.mark.parametrize("seed", range(6))
def test_covers_admits_exactly_the_budgets_that_give_the_same_run(seed):
    """For replicas waiting on slots, the run under a budget ``covers`` admits is bit for bit the
    run under a budget that never binds; the tightest budget it refuses gives a different run for
    some replica (the rule is not vacuous)."""
    rng = np.random.default_rng(seed)
    reps = np.ceil(np.exp(rng.normal(np.log(300), 0.7, (24, 96)))).astype(np.int64)
    reps[:, 60:][rng.random((24, 36)) < 0.3] = 0
    prompt = rng.integers(50, 300, 24).astype(float)
    free_clock, free_pre, held, asked = _simulate(reps, prompt, _a(), 1e-7, 1e12, _prefill, 24, demand=True)
    assert free_pre.sum() == 0
    tight = 16 * np.ceil(np.maximum(held, (asked + 1.0) / 0.99) / 16)  # the smallest 16-token budgets that cover
    assert covers(tight, held, asked).all() and not covers(tight - 16, held, asked).all()
    for kv in np.unique(tight)[:: max(1, len(np.unique(tight)) // 4)]:
        ok = covers(kv, held, asked)
        clock, pre = _simulate(reps, prompt, _a(), 1e-7, float(kv), _prefill, 24)
        assert np.array_equal(clock[ok], free_clock[ok]) and np.array_equal(pre[ok], free_pre[ok])
    below = float(tight.min()) - 16
    refused = ~covers(below, held, asked)
    clock, pre = _simulate(reps, prompt, _a(), 1e-7, below, _prefill, 24)
    assert refused.any() and (clock[refused] != free_clock[refused]).any()


def test_a_budget_that_holds_the_kv_but_not_the_admissions_room_shapes_the_run():
    """Responses of a token or two: a replica holds little more KV than it asks for at admission, so
    a budget can hold all of it and still, past vLLM's watermark, lack the room to admit every
    sequence the slots allow. ``covers`` refuses it, and that run differs."""
    rng = np.random.default_rng(0)
    reps = rng.integers(1, 3, (8, 96))
    prompt = rng.integers(200, 300, 8).astype(float)
    free_clock, _, held, asked = _simulate(reps, prompt, _a(), 1e-7, 1e12, _prefill, 24, demand=True)
    kv = np.ceil(held)
    assert (kv * 0.99 < asked + 1.0).all()  # enough for what it holds, not for its admissions
    assert not covers(kv, held, asked).any()
    differ = [_simulate(reps[i:i + 1], prompt[i:i + 1], _a(), 1e-7, float(kv[i]), _prefill, 24)[0][0] != free_clock[i]
              for i in range(len(reps))]
    assert sum(differ) >= len(reps) // 2


def test_engine_work_handed_back_by_a_forked_worker_gives_the_same_numbers(trace, monkeypatch):
    """A truth that takes another's engine work (``merge_engine_results``, as after the forked
    online policies) scores every plan as a fresh truth does, simulating fewer replicas."""
    rows = []

    def counting(reps, *a, **k):
        rows.append(len(reps))
        return _simulate(reps, *a, **k)

    monkeypatch.setattr(machine, "_simulate", counting)
    plans = _plans()
    alone = _matrix(_truth(trace), trace, plans)
    fresh_rows = sum(rows)
    gen = {i: _truth(trace)._info(p)["keys"]["actor/generation"] for i, p in enumerate(plans)}
    # one engine under two budgets: the worker runs the roomy one, this process the tight one (whose
    # runs that budget shaped are not shared), so the merge fills some replicas and leaves others
    pairs = sorted(((i, j) for i in gen for j in gen if gen[i][:4] == gen[j][:4] and 0 < gen[i][4] < gen[j][4]),
                   key=lambda ij: gen[ij[0]][4] / gen[ij[1]][4])
    for tight, roomy in pairs:
        worker, mine = _truth(trace), _truth(trace)
        _matrix(worker, trace, [plans[roomy]])
        _matrix(mine, trace, [plans[tight]])
        theirs, ours = worker.engine_results(), mine.engine_results()
        if any((theirs[k]["known"] & ~ours[k]["known"]).any() for k in set(theirs) & set(ours)):
            break
    else:
        pytest.fail("no engine whose tight budget shaped runs the roomy one shares")
    rows.clear()
    mine.merge_engine_results(worker.engine_results())
    for k, e in mine.engine_results().items():  # every run held is a real run (a replica's time is
        assert (e["clock"][e["known"]] > 0).all()  # rarely the step's slowest, so check each)
        w = worker.engine_results().get(k)
        if w is not None:
            assert (e["known"] >= w["known"]).all()
            assert np.array_equal(e["clock"][w["known"]], w["clock"][w["known"]])
    assert np.array_equal(_matrix(mine, trace, plans), alone)
    assert sum(rows) < fresh_rows
