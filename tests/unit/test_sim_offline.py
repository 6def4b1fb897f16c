"""The offline policies' machinery on its own: the DP over (step, plan) against brute force over every
plan sequence, the truth's step-time matrix scored in forked processes against one process, and the
layout-change prices the forked online policies computed reaching the offline policies' graph."""
import itertools
import math

import numpy as np
import pytest

from nereus.models.spec import preset
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec
from nereus.simulator import oracle as offline
from nereus.simulator import simulate as sim
from nereus.simulator.schedules import TransitionSchedules
from nereus.simulator.trace import parse_trace
from nereus.simulator.truth.machine import GroundTruth

JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=2048, response_len_max=8192))
H100 = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=2)
TRACE = "step,response_len_mean,response_len_max,gpus\n0,1200,8192,8\n40,3000,8192,8\n80,5000,8192,16\n139,6000,8192,16\n"


def _brute(times: np.ndarray, trans: np.ndarray) -> float:
    n, k = times.shape
    best = math.inf
    for seq in itertools.product(range(k), repeat=n):
        t = times[0, seq[0]] + sum(trans[a, b] + times[i + 1, b] for i, (a, b) in enumerate(zip(seq, seq[1:])))
        best = min(best, t)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_path_equals_brute_force_over_every_plan_sequence(seed):
    """The oracle's bound is only a bound if its DP finds the cheapest sequence: random step times with
    unusable (inf) cells and missing edges, against every one of k^n sequences."""
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 6)), int(rng.integers(1, 4))
    times = rng.uniform(1, 10, (n, k))
    times[rng.random((n, k)) < 0.2] = np.inf
    trans = rng.uniform(0, 8, (k, k))
    np.fill_diagonal(trans, 0.0)
    trans[rng.random((k, k)) < 0.3] = np.inf
    np.fill_diagonal(trans, 0.0)
    want = _brute(times, trans)
    path = offline.dp_path(times, trans)
    if not math.isfinite(want):
        assert path is None
        return
    assert path is not None and path.total_s == pytest.approx(want)
    # the path it reports costs what it says
    idx = path.plan_index
    assert sum(times[t, j] for t, j in enumerate(idx)) + sum(trans[a, b] for a, b in zip(idx, idx[1:])) == \
        pytest.approx(path.total_s)


@pytest.fixture(scope="module")
def world():
    trace = parse_trace(TRACE, "offline")
    gt = GroundTruth(JOB, H100, trace, seed=3, schedule_fn=TransitionSchedules(JOB, H100), block=16)
    return trace, gt


def test_step_time_matrix_is_the_same_scored_in_forked_processes(world):
    trace, gt = world
    res = sim.simulate(JOB, H100, trace, ["static", "adaptive"], gt=gt, time_limit_s=2, seed=0)
    cands = [p for r in res.values() for p in r.plans]
    cands += [q for p in cands[:2] for q in offline.gen_tp_variants(p, JOB.model("actor").heads, 8)]
    gpus = np.array([r.gpus for r in trace.rows])
    steps = offline.usable_steps(cands, gpus)
    assert sum(len(s) for s in steps) > 2 * gt.block  # several blocks to split
    one = offline.step_time_matrix(gt, cands, steps, len(trace))
    fresh = GroundTruth(JOB, H100, trace, seed=3, schedule_fn=TransitionSchedules(JOB, H100), block=16)
    two = offline.step_time_matrix(fresh, cands, steps, len(trace), workers=2)
    assert np.isfinite(one).any()
    assert np.array_equal(one, two)


def test_the_forked_policies_hand_their_layout_change_prices_back(world, monkeypatch):
    """The online policies run in forked processes; the switches they priced there reach the parent's
    truth, so the offline policies' graph does not price them again."""
    trace, _ = world
    gt = GroundTruth(JOB, H100, trace, seed=3, schedule_fn=TransitionSchedules(JOB, H100), block=16)
    res = sim.simulate(JOB, H100, trace, ["adaptive", "always"], gt=gt, time_limit_s=2, seed=0, workers=2)
    switched = [(r.plans[r.plan_index[i - 1]], r.plans[r.plan_index[i]]) for r in res.values()
                for i in range(1, len(trace)) if r.transition_s[i] > 0]
    assert switched  # the GPU doubling is taken
    priced = gt.prices.priced()
    for a, b in switched:
        assert (a.layout_key(), b.layout_key()) in priced
    monkeypatch.setattr(gt, "_live_transition_s", lambda a, b: pytest.fail("priced again"))
    gt.prices._price = gt._live_transition_s
    for a, b in switched:
        assert gt.transition_s(a, b) == priced[(a.layout_key(), b.layout_key())]
