"""The two exact backends on one LinModel. CP-SAT translates it into integers (seconds -> ticks,
KiB as is) with enforcement literals instead of big-M and hints the greedy answer; PuLP/CBC keeps
floats, turns enforcement literals into big-M terms whose M comes from the variable bounds, and
scales memory to GiB to keep CBC's numerics tame. Each solver library is imported only when used."""
from __future__ import annotations

import math

from nereus.planner.solver.linmodel import LinModel

TICKS = 1e9
"""Integer ticks for the largest time the model can take: rounding errors stay near 1e-9 relative."""


def _cpsat_scales(m: LinModel, t_hi: float) -> dict[str, float]:
    return {"time": TICKS / max(t_hi, 1e-9), "mem": 1.0, "count": 1.0, "bool": 1.0}


def solve_cpsat(m: LinModel, t_hi: float, time_limit_s: float, workers: int, seed: int, deterministic: bool = False):
    """CP-SAT: (status name, value function, objective bound in seconds, objective in seconds).
    ``deterministic``: ``time_limit_s`` is CP-SAT's deterministic time (work counted, not seconds
    elapsed), so with one worker a solve cut by its limit stops at the same point on an idle or a
    loaded machine and returns the same plan; a wall limit of 20x + 30 s stays as a safety net."""
    from ortools.sat.python import cp_model

    sc = _cpsat_scales(m, t_hi)
    model = cp_model.CpModel()
    xs = []
    for v in m.vars:
        if v.kind == "bool":
            xs.append(model.new_bool_var(v.name))
        else:
            s = sc[v.kind]
            xs.append(model.new_int_var(math.floor(v.lo * s), math.ceil(v.hi * s), v.name))
    vscale = [sc[v.kind] for v in m.vars]
    weighted = cp_model.LinearExpr.weighted_sum
    for c in m.cons:
        s = sc[c.kind] if c.kind != "count" else 1.0
        expr = weighted([xs[v] for v, _ in c.terms], [round(coef * s / vscale[v]) for v, coef in c.terms])
        rhs = c.rhs * s
        if c.sense == "<=":
            ct = model.add_linear_constraint(expr, -cp_model.INT_MAX, math.floor(rhs + 1e-9))
        elif c.sense == ">=":
            ct = model.add_linear_constraint(expr, math.ceil(rhs - 1e-9), cp_model.INT_MAX)
        else:
            ct = model.add_linear_constraint(expr, round(rhs), round(rhs))
        if c.enforce:
            ct.only_enforce_if([xs[e] for e in c.enforce])
    model.minimize(weighted([xs[v] for v, _ in m.objective],
                            [round(coef * sc["time"] / vscale[v]) for v, coef in m.objective]))
    for v, val in m.hint.items():
        model.add_hint(xs[v], int(round(val)))
    solver = cp_model.CpSolver()
    if deterministic:
        solver.parameters.max_deterministic_time = float(time_limit_s)
        solver.parameters.max_time_in_seconds = 20.0 * float(time_limit_s) + 30.0
    else:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # OR-Tools 9.15's inclusion presolve returned a wrong "OPTIMAL" on this model (a 64-GPU 70B
    # instance: 651.9 s claimed optimal while 629.5 s is feasible and verified); switch it off.
    solver.parameters.presolve_inclusion_work_limit = 0
    # probing costs more than it saves on this model (measured: about 2x faster proofs at 64-1,024 GPUs)
    solver.parameters.cp_model_probing_level = 0
    # one presolve round: the tightened models are small and presolve was most of their time (measured
    # on the 64-1,024-GPU PPO models: 10-30% less CPU on the small ones, about 6% over all)
    solver.parameters.max_presolve_iterations = 1
    code = solver.solve(model)
    status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE", cp_model.INFEASIBLE: "INFEASIBLE"}.get(code, "UNKNOWN")
    if status in ("OPTIMAL", "FEASIBLE"):
        value = lambda i: solver.value(xs[i])  # noqa: E731
        return status, value, solver.best_objective_bound / sc["time"], solver.objective_value / sc["time"]
    return status, None, math.nan, math.nan


PULP_SCALE = {"time": 1.0, "mem": 1.0 / 2**20, "count": 1.0, "bool": 1.0}


