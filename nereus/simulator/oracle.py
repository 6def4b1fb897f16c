"""The offline bound: the best plan sequence for a known trace, by dynamic programming.

States are (step, candidate plan); a step on plan k costs its ground-truth time (the same noisy
times every policy sees), an edge j -> k costs the ground-truth transition time. The optimum over
the candidate set is a lower bound for every policy whose plans are all in that set, so the
simulator puts every plan any online policy used into it, plus the plan the solver finds with the
*true* cost parameters for sampled trace segments. A plan is unusable at a step when it does not fit
in memory or needs more GPUs than the step has.

Edges: pricing every pair of candidates with the transition planner is too slow at 1,024 GPUs
(seconds per large layout change), so the edge set is: free edges between plans of one layout,
every transition some policy actually paid (already priced), and up to ``edge_budget`` priced edges
into and out of the solver's extra plans; other pairs are not edges. Every online policy's plan
sequence is therefore a path of the graph, so the optimum is still a bound on each of them.
Cost: plans x segments noiseless evaluations (cached in the ground truth), one vectorised step-time
matrix, the priced edges; the DP itself is O(steps x K^2) numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nereus.planner.plan import Plan
from nereus.simulator.groundtruth import GroundTruth
from nereus.simulator.trace import Trace
from nereus.planner.specs import Workload


@dataclass(frozen=True, slots=True)
class OraclePath:
    plan_index: tuple[int, ...]
    step_s: tuple[float, ...]
    transition_s: tuple[float, ...]
    """Transition time paid before each step (0 when the plan did not change)."""
    floor_s: tuple[float, ...]
    """Per step, the fastest usable candidate (a lower bound on any step's time)."""


def segments(trace: Trace) -> list[tuple[int, int]]:
    """(first row, end row) of runs of identical trace rows (a sparse CSV row held over steps)."""
    out, start = [], 0
    for i in range(1, len(trace.rows) + 1):
        if i == len(trace.rows) or _row_key(trace.rows[i]) != _row_key(trace.rows[start]):
            out.append((start, i))
            start = i
    return out


def _row_key(r) -> tuple:
    return (r.response_len_mean, r.response_len_max, r.gpus, r.response_len_p90, r.prompt_len_mean)


def step_time_matrix(gt: GroundTruth, trace: Trace, base: Workload, plans: list[Plan]) -> np.ndarray:
    """[steps, plans] ground-truth step seconds with the per-step noise (inf where unusable)."""
    job = gt.job
    stages = job.model_stages()
    noise = np.stack([gt.noise_factors(i) for i in range(len(trace.rows))])
    segs = segments(trace)
    out = np.full((len(trace.rows), len(plans)), np.inf)
    for k, plan in enumerate(plans):
        pools = {s.name: s.pool for s in plan.stages}
        for a, b in segs:
            if plan.num_gpus > trace.rows[a].gpus:
                continue
            t = gt.times(plan, trace.workload(a, base))
            if not t.feasible:
                continue
            st = np.array([t.stage_s[ms] for ms in stages]) * noise[a:b]
            total = np.full(b - a, t.weight_sync_s)
            for phase in job.phases():
                per_pool: dict[int, np.ndarray] = {}
                for ms in phase:
                    col = st[:, stages.index(ms)]
                    per_pool[pools[ms]] = per_pool.get(pools[ms], 0.0) + col
                total = total + np.max(np.stack(list(per_pool.values())), axis=0)
            out[a:b, k] = total
    return out


def edge_matrix(gt: GroundTruth, plans: list[Plan], extra: list[int], edge_budget: int = 48) -> np.ndarray:
    """[from, to] transition seconds; inf where the pair is not an edge (see the module docstring)."""
    k = len(plans)
    trans = np.full((k, k), np.inf)
    for i, a in enumerate(plans):
        for j, b in enumerate(plans):
            t = gt.known_transition(a, b)
            if t is not None:
                trans[i, j] = t
    # extra plans connect to plans of the same GPU count (moves within a regime) and from smaller ones
    pairs = [(i, j) for j in extra for i in range(k) if i != j and plans[i].num_gpus <= plans[j].num_gpus]
    pairs += [(j, i) for j in extra for i in range(k) if i != j and plans[i].num_gpus == plans[j].num_gpus]
    pairs.sort(key=lambda p: (max(plans[p[0]].num_gpus, plans[p[1]].num_gpus), p))
    for i, j in [p for p in pairs if not np.isfinite(trans[p])][:edge_budget]:
        trans[i, j] = gt.transition_s(plans[i], plans[j])
    return trans


def solve_oracle(gt: GroundTruth, trace: Trace, base: Workload, plans: list[Plan], extra: list[int] = (),
                 edge_budget: int = 48) -> OraclePath:
    """Minimum total (steps + transitions) over plan sequences drawn from ``plans``; ``extra`` are
    the indices of plans no policy used (their edges are priced within ``edge_budget``)."""
    times = step_time_matrix(gt, trace, base, plans)
    n, k = times.shape
    trans = edge_matrix(gt, plans, list(extra), edge_budget)
    cost = times[0].copy()
    back = np.zeros((n, k), dtype=np.int64)
    back[0] = np.arange(k)
    for t in range(1, n):
        via = cost[:, None] + trans  # [from, to]
        back[t] = np.argmin(via, axis=0)
        cost = via[back[t], np.arange(k)] + times[t]
    last = int(np.argmin(cost))
    if not math.isfinite(cost[last]):
        raise ValueError("oracle: no candidate plan is usable at some step")
    idx = [last]
    for t in range(n - 1, 0, -1):
        idx.append(int(back[t, idx[-1]]))
    idx.reverse()
    steps = tuple(float(times[t, j]) for t, j in enumerate(idx))
    trs = (0.0,) + tuple(float(trans[idx[t - 1], idx[t]]) for t in range(1, n))
    return OraclePath(tuple(idx), steps, trs, tuple(float(x) for x in times.min(axis=1)))
