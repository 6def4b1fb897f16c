"""Offline policies, which know the whole trace: ``oracle`` (the best plan sequence) and
``hindsight`` (the best single layout), both by dynamic programming over (step, candidate plan).

A step on plan k costs its ground-truth time (the same per-step times every policy sees: the truth
is a deterministic function of plan and step); an edge j -> k costs the ground-truth transition
time. A plan is unusable at a step when it does not fit there or needs more GPUs than granted.

Candidates: every plan an online policy used, the solver's plan for a few trace segments (planner
parameters: no policy is handed the truth's internals) and, for each of those, the same plan with
every other generation TP (the axis the planner's model most often ranks wrongly; the offline
policies see the true times, so they may as well look). The oracle's optimum over that set is a
lower bound for every online policy whose plans are all in it.

Edges: free between plans of one layout; every plan change a policy made, live or through a crash
and restart (priced as a live transition); up to ``edge_budget`` more priced edges into and out of
the extra plans (pricing every pair at 1,024 GPUs would take minutes). Every online policy's plan
sequence is therefore a path of the graph, and the oracle a bound on every policy that completed
all its steps (a crash costs a restart, which is dearer than the live transition priced here).

``hindsight`` runs the same DP inside one layout family at a time (the TP/PP of every model-stage
and the pools as fractions of the GPUs, so a family follows the GPU count by scaling DP, and the
knobs stay free), and keeps the best family: the best a user could do with one layout chosen
knowing the trace. ``static``'s plans are one family, so hindsight is never slower than static
when static completes every step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from nereus.planner.plan import Plan
from nereus.simulator.truth.machine import GroundTruth


@dataclass(frozen=True, slots=True)
class OraclePath:
    plan_index: tuple[int, ...]
    step_s: tuple[float, ...]
    transition_s: tuple[float, ...]
    """Transition time paid before each step (0 when the plan did not change)."""
    total_s: float


def family(plan: Plan) -> tuple:
    """Layout family: TP/PP per model-stage and pools as fractions of the plan's GPUs."""
    n = plan.num_gpus
    return tuple((s.name, s.config.tp, s.config.pp, getattr(s.config, "sp", 1), Fraction(s.first_gpu, n),
                  Fraction(s.gpus, n)) for s in plan.stages)


def usable_steps(plans: list[Plan], gpus: np.ndarray, used: dict[int, set[int]] | None = None) -> list[np.ndarray]:
    """Per plan, the steps it is scored on: where it uses exactly the granted GPUs, plus the steps
    some policy ran it on (a plan on fewer GPUs than granted is never better than its scaled self,
    and scoring it everywhere would cost time)."""
    out = []
    for k, p in enumerate(plans):
        mask = gpus == p.num_gpus
        for i in (used or {}).get(k, ()):
            mask[i] = p.num_gpus <= gpus[i]
        out.append(np.nonzero(mask)[0])
    return out


def step_time_matrix(gt: GroundTruth, plans: list[Plan], steps: list[np.ndarray], n: int,
                     workers: int = 1) -> np.ndarray:
    """[steps, plans] ground-truth seconds (inf where unusable or out of memory). ``workers`` > 1
    splits the trace's blocks of steps between that many forked processes (the truth is a pure
    function of plan and step, so the matrix is the same; the truth caches a model-stage per block,
    which many plans share, so blocks split the work and plans would repeat it)."""
    out = np.full((n, len(plans)), np.inf)
    if workers > 1 and n > gt.block:
        import multiprocessing as mp

        global _SCORING
        blocks = np.arange(n) // gt.block
        _SCORING = (gt, plans, [(s, blocks[s]) for s in steps], workers)
        try:
            with mp.get_context("fork").Pool(workers) as pool:
                for cols in pool.imap_unordered(_score_share, range(workers)):
                    for k, idx, col in cols:
                        out[idx, k] = col
        finally:
            _SCORING = ()
        return out
    for k, plan in enumerate(plans):
        if len(steps[k]):
            out[steps[k], k] = gt.step_times(plan, steps[k])
    return out


_SCORING: tuple = ()
"""What ``step_time_matrix``'s forked workers inherit (set just before the fork)."""


