"""SIMULATED reproduction of the published online-adaptation figures (issue 16).

Everything here is a simulation: step and transition times come from the simulator's ground truth
(``nereus/simulator/truth``: sampled response lengths, continuous-batching engines and 1F1B
pipelines priced from published measurements; it shares no code with the planner's cost model),
not from GPUs. Nothing was tuned to hit the published numbers: the traces are the shipped ones
(sources in their header comments), the jobs are the shipped examples, every policy runs on every
run, and a job/trace pair that cannot run (the model does not fit the trace's GPUs) is listed as
skipped with the reason.

Published (the paper this project follows): adaptive TP/PP cut mean step latency 27.7% against a fixed
TP/PP layout that only scales DP; in a 1,000-step run reaching 1,024 GPUs, 6 transitions took 0.079%
of run time; 8B PPO throughput 1.10-1.47x verl and 2.14-7.27x OpenRLHF.

Figures per run: mean step latency (wall time per completed step, transitions and restarts
included) of adaptive against static-naive, static and hindsight (and the oracle's); number of
adaptive's transitions and their share of run time; throughput (completed steps per hour) against
verl-like and OpenRLHF-like.

    .venv/bin/python benchmarks/simulate_repro.py --json benchmarks/results/simulate_repro.json
    .venv/bin/python benchmarks/simulate_repro.py --only ramp_1024_noisy --jobs ppo-8b --steps 50   # smoke test
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.errors import NereusError  # noqa: E402
from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from nereus.simulator.policies import POLICIES  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import load_trace  # noqa: E402

PUBLISHED = {"latency_reduction_vs_static": 0.277, "transitions": 6, "transition_overhead": 0.00079,
             "vs_verl": (1.10, 1.47), "vs_openrlhf": (2.14, 7.27)}
JOBS = ("ppo-8b", "grpo-8b", "ppo-32b", "grpo-32b", "ppo-70b", "grpo-70b")
RUNS = (  # (trace, cluster, steps: None = all, jobs)
    ("ramp_1024_noisy", "cluster-h100-128n", None, JOBS),
    ("ramp_1024", "cluster-h100-128n", None, JOBS),
    ("deepscaler_staged", "cluster-h100-4n", None, ("ppo-8b", "grpo-8b")),
    ("r1zero_linear", "cluster-h100-16n", 2000, ("ppo-8b", "grpo-8b", "grpo-32b")),
)
SKIPPED = {("deepscaler_staged", j): "8-32 GPUs: a 32B/70B job does not fit 8 GPUs" for j in JOBS[2:]}
SKIPPED |= {("r1zero_linear", j): "not run: 2,000 steps of every policy per job; 8B and 32B GRPO cover it"
            for j in ("ppo-32b", "ppo-70b", "grpo-70b")}


def figures(d: dict) -> dict:
    a = d["adaptive"]
    if "not_run" in a or not a["completed_steps"]:
        raise NereusError(f"adaptive did not run: {a.get('not_run', 'no step completed')}")

    def ok(ref: str) -> bool:
        return ref in d and d[ref]["completed_steps"] > 0 and "not_run" not in d[ref]

    def red(ref: str) -> float | None:
        return 1 - a["mean_step_s"] / d[ref]["mean_step_s"] if ok(ref) else None

    def thr(ref: str) -> float | None:  # completed steps per wall second, adaptive over ref
        if not ok(ref):
            return None
        return (a["completed_steps"] / a["total_s"]) / (d[ref]["completed_steps"] / d[ref]["total_s"])

    return {"latency_reduction_vs_static_naive": red("static-naive"), "latency_reduction_vs_static": red("static"),
            "latency_reduction_vs_hindsight": red("hindsight"),
            "oracle_reduction_vs_static": 1 - d["oracle"]["mean_step_s"] / d["static"]["mean_step_s"] if ok("static") else None,
            "adaptive_transitions": a["transitions"], "adaptive_transition_overhead": a["transition_overhead"],
            "throughput_vs_verl": thr("verl"), "throughput_vs_openrlhf": thr("openrlhf"),
            "ooms": {k: v["ooms"] for k, v in d.items()}, "dropped_steps": {k: v["dropped_steps"] for k, v in d.items()},
            "not_run": {k: v["not_run"] for k, v in d.items() if "not_run" in v}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all figures as JSON (rewritten after every run)")
    ap.add_argument("--steps", type=int, help="only the first N steps of each trace (smoke test)")
    ap.add_argument("--only", choices=[r[0] for r in RUNS], help="one trace only")
    ap.add_argument("--jobs", nargs="+", choices=JOBS, help="these jobs only")
    ap.add_argument("--merge", action="store_true", help="update the runs of --json that this call re-runs, keep the rest")
    args = ap.parse_args(argv)
    out = {"published": PUBLISHED, "label": "SIMULATED", "runs": [], "skipped": []}
    if args.merge and args.json and Path(args.json).exists():
        out = json.loads(Path(args.json).read_text())
        redo = {(j, t) for t, _, _, jobs in RUNS if not args.only or t == args.only
                for j in jobs if not args.jobs or j in args.jobs}
        out["runs"] = [r for r in out["runs"] if (r["job"], r["trace"]) not in redo]
        out["skipped"] = [r for r in out["skipped"] if (r["job"], r["trace"]) not in redo]
    for trace_name, cluster_name, steps, jobs in RUNS:
        if args.only and trace_name != args.only:
            continue
        for job_name in JOBS:
            if args.jobs and job_name not in args.jobs:
                continue
            if job_name not in jobs:
                out["skipped"].append({"job": job_name, "trace": trace_name, "why": SKIPPED.get((trace_name, job_name), "")})
                continue
            trace = load_trace(trace_name)
            n = args.steps or steps
            if n:
                trace = trace.head(n)
            job, cluster = load_job(ROOT / f"examples/{job_name}.yaml"), load_cluster(ROOT / f"examples/{cluster_name}.yaml")
            t0 = time.perf_counter()
            try:
                res = simulate(job, cluster, trace, POLICIES, time_limit_s=1.0, seed=0)
            except NereusError as e:
                out["skipped"].append({"job": job_name, "trace": trace_name, "why": str(e)})
                print(f"{job_name} / {trace_name}: skipped ({e})", file=sys.stderr)
                continue
            d = {k: r.to_dict() for k, r in res.items()}
            run = {"job": job_name, "trace": trace_name, "steps": len(trace), "of_steps": len(load_trace(trace_name)),
                   "gpus": f"{trace.rows[0].gpus}->{trace.max_gpus}" if trace.rows[0].gpus != trace.max_gpus
                   else str(trace.max_gpus), "wall_s": time.perf_counter() - t0, **figures(d), "policies": d}
            out["runs"].append(run)
            print(f"[{run['wall_s']:.0f}s] {job_name} / {trace_name}: done", file=sys.stderr)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    order = {(t, j): k for k, (t, j) in enumerate((t, j) for t, _, _, _ in RUNS for j in JOBS)}
    out["runs"].sort(key=lambda r: order.get((r["trace"], r["job"]), 0))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(table(out))
    return 0


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(out: dict) -> str:
    lines = ["SIMULATED (ground truth built from published measurements, not hardware). Published figures in brackets.",
             "| job | trace | steps | GPUs | latency vs static-naive | vs static [27.7%] | vs hindsight | oracle vs static "
             "| transitions [6] | transition share [0.079%] | x verl [1.10-1.47] | x OpenRLHF [2.14-7.27] | OOMs adaptive / static |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        steps = f"{r['steps']:,}" + ("" if r["steps"] == r["of_steps"] else f" of {r['of_steps']:,}")
        lines.append(f"| {r['job']} | {r['trace']} | {steps} | {r['gpus']} | {_pct(r['latency_reduction_vs_static_naive'])} "
                     f"| {_pct(r['latency_reduction_vs_static'])} | {_pct(r['latency_reduction_vs_hindsight'])} "
                     f"| {_pct(r['oracle_reduction_vs_static'])} | {r['adaptive_transitions']} "
                     f"| {r['adaptive_transition_overhead']:.3%} | {_x(r['throughput_vs_verl'])} "
                     f"| {_x(r['throughput_vs_openrlhf'])} | {r['ooms']['adaptive']} / {r['ooms']['static']} |")
        for k, why in r.get("not_run", {}).items():
            lines.append(f"  ({r['job']} / {r['trace']}: {k} could not start: {why[:160]})")
    for s in out["skipped"]:
        lines.append(f"skipped: {s['job']} / {s['trace']}: {s['why']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
