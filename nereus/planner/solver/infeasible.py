"""Why no plan exists: the binding constraint, with numbers."""
from __future__ import annotations

import math

from nereus.errors import InfeasibleError
from nereus.planner.cost.model import estimate
from nereus.planner.solver.candidates import GEN, build_tables, layouts, make_units
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.specs import GiB, ParallelConfig


def _most_sharded_need(problem: PlanProblem, unit) -> tuple[float, str]:
    """Smallest per-GPU memory any config of ``unit`` needs on the whole cluster."""
    c, j, w, p = problem.cluster, problem.job, problem.workload, problem.params
    n = c.num_gpus
    best = (math.inf, "no (tp, pp) tiles the cluster")
    for tp, pp in layouts(problem, unit, n):
        cfg = ParallelConfig(tp=tp, pp=pp, dp=n // (tp * pp), micro_batch=1,
                             zero=3 if len(unit.stages) == 2 else 1, recompute=len(unit.stages) == 2)
        ests = [estimate(j, c, ms, cfg, w, p) for ms in unit.stages]
        need = ests[0].resident_bytes + max(e.transient_bytes for e in ests)
        if need < best[0]:
            note = "; ".join(n for e in ests for n in e.notes)
            best = (need, f"{cfg.label()}{' ZeRO-3 recompute' if len(unit.stages) == 2 else ''}"
                          f"{', ' + note if note else ''}")
    return best


def explain_infeasible(problem: PlanProblem) -> str:
    """One line naming the binding constraint (model-stage, GiB needed, GiB available)."""
    c = problem.cluster
    usable = c.gpu.usable_bytes / GiB
    have = f"GPUs have {usable:.1f} GiB usable ({c.gpu.memory_gib:g} GiB - {c.gpu.reserved_gib:g} GiB reserved)"
    worst = None
    for unit in make_units(problem):
        need, how = _most_sharded_need(problem, unit)
        if need > c.gpu.usable_bytes and (worst is None or need / GiB > worst[1]):
            worst = (unit.name, need / GiB, how)
    if worst is not None:
        name, need, how = worst
        what = "its weights plus one longest sequence's KV cache" if name == GEN else "its most sharded config"
        return (f"{name} needs >= {need:.1f} GiB per GPU at {what} ({how}) on {c.num_gpus} GPUs; {have}")
    t = build_tables(problem)
    empty = [u.name for u, opts in zip(t.units, t.options) if not opts]
    if empty:
        pins = ", ".join(f"{ms} tp{tp} pp{pp}" for ms, tp, pp in problem.constraints.fixed_tp_pp)
        return (f"{', '.join(empty)}: no config fits {usable:.1f} GiB per GPU on any pool of the allowed sizes "
                f"{list(t.sizes)}" + (f" with pinned {pins}" if pins else ""))
    res = sum(min(o.resident_kib for o in opts) for opts in t.options) * 1024 / GiB
    tra = max(min(o.transient_kib for o in opts) for opts in t.options) * 1024 / GiB
    return (f"every model-stage fits alone, but no '{problem.constraints.placement}' placement on {c.num_gpus} GPUs "
            f"fits them together (smallest residents sum to {res:.1f} GiB per GPU if colocated, largest "
            f"smallest transient {tra:.1f} GiB); {have}")


def raise_infeasible(problem: PlanProblem) -> None:
    msg = explain_infeasible(problem)
    raise InfeasibleError(msg, binding=msg.split(" ", 1)[0])
