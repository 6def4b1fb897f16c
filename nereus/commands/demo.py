"""nereus demo: a real GRPO run on CPU gloo processes that re-plans its parallelism online."""
from __future__ import annotations

import argparse

from nereus.commands.common import pos_float, pos_int, write_json


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="real GRPO run on gloo processes that switches layouts as responses grow",
                       description="A real RL run (GRPO on the reference transformer, gloo processes on CPU) whose "
                                   "controller re-plans the parallel layout online, then the same run under the "
                                   "static policy, side by side. Everything printed is measured in this run.")
    p.add_argument("--steps", type=pos_int, default=30)
    p.add_argument("--world", type=pos_int, default=4, help="gloo processes (2-4)")
    p.add_argument("--budget-mb", type=pos_float, default=16.0, help="per-process device-memory budget (MiB)")
    p.add_argument("--policy", choices=("both", "adaptive", "static"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="out/demo", help="plot, audit logs and per-step records")
    p.add_argument("--json", metavar="OUT", help="write the measured figures as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from nereus.demo.run import run_demo
    from nereus.demo.setup import DemoConfig
    from nereus.errors import SpecError

    if not 2 <= args.world <= 4:
        raise SpecError(f"--world must be 2, 3 or 4 (gloo processes on this machine), got {args.world}")
    cfg = DemoConfig(steps=args.steps, world=args.world, budget_mb=args.budget_mb, policy=args.policy,
                     seed=args.seed, out_dir=args.out_dir)
    out = run_demo(cfg)
    s = out["summary"]
    blank = {"mean_step_s": None, "transition_s": None, "infeasible_steps": None, "peak_mem_frac": None,
             "transition_peak_mem_frac": None}
    pick = lambda d: {k: d[k] for k in blank} if d else blank  # noqa: E731
    a = s.get("adaptive")
    write_json(args.json, {"steps": cfg.steps, "transitions": a["transitions"] if a else 0,
                           "verified_transitions": a["verified_transitions"] if a else 0,
                           "adaptive": pick(a), "static": pick(s.get("static"))})
    return 0
