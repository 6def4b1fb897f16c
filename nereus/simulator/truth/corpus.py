"""Tables the ground truth interpolates, derived at load time from the published measurements in
``nereus/calibration/published/*.csv`` (numbers other people measured; see the README there).

Only rows of the corpus's *fit* split are read (the held-out sources stay unseen by the simulator
too), and only NVIDIA dense-model rows. Every table is per GPU type; what each one is built from:

- ``decode``: a decode iteration of one engine replica costs ``m(B) x`` the time to read its weights
  once at full HBM bandwidth, plus its KV cache read at a fraction ``kv_eff`` of HBM bandwidth.
  ``m`` is interpolated linearly in the batch ``B`` between three points: ``m(1)`` from the
  batch-1 time per output token of tt143 (Qwen2.5-72B, 2x H100, TP2, its all-reduces removed with
  the collectives table), and ``m(896)`` and ``kv_eff`` solved from TensorRT-LLM v0.9.0's two
  Mistral-7B (GQA, TP1) peak-throughput rows of that GPU (batch 896 at 128/128 and batch 56 at
  2048/2048; FP8 rows read 1-byte weights and KV; each row's prefill share removed by FLOPs).
  Beyond 896 the line is extrapolated (compute-bound: time grows with the batch).
- ``prefill``: fraction of the dtype's peak FLOP/s reached by a prefill of ``x`` tokens, from
  TensorRT-LLM v0.9.0's batch-1 time-to-first-token rows (TP1), interpolated in log x and flat
  beyond the largest prompt measured.
- ``train``: hardware FLOP utilisation (MFU x 8/6 with full recomputation) of a training
  micro-batch of ``x`` tokens per GPU (MosaicML llm-foundry MPT runs, FSDP, sequences up to
  4,096), a non-decreasing curve in log x; times a sequence-length factor from the MPT-7B
  65,536-token series (1k ... 64k sequences).
- ``allreduce_intra`` / ``allreduce_inter``: seconds of an all-reduce of ``S`` bytes on 8 GPUs of
  one node / 16 GPUs on 2 nodes, interpolated in log S (nccl-tests and torch benchmarks);
  ``graph_factor(S)``: the speed-up of a CUDA/HIP-graph-captured all-reduce (rccl-tests graph=1 vs
  graph=0), applied to decode's captured iterations.

Substitutions where the fit split has no row (stated, not hidden): H100 intra-node all-reduce uses
the H200 rows (same NVLink 4 / NVSwitch generation); H200 inter-node uses the H100 2-node rows;
A100 inter-node scales the H100 2-node bandwidth term by the scale-out bandwidth ratio; H200
training uses the H100 MPT table (same compute); a GPU type not in the corpus uses the H100 tables
with times scaled by its HBM bandwidth and peak FLOP/s. ``source_rows`` lists the rows behind each
table (the README of this package prints them).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from nereus.planner.specs import GPUSpec

CORPUS = Path(__file__).resolve().parents[2] / "calibration" / "published"

# Shapes of the models the corpus names (public configs): layers, hidden, ffn, heads, kv heads, vocab.
CORPUS_MODELS = {
    "Mistral-7B": (32, 4096, 14336, 32, 8, 32000), "Llama-2-7B": (32, 4096, 11008, 32, 32, 32000),
    "Llama-2-70B": (80, 8192, 28672, 64, 8, 32000), "Qwen2.5-72B-Instruct": (80, 8192, 29568, 64, 8, 152064),
}
HARDWARE = {"h100-80gb": ("h100-80gb", "h100 (variant not stated)"), "h200": ("h200",),
            "a100-80gb": ("a100-80gb", "a100")}
PEAK = {"h100-80gb": (989e12, 3.35e12), "h200": (989e12, 4.8e12), "a100-80gb": (312e12, 2.039e12)}
"""bf16 dense peak FLOP/s and HBM bytes/s of the corpus's GPU types (COST_MODEL.md, Hardware)."""
KV_EFF_MAX = 0.9
"""Clamp of the solved KV-read efficiency (the A100 rows alone would put it above HBM bandwidth)."""


def _params(shape: tuple[int, ...]) -> float:
    L, h, f, a, g, V = shape
    return L * (2 * h * a * 128 + 2 * h * g * 128 + 3 * h * f) + 2 * V * h