def cbc_path() -> str:
    """The CBC executable PuLP drives (``COIN_CMD``; PuLP 4 no longer bundles one): ``cbc`` beside
    this Python (the ``cbcbox`` wheel that ``pulp[cbc]`` installs puts it there), on PATH, or the
    wheel's own copy."""
    import shutil
    import sys
    from pathlib import Path

    here = Path(sys.executable).parent / "cbc"
    found = str(here) if here.exists() else shutil.which("cbc")
    if found is None:
        try:
            import cbcbox

            found = cbcbox.cbc_bin_path()
        except ImportError:
            pass
    if not found:
        from nereus.errors import NereusError

        raise NereusError("the pulp backend needs the CBC solver: pip install 'pulp[cbc]' (or put cbc on PATH)")
    return found


def solve_pulp(m: LinModel, time_limit_s: float, workers: int, seed: int):
    """PuLP/CBC: (status name, value function, objective bound in seconds, objective in seconds)."""
    import pulp

    prob = pulp.LpProblem("nereus_plan", pulp.LpMinimize)
    xs = []
    for i, v in enumerate(m.vars):
        if v.kind == "bool":
            xs.append(prob.add_variable(f"v{i}", 0, 1, cat=pulp.LpBinary))
        else:
            s = PULP_SCALE[v.kind]
            xs.append(prob.add_variable(f"v{i}", v.lo * s, v.hi * s))
    for c in m.cons:
        s = PULP_SCALE[c.kind]
        terms = [(v, coef * s / PULP_SCALE[m.vars[v].kind]) for v, coef in c.terms]
        expr = pulp.lpSum(coef * xs[v] for v, coef in terms)
        rhs = c.rhs * s
        lo, hi = m.bounds(c.terms, lambda v: s)
        slack = pulp.lpSum(1 - xs[e] for e in c.enforce) if c.enforce else 0
        if c.sense in ("<=", "==") :
            big = max(0.0, hi - rhs)
            prob += (expr <= rhs + big * slack) if c.enforce else (expr <= rhs)
        if c.sense in (">=", "=="):
            big = max(0.0, rhs - lo)
            prob += (expr >= rhs - big * slack) if c.enforce else (expr >= rhs)
    prob += pulp.lpSum(coef * xs[v] for v, coef in m.objective)
    for v, val in m.hint.items():
        xs[v].setInitialValue(val)
    # CBC otherwise derives a cutoff increment from the objective and skips solutions that improve by
    # less (seen: "OPTIMAL" 9e-6 above the brute-force optimum on a random test instance)
    opts = [f"randomSeed {seed}", "randomCbcSeed " + str(seed + 1), "allowableGap 0", "increment 1e-12"]
    solver = pulp.COIN_CMD(path=cbc_path(), msg=False, timeLimit=float(time_limit_s), threads=int(workers), gapRel=1e-9,
                           warmStart=bool(m.hint), options=opts)
    prob.solve(solver)
    status = pulp.LpStatus[prob.status]
    sol = prob.sol_status
    if sol == pulp.LpSolutionOptimal:
        name = "OPTIMAL"
    elif sol == pulp.LpSolutionIntegerFeasible:
        name = "FEASIBLE"
    elif status == "Infeasible" or sol == pulp.LpSolutionInfeasible:
        return "INFEASIBLE", None, math.nan, math.nan
    else:
        return "UNKNOWN", None, math.nan, math.nan
    value = lambda i: xs[i].value() or 0.0  # noqa: E731
    obj = pulp.value(prob.objective)
    bound = obj if name == "OPTIMAL" else math.nan
    return name, value, bound, obj


def solve_formulation(form, backend: str, time_limit_s: float, workers: int, seed: int,
                      deterministic: bool = False):
    """(status, value, bound) of a built ``Formulation`` on ``backend`` ("cpsat" or "pulp")."""
    if backend == "cpsat":
        status, value, bound, _ = solve_cpsat(form.m, form.t_hi, time_limit_s, workers, seed, deterministic)
    else:
        status, value, bound, _ = solve_pulp(form.m, time_limit_s, workers, seed)
    return status, value, bound
