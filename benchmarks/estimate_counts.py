"""How many cost-model estimates a cold cpsat solve makes, per example row, in one or more checkouts
side by side: a count, so unlike a time it does not move with the machine's load. Each solve runs in
a fresh subprocess of its checkout (empty caches); ``candidates.estimate`` is wrapped to count calls.
Rows: 8B and 70B PPO (examples/ppo-*.yaml), sync / one_step_off / fully_async (the job's own
staleness and sync_every), 64 / 256 / 1,024 H100s. The objective is printed beside each count.

    .venv/bin/python benchmarks/estimate_counts.py [--before OTHER_TREE] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from dataclasses import replace
from nereus.planner.solver import PlanProblem, solve, candidates as C
from nereus.planner.specs import load_cluster, load_job
n = [0]
orig = C.estimate
def counted(*a, **k):
    n[0] += 1
    return orig(*a, **k)
C.estimate = counted
job = load_job(sys.argv[1] + "/examples/ppo-%s.yaml" % sys.argv[2])
if sys.argv[3] != "sync":
    job = replace(job, schedule=replace(job.schedule, kind=sys.argv[3]))
cl = load_cluster(sys.argv[1] + "/examples/cluster-h100-1n.yaml").with_gpus(int(sys.argv[4]))
sol = solve(PlanProblem(job=job, cluster=cl, workload=job.workload()), backend="cpsat", time_limit_s=60, workers=1)
print(json.dumps([n[0], sol.status, sol.objective]))
"""
ROWS = [(m, k, g) for g in (1024, 256, 64) for k in ("sync", "one_step_off", "fully_async") for m in ("8b", "70b")]


def count(tree: str, row) -> tuple[int, str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", CHILD, tree, *map(str, row)], capture_output=True, text=True,
                         env=env, check=True)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", help="another checkout to count beside this one")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args()
    trees = ([a.before] if a.before else []) + [str(ROOT)]
    rows = []
    for r in ROWS:
        got = {t: count(t, r) for t in trees}
        rows.append({"model": r[0], "schedule": r[1], "gpus": r[2],
                     "estimates": [got[t][0] for t in trees], "objective": [got[t][2] for t in trees]})
        print(r, " | ".join(f"{got[t][0]:6d} estimates, {got[t][1]} {got[t][2]:.4f}" for t in trees), flush=True)
    totals = [sum(x["estimates"][i] for x in rows) for i in range(len(trees))]
    print("total", totals)
    if a.json:
        Path(a.json).write_text(json.dumps({"trees": trees, "rows": rows, "totals": totals}, indent=1))


if __name__ == "__main__":
    main()
