"""Speed of the simulator (SIMULATED results; the timing is real): the 1,000-step trace to 1,024
GPUs whose every step differs (``ramp_1024_noisy``: noisy mean and longest response, cap column),
every policy, examples/ppo-8b.yaml on examples/cluster-h100-128n.yaml. Goal: <= 60 s on the
project's 2-core machine; a controller step without a re-solve <= 10 ms.

    .venv/bin/python benchmarks/simulate_speed.py --json benchmarks/results/simulate_speed.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from nereus.simulator.policies import POLICIES  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import load_trace  # noqa: E402


def bucket_error(job, cluster, n: int, ratio: float, seed: int = 0) -> dict:
    """What solving on workload buckets costs: for ``n`` random mean response lengths, the plan solved
    for the bucket's mean against the plan solved for the exact mean, both predicted (planner's
    model) at the exact mean. Returns the worst and median excess."""
    import math

    import numpy as np

    from nereus.planner.cost.params import CostParams
    from nereus.planner.cost.plan_times import evaluate_times
    from nereus.planner.online.plan_cache import FREE, PlanCache
    from nereus.simulator.simulate import SIM_CANDIDATES

    rng = np.random.default_rng(seed)
    cache = PlanCache(job, cluster, time_limit_s=2.0, seed=0, candidates=SIM_CANDIDATES)
    base, params, r = job.workload(), CostParams(), math.log(ratio)
    excess = []
    for mean in np.exp(rng.uniform(math.log(1500), math.log(16000), n)):
        w = base.with_lengths(mean=float(round(mean, 1)), max_=20480)
        wb = base.with_lengths(mean=round(math.exp(round(math.log(mean) / r) * r), 1), max_=20480)
        exact, bucket = cache.best(FREE, w, cluster.num_gpus, params), cache.best(FREE, wb, cluster.num_gpus, params)
        te, tb = (evaluate_times(job, cluster, p, w, params).step_s for p in (exact, bucket))
        excess.append(tb / te - 1)
    return {"ratio": ratio, "samples": n, "max_excess": float(max(excess)), "median_excess": float(np.median(excess))}


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="ramp_1024_noisy")
    ap.add_argument("--job", default=str(ROOT / "examples/ppo-8b.yaml"))
    ap.add_argument("--cluster", default=str(ROOT / "examples/cluster-h100-128n.yaml"))
    ap.add_argument("--steps", type=int)
    ap.add_argument("--json")
    ap.add_argument("--workers", type=int, default=2, help="processes for the online policies (the machine has 2 cores)")
    ap.add_argument("--bucket-check", type=int, default=0, metavar="N",
                    help="also measure the solve buckets' error on N random lengths (each costs two solves)")
    args = ap.parse_args(argv)
    job, cluster, trace = load_job(args.job), load_cluster(args.cluster), load_trace(args.trace)
    if args.steps:
        trace = trace.head(args.steps)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(job, cluster, trace, POLICIES, time_limit_s=1.0, seed=0, workers=args.workers)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    children = os.times()
    cpu += children.children_user + children.children_system  # the forked workers' CPU
    per = {k: {x: r.to_dict()[x] for x in ("wall_s", "solves", "controller_overhead_ms_median",
                                          "controller_overhead_ms_p99", "controller_overhead_ms_max", "mean_step_s",
                                          "transitions", "ooms", "dropped_steps")} for k, r in res.items()}
    pooled = sorted(x for r in res.values() for x in r.overhead_ms)
    no_resolve = {"decisions": len(pooled), "median_ms": _q(pooled, 0.5), "p90_ms": _q(pooled, 0.9),
                  "p99_ms": _q(pooled, 0.99), "max_ms": pooled[-1] if pooled else 0.0,
                  "share_within_10ms": sum(1 for x in pooled if x <= 10.0) / max(1, len(pooled))}
    out = {"label": "SIMULATED results; timing measured", "trace": trace.name, "steps": len(trace),
           "max_gpus": trace.max_gpus, "policies": list(res), "workers": args.workers, "wall_s": wall, "cpu_s": cpu,
           "load_average_before": load0, "load_average_after": os.getloadavg()[0],
           "controller_step_without_resolve": no_resolve, "per_policy": per}
    print(f"{trace.name}: {len(trace)} steps to {trace.max_gpus} GPUs, {len(res)} policies: wall {wall:.1f} s, "
          f"CPU {cpu:.1f} s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; the machine is shared)")
    for k, d in per.items():
        print(f"  {k:13} wall {d['wall_s']:6.1f} s  solves {d['solves']:3}  no-resolve step ms: median "
              f"{d['controller_overhead_ms_median']:.1f} p99 {d['controller_overhead_ms_p99']:.1f}")
    print(f"controller steps without a re-solve (all online policies, {no_resolve['decisions']}): median "
          f"{no_resolve['median_ms']:.1f} ms, p90 {no_resolve['p90_ms']:.1f} ms, p99 {no_resolve['p99_ms']:.1f} ms; "
          f"{no_resolve['share_within_10ms']:.1%} within 10 ms")
    if args.bucket_check:
        from nereus.simulator.policies import SOLVE_BUCKET_RATIO

        out["bucket_error"] = b = bucket_error(job, cluster.with_gpus(128), args.bucket_check, SOLVE_BUCKET_RATIO)
        print(f"solve buckets (ratio {b['ratio']}): the bucket's plan is at most {b['max_excess']:.1%} (median "
              f"{b['median_excess']:.1%}) slower than the exact workload's plan, predicted, on {b['samples']} lengths")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