def _score_share(w: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Worker ``w``'s share: every plan on the blocks b with b % workers == w."""
    gt, plans, steps, workers = _SCORING
    out = []
    for k, (idx, blk) in enumerate(steps):
        mine = idx[blk % workers == w]
        if len(mine):
            out.append((k, mine, gt.step_times(plans[k], mine)))
    return out


def edge_matrix(gt: GroundTruth, plans: list[Plan], extra: list[int], edge_budget: int = 48) -> np.ndarray:
    """[from, to] transition seconds; inf where the pair is not an edge (see the module docstring)."""
    k = len(plans)
    trans = np.full((k, k), np.inf)
    index: dict[tuple, list[int]] = {}
    for i, p in enumerate(plans):
        index.setdefault(p.layout_key(), []).append(i)
    for rows in index.values():  # the same layout: free
        trans[np.ix_(rows, rows)] = 0.0
    for (ka, kb), t in gt.prices.priced().items():  # every pair priced so far (not k^2 look-ups)
        if ka in index and kb in index:
            trans[np.ix_(index[ka], index[kb])] = t
    pairs = [(i, j) for j in extra for i in range(k) if i != j and plans[i].num_gpus <= plans[j].num_gpus]
    pairs += [(j, i) for j in extra for i in range(k) if i != j and plans[i].num_gpus == plans[j].num_gpus]
    pairs.sort(key=lambda p: (max(plans[p[0]].num_gpus, plans[p[1]].num_gpus), p))
    for i, j in [p for p in pairs if not np.isfinite(trans[p])][:edge_budget]:
        trans[i, j] = gt.transition_s(plans[i], plans[j])
    return trans


def dp_path(times: np.ndarray, trans: np.ndarray) -> OraclePath | None:
    """Minimum of step times + transitions over plan sequences; None when some step has no
    usable plan."""
    n, k = times.shape
    if n == 0 or k == 0:
        return None
    cost = times[0].copy()
    back = np.zeros((n, k), dtype=np.int64)
    for t in range(1, n):
        via = cost[:, None] + trans
        back[t] = np.argmin(via, axis=0)
        cost = via[back[t], np.arange(k)] + times[t]
    last = int(np.argmin(cost))
    if not math.isfinite(cost[last]):
        return None
    idx = [last]
    for t in range(n - 1, 0, -1):
        idx.append(int(back[t, idx[-1]]))
    idx.reverse()
    steps = tuple(float(times[t, j]) for t, j in enumerate(idx))
    trs = (0.0,) + tuple(float(trans[idx[t - 1], idx[t]]) for t in range(1, n))
    return OraclePath(tuple(idx), steps, trs, float(cost[last]))


def gen_tp_variants(plan: Plan, heads: int, gpus_per_node: int, tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[Plan]:
    """``plan`` with every other generation TP that splits the heads and fits its pool (DP adjusted)."""
    gen = plan.stage("actor/generation")
    out = []
    for tp in tps:
        c = gen.config
        if tp == c.tp or gen.gpus % (tp * c.pp) or heads % tp or tp > gpus_per_node:
            continue
        g = replace(gen, config=replace(c, tp=tp, dp=gen.gpus // (tp * c.pp)))
        out.append(replace(plan, stages=tuple(g if s.name == gen.name else s for s in plan.stages)))
    return out


def complete_families(plans: list[Plan], gpu_counts: list[int], scale) -> list[Plan]:
    """Every layout family of ``plans`` at every GPU count of the trace (its plans scaled by
    ``scale(plan, gpus)`` where the family has none there): a single layout must run the whole trace."""
    fams: dict[tuple, list[Plan]] = {}
    for p in plans:
        fams.setdefault(family(p), []).append(p)
    have = {p.key() for p in plans}
    out = list(plans)
    for members in fams.values():
        counts = {p.num_gpus for p in members}
        for g in gpu_counts:
            if g in counts:
                continue
            q = scale(members[0], g)
            if q is not None and q.key() not in have:
                have.add(q.key())
                out.append(q)
    return out


def hindsight(gt: GroundTruth, plans: list[Plan], times: np.ndarray,
              gpu_changes: set[tuple[int, int]], key=None) -> tuple[OraclePath | None, list[int]]:
    """Best single layout family: (its path, indices of its plans). Edges inside a family join
    plans on the same GPU count and plans across a GPU change the trace makes (``gpu_changes``:
    (from, to) GPU counts). ``key``: what a family holds fixed (default ``family``; ``hindsight-split``:
    the schedule and the rollout share)."""
    fams: dict[tuple, list[int]] = {}
    for k, p in enumerate(plans):
        fams.setdefault((key or family)(p), []).append(k)
    best, best_idx = None, []
    for idx in fams.values():
        sub = times[:, idx]
        if not np.isfinite(sub).any(axis=1).all():
            continue
        if best is not None and np.min(sub, axis=1).sum() >= best.total_s:
            continue  # even free transitions could not beat the best family so far
        k = len(idx)
        trans = np.zeros((k, k))
        for a in range(k):
            for b in range(k):
                pa, pb = plans[idx[a]], plans[idx[b]]
                if a == b:
                    continue
                if pa.num_gpus == pb.num_gpus or (pa.num_gpus, pb.num_gpus) in gpu_changes:
                    trans[a, b] = gt.transition_s(pa, pb)
                else:
                    trans[a, b] = np.inf
        path = dp_path(sub, trans)
        if path is not None and (best is None or path.total_s < best.total_s):
            best, best_idx = path, idx
    if best is None:
        return None, []
    return replace(best, plan_index=tuple(best_idx[i] for i in best.plan_index)), best_idx