def _rows(name: str) -> list[dict]:
    with open(CORPUS / f"{name}.csv", newline="") as fh:
        out = []
        for r in csv.DictReader(fh):
            if r["split"] != "fit":
                continue
            r["cfg"] = dict(kv.split("=", 1) for kv in r["config"].split(";") if "=" in kv)
            out.append(r)
        return out


@dataclass(frozen=True)
class Curve:
    """Piecewise-linear interpolation of ``y`` over ``x`` (optionally in log x), clamped at the ends
    unless ``extrapolate`` (linear continuation of the last segment)."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    log_x: bool = True
    extrapolate: bool = False

    def __call__(self, v):
        v = np.asarray(v, dtype=float)
        xs = np.log(self.x) if self.log_x else np.asarray(self.x)
        q = np.log(np.maximum(v, 1e-30)) if self.log_x else v
        out = np.interp(q, xs, self.y)
        if self.extrapolate and len(self.x) >= 2:
            slope = (self.y[-1] - self.y[-2]) / (xs[-1] - xs[-2])
            out = np.where(q > xs[-1], self.y[-1] + slope * (q - xs[-1]), out)
        return out


@dataclass(frozen=True)
class Tables:
    gpu: str
    peak_flops: float
    hbm_bps: float
    decode_m: Curve
    """m(B): decode iteration time / (weight bytes / HBM bandwidth), B = running sequences."""
    kv_eff: float
    """Achieved fraction of HBM bandwidth reading the KV cache in decode."""
    prefill_eff: Curve
    train_hfu: Curve
    train_seq_factor: Curve
    allreduce_intra: Curve
    allreduce_inter: Curve
    graph_factor: Curve
    source_rows: tuple[tuple[str, str], ...]
    """(table, row ids) behind each table."""

    def allreduce_s(self, nbytes, n: int, inter: bool, graph: bool = False):
        """All-reduce of ``nbytes`` over ``n`` GPUs: the 8-GPU (intra) or 2-node (inter) measured
        time (proportional to the bytes beyond the largest message measured) scaled by the ring's
        2(n-1)/n against the measured group's; CUDA-graph factor on top."""
        if n <= 1:
            return np.zeros_like(np.asarray(nbytes, dtype=float))
        ref = 16 if inter else 8
        curve = self.allreduce_inter if inter else self.allreduce_intra
        size = np.maximum(np.asarray(nbytes, dtype=float), 8.0)
        top = curve.x[-1]
        # beyond the largest message measured the time grows with the bytes (bandwidth-bound)
        t = curve(np.minimum(size, top)) * np.maximum(1.0, size / top)
        t = t * (2 * (n - 1) / n) / (2 * (ref - 1) / ref)
        if inter and n > ref:  # tree/ring latency grows with the node count
            t = t * (1 + 0.1 * math.log2(n / ref))
        return t * (self.graph_factor(size) if graph else 1.0)


