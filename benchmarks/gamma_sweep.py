"""The cost rule where it binds (SIMULATED; issue 29 item 4): transitions and mean step latency of
``adaptive`` (Nereus's cost rule), ``always`` (best plan every step, cost ignored) and the published
paper's gamma rule over gamma in {0, 0.25, 0.5, 1, 2, inf}, all in restart mode.

The scenario is fixed here before any run, with the reason for each choice:

- restart mode at the measured ``RestartCost`` defaults (``nereus/planner/online/restart.py``:
  174.15 s relaunch + 47.85 s engine start, checkpoints at 0.42 / 0.126 GB/s per node): a framework
  without live resharding, where every change of launch configuration, knobs included, is a
  checkpoint save and relaunch, charged so by the ground truth (``GroundTruth.switch_restart_s``);
- small steps: Qwen2.5-1.5B GRPO (DeepScaleR's model size), 64 prompts x 8 samples, on one node of
  8 H100s, so a step is tens of seconds against several minutes per relaunch;
- frequent drift: the mean response length climbs geometrically from 1,000 to 5,000 tokens (of an
  8,192 cap) and falls back, twice, at 30% per ``TRIGGER_EVERY`` steps: a drift trigger of the gamma
  rule every 8 steps, along a trend the controller's forecast can follow (a length that flips back
  and forth faster than the forecast's window is noise to it, not drift), with a different best
  layout at the short and the long end (generation TP4 / TP2, training TP1 / TP2 PP2).

The gamma rule re-plans only at a 30% length change and switches when transition cost / saving
per step <= gamma x H (H: steps to the next trigger by the forecast's trend, at most the horizon);
``adaptive`` switches when the saving over its horizon repays the cost x (1 + margin), past a noise
band and hysteresis; ``always`` takes the predicted-fastest plan every step.

    .venv/bin/python benchmarks/gamma_sweep.py --json benchmarks/results/gamma_sweep.json
    .venv/bin/python benchmarks/gamma_sweep.py --steps 40 --gammas 0 inf   # smoke test
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.models.spec import preset  # noqa: E402
from nereus.planner.online.admission import AdmissionConstants  # noqa: E402
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import Trace, parse_trace  # noqa: E402

GAMMAS = (0.0, 0.25, 0.5, 1.0, 2.0, math.inf)
"""The paper's sweep (its default gamma 0.5)."""
TRIGGER_EVERY = 8
"""Steps per 30% change of the mean length (the gamma rule's trigger)."""
SHORT, LONG, CAP = 1000, 5000, 8192
HALF = math.ceil(math.log(LONG / SHORT) / math.log(1.3) * TRIGGER_EVERY)
"""Steps from SHORT to LONG (50)."""
STEPS = 4 * HALF
"""Two climbs and two falls (200 steps)."""
JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=SHORT, response_len_max=CAP))
CLUSTER = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=1)


def drift_trace(steps: int = STEPS) -> Trace:
    """Per step: the mean response length SHORT x (LONG / SHORT) ** tri, tri rising 0 -> 1 over HALF
    steps and falling back (a triangle wave in log length), on the cluster's 8 GPUs, cap 8,192."""
    rows = ["step,response_len_mean,response_len_max,gpus,response_len_cap"]
    for k in range(steps):
        phase = (k % (2 * HALF)) / HALF
        tri = phase if phase <= 1 else 2 - phase
        rows.append(f"{k},{SHORT * (LONG / SHORT) ** tri:.1f},{CAP},{CLUSTER.num_gpus},{CAP}")
    return parse_trace("\n".join(rows) + "\n", name=f"log_triangle_{SHORT}_{LONG}")


def summary(r) -> dict:
    d = r.to_dict()
    keep = ("completed_steps", "mean_step_s", "total_s", "transitions", "transition_s", "transition_overhead", "ooms",
            "dropped_steps", "mean_compute_step_s")
    return {k: d[k] for k in keep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures as JSON")
    ap.add_argument("--steps", type=int, default=STEPS, help=f"trace length (default {STEPS})")
    ap.add_argument("--gammas", nargs="+", type=float, default=list(GAMMAS), help="gamma values (inf allowed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    trace = drift_trace(args.steps)
    t0 = time.perf_counter()
    # one simulate() for the three: a policy's result does not depend on the others in its call (the
    # plan cache holds pure-function results; tests/unit/test_sim_policy_mix.py); the gamma values
    # need a call each, as the admission constants are per call
    names = ("static", "adaptive-restart", "always-restart")
    res = simulate(JOB, CLUSTER, trace, list(names), time_limit_s=1.0, seed=args.seed)
    rows = {name: summary(res[name]) for name in names}
    sweep = []
    for g in args.gammas:
        r = simulate(JOB, CLUSTER, trace, ["gamma-restart"], time_limit_s=1.0, seed=args.seed,
                     admission=AdmissionConstants(gamma=g))["gamma-restart"]
        sweep.append({"gamma": "inf" if math.isinf(g) else g, **summary(r)})
    load = os.getloadavg()
    out = {"label": "SIMULATED", "scenario": {"job": "llama-3.1-8b GRPO, 64 prompts x 8, cap 8,192",
                                              "cluster": "1 x 8 H100-80GB", "trace": trace.name, "steps": len(trace),
                                              "trigger_every": TRIGGER_EVERY, "lengths": [SHORT, LONG],
                                              "transition_mode": "restart (RestartCost defaults)"},
           "policies": rows, "gamma_sweep": sweep, "wall_s": time.perf_counter() - t0,
           "load_avg_1_5_15": [round(x, 2) for x in load]}
    print(table(out))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def table(out: dict) -> str:
    s = out["scenario"]
    lines = [f"SIMULATED: {s['job']} on {s['cluster']}, {s['steps']} steps, length {s['lengths'][0]} -> "
             f"{s['lengths'][1]} and back (30% per {s['trigger_every']} steps), {s['transition_mode']}",
             "| policy | transitions | transition share | mean step s (transitions and crashes included) | "
             "mean compute step s | OOM | dropped |", "|---|---|---|---|---|---|---|"]

    def row(name, d):
        lines.append(f"| {name} | {d['transitions']} | {d['transition_overhead']:.1%} | {d['mean_step_s']:.1f} | "
                     f"{d['mean_compute_step_s']:.1f} | {d['ooms']} | {d['dropped_steps']} |")

    for name, d in out["policies"].items():
        row("static (live: its knob changes free; for reference)" if name == "static" else name, d)
    for d in out["gamma_sweep"]:
        row(f"gamma-restart, gamma {d['gamma']}", d)
    lines.append(f"wall {out['wall_s']:.0f} s, load average {out['load_avg_1_5_15']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
