"""The ``nereus`` command. Each subcommand lives in ``nereus/commands/<name>.py`` with
``add_parser(subparsers)`` and ``run(args) -> int``; heavy imports happen inside ``run`` so that
``nereus --help`` is instant and planner commands never import torch.

Errors: a :class:`nereus.errors.NereusError` (bad spec, infeasible plan, failed transition) is
printed as one line on stderr with exit code 2 and no traceback; argparse usage errors also exit 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from nereus.errors import NereusError

COMMANDS = ("estimate", "plan", "transition", "simulate", "calibrate", "fidelity", "fit_profiles", "reshard_check", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nereus", description="Cost-aware planner and runtime for RL post-training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"nereus.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"nereus.commands.{name}":
                continue  # command not built yet
            raise
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except NereusError as e:
        print(f"nereus {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
