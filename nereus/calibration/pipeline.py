"""From microbenchmark tables to a hardware description and ``CostParams``, and the held-out
error table that says how well the fitted parameters predict sizes they never saw.

Every prediction here goes through the cost model's own formulas (``matmul_eff``,
``allreduce_s``, ``allgather_s``, ``p2p_s``), so the error measured is the error the planner
will see, not the error of a side model.
"""
from __future__ import annotations

import platform
from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from nereus.calibration.fit import (AlphaBetaFit, SaturatingFit, fit_alpha_beta, fit_positive, fit_saturating,
                                    heldout_mask, mape)
from nereus.calibration.microbench import COLLECTIVE_OPS, compute_dtype, cpu_nominal_tflops
from nereus.calibration.profile import Hardware
from nereus.planner.cost.params import CostParams, allgather_s, allreduce_s, p2p_s
from nereus.planner.specs import GPU_PRESETS


def split(df: pd.DataFrame, size_col: str, group: str | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(fit rows, held-out rows); held-out chosen per group by :func:`heldout_mask`."""
    if df.empty:
        return df, df
    mask = np.zeros(len(df), bool)
    groups = [df.index] if group is None else [g.index for _, g in df.groupby(group)]
    for idx in groups:
        pos = df.index.get_indexer(idx)
        mask[pos] = heldout_mask(df.loc[idx, size_col].to_numpy())
    return df[~mask], df[mask]


def fit_curves(fit_tables: dict[str, pd.DataFrame], device: str) -> dict[str, Any]:
    """Saturating curves (matmul per dtype, copy) and alpha-beta per collective (link class
    ``intra``: all ranks on one host)."""
    out: dict[str, Any] = {"matmul": {}, "comm": {}}
    mm = fit_tables["matmul"]
    for dtype, g in mm.groupby("dtype"):
        out["matmul"][dtype] = fit_saturating(g["flops"], g["seconds"])
    cp = fit_tables["copy"]
    out["copy"] = fit_saturating(cp["moved_bytes"], cp["seconds"])
    comm = fit_tables.get("comm", pd.DataFrame())
    for op in COLLECTIVE_OPS:
        rows = comm[comm["kind"] == op] if not comm.empty else comm
        if len(rows) >= 2:
            out["comm"][op] = fit_alpha_beta(rows, op, "intra")
    return out


def build_hardware(device: str, curves: dict[str, Any], world: int) -> Hardware:
    """Nominal figures where a datasheet exists, fitted asymptotes otherwise (see profile.py)."""
    dtype = compute_dtype(device)
    mm: SaturatingFit = curves["matmul"][dtype]
    copy: SaturatingFit = curves["copy"]
    comm: dict[str, AlphaBetaFit] = curves["comm"]
    # the link's nominal rate is the fastest collective's fitted bandwidth (p2p: the wire itself);
    # the joint fit then finds the one efficiency the cost model applies to every collective
    link_gbps = max((f.bandwidth for f in comm.values()), default=10e9) / 1e9
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        preset = next((k for k in GPU_PRESETS if k.split("-")[0] in name.lower()), None)
        if preset:
            hw = Hardware.from_preset(preset)
            return replace(hw, description=f"{name} (datasheet figures of preset {preset})", gpus_per_node=8)
        mem = torch.cuda.get_device_properties(0).total_memory / 2**30
        return Hardware(name=name.lower().replace(" ", "-"), device="cuda", dtype=dtype, memory_gib=mem,
                        tflops_bf16=mm.peak / 1e12, hbm_tbps=copy.peak / 1e12, intra_node_gbps=link_gbps,
                        inter_node_gbps=link_gbps, gpus_per_node=8, description=name,
                        sources=(("tflops_bf16", "fitted matmul asymptote"), ("hbm_tbps", "fitted copy asymptote"),
                                 ("intra_node_gbps", "fastest fitted gloo collective bandwidth")))
    nominal = cpu_nominal_tflops(1)
    peak = nominal if nominal > 0 else mm.peak / 1e12
    mem_gib = _host_memory_gib() / max(world, 1)
    return Hardware(
        name="cpu", device="cpu", dtype=dtype, memory_gib=mem_gib, tflops_bf16=peak, hbm_tbps=copy.peak / 1e12,
        intra_node_gbps=link_gbps, inter_node_gbps=link_gbps, gpus_per_node=max(world, 1), reserved_gib=0.5,
        description=f"{platform.processor() or platform.machine()} {_cpu_model()}: one device = one process with "
                    f"one thread",
        sources=(("tflops_bf16", "nominal: clock x FP32 FLOPs/cycle from /proc/cpuinfo, 1 core" if nominal > 0
                  else "fitted matmul asymptote"),
                 ("hbm_tbps", "fitted asymptote of large-copy bandwidth (DRAM)"),
                 ("intra_node_gbps", "fastest fitted gloo loopback collective bandwidth (p2p)"),
                 ("inter_node_gbps", "same as intra (one host)"),
                 ("memory_gib", "host RAM / world")))


def params_from_curves(curves: dict[str, Any], hw: Hardware, fit_comm: pd.DataFrame,
                       base: CostParams | None = None) -> CostParams:
    """Efficiencies relative to ``hw``; link bandwidth and latencies from one joint fit of all
    collectives, since the cost model uses one bandwidth per link class for all of them."""
    p = base or CostParams()
    mm: SaturatingFit = curves["matmul"][hw.dtype]
    mfu = min(1.0, mm.peak / (hw.tflops_bf16 * 1e12))
    p = replace(p, mfu_train=mfu, mfu_prefill=mfu, mfu_decode=mfu, matmul_half_flops=mm.half,
                hbm_eff=min(1.0, curves["copy"].peak / (hw.hbm_tbps * 1e12)))
    if fit_comm is not None and len(fit_comm) >= 3:
        def predict(v: dict[str, float]) -> np.ndarray:
            q = replace(p, intra_link_eff=min(1.0, v["eff"]), allreduce_latency_s=v["alpha_ar"],
                        p2p_latency_s=v["alpha_p2p"])
            return np.array([predict_comm(r, q, hw) for r in fit_comm.itertuples()])

        pf = fit_positive(("eff", "alpha_ar", "alpha_p2p"), (0.8, p.allreduce_latency_s, p.p2p_latency_s),
                          predict, fit_comm["seconds"]).as_dict()
        p = replace(p, intra_link_eff=min(1.0, pf["eff"]), inter_link_eff=min(1.0, pf["eff"]) if hw.device == "cpu"
                    else p.inter_link_eff, allreduce_latency_s=pf["alpha_ar"], p2p_latency_s=pf["alpha_p2p"])
    return p


# ---- predictions through the cost model's formulas -------------------------------------------------
def predict_matmul(flops: float, p: CostParams, hw: Hardware) -> float:
    return flops / (hw.tflops_bf16 * 1e12 * p.matmul_eff(p.mfu_prefill, flops))


def predict_copy(moved_bytes: float, p: CostParams, hw: Hardware) -> float:
    return moved_bytes / (hw.hbm_tbps * 1e12 * p.hbm_eff)


def predict_comm(row: Any, p: CostParams, hw: Hardware) -> float:
    bw = hw.intra_node_gbps * 1e9 * p.intra_link_eff
    if row.kind == "all_reduce":
        return allreduce_s(row.bytes, int(row.world), bw, p.allreduce_latency_s)
    if row.kind == "all_gather":
        return allgather_s(row.bytes, int(row.world), bw, p.allreduce_latency_s)
    return p2p_s(row.bytes, bw, p.p2p_latency_s)


def error_table(held: dict[str, pd.DataFrame], hw: Hardware, before: CostParams, after: CostParams,
                curves: dict[str, Any]) -> pd.DataFrame:
    """One row per held-out microbenchmark: measured; analytic defaults (before); calibrated
    ``CostParams`` through the cost model's formulas (after); the fitted curve of that
    microbenchmark alone (``curve_s``: per-op alpha-beta, which the cost model cannot express
    because it has one bandwidth per link class for every collective)."""
    rows = []
    mm = held["matmul"]
    for r in mm[mm["dtype"] == hw.dtype].itertuples():
        rows.append({"what": f"matmul {r.dtype} {r.m}x{r.k}x{r.n}", "kind": "matmul", "measured_s": r.seconds,
                     "analytic_s": predict_matmul(r.flops, before, hw), "predicted_s": predict_matmul(r.flops, after, hw),
                     "curve_s": float(curves["matmul"][r.dtype].seconds(r.flops))})
    for r in held["copy"].itertuples():
        rows.append({"what": f"copy {r.bytes / 2**20:.0f} MiB", "kind": "copy", "measured_s": r.seconds,
                     "analytic_s": predict_copy(r.moved_bytes, before, hw),
                     "predicted_s": predict_copy(r.moved_bytes, after, hw),
                     "curve_s": float(curves["copy"].seconds(r.moved_bytes))})
    comm = held.get("comm", pd.DataFrame())
    for r in comm.itertuples():
        rows.append({"what": f"{r.kind} n={r.world} {r.bytes / 1024:.0f} KiB", "kind": r.kind, "measured_s": r.seconds,
                     "analytic_s": predict_comm(r, before, hw), "predicted_s": predict_comm(r, after, hw),
                     "curve_s": float(curves["comm"][r.kind].seconds(r.bytes, int(r.world)))})
    df = pd.DataFrame(rows, columns=["what", "kind", "measured_s", "analytic_s", "predicted_s", "curve_s"])
    df["ratio"] = df["predicted_s"] / df["measured_s"]
    return df


def summarize_errors(df: pd.DataFrame) -> dict[str, Any]:
    """MAPE before / after, overall and per kind."""
    def one(g: pd.DataFrame) -> dict[str, Any]:
        d = {"mape_before": mape(g["analytic_s"], g["measured_s"]),
             "mape_after": mape(g["predicted_s"], g["measured_s"]), "points": int(len(g))}
        if "curve_s" in g:
            d["mape_curves"] = mape(g["curve_s"], g["measured_s"])
        return d

    out = one(df)
    out["by_kind"] = {kind: one(g) for kind, g in df.groupby("kind")}
    return out


def calibrate_microbench(tables: dict[str, pd.DataFrame], device: str, world: int) -> dict[str, Any]:
    """Split, fit, build hardware and params, and evaluate on the held-out rows."""
    fit_t, held_t = {}, {}
    fit_t["matmul"], held_t["matmul"] = split(tables["matmul"], "flops", "dtype")
    fit_t["copy"], held_t["copy"] = split(tables["copy"], "bytes")
    comm = tables.get("comm", pd.DataFrame())
    fit_t["comm"], held_t["comm"] = split(comm, "bytes", "kind") if not comm.empty else (comm, comm)
    curves = fit_curves(fit_t, device)
    hw = build_hardware(device, curves, world)
    params = params_from_curves(curves, hw, fit_t["comm"])
    table = error_table(held_t, hw, CostParams(), params, curves)
    return {"curves": curves, "hardware": hw, "params": params, "table": table, "summary": summarize_errors(table)}


def curves_to_dict(curves: dict[str, Any]) -> dict[str, Any]:
    return {"matmul": {k: v.to_dict() for k, v in curves["matmul"].items()}, "copy": curves["copy"].to_dict(),
            "comm": {k: v.to_dict() for k, v in curves["comm"].items()}}


def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 16.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
