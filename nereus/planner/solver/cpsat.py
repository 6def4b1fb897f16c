"""CP-SAT backend: translates the LinModel into integers (seconds -> ticks, KiB as is) with
enforcement literals instead of big-M, hints the greedy answer, and reads the solution back."""
from __future__ import annotations

import math

from ortools.sat.python import cp_model

from nereus.planner.solver.linmodel import LinModel

TICKS = 1e9
"""Integer ticks for the largest time the model can take: rounding errors stay near 1e-9 relative."""


def _scales(m: LinModel, t_hi: float) -> dict[str, float]:
    return {"time": TICKS / max(t_hi, 1e-9), "mem": 1.0, "count": 1.0, "bool": 1.0}


def solve_linmodel(m: LinModel, t_hi: float, time_limit_s: float, workers: int, seed: int):
    """Returns (status name, value function, objective bound in seconds, objective in seconds)."""
    sc = _scales(m, t_hi)
    model = cp_model.CpModel()
    xs = []
    for v in m.vars:
        if v.kind == "bool":
            xs.append(model.new_bool_var(v.name))
        else:
            s = sc[v.kind]
            xs.append(model.new_int_var(math.floor(v.lo * s), math.ceil(v.hi * s), v.name))
    for c in m.cons:
        s = sc[c.kind] if c.kind != "count" else 1.0
        expr = sum(round(coef * s / sc[m.vars[v].kind]) * xs[v] for v, coef in c.terms)
        rhs = c.rhs * s
        if c.sense == "<=":
            ct = model.add(expr <= math.floor(rhs + 1e-9))
        elif c.sense == ">=":
            ct = model.add(expr >= math.ceil(rhs - 1e-9))
        else:
            ct = model.add(expr == round(rhs))
        if c.enforce:
            ct.only_enforce_if([xs[e] for e in c.enforce])
    model.minimize(sum(round(coef * sc["time"] / sc[m.vars[v].kind]) * xs[v] for v, coef in m.objective))
    for v, val in m.hint.items():
        model.add_hint(xs[v], int(round(val)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # OR-Tools 9.15's inclusion presolve returned a wrong "OPTIMAL" on this model (a 64-GPU 70B
    # instance: 651.9 s claimed optimal while 629.5 s is feasible and verified); switch it off.
    solver.parameters.presolve_inclusion_work_limit = 0
    # probing costs more than it saves on this model (measured: about 2x faster proofs at 64-1,024 GPUs)
    solver.parameters.cp_model_probing_level = 0
    code = solver.solve(model)
    status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE", cp_model.INFEASIBLE: "INFEASIBLE"}.get(code, "UNKNOWN")
    if status in ("OPTIMAL", "FEASIBLE"):
        value = lambda i: solver.value(xs[i])  # noqa: E731
        return status, value, solver.best_objective_bound / sc["time"], solver.objective_value / sc["time"]
    return status, None, math.nan, math.nan
