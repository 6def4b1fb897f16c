"""End-to-end calibration of the machine we run on: microbenchmarks -> fitted hardware and
``CostParams`` -> stage timings of the reference transformer -> fitted stage corrections ->
a :class:`Profile` carrying its own held-out error.

This is what ``nereus calibrate`` runs; notebooks and benchmarks call it directly.
"""
from __future__ import annotations

import platform
import time
from typing import Any, Callable

import pandas as pd

from nereus.calibration import microbench, pipeline, stages
from nereus.calibration.profile import Profile, utc_now
from nereus.calibration.subject import TIMED_MODEL


def choose_backend(requested: str = "auto", device: str = "cpu") -> str:
    """``executor`` when the executor's parallel reference transformer can be driven (on CPU:
    its ranks are processes on gloo), else ``plain`` (the single-device plain-torch stand-in,
    which is also what runs on a single GPU)."""
    if requested != "auto":
        return requested
    if device != "cpu":
        return "plain"
    try:
        from nereus.calibration import executor_backend

        return "executor" if executor_backend.available() else "plain"
    except ImportError:
        return "plain"


def plan_work(quick: bool, world: int, device: str, backend: str) -> tuple[microbench.BenchGrid, tuple]:
    grid = microbench.BenchGrid.quick(device) if quick else microbench.BenchGrid.full(device)
    if device == "cuda":
        layouts = ((1, 1, 1),)  # one GPU: replicas or TP ranks would share it
    elif backend == "executor":
        from nereus.calibration.executor_backend import LAYOUTS

        layouts = LAYOUTS
    else:
        layouts = ((1, 1, 1), (1, 1, 2))
    configs = stages.stage_grid(quick, world, layouts)
    if backend == "executor":
        from nereus.calibration.executor_backend import adapt

        configs = adapt(configs)
    return grid, configs


def timing_world(configs: tuple, world: int, device: str, backend: str) -> int:
    """Processes of the stage-timing world: the executor backend always needs a process group
    (its Engine is collective), the plain one runs in-process on a single GPU."""
    if device == "cuda" and backend == "plain":
        return 1
    return max(world, 1) if device == "cpu" else 1 if backend == "plain" else max(world, 1)


def calibrate_local(quick: bool = False, world: int = 2, device: str | None = None, backend: str = "auto",
                    how: str = "", progress: Callable[[int], None] | None = None,
                    on_total: Callable[[int], None] | None = None) -> tuple[Profile, dict[str, Any]]:
    """Measure, fit, evaluate. ``on_total(n)`` is told the progress-bar length first."""
    t0 = time.perf_counter()
    load0 = _loadavg()
    device = device or microbench.pick_device()
    backend = choose_backend(backend, device)
    grid, configs = plan_work(quick, world, device, backend)
    tw = timing_world(configs, world, device, backend)
    configs = tuple(c for c in configs if tw % c.world == 0)
    reps = 1 if quick else 3
    if on_total:
        on_total(microbench.count_steps(grid, world) + len(configs) * (reps + 1))
    tables = microbench.run_all(grid, device, world, progress)
    micro = pipeline.calibrate_microbench(tables, device, world)
    sdf = stages.measure(configs, tw, reps=reps, backend=backend, device=device, progress=progress)
    sdf["heldout"] = stages.heldout_configs(configs, every=3 if quick else 2)
    st = stages.calibrate_stages(sdf, micro["params"], micro["hardware"])
    wall = time.perf_counter() - t0
    fit = {
        "heldout_mape": {"microbench": micro["summary"]["mape_after"], "stages": st["summary"]["mape_after"]},
        "heldout_mape_before": {"microbench": micro["summary"]["mape_before"],
                                "stages": st["summary"]["mape_before"]},
        "heldout_mape_curves": {"microbench": micro["summary"]["mape_curves"]},
        "note": ("before = analytic defaults (CostParams()) on this hardware entry; after = fitted CostParams "
                 "through the cost model's formulas; curves = each microbenchmark's own fitted curve"),
        "microbench": {"curves": pipeline.curves_to_dict(micro["curves"]), "summary": micro["summary"],
                       "heldout_table": micro["table"].to_dict("records")},
        "stages": {"backend": backend, "model": TIMED_MODEL.to_dict(), "timing_world": tw,
                   "fit": st["fit"], "summary": st["summary"], "configs_fit": int((~sdf["heldout"]).sum()),
                   "configs_heldout": int(sdf["heldout"].sum()), "heldout_table": st["table"].to_dict("records")},
        "wall_s": wall,
    }
    prof = Profile(name=f"{micro['hardware'].name}-local" if device == "cpu" else micro["hardware"].name,
                   hardware=micro["hardware"], params=st["params"], fit=fit, how=how, when=utc_now(),
                   where={**host_info(device, world), "loadavg_1min_start_end": [load0, _loadavg()]})
    return prof, {"tables": tables, "stages": sdf, "micro": micro, "stage_fit": st}


def host_info(device: str, world: int) -> dict[str, Any]:
    import torch

    info = {"host": platform.node(), "machine": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "device": device, "world": world, "threads_per_rank": 1,
            "cpus": __import__("os").cpu_count()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def report_markdown(prof: Profile) -> str:
    """The error tables and fitted parameters as Markdown (``--report``)."""
    f = prof.fit
    lines = [f"# Calibration profile `{prof.name}`", "", f"- measured: {prof.when}", f"- how: `{prof.how}`",
             f"- hardware: {prof.hardware.description}",
             f"- stage-timing backend: {f.get('stages', {}).get('backend', '-')}",
             f"- host load average (1 min) at start and end: {prof.where.get('loadavg_1min_start_end', '-')}",
             f"- wall time: {f.get('wall_s', 0):.0f} s", ""]
    hm, hb = f.get("heldout_mape", {}), f.get("heldout_mape_before", {})
    lines += ["## Held-out MAPE", "", "| part | before (analytic defaults) | after (calibrated) |", "|---|---|---|"]
    for part in ("microbench", "stages"):
        b, a = hb.get(part), hm.get(part)
        lines.append(f"| {part} | {_pct(b)} | {_pct(a)} |")
    curves = f.get("heldout_mape_curves", {}).get("microbench")
    if curves is not None:
        lines += ["", f"Microbenchmarks through their own fitted curves (per-op alpha-beta): {_pct(curves)}."]
    for part in ("stages", "microbench"):
        tab = pd.DataFrame(f.get(part, {}).get("heldout_table", []))
        if tab.empty:
            continue
        lines += ["", f"## Held-out {part}: predicted vs measured", "", "| what | measured s | analytic s | "
                  "calibrated s | ratio |", "|---|---|---|---|---|"]
        for r in tab.itertuples():
            lines.append(f"| {r.what} | {r.measured_s:.4g} | {r.analytic_s:.4g} | {r.predicted_s:.4g} | "
                         f"{r.predicted_s / r.measured_s:.3f} |")
    lines += ["", "## Fitted parameters", "", "| parameter | value |", "|---|---|"]
    for k, v in prof.params.to_dict().items():
        lines.append(f"| {k} | {v} |")
    return "\n".join(lines) + "\n"


def _loadavg() -> float | None:
    """The machine's 1-minute load average: on a shared host it says how much the timings suffered."""
    try:
        import os

        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"
