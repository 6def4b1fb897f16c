"""Two trace shapes where adapting should cost little and gain little (SIMULATED results): does the
controller stay put, and does it get through a GPU loss without crashes and extra switches?

- ``flat``: the mean response length constant (3,000 tokens), the cap a constant column (8,192), the
  observed longest response noisy (each step's mean and longest are those of its own 256 x 4
  sampled responses, ``trace.as_logged``); 128 GPUs throughout. A controller that follows the noise
  switches; the issue's goal is at most 1 transition.
- ``dip``: the same lengths, but the job loses a quarter of its GPUs (128 -> 96) for the middle 35% of
  the run and then gets them back. Two layout changes are forced (the GPU count changes twice);
  every other transition, and every out-of-memory step, is the controller's.
- ``dip_ramp``: the dip with the mean growing 2,000 -> 6,000 tokens (both drifts at once).

examples/ppo-8b.yaml on examples/cluster-h100-16n.yaml (128 H100s), ``static`` / ``adaptive`` /
``always`` (the cost rule switched off), one process. Prints a table; --json writes the rows.

    .venv/bin/python benchmarks/simulate_flat_and_dip.py [--steps 200] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import Trace, TraceRow, as_logged  # noqa: E402

CAP = 8192
POLICIES = ("static", "adaptive", "always")


def shapes(steps: int) -> dict[str, Trace]:
    def dip(i: int) -> int:
        return 96 if 0.30 * steps <= i < 0.65 * steps else 128

    def make(name: str, mean, gpus) -> Trace:
        rows = tuple(TraceRow(step=i, response_len_mean=float(mean(i)), response_len_max=CAP, gpus=gpus(i),
                              response_len_cap=CAP) for i in range(steps))
        return as_logged(Trace(name=name, rows=rows), prompts=256, samples=4, seed=0, name=name)

    return {"flat": make("flat", lambda i: 3000, lambda i: 128),
            "dip": make("dip", lambda i: 3000, dip),
            "dip_ramp": make("dip_ramp", lambda i: 2000 + 4000 * i / steps, dip)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    job = load_job(ROOT / "examples/ppo-8b.yaml")
    cluster = load_cluster(ROOT / "examples/cluster-h100-16n.yaml")
    rows = []
    print(f"SIMULATED, {args.steps} steps, ppo-8b on 128 H100s")
    print(f"{'trace':9} {'policy':9} {'mean step s':>11} {'transitions':>11} {'forced':>6} {'OOM steps':>9} "
          f"{'OOMs':>5} {'dropped':>7}")
    for name, trace in shapes(args.steps).items():
        gpus = [r.gpus for r in trace.rows]
        forced = sum(1 for a, b in pairwise(gpus) if a != b)
        res = simulate(job, cluster, trace, list(POLICIES), time_limit_s=1.0, seed=0, workers=1)
        for p, r in res.items():
            d = r.to_dict()
            rows.append({"trace": name, "policy": p, "mean_step_s": d["mean_step_s"], "transitions": d["transitions"],
                         "forced_by_gpu_changes": forced, "infeasible_steps": d["infeasible_steps"], "ooms": d["ooms"],
                         "dropped_steps": d["dropped_steps"], "steps": d["steps"]})
            print(f"{name:9} {p:9} {d['mean_step_s']:11.2f} {d['transitions']:11d} {forced:6d} "
                  f"{d['infeasible_steps']:9d} {d['ooms']:5d} {d['dropped_steps']:7d}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"label": "SIMULATED", "steps": args.steps, "job": "examples/ppo-8b.yaml",
                                               "cluster": "examples/cluster-h100-16n.yaml", "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
