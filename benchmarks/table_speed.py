"""Option-table and cold-solve CPU time of the 8B and 70B PPO jobs at 1,024 GPUs (or ``--gpus``), two checkouts
side by side, with the plans each returns compared (a digest of the plan JSON less its solve time).

Each measurement (the tables alone; the whole cpsat solve) runs in a fresh subprocess of the
checkout (its own imports and empty caches; solver libraries imported before the clock starts),
alternating before / after so load drifts hit both. CPU time is ``time.process_time`` of this
process plus its children (CBC is not used: backend cpsat): the steady figure on a shared machine;
wall time is beside it, with the 1-minute load average before and after every run. Prints JSON;
--json writes it too.

    .venv/bin/python benchmarks/table_speed.py --before /tmp/wt-before [--after .] [--runs 5] [--json OUT]
        [--gpus 8 64 256 1024] [--backends cpsat pulp greedy] [--schedules sync one_step_off fully_async auto]
        [--solve-only]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("examples/ppo-8b.yaml", "examples/ppo-70b.yaml")

CHILD = r"""
import json, os, resource, sys, time
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
from nereus.planner.solver import PlanProblem, solve, candidates
from nereus.planner.solver.candidates import _build_tables_cached, build_tables
from nereus.planner.specs import load_cluster, load_job
import ortools.sat.python.cp_model  # noqa: F401  (imported before the clock, as plan_scaling does)
job = load_job(root / sys.argv[3])
cluster = load_cluster(root / "examples/cluster-h100-1n.yaml").with_gpus(int(sys.argv[4]))
from dataclasses import replace
from nereus.planner.schedules import ScheduleSpec
kind = sys.argv[6] if len(sys.argv) > 6 else "file"
if kind != "file":  # (the schedules of benchmarks/plan_scaling_async.py)
    job = replace(job, schedule={"sync": ScheduleSpec(), "one_step_off": ScheduleSpec(kind="one_step_off"),
                                 "fully_async": ScheduleSpec(kind="fully_async", staleness=2, sync_every=2),
                                 "auto": ScheduleSpec(kind="auto", staleness=2, sync_every=2)}[kind])
problem = PlanProblem(job=job, cluster=cluster, workload=job.workload())
def cold():
    _build_tables_cached.cache_clear(); candidates._estimates.clear()
def cpu():
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + c.ru_utime + c.ru_stime
cold(); t0 = cpu(); w0 = time.perf_counter()
if sys.argv[2] == "tables":
    tables = build_tables(problem)
    print(json.dumps({"tables_cpu_s": cpu() - t0, "tables_wall_s": time.perf_counter() - w0,
                      "options": sum(len(o) for o in tables.options)}))
else:
    sol = solve(problem, backend=sys.argv[5], time_limit_s=60.0, workers=1, seed=0)
    c = cpu() - t0
    import hashlib
    plan = {k: v for k, v in sol.plan.to_dict().items() if k != "solve_s"} if sol.plan is not None else None
    print(json.dumps({"solve_cpu_s": c, "solve_wall_s": sol.wall_s, "objective": sol.objective,
                      "bound": sol.bound, "status": sol.status, "plan_sha": hashlib.sha1(json.dumps(plan, sort_keys=True, default=str)
                                                                     .encode()).hexdigest()}))
"""


def one(checkout: Path, job: str, gpus: int = 1024, backend: str = "cpsat", schedule: str = "file",
        solve_only: bool = False) -> dict:
    """The option tables and the whole solve, each in a fresh process (no cache of the other)."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    row = {"load_1m_before": os.getloadavg()[0]}
    for what in ("solve",) if solve_only else ("tables", "solve"):
        out = subprocess.run([sys.executable, "-c", CHILD, str(checkout), what, job, str(gpus), backend, schedule],
                             capture_output=True, text=True, env=env, check=True, cwd=checkout).stdout
        row.update(json.loads(out.strip().splitlines()[-1]))
    row["load_1m_after"] = os.getloadavg()[0]
    return row


