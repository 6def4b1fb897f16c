"""CP-SAT with and without its warm start (``solve.thin_options`` / ``_warm_start``), side by side on
instances beyond plan_scaling's: the example PPO jobs at other response lengths on 1,024 H100s, the
32B / 70B examples on 256 and 1,024, and plan_scaling's own PPO 8B / 70B cases, three seeds each.
Each instance is solved first without, then with the warm start (its cost estimates are cached by the
first solve, so the rows compare the solver, not the estimates); both must reach the same proven
optimum. Step times are predictions; solve times are measured wall seconds.

    .venv/bin/python benchmarks/solver_warm_start.py [--json OUT]
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.planner.solver import PlanProblem, solve  # noqa: E402
from nereus.planner.solver.candidates import _build_tables_cached  # noqa: E402
from nereus.planner.specs import load_cluster, load_job  # noqa: E402

CASES = ([("ppo-8b", 1024, m) for m in (1024, 4096, 16384)] + [("ppo-70b", 1024, m) for m in (1024, 4096, 16384)]
         + [(n, g, None) for n in ("ppo-32b", "grpo-32b", "grpo-70b") for g in (256, 1024)]
         + [("ppo-8b", g, None) for g in (64, 256, 1024)] + [("ppo-70b", g, None) for g in (64, 256, 1024)])
SEEDS = (0, 1, 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    from ortools.sat.python import cp_model  # noqa: F401  (imported before timing)
    S = importlib.import_module("nereus.planner.solver.solve")  # the module (the package exports solve())
    on = S.WARM_START_MIN_OPTIONS
    rows = []
    for name, gpus, mean in CASES:
        job = load_job(ROOT / f"examples/{name}.yaml")
        if mean:
            seq = replace(job.sequence, response_len_mean=mean, response_len_max=max(job.sequence.response_len_max, 4 * mean))
            job = replace(job, sequence=seq)
        cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(gpus)
        row = {"job": name, "gpus": gpus, "response_len_mean": mean or job.sequence.response_len_mean}
        for mode, threshold in (("plain", 10**9), ("warm", on)):
            S.WARM_START_MIN_OPTIONS = threshold
            times, objs = [], set()
            for seed in SEEDS:
                _build_tables_cached.cache_clear()
                sol = solve(PlanProblem(job=job, cluster=cluster, workload=job.workload()), backend="cpsat",
                            time_limit_s=60, workers=1, seed=seed)
                assert sol.status == "OPTIMAL", (name, gpus, mean, mode, sol.status)
                times.append(sol.wall_s)
                objs.add(round(sol.objective, 9))
            row[mode] = times
            row[f"{mode}_step_s"] = objs.pop()
        S.WARM_START_MIN_OPTIONS = on
        assert abs(row["plain_step_s"] - row["warm_step_s"]) < 1e-6, row
        rows.append(row)
        print(f"{name:8s} {gpus:5d} GPUs mean {row['response_len_mean']:6.0f}: plain "
              + " ".join(f"{t:.2f}" for t in row["plain"]) + "  warm " + " ".join(f"{t:.2f}" for t in row["warm"]),
              flush=True)
    summary = {m: {"max_s": max(t for r in rows for t in r[m]), "sum_s": sum(t for r in rows for t in r[m]),
                   "max_s_seeds_1_2": max(t for r in rows for t in r[m][1:])} for m in ("plain", "warm")}
    worse = max(w - p for r in rows for p, w in zip(r["plain"][1:], r["warm"][1:]))
    summary["largest_warm_minus_plain_s_seeds_1_2"] = worse
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
