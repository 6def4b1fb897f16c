"""Plan-solver scaling under each schedule: the jobs of ``plan_scaling.py`` (PPO with four models,
Llama-3.1-8B and -70B on H100s) planned as sync, one_step_off, fully_async (staleness 2, a sync
every 2 steps) and auto (each admitted schedule solved exactly, the fastest kept), CP-SAT only,
cold option tables for every row. Prints a table; --json writes the rows. Step times are
predictions of the analytic cost model, not measurements; solve_s is wall time on this machine.

    .venv/bin/python benchmarks/plan_scaling_async.py [--json OUT] [--gpus 64 256 1024] [--time-limit S]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.plan_scaling import JOBS, _cpu, cold_start, import_solvers  # noqa: E402
from nereus.planner.schedules import ScheduleSpec  # noqa: E402
from nereus.planner.solver import PlanProblem, solve  # noqa: E402
from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from benchmarks.machine_info import machine_info  # noqa: E402

SCHEDULES = {"sync": ScheduleSpec(), "one_step_off": ScheduleSpec(kind="one_step_off"),
             "fully_async": ScheduleSpec(kind="fully_async", staleness=2, sync_every=2),
             "auto": ScheduleSpec(kind="auto", staleness=2, sync_every=2)}


def run(gpus, time_limit_s: float) -> list[dict]:
    from rich.progress import track

    cases = [(m, g, k) for m in JOBS for g in gpus for k in SCHEDULES]
    rows = []
    for model, g, kind in track(cases, description="solving", transient=True):
        job = replace(load_job(JOBS[model]), schedule=SCHEDULES[kind])
        cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(g)
        cold_start()
        cpu0 = _cpu()
        sol = solve(PlanProblem(job=job, cluster=cluster, workload=job.workload()), backend="cpsat",
                    time_limit_s=time_limit_s, workers=1, seed=0)
        ex = dict(sol.plan.extras) if sol.plan is not None else {}
        gen = sol.plan.stage("actor/generation") if sol.plan is not None else None
        rows.append({"model": model, "gpus": g, "schedule": kind, "status": sol.status, "solve_s": sol.wall_s,
                     "cpu_s": _cpu() - cpu0, "gap": None if not math.isfinite(sol.gap) else sol.gap,
                     "step_time_s": sol.objective if sol.plan is not None else None,
                     "chosen": (ex.get("schedule") or {"kind": "sync"})["kind"] if sol.plan is not None else None,
                     "rollout_gpus": gen.gpus if gen is not None and ex.get("schedule", {}).get("kind", "sync") != "sync"
                     else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--gpus", type=int, nargs="*", default=[64, 256, 1024])
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    imports_s = import_solvers()
    rows = run(args.gpus, args.time_limit)
    from rich.console import Console
    from rich.table import Table

    t = Table("model", "GPUs", "schedule", "status", "wall s", "cpu s", "step s (predicted)", "chosen", "rollout GPUs",
              title="plan solver by schedule (CP-SAT; step times predicted by the cost model)")
    for r in rows:
        t.add_row(r["model"], str(r["gpus"]), r["schedule"], r["status"], f"{r['solve_s']:.2f}", f"{r['cpu_s']:.2f}",
                  "-" if r["step_time_s"] is None else f"{r['step_time_s']:.2f}", str(r["chosen"]),
                  str(r["rollout_gpus"] or "-"))
    Console(width=160).print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "imports_s": imports_s, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
