"""PuLP / CBC backend on the same LinModel: floats, enforcement literals become big-M terms whose
M comes from the variable bounds; memory is scaled to GiB to keep CBC's numerics tame."""
from __future__ import annotations

import math

import pulp

from nereus.planner.solver.linmodel import LinModel

SCALE = {"time": 1.0, "mem": 1.0 / 2**20, "count": 1.0, "bool": 1.0}


def solve_linmodel(m: LinModel, time_limit_s: float, workers: int, seed: int):
    prob = pulp.LpProblem("nereus_plan", pulp.LpMinimize)
    xs = []
    for i, v in enumerate(m.vars):
        if v.kind == "bool":
            xs.append(pulp.LpVariable(f"v{i}", cat="Binary"))
        else:
            s = SCALE[v.kind]
            xs.append(pulp.LpVariable(f"v{i}", lowBound=v.lo * s, upBound=v.hi * s))
    for c in m.cons:
        s = SCALE[c.kind]
        terms = [(v, coef * s / SCALE[m.vars[v].kind]) for v, coef in c.terms]
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
    opts = [f"randomSeed {seed}", "randomCbcSeed " + str(seed + 1)]
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=float(time_limit_s), threads=int(workers), gapRel=1e-9, warmStart=bool(m.hint),
                               options=opts)
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


