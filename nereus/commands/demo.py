"""nereus demo: a real GRPO run on CPU gloo processes that re-plans its parallelism online, beside
single-layout baselines (static, static+recompute, model-hindsight), at one memory budget or several,
every policy repeated and interleaved, with an A/A control."""
from __future__ import annotations

import argparse

from nereus.commands.common import pos_float, pos_int, torchrun_world, write_json


def _ks(text: str) -> tuple[float, ...]:
    try:
        ks = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budgets takes multiples of the model state like 1.5,2,3, got {text!r}")
    if not ks or any(not k > 0 for k in ks):
        raise argparse.ArgumentTypeError(f"--budgets: every multiple must be > 0, got {text!r}")
    return ks


def add_parser(sub) -> argparse.ArgumentParser:
    from nereus.demo.setup import ONE_STEP_OFF_DEFAULTS, POLICIES, DemoConfig

    p = sub.add_parser("demo", help="real GRPO run on gloo processes that switches layouts as responses grow",
                       description="A real RL run (GRPO on the reference transformer, gloo processes on CPU) whose "
                                   "controller re-plans the parallel layout online, beside the same run under single "
                                   "layouts: static (what a user would pick), static+recompute, model-hindsight (the "
                                   "best single plan by the cost model, knowing the run's lengths; run unchanged, it "
                                   "is also the A/A control). Every policy runs --repeats times, interleaved; a "
                                   "difference inside the A/A control's spread is reported as a tie. Everything "
                                   "printed is measured in this run. Memory budget per process: k x the model state "
                                   "of the plainest layout.")
    p.add_argument("--steps", type=pos_int,
                   help=f"RL steps of every run (default {DemoConfig().steps}: three at each cap of the schedule; "
                        f"{ONE_STEP_OFF_DEFAULTS['steps']} with --schedule one_step_off, its own schedule)")
    p.add_argument("--world", type=pos_int, default=4, help="gloo processes (2-4)")
    p.add_argument("--budget-k", type=pos_float, default=1.5,
                   help="per-process memory budget as a multiple of the per-process model state (default 1.5: "
                        "where memory binds as the cap rises)")
    p.add_argument("--budgets", type=_ks, metavar="K,K,K",
                   help="run every policy at each of these multiples (e.g. 1.5,2,3: the README's table)")
    p.add_argument("--budget-mb", type=pos_float, help="an explicit per-process budget (MiB) instead of --budget-k")
    p.add_argument("--policy", choices=("all", "both") + tuple(x for x in POLICIES if x != "model-hindsight"),
                   default="all", help="all (default: the four policies), both (adaptive and static) or one policy "
                                       "(model-hindsight, the A/A control, is chosen from the adaptive run, so only "
                                       "with all)")
    p.add_argument("--repeats", type=pos_int, default=2,
                   help="runs of every policy, interleaved (default 2; the A/A spread needs 2 or more)")
    p.add_argument("--schedule", choices=("sync", "one_step_off"), default="sync",
                   help="sync (default: the policies above) or one_step_off: rollout and trainer on disjoint ranks, "
                        "rollout of step k+1 beside training of step k, a real weight sync each step, the controller "
                        "re-splitting the ranks online (one run; on 2 CPU cores it shows the mechanism, not a speed-up)")
    p.add_argument("--rollout-ranks", type=pos_int, metavar="R",
                   help="one_step_off: rollout ranks to start with (default: verl's 1 : 3 share, max(1, world / 4))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="out/demo", help="plot, audit logs and per-step records")
    p.add_argument("--json", metavar="OUT", help="write the measured figures as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from nereus.demo.run import run_demo
    from nereus.demo.setup import ONE_STEP_OFF_DEFAULTS, DemoConfig
    from nereus.errors import SpecError

    torchrun_world(args.world)  # refuses a torchrun world of another size
    if not 2 <= args.world <= 4:
        raise SpecError(f"--world must be 2, 3 or 4 (gloo processes on this machine), got {args.world}")
    if args.budgets and args.budget_mb:
        raise SpecError("give --budgets (multiples of the model state) or --budget-mb, not both")
    schedule = dict(ONE_STEP_OFF_DEFAULTS) if args.schedule == "one_step_off" else {}
    if args.steps is not None:
        schedule["steps"] = args.steps
    cfg = DemoConfig(**schedule, world=args.world, budget_mb=args.budget_mb, budget_k=args.budget_k,
                     policy=args.policy, seed=args.seed, out_dir=args.out_dir, repeats=args.repeats,
                     schedule=args.schedule, rollout_ranks=args.rollout_ranks)
    if args.schedule == "one_step_off":
        from nereus.demo.async_run import run_async_demo

        if args.budgets:
            raise SpecError("--schedule one_step_off runs one budget: give --budget-k or --budget-mb, not --budgets")
        if args.rollout_ranks is not None and not 1 <= args.rollout_ranks < args.world:
            raise SpecError(f"--rollout-ranks must be 1 to world - 1 ({args.world - 1}), got {args.rollout_ranks}")
        out = run_async_demo(cfg)
    elif args.rollout_ranks is not None:
        raise SpecError("--rollout-ranks applies to --schedule one_step_off only")
    else:
        out = run_demo(cfg, budgets=args.budgets)
    if out is None:  # a torchrun rank other than 0: rank 0 prints and writes
        return 0
    write_json(args.json, out)
    return 0