def summary(rows: list[dict]) -> dict:
    keys = [k for k in ("tables_cpu_s", "tables_wall_s", "solve_cpu_s", "solve_wall_s") if k in rows[0]]
    return {k: {"median": statistics.median(r[k] for r in rows), "min": min(r[k] for r in rows),
                "max": max(r[k] for r in rows)} for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=ROOT)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--jobs", nargs="*", default=list(JOBS))
    ap.add_argument("--gpus", type=int, nargs="*", default=[1024])
    ap.add_argument("--backends", nargs="*", default=["cpsat"])
    ap.add_argument("--schedules", nargs="*", default=["file"],
                    help="file (the job's own) or sync one_step_off fully_async auto (plan_scaling_async's)")
    ap.add_argument("--solve-only", action="store_true", help="time the cold solve only, not the full tables")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    load = [os.getloadavg()]
    cases = [(job, g, b, k) for job in a.jobs for g in a.gpus for b in a.backends for k in a.schedules]
    key = {c: (c[0] if (c[1], c[2]) == (1024, "cpsat") else f"{c[0]}@{c[1]}:{c[2]}") + ("" if c[3] == "file" else f"/{c[3]}")
           for c in cases}
    runs = {key[c]: {"before": [], "after": []} for c in cases}
    for _ in range(a.runs):
        for c in cases:
            for name, path in (("before", a.before), ("after", a.after)):
                runs[key[c]][name].append(one(path.resolve(), *c, solve_only=a.solve_only))
                load.append(os.getloadavg())
    jobs = {}
    for job, sides in runs.items():
        objs = {name: sorted({r["objective"] for r in rs}) for name, rs in sides.items()}
        plans = {name: sorted({r.get("plan_sha", "") for r in rs}) for name, rs in sides.items()}
        status = {name: sorted({(r.get("status"), r.get("bound")) for r in rs}, key=str) for name, rs in sides.items()}
        jobs[job] = {"objectives_identical": objs["before"] == objs["after"], "objectives": objs,
                     "plans_identical": plans["before"] == plans["after"], "plan_sha": plans,
                     "status_bound_identical": status["before"] == status["after"], "status_bound": status,
                     "options": {name: sorted({r.get("options", 0) for r in rs}) for name, rs in sides.items()},
                     "before": summary(sides["before"]), "after": summary(sides["after"]), "rows": sides}
    res = {"gpus": a.gpus, "backends": a.backends, "workers": 1, "runs": a.runs,
           "steady_figure": "tables_cpu_s / solve_cpu_s (time.process_time); wall beside it",
           "before_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.before, capture_output=True,
                                           text=True, check=False).stdout.strip(),
           "after_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=a.after, capture_output=True,
                                          text=True, check=False).stdout.strip(),
           "load_avg_1_5_15": {"min_1m": min(x[0] for x in load), "max_1m": max(x[0] for x in load),
                               "start": load[0], "end": load[-1]},
           "jobs": jobs}
    text = json.dumps(res, indent=1)
    print(text)
    for job, r in jobs.items():
        b, f = r["before"], r["after"]
        tab = "" if "tables_cpu_s" not in b else (
            f"tables cpu {b['tables_cpu_s']['median']:.3f} -> {f['tables_cpu_s']['median']:.3f} s "
            f"(wall {b['tables_wall_s']['median']:.3f} -> {f['tables_wall_s']['median']:.3f}); ")
        print(f"{job}: {tab}solve cpu "
              f"{b['solve_cpu_s']['median']:.3f} -> {f['solve_cpu_s']['median']:.3f} s (wall "
              f"{b['solve_wall_s']['median']:.3f} -> {f['solve_wall_s']['median']:.3f}); objectives identical: "
              f"{r['objectives_identical']}, plans identical: {r['plans_identical']}, status and bound identical: "
              f"{r['status_bound_identical']}", file=sys.stderr)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
