"""The on-demand option tables against everything priced up front, on random jobs nobody wrote a
test for (``tests/unit/test_solver_bounds._random_problem``: the example jobs with lengths, batch,
prompt, engine, schedule, GPU type, cluster size, profile and candidate axes drawn at random):
per job, every floor <= every priced row (the solver skips a group only on its floor), and CP-SAT's
status and objective with groups priced on demand equal those with every group priced.

    .venv/bin/python benchmarks/solver_fuzz.py --jobs 200 --json benchmarks/results/solver_fuzz.json
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests/unit"), str(ROOT / "benchmarks")]

from test_solver_bounds import _random_problem, floor_violations  # noqa: E402

from nereus.planner.solver import candidates  # noqa: E402

S = importlib.import_module("nereus.planner.solver.solve")


def solve_both(p) -> list[tuple]:
    lazy = S.table_builder

    def full(problem):
        b = lazy(problem)
        b.full()
        return b

    out = []
    for builder in (full, lazy):
        candidates._build_tables_cached.cache_clear()
        candidates._estimates.clear()
        S.table_builder = builder
        try:
            sol = S.solve(p, backend="cpsat", time_limit_s=60, workers=1, seed=0, deterministic=True)
            out.append((sol.status, None if sol.objective is None else round(sol.objective, 9)))
        finally:
            S.table_builder = lazy
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args()
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    res = {"drawn": 0, "valid": 0, "rows": 0, "floor_violations": 0, "optimal": 0, "infeasible": 0, "differ": []}
    for k in range(a.seed, a.seed + a.jobs):
        res["drawn"] += 1
        p = _random_problem(random.Random(k))
        if p is None:
            continue
        res["valid"] += 1
        rows, bad = floor_violations(p)
        res["rows"] += rows
        res["floor_violations"] += len(bad)
        full, lazy = solve_both(p)
        res["optimal"] += full[0] == "OPTIMAL"
        res["infeasible"] += full[0] == "INFEASIBLE"
        if full != lazy:
            res["differ"].append({"seed": k, "full": full, "on_demand": lazy})
        print(f"{k}: {rows} rows, {len(bad)} floor violations, {full[0]} {full[1]} {'same' if full == lazy else lazy}",
              flush=True)
    res.update(wall_s=time.perf_counter() - t0, load_average_before=load0, load_average_after=os.getloadavg()[0])
    print(json.dumps({k: v for k, v in res.items() if k != "differ"}), f"differ: {len(res['differ'])}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 1 if res["floor_violations"] or res["differ"] else 0


if __name__ == "__main__":
    sys.exit(main())