def _isotonic(xs: list[float], ys: list[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Median y per distinct x, then a non-decreasing envelope (pool adjacent violators by mean)."""
    pts: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        pts.setdefault(x, []).append(y)
    ux = sorted(pts)
    blocks = [[float(np.median(pts[x])), 1, x] for x in ux]
    out: list[list] = []
    for b in blocks:
        out.append(b)
        while len(out) > 1 and out[-2][0] > out[-1][0]:
            y2, n2, _ = out.pop()
            y1, n1, x1 = out.pop()
            out.append([(y1 * n1 + y2 * n2) / (n1 + n2), n1 + n2, x1])
    vals = []
    for y, n, _ in out:
        vals.extend([y] * n)
    return tuple(ux), tuple(vals)


def _allreduce_curve(gpu: str) -> tuple[Curve, Curve, list[str], list[str]]:
    rows = [r for r in _rows("collectives") if r["cfg"].get("op") == "all_reduce"]
    intra_hw = {"h100-80gb": "h200", "h200": "h200", "a100-80gb": "a100-80gb"}[gpu]
    intra, intra_ids = {}, []
    for r in rows:
        c = r["cfg"]
        if r["hardware"] != intra_hw or c.get("gpus") != "8" or c.get("nodes") != "1" or c.get("algo") == "nvls":
            continue
        size = float(c["msg_bytes"])
        if r["metric"] == "latency_us":
            intra[size] = float(r["value"]) * 1e-6
            intra_ids.append(r["id"])
        elif r["metric"] == "busbw_gbs" and size not in intra and float(r["value"]) > 0:
            intra.setdefault(size, size / (float(r["value"]) * 1e9 / (2 * 7 / 8)))
            intra_ids.append(r["id"])
    inter, inter_ids = {}, []
    for r in rows:
        c = r["cfg"]
        if r["hardware"] == "h100-80gb" and c.get("nodes") == "2" and c.get("gpus") == "16" and r["metric"] == "latency_us":
            inter[float(c["msg_bytes"])] = float(r["value"]) * 1e-6
            inter_ids.append(r["id"])
    xi = sorted(intra)
    xe = sorted(inter)
    ye = [inter[x] for x in xe]
    if gpu == "a100-80gb":  # no A100 multi-node row: the bandwidth part scales with scale-out bandwidth
        floor = ye[0]
        ye = [floor + (y - floor) * 2.0 for y in ye]
    return (Curve(tuple(xi), tuple(intra[x] for x in xi)), Curve(tuple(xe), tuple(ye)), intra_ids, inter_ids)


def _graph_factor() -> tuple[Curve, list[str]]:
    rows = [r for r in _rows("collectives") if r["id"].startswith("rcclblog") and r["metric"] == "latency_us"]
    by: dict[float, dict[str, float]] = {}
    for r in rows:
        by.setdefault(float(r["cfg"]["msg_bytes"]), {})[r["cfg"]["graph"]] = float(r["value"])
    xs = sorted(s for s, v in by.items() if "0" in v and "1" in v and s >= 1024)
    return Curve(tuple(xs), tuple(min(1.0, by[s]["1"] / by[s]["0"]) for s in xs)), [r["id"] for r in rows]


def _prefill(gpu: str) -> tuple[Curve, list[str]]:
    pts: dict[float, list[float]] = {}
    ids = []
    for r in _rows("prefill"):
        c = r["cfg"]
        if (r["hardware"] not in HARDWARE[gpu] or r["model"] not in CORPUS_MODELS or r["metric"] != "ttft_ms"
                or c.get("tp") != "1" or c.get("batch") != "1"):
            continue
        shape = CORPUS_MODELS[r["model"]]
        n_in = int(c["input_len"])
        flops = 2 * _params(shape) * n_in + 2 * shape[0] * shape[3] * 128 * n_in * n_in
        peak = PEAK[gpu][0] * (2 if "fp8" in c.get("dtype", "") else 1)
        pts.setdefault(n_in, []).append(flops / (float(r["value"]) * 1e-3) / peak)
        ids.append(r["id"])
    xs = sorted(pts)
    return Curve(tuple(xs), tuple(float(np.median(pts[x])) for x in xs)), ids


def _decode(gpu: str, allreduce_intra: Curve, graph: Curve, hbm: float) -> tuple[Curve, float, list[str]]:
    rows = {(r["cfg"]["batch"], r["cfg"]["input_len"], r["cfg"]["output_len"]): r for r in _rows("decode")
            if r["id"].startswith("trt090") and r["hardware"] in HARDWARE[gpu] and r["model"] == "Mistral-7B"
            and r["cfg"].get("tp") == "1" and r["metric"] == "output_tok_s_per_gpu"}
    big, long = rows[("896", "128", "128")], rows[("56", "2048", "2048")]
    shape = CORPUS_MODELS["Mistral-7B"]
    L, h, _, a, g, _ = shape
    n = _params(shape)

    def parts(r) -> tuple[float, float, float, float]:
        """(batch, weight-read seconds, KV bytes read per iteration, decode seconds per iteration)."""
        c = r["cfg"]
        wb = 1 if "fp8" in c["dtype"] else 2
        b, n_in, n_out = int(c["batch"]), int(c["input_len"]), int(c["output_len"])
        total = b * n_out / float(r["value"])
        pre = b * (2 * n * n_in + L * a * 128 * n_in * n_in)
        dec = b * n_out * (2 * n + 4 * L * a * 128 * (n_in + n_out / 2))
        return b, wb * n / hbm, b * (n_in + n_out / 2) * 2 * L * g * 128 * wb, total * dec / (pre + dec) / n_out

    # m(1): batch-1 seconds per output token of tt143 (TP2), its 2 all-reduces per layer removed
    tt = [r for r in _rows("decode") if r["id"].startswith("tt143") and r["metric"] == "tpot_ms"]
    q = CORPUS_MODELS["Qwen2.5-72B-Instruct"]
    t1 = float(np.median([float(r["value"]) for r in tt])) * 1e-3
    ar = 2 * q[0] * float(allreduce_intra(q[1] * 2)) * (2 * 1 / 2) / (2 * 7 / 8) * float(graph(q[1] * 2))
    m1 = (t1 - ar) / (2 * _params(q) / 2 / PEAK["h100-80gb"][1])
    # two rows, two unknowns (m at batch 896, KV read efficiency), m linear in the batch
    b1, w1, k1, t1b = parts(big)
    b2, w2, k2, t2b = parts(long)
    frac2 = (b2 - 1) / (b1 - 1)
    # t1b = w1*m896 + k1*x ; t2b = w2*(m1 + (m896 - m1)*frac2) + k2*x
    A = np.array([[w1, k1], [w2 * frac2, k2]])
    rhs = np.array([t1b, t2b - w2 * m1 * (1 - frac2)])
    m896, x = np.linalg.solve(A, rhs)
    kv_eff = float(min(KV_EFF_MAX, max(0.2, 1.0 / (x * hbm))))
    return (Curve((1.0, float(b1)), (float(m1), float(m896)), log_x=False, extrapolate=True), kv_eff,
            [big["id"], long["id"]] + [r["id"] for r in tt])


def _train(gpu: str) -> tuple[Curve, Curve, list[str]]:
    hw = {"h200": "h100-80gb"}.get(gpu, gpu)
    xs, ys, ids, series = [], [], [], {}
    for r in _rows("training"):
        c = r["cfg"]
        if not r["id"].startswith("mpt") or r["hardware"] != hw or r["metric"] != "mfu":
            continue
        s, x = int(c["seq_len"]), int(c["micro_batch"]) * int(c["seq_len"])
        hfu = float(r["value"]) * (8 / 6 if c.get("recompute") == "full" else 1.0)
        ids.append(r["id"])
        if s <= 4096:
            xs.append(x)
            ys.append(hfu)
        if r["model"] == "MPT-7B" and x == 65536:
            series[s] = hfu
    cx, cy = _isotonic(xs, ys)
    hfu_curve = Curve(cx, cy)
    ref = float(hfu_curve(65536))
    sx = sorted(series)
    factors = [min(1.0, series[s] / ref) if s > 2048 else 1.0 for s in sx]
    return hfu_curve, Curve(tuple(sx), tuple(factors)), ids


@lru_cache(maxsize=8)
def tables_for(gpu_name: str) -> Tables:
    """The tables of a corpus GPU type (``h100-80gb``, ``h200``, ``a100-80gb``)."""
    if gpu_name not in PEAK:
        raise KeyError(gpu_name)
    peak, hbm = PEAK[gpu_name]
    ar_intra, ar_inter, intra_ids, inter_ids = _allreduce_curve(gpu_name)
    graph, graph_ids = _graph_factor()
    prefill, pre_ids = _prefill(gpu_name)
    m, kv_eff, dec_ids = _decode(gpu_name, ar_intra, graph, hbm)
    hfu, seqf, train_ids = _train(gpu_name)
    src = (("decode", " ".join(dec_ids)), ("prefill", " ".join(pre_ids)), ("train", " ".join(train_ids)),
           ("allreduce_intra", " ".join(intra_ids)), ("allreduce_inter", " ".join(inter_ids)),
           ("graph_factor", " ".join(graph_ids)))
    return Tables(gpu_name, peak, hbm, m, kv_eff, prefill, hfu, seqf, ar_intra, ar_inter, graph, src)


def tables(gpu: GPUSpec) -> Tables:
    """Tables for ``gpu``: its corpus type, or the H100 tables with HBM and FLOP/s rescaled."""
    if gpu.name in PEAK:
        return tables_for(gpu.name)
    base = tables_for("h100-80gb")
    from dataclasses import replace

    return replace(base, gpu=gpu.name, peak_flops=gpu.peak_flops, hbm_bps=gpu.hbm_bytes_per_s)
