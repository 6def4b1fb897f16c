"""SIMULATED: asynchronous baselines beside adaptive re-splitting on the shipped growth traces.

    .venv/bin/python benchmarks/simulate_async.py --steps 100 --json benchmarks/results/simulate_async.json
    .venv/bin/python benchmarks/simulate_async.py --steps 300 --only r1zero_linear --seeds 0 1 2 \
        --policies static adaptive static-split   # the truth's seed: how much of a difference is luck

examples/grpo-8b.yaml with ``schedule: auto`` (staleness 1) on H100s: r1zero_linear (128 GPUs) and
deepscaler_staged (8 -> 32 GPUs), every policy of ``nereus simulate --schedule auto --policy all``.
Prints the docs table (mean step latency, idle share of each pool, transitions and their share).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = (("r1zero_linear", 128), ("deepscaler_staged", 32))
ROWS = ("adaptive", "static-split", "hindsight-split", "verl-one-step-off", "verl-fully-async",
        "verl-fully-async-dynamic")
SYNC = ("static", "verl", "openrlhf", "static-naive", "hindsight", "oracle", "always", "adaptive-restart")


def main() -> None:
    from nereus.planner.schedules import ScheduleSpec
    from nereus.planner.specs import load_cluster, load_job
    from nereus.simulator.async_policies import ASYNC_POLICIES
    from nereus.simulator.policies import POLICIES
    from nereus.simulator.simulate import simulate
    from nereus.simulator.trace import load_trace

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json")
    ap.add_argument("--time-limit", type=float, default=1.0)
    ap.add_argument("--only", choices=[n for n, _ in RUNS], help="one trace")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="the truth's seeds (sampled lengths, jitter); runs of several are keyed TRACE@seedN")
    ap.add_argument("--policies", nargs="+", help="a subset of the policies (default: every sync and async one)")
    a = ap.parse_args()
    job = replace(load_job(ROOT / "examples/grpo-8b.yaml"), schedule=ScheduleSpec(kind="auto", staleness=1))
    out = {"label": "SIMULATED", "job": "examples/grpo-8b.yaml (schedule auto, staleness 1)", "gpu": "H100",
           "steps": a.steps, "runs": {}}
    policies = a.policies or POLICIES + ASYNC_POLICIES
    for name, gpus in RUNS:
        if a.only and name != a.only:
            continue
        trace = load_trace(name).head(a.steps)
        cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(gpus)
        for seed in a.seeds:
            key = name if len(a.seeds) == 1 else f"{name}@seed{seed}"
            t0 = time.perf_counter()
            res = simulate(job, cluster, trace, policies, time_limit_s=a.time_limit, seed=seed)
            out["runs"][key] = {"gpus": gpus, "seed": seed, "wall_s": time.perf_counter() - t0,
                                "policies": {k: r.to_dict() for k, r in res.items()}}
            print(f"{key}: {time.perf_counter() - t0:.0f} s", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(table(out))


def table(out: dict) -> str:
    lines = ["| trace (steps, GPUs) | policy | mean step s | vs best sync | idle rollout | idle trainer | sync share "
             "| transitions | transition share |", "|---|---|---|---|---|---|---|---|---|"]
    for name, run in out["runs"].items():
        ps = run["policies"]
        sync = {k: ps[k]["mean_step_s"] for k in SYNC[:4] if k in ps and ps[k]["mean_step_s"] == ps[k]["mean_step_s"]}
        best = min(sync, key=sync.get) if sync else None
        for k in ROWS + ((best,) if best else ()):
            if k not in ps:
                continue
            d = ps[k]
            rel = f"{1 - d['mean_step_s'] / sync[best]:+.1%}" if best else "-"
            pct = (lambda x: f"{d[x]:.1%}" if x in d else "-")
            label = k if k != best else f"best sync ({k})"
            lines.append(f"| {name} ({out['steps']}, {run['gpus']}) | {label} | {d['mean_step_s']:.2f} | {rel} | "
                         f"{pct('idle_share_rollout')} | {pct('idle_share_trainer')} | {pct('sync_share')} | "
                         f"{d['transitions']} | {d['transition_overhead']:.3%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
