"""Plan-solver scaling: PPO with four models (Llama-3.1-8B and -70B) on 8, 64, 256 and 1,024 H100s,
solved by cpsat, pulp and greedy side by side. Prints a table; --json writes the rows.

solve_s is the wall time of the whole call to ``solve`` from a cold start (option tables, greedy,
model, search); the option tables and the memoised cost-model estimates are cleared before every
row, so no backend rides on another's cache. The solver libraries are imported once before the
first solve (OR-Tools takes about 0.3 s to import, once per process, like any long-running planner
or a CLI's start-up); that time is printed and written as ``imports_s`` beside the rows, not hidden
in the first row. cpu_s is the CPU time of the same call, this process plus its children (CBC runs
as a child), which stays meaningful when other work shares the machine's two cores. Step times are
predictions of the analytic cost model, not measurements.

    .venv/bin/python benchmarks/plan_scaling.py [--json OUT] [--time-limit S] [--workers N] [--seeds N] [--moe]

--moe solves the mixture-of-experts job list (``MOE_JOBS``: Qwen3-30B-A3B GRPO, expert parallelism
in the options) instead of the dense one; without it the rows are the dense ones, unchanged.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.planner.solver import PlanProblem, solve  # noqa: E402
from nereus.planner.solver import candidates  # noqa: E402
from nereus.planner.solver.candidates import _build_tables_cached  # noqa: E402
from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from benchmarks.machine_info import machine_info  # noqa: E402

JOBS = {"llama-3.1-8b": ROOT / "examples/ppo-8b.yaml", "llama-3.1-70b": ROOT / "examples/ppo-70b.yaml"}
MOE_JOBS = {"qwen3-30b-a3b": ROOT / "examples/grpo-qwen3-30b-a3b.yaml"}
GPUS = (8, 64, 256, 1024)
BACKENDS = ("cpsat", "pulp", "greedy")


def run(time_limit_s: float, workers: int, gpus=GPUS, backends=BACKENDS, seeds: int = 1) -> list[dict]:
    """One row per (model, GPUs, backend) at seed 0; with ``seeds`` > 1, CP-SAT again with seeds
    1 .. seeds-1 (rows with a ``seed`` key): its search order, and so how long its proof takes,
    follows the seed."""
    from rich.progress import track

    cases = [(m, g, b, 0) for m in JOBS for g in gpus for b in backends]
    cases += [(m, g, "cpsat", k) for m in JOBS for g in gpus for k in range(1, seeds) if "cpsat" in backends]
    rows = []
    for model, g, backend, seed in track(cases, description="solving", transient=True):
        job = load_job(JOBS[model])
        cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(g)
        cold_start()  # for every backend: no option table or estimate of an earlier row is reused
        cpu0 = _cpu()
        sol = solve(PlanProblem(job=job, cluster=cluster, workload=job.workload()), backend=backend,
                    time_limit_s=time_limit_s, workers=workers, seed=seed)
        rows.append({"model": model, "gpus": g, "backend": backend, "status": sol.status, "solve_s": sol.wall_s,
                     "gap": None if not math.isfinite(sol.gap) else sol.gap,
                     "step_time_s": sol.objective if sol.plan is not None else None,
                     "cpu_s": _cpu() - cpu0, "message": sol.message, "seed": seed})
    return rows


def seed_spread(rows: list[dict]) -> list[dict]:
    """CP-SAT wall seconds over the seeds run, per model and GPU count: min, median, max."""
    import statistics
    out = []
    for model in JOBS:
        for g in sorted({r["gpus"] for r in rows}):
            ts = [r["solve_s"] for r in rows if (r["model"], r["gpus"], r["backend"]) == (model, g, "cpsat")]
            if len(ts) > 1:
                out.append({"model": model, "gpus": g, "seeds": len(ts), "min_s": min(ts),
                            "median_s": statistics.median(ts), "max_s": max(ts)})
    return out


def cold_start() -> None:
    """Forget the option tables and the memoised cost-model estimates (``candidates._Estimator``)."""
    _build_tables_cached.cache_clear()
    candidates._estimates.clear()
    candidates._prefixes.clear()


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("model", "GPUs", *[f"{b} {k}" for b in BACKENDS for k in ("status", "wall s", "cpu s", "gap", "step s")],
              title="plan solver scaling (PPO, 4 models, H100; step times predicted by the cost model)")
    by = {(r["model"], r["gpus"], r["backend"]): r for r in rows if r.get("seed", 0) == 0}
    for model in JOBS:
        for g in sorted({r["gpus"] for r in rows}):
            cells = []
            for b in BACKENDS:
                r = by.get((model, g, b))
                if r is None:
                    cells += ["-"] * 5
                    continue
                gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
                step = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.2f}"
                cells += [r["status"], f"{r['solve_s']:.2f}", f"{r['cpu_s']:.2f}", gap, step]
            t.add_row(model, str(g), *cells)
    Console(width=200).print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpus", type=int, nargs="*", default=list(GPUS))
    ap.add_argument("--moe", action="store_true", help="solve MOE_JOBS (expert parallelism) instead of the dense jobs")
    ap.add_argument("--seeds", type=int, default=1, help="run CP-SAT with this many seeds (0 .. N-1); the table "
                                                          "shows seed 0, the spread is printed and written")
    args = ap.parse_args()
    imports_s = import_solvers()
    print(f"solver libraries imported in {imports_s:.2f} s (once per process; not in solve_s)")
    if args.moe:  # the mixture-of-experts rows instead of the dense ones
        global JOBS
        JOBS = MOE_JOBS
    rows = run(args.time_limit, args.workers, tuple(args.gpus), seeds=max(1, args.seeds))
    print_table(rows)
    spread = seed_spread(rows)
    for sp in spread:
        print(f"cpsat over {sp['seeds']} seeds, {sp['model']} on {sp['gpus']} GPUs: {sp['min_s']:.2f} / "
              f"{sp['median_s']:.2f} / {sp['max_s']:.2f} s (min / median / max)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "imports_s": imports_s, "seed_spread": spread, "rows": [
            {k: r[k] for k in ("model", "gpus", "backend", "status", "solve_s", "cpu_s", "gap", "step_time_s", "seed")}
            for r in rows]}, indent=2))
    return 0


def import_solvers() -> float:
    """Import OR-Tools CP-SAT and PuLP (what ``solve`` imports on first use), timed."""
    import time
    t0 = time.perf_counter()
    from ortools.sat.python import cp_model  # noqa: F401
    import pulp  # noqa: F401
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
