"""nereus demo: until the real RL demo lands, run the best end-to-end thing that exists."""
from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="the main job (for now: an estimate on the bundled example job)")
    return p


def run(args: argparse.Namespace) -> int:
    from nereus.cli import main

    root = Path(__file__).resolve().parents[2] / "examples"
    print("nereus demo: the online re-planning RL demo has not landed yet; running `nereus estimate` "
          "on the bundled example job (examples/ppo-8b.yaml on 4 DGX-H100 nodes) instead.\n")
    return main(["estimate", "--job", str(root / "ppo-8b.yaml"), "--cluster", str(root / "cluster-h100-4n.yaml"),
                 "--model-stage", "actor/training", "--tp", "2", "--dp", "16"])
