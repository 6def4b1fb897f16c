"""Shared CLI helpers: spec loading arguments, JSON output, rich console."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from nereus.errors import SpecError
from nereus.jsonio import atomic_path, write_atomic

GiB = 1024**3


def add_job_cluster(p: argparse.ArgumentParser, profile: bool = True) -> None:
    p.add_argument("--job", required=True, help="job YAML (see examples/)")
    p.add_argument("--cluster", required=True, help="cluster YAML (see examples/)")
    if profile:
        p.add_argument("--profile", help="cost profile: a JSON file (nereus calibrate / fit-profiles) or a shipped "
                                         "one by name (h100-80gb, h200, a100-80gb, h20, mi300x, cpu-local); "
                                         "default: analytic defaults")


def load_specs(args: argparse.Namespace):
    from nereus.planner.cost.params import CostParams
    from nereus.planner.specs import load_cluster, load_job

    job = load_job(args.job)
    cluster = load_cluster(args.cluster)
    params = load_params(getattr(args, "profile", None))
    return job, cluster, params


def load_params(profile: str | None):
    """CostParams from a profile file, a shipped profile by name (``h100-80gb``, ...), or the
    analytic defaults when none is given."""
    from nereus.planner.cost.params import CostParams

    if not profile:
        return CostParams()
    if not Path(profile).exists():
        from nereus.calibration.profile import SHIPPED, load_profile

        if profile in SHIPPED:
            return load_profile(profile).params
    return CostParams.load(profile)


def write_json(path: str | None, data: Any) -> None:
    """``data`` as JSON at ``path`` (nothing when no path), atomically: no half-written output."""
    if not path:
        return
    write_atomic(path, json.dumps(data, indent=2, default=float) + "\n")


def figure_format(path: str) -> str:
    """The figure format ``path``'s suffix names (``png`` without one); a SpecError for one
    matplotlib does not write."""
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix[1:].lower() or "png"
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise SpecError(f"cannot write {path}: no figure format .{fmt} (use .png, .pdf or .svg)")
    return fmt


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """A matplotlib figure at ``path``, atomically, in the format its suffix names."""
    fmt = figure_format(path)
    with atomic_path(path, suffix=f".{fmt}") as tmp:
        fig.savefig(tmp, dpi=dpi, format=fmt)


def torchrun_world(world: int) -> tuple[int, int, int] | None:
    """torchrun's (rank, world size, local rank) when this process was started by torchrun, else
    None; SpecError when torchrun started another number of processes than ``--world`` asks."""
    from nereus.executor.launch import torchrun_env

    env = torchrun_env()
    if env is not None and env[1] != world:
        raise SpecError(f"torchrun started {env[1]} processes (WORLD_SIZE) but --world is {world}: "
                        f"pass --world {env[1]}")
    return env


def nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def pos_int(text: str) -> int:
    v = nonneg_int(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return v


def pos_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


PIPE_WIDTH = 160
"""Columns of a table written to a pipe or a file when ``COLUMNS`` is unset: rich would squeeze it
to 80, cutting every figure of a wide table (``nereus simulate``'s) to an ellipsis."""


def console(stderr: bool = False):
    import os

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    piped = "COLUMNS" not in os.environ and not (hasattr(stream, "isatty") and stream.isatty())
    return Console(highlight=False, stderr=stderr, width=PIPE_WIDTH if piped else None)
