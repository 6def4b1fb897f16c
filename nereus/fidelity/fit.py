"""Fitted GPU profiles: the cost model's coefficients for one GPU, fitted on the fit split of the
corpus only (``corpus.fit_rows``), by one reproducible command (``nereus fit-profiles``).

Procedure: minimise the robust (soft-L1) sum of log(predicted / measured) over the GPU's fit rows
(plus the collective rows of GPUs on the same interconnect, ``LINK_FAMILIES``),
in log space of each coefficient, within physical bounds (``FITTED``), with a weak prior pulling
each coefficient toward its analytic default (one unit of residual per factor ``PRIOR_WIDTH`` away),
so a coefficient the GPU's rows do not constrain stays at the analytic value instead of drifting.
Engine overheads (per iteration at batch 1 and per running sequence) are fitted per engine seen
in the GPU's rows. A profile records the rows it read, the procedure, and its fit-split error.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable

import numpy as np

from nereus.errors import SpecError
from nereus.fidelity.catalog import engine_of
from nereus.fidelity.corpus import Row, fit_rows
from nereus.fidelity.predict import HOST_LAYER_METRICS, predict, row_gpu
from nereus.planner.cost.params import CostParams

FITTED: tuple[tuple[str, float, float], ...] = (
    ("mfu_train", 0.15, 0.80),
    ("mfu_train_fp8", 0.10, 0.80),
    ("power_cap_flops_scale", 0.40, 1.00),
    ("mfu_prefill", 0.15, 0.90),
    ("mfu_decode", 0.10, 0.90),
    ("mfu_attn", 0.10, 0.80),
    ("hbm_eff", 0.40, 0.95),
    ("matmul_half_flops", 1e7, 1e12),
    ("intra_link_eff", 0.30, 1.00),
    ("inter_link_eff", 0.20, 1.00),
    ("allreduce_latency_s", 5e-7, 3e-5),
    ("inter_latency_s", 1e-6, 2e-4),
)
"""(CostParams field, lower bound, upper bound): the coefficients a profile fits."""
ENGINE_BOUNDS = ((5e-5, 5e-2), (1e-7, 1e-3))
PRIOR_WIDTH = 4.0
LINK_FAMILIES = (("h100-80gb", "h200", "h20", "h800"), ("a100-80gb", "a800-80gb", "a100-40gb"))
"""GPUs that share an interconnect generation (NVLink 4 / NVSwitch 3 with NDR InfiniBand; NVLink 3):
their collective rows are fitted together, since link latency and efficiency belong to the links
and NCCL, not to the GPU. A GPU's compute rows are its own."""
MATMUL_HALF_DEFAULT = 1e9
"""Starting / prior value of ``matmul_half_flops`` (the analytic default 0 disables the curve)."""
PROCEDURE = ("scipy.optimize.least_squares, soft_l1 loss (f_scale 0.2) on log(predicted/measured) of every "
             "predictable fit-split row of the GPU and the collective rows of its interconnect family, log-space "
             "coefficients within bounds, prior residual log(x/default)/log(4) per coefficient")


def _start(name: str, base: CostParams) -> float:
    v = getattr(base, name)
    return MATMUL_HALF_DEFAULT if name == "matmul_half_flops" and v <= 0 else v


def fit_profile_params(rows: Iterable[Row], gpu: str, base: CostParams | None = None) -> tuple[CostParams, dict]:
    """Fit ``gpu``'s coefficients on the fit-split rows of that GPU among ``rows`` (held-out rows are
    dropped before anything reads them). Returns the parameters and the fit record."""
    from scipy.optimize import least_squares

    base = base or CostParams()
    family = next((f for f in LINK_FAMILIES if gpu in f), (gpu,))
    mine = [r for r in fit_rows(list(rows)) if r.category not in ("host", "async")  # host time: fitted across GPUs
            # (engine_host_overhead, layer_host_s); weight syncs: weight_sync_tensor_s
            and (row_gpu(r) == gpu or (r.category == "collectives" and row_gpu(r) in family))]
    usable = [r for r in mine if predict(r, lambda _: base).predicted is not None]
    if not usable:
        raise SpecError(f"no predictable fit-split row for gpu {gpu!r}: cannot fit a profile")
    engines = sorted({engine_of(r.engine, r.get("vllm_engine")) for r in usable if r.category in ("decode", "prefill")})
    names = [n for n, _, _ in FITTED]
    lo = [math.log(b) for _, b, _ in FITTED] + [math.log(b) for _ in engines for b, _ in ENGINE_BOUNDS]
    hi = [math.log(b) for _, _, b in FITTED] + [math.log(b) for _ in engines for _, b in ENGINE_BOUNDS]
    x0 = [math.log(_start(n, base)) for n in names]
    for e in engines:  # from the engine's default (a host-time fit for vLLM V0), else the generic one
        x0 += [math.log(v) for v in base.engine_overhead_terms(e)]
    x0 = np.clip(np.array(x0), np.array(lo) + 1e-9, np.array(hi) - 1e-9)
    measured = np.log([r.value for r in usable])

    def params_of(x: np.ndarray) -> CostParams:
        kw = {n: float(math.exp(v)) for n, v in zip(names, x[:len(names)])}
        eo = tuple((e, float(math.exp(x[len(names) + 2 * i])), float(math.exp(x[len(names) + 2 * i + 1])))
                   for i, e in enumerate(engines))
        kept = tuple(t for t in base.engine_overhead if t[0] not in engines)  # engines the GPU's rows do not show
        return replace(base, **kw, engine_overhead=eo + kept)

    def residuals(x: np.ndarray) -> np.ndarray:
        p = params_of(x)
        pred = [predict(r, lambda _: p).predicted for r in usable]
        res = np.array([math.log(v) if v else math.log(1e6) for v in pred]) - measured
        prior = (x - np.array(x0)) / math.log(PRIOR_WIDTH)
        return np.concatenate([res, prior])

    sol = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.2, max_nfev=200)
    fitted = params_of(sol.x)
    ratios = np.exp(residuals(sol.x)[:len(usable)])
    before = np.exp(residuals(np.array(x0))[:len(usable)])
    record = {
        "gpu": gpu, "procedure": PROCEDURE, "rows": [r.id for r in usable],
        "rows_by_category": {c: sum(1 for r in usable if r.category == c) for c in sorted({r.category for r in usable})},
        "fit_mape": float(np.mean(np.abs(ratios - 1))), "fit_median_ratio": float(np.median(ratios)),
        "analytic_fit_mape": float(np.mean(np.abs(before - 1))), "engines": engines,
        "at_bound": [n for n, v, (_, a, b) in zip(names, sol.x, FITTED) if abs(v - math.log(a)) < 1e-6 or abs(v - math.log(b)) < 1e-6],
    }
    return fitted, record


EAGER_LAUNCH_BOUND = 1.5
"""A pair counts as launch-bound when its eager time is at least this multiple of its CUDA-graph
time: below it the GPU work hides most launches and the difference says little about them."""


def _per_token_ms(r: Row) -> float | None:
    """Milliseconds per decode iteration of a decode row: TPOT / ITL as stated, a batch's end-to-end
    latency over its output tokens, or a static batch's output tokens/s inverted."""
    if r.metric in ("tpot_ms", "median_tpot_ms", "itl_ms", "median_itl_ms"):
        return r.value
    out = r.num("output_len")
    if r.metric == "e2e_latency_ms" and out:
        return r.value / out
    b = r.num("batch")
    if r.metric == "output_tok_s" and b:
        return 1e3 * b / r.value
    return None


def eager_pairs(rows: Iterable[Row]) -> list[dict]:
    """The fit split's eager / CUDA-graph pairs: decode rows of one source, model, engine and metric
    whose configs differ only in ``enforce_eager``, on vLLM or SGLang, of a dense model in the
    catalog (its layer count). Each pair: ids, per-token ms both ways, layers, and the lower bound
    on the per-layer launch time (eager - graph) / layers. Held-out rows are dropped first."""
    from nereus.fidelity.catalog import resolve_model

    graph, out = {}, []
    cands = [r for r in fit_rows(list(rows)) if r.category == "decode" and r.get("enforce_eager") in ("0", "1")
             and any(e in r.engine.lower() for e in ("vllm", "sglang"))]

    def key(r: Row) -> tuple:
        cfg = tuple(sorted((k, v) for k, v in r.config.items() if k != "enforce_eager"))
        return (r.source, r.model, r.engine, r.metric, r.hardware, cfg)

    for r in cands:
        if r.get("enforce_eager") == "0":
            graph[key(r)] = r
    for r in cands:
        g = graph.get(key(r)) if r.get("enforce_eager") == "1" else None
        model, _ = resolve_model(r.model)
        if g is None or model is None:
            continue
        te, tg = _per_token_ms(r), _per_token_ms(g)
        if te is None or tg is None:
            continue
        out.append({"eager": r.id, "graph": g.id, "eager_ms": te, "graph_ms": tg, "layers": model.layers,
                    "ratio": te / tg, "layer_ms": (te - tg) / model.layers})
    return out


def eager_layer_cpu_s(rows: Iterable[Row]) -> tuple[float, list[dict]]:
    """``CostParams.eager_layer_cpu_s`` from the corpus: the median per-layer launch time over the
    launch-bound eager pairs (``eager_pairs``, ratio >= ``EAGER_LAUNCH_BOUND``). Returns seconds and
    the pairs it used."""
    pairs = [p for p in eager_pairs(rows) if p["ratio"] >= EAGER_LAUNCH_BOUND]
    if not pairs:
        raise SpecError("no launch-bound eager / CUDA-graph pair in the corpus's fit split")
    return float(np.median([p["layer_ms"] for p in pairs])) * 1e-3, pairs


def engine_host_overhead(rows: Iterable[Row], engine: str) -> tuple[float, float, list[str]]:
    """An engine's per-iteration host overhead (``o0 + o1 * batch`` seconds) from the fit
    split's ``host`` rows of that engine, whatever their GPU (host time: the CPU's, not the GPU's):
    a robust (soft-L1) least-squares line in log space of the measured ms, each source weighing the
    same in all (one profiler's sweep of twelve rows must not outvote another source's one row).
    Returns (o0 s, o1 s per sequence, the row ids used)."""
    from scipy.optimize import least_squares

    use = [r for r in fit_rows(list(rows)) if r.category == "host" and r.metric == "host_ms_per_iteration"
           and engine_of(r.engine, r.get("vllm_engine")) == engine and (r.num("batch") or 0) >= 1]
    if len({r.num("batch") for r in use}) < 2:
        raise SpecError(f"engine {engine!r}: fewer than two batch sizes among the fit split's host rows")
    b = np.array([r.num("batch") for r in use])
    ms = np.array([r.value for r in use])
    n = _by_source(use)
    w = np.sqrt([1.0 / len(n[_source(r)]) for r in use])  # each source weighs the same in all

    def res(x: np.ndarray) -> np.ndarray:
        return w * (np.log(np.exp(x[0]) + np.exp(x[1]) * b) - np.log(ms))

    sol = least_squares(res, np.log([1.0, 0.05]), loss="soft_l1", f_scale=0.2)
    o0, o1 = np.exp(sol.x) * 1e-3
    return float(o0), float(o1), [r.id for r in use]


def layer_host_s(rows: Iterable[Row], metric: str) -> tuple[float, list[str]]:
    """A per-unit host time (``HOST_LAYER_METRICS``: per decoder layer and pass, per FSDP unit and
    pass, per GiB of KV cache re-created) from the fit split's ``host`` rows of that metric: the median over sources of each source's median (one source, one vote), in seconds.
    Returns seconds and the row ids used."""
    if metric not in HOST_LAYER_METRICS:
        raise SpecError(f"host metric must be one of {', '.join(HOST_LAYER_METRICS)}, got {metric!r}")
    use = [r for r in fit_rows(list(rows)) if r.category == "host" and r.metric == metric]
    if not use:
        raise SpecError(f"no fit-split host row of metric {metric!r}")
    return float(np.median([np.median(v) for v in _by_source(use).values()])) * 1e-3, [r.id for r in use]


def _source(r: Row) -> str:
    """A row's source for one-vote-per-source fits: its first word (a repository, ``owner/repo#N``
    or URL; the files of one repository count once)."""
    return r.source.split()[0]


def _by_source(rows: list[Row]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in rows:
        out.setdefault(_source(r), []).append(r.value)
    return out


def weight_sync_tensor_s(rows: Iterable[Row], params_for) -> tuple[float, list[dict]]:
    """``CostParams.weight_sync_tensor_s`` from the fit split's bucketed weight syncs (``async`` rows
    of ``stage=weight_sync``, ``checkpoint_engine=1``): for each, what the measured seconds leave
    after the bytes and the bucket broadcasts' latency (``comm.weight_sync_s`` with the per-tensor
    term at 0, the row's GPU profile from ``params_for``), per tensor of the model
    (``ModelSpec.weight_tensors``); the median over sources of each source's median (one source, one
    vote), in seconds. Held-out rows are dropped first. Returns seconds and one record per row."""
    from nereus.fidelity.async_rows import sync_model
    from nereus.fidelity.catalog import resolve_gpu

    use = [r for r in fit_rows(list(rows)) if r.category == "async" and r.get("stage") == "weight_sync"
           and r.get("checkpoint_engine", "1") == "1"]
    if not use:
        raise SpecError("no fit-split bucketed weight-sync row (async, stage=weight_sync, checkpoint_engine=1)")
    recs, by_source = [], {}
    for r in use:
        rest = predict(r, lambda g: replace(params_for(g), weight_sync_tensor_s=0.0)).predicted
        if rest is None:
            raise SpecError(f"weight-sync row {r.id}: not predictable ({predict(r, params_for).reason})")
        model, _ = sync_model(r, resolve_gpu(r.hardware)[0])
        per = (r.value - rest) / model.weight_tensors()
        recs.append({"id": r.id, "model": model.name, "tensors": model.weight_tensors(), "measured_s": r.value,
                     "bytes_and_latency_s": rest, "per_tensor_s": per})
        by_source.setdefault(_source(r), []).append(per)
    return float(np.median([np.median(v) for v in by_source.values()])), recs


RESTART_FILE = "restart.csv"
"""The restart rows of the corpus directory (checkpoint rates, engine start-up, launch times): not a
fidelity category (no cost-model function predicts them); ``RestartCost``'s defaults are read off them
(``restart_defaults``)."""


def restart_rows(directory=None) -> list[Row]:
    """The corpus's restart rows (``RESTART_FILE``), checked like every corpus file."""
    from nereus.fidelity.corpus import DEFAULT_DIR, load_file
    from pathlib import Path

    return load_file(Path(directory or DEFAULT_DIR) / RESTART_FILE, "restart")


def restart_defaults(rows: Iterable[Row]) -> dict:
    """``RestartCost``'s defaults, each (value, the fit-split row ids it comes from), each the median
    over sources of each source's median (one source, one vote); held-out rows (whole-restart checks)
    are dropped first.

    ``engine_start_s`` from inference-engine cold starts, ``relaunch_s`` from launch-to-first-step
    times minus that engine start; under ``"storage"``, per storage kind (the rows' ``storage=``
    config, ``restart.STORAGE_KINDS``; kinds are never mixed in one median): ``write_gbps_per_node``
    / ``read_gbps_per_node`` from that kind's checkpoint write / read rates per node, a kind with no
    read row reading at its write rate (the write rows' ids), and ``storage_gbps`` from its
    aggregate-bandwidth rows, None where it has none."""
    from nereus.planner.online.restart import STORAGE_KINDS

    use = fit_rows(list(rows))

    def vote(metric: str, kind: str | None = None) -> tuple[float, list[str]] | None:
        mine = [r for r in use if r.metric == metric and (kind is None or r.get("storage") == kind)]
        if not mine:
            return None
        return float(np.median([np.median(v) for v in _by_source(mine).values()])), [r.id for r in mine]

    for r in use:
        rate = r.metric.startswith("ckpt_") or r.metric == "storage_aggregate_gbps"
        if rate and r.get("storage") not in STORAGE_KINDS:
            raise SpecError(f"restart row {r.id}: {r.metric} needs storage= one of {STORAGE_KINDS}, "
                            f"got {r.get('storage')!r}")
    out: dict = {}
    for field, metric in (("engine_start_s", "engine_start_s"), ("relaunch_s", "launch_to_first_step_s")):
        got = vote(metric)
        if got is None:
            raise SpecError(f"no fit-split restart row of metric {metric!r}")
        out[field] = got
    launch, ids = out["relaunch_s"]
    out["relaunch_s"] = (launch - out["engine_start_s"][0], ids)
    out["storage"] = {}
    for kind in STORAGE_KINDS:
        write = vote("ckpt_write_gbps_per_node", kind)
        if write is None:
            raise SpecError(f"no fit-split checkpoint write row of storage {kind!r}")
        out["storage"][kind] = {"write_gbps_per_node": write,
                                "read_gbps_per_node": vote("ckpt_read_gbps_per_node", kind) or write,
                                "storage_gbps": vote("storage_aggregate_gbps", kind)}
    return out


MEMORY_FITTED: tuple[tuple[str, float, float], ...] = (
    ("logits_copies_train", 1.0, 6.0),
    ("mem_fragmentation", 1.0, 2.0),
)
"""(CostParams field, lower, upper): the memory coefficients ``fit_memory_params`` fits. The
other memory terms are mechanisms with their sources and no free constant: model states in each
framework's layout (``memory.model_state_bytes``), activations (``CostParams.act_bytes_per_token``
and the recompute rule), FSDP's unsharded layers (``passes.fsdp_unsharded_bytes``), an engine's KV
pool at its memory fraction (``memory.kv_budget_full``)."""
MEMORY_START = {"logits_copies_train": 2.0, "mem_fragmentation": 1.0}
"""Where the memory fit starts and what its prior pulls toward: the logits and their gradient in
fp32, no allocator slack."""
MEMORY_PROCEDURE = ("scipy.optimize.least_squares, soft_l1 loss (f_scale 0.1) on log(predicted/measured) of every "
                    "predictable fit-split memory row (all GPUs: allocator behaviour is the framework's, not the GPU's), "
                    "prior residual log(x/default)/log(4) per coefficient")


def fit_memory_params(rows: Iterable[Row], base: CostParams | None = None) -> tuple[dict[str, float], dict]:
    """The memory coefficients (``MEMORY_FITTED``) from the fit split's ``memory`` rows, whatever
    their GPU; held-out rows are dropped before anything reads them. Returns {field: value} and the
    fit record (rows used, fit-split error before and after)."""
    from scipy.optimize import least_squares

    base = replace(base or CostParams(), **MEMORY_START)  # start and prior: the analytic values, not a past fit
    use = [r for r in fit_rows(list(rows)) if r.category == "memory"
           and predict(r, lambda _: base).predicted is not None]
    if not use:
        raise SpecError("no predictable fit-split memory row")
    names = [n for n, _, _ in MEMORY_FITTED]
    lo = [math.log(a) for _, a, _ in MEMORY_FITTED]
    hi = [math.log(b) for _, _, b in MEMORY_FITTED]
    x0 = np.clip([math.log(max(getattr(base, n), a)) for n, a, _ in MEMORY_FITTED], np.array(lo) + 1e-9,
                 np.array(hi) - 1e-9)
    measured = np.log([r.value for r in use])

    def res(x: np.ndarray) -> np.ndarray:
        p = replace(base, **{n: float(math.exp(v)) for n, v in zip(names, x)})
        pred = np.log([predict(r, lambda _: p).predicted for r in use])
        return np.concatenate([pred - measured, (x - x0) / math.log(PRIOR_WIDTH)])

    sol = least_squares(res, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, max_nfev=200)
    fitted = {n: float(math.exp(v)) for n, v in zip(names, sol.x)}
    after, before = np.exp(res(sol.x)[:len(use)]), np.exp(res(x0)[:len(use)])
    return fitted, {"procedure": MEMORY_PROCEDURE, "rows": [r.id for r in use],
                    "fit_mape": float(np.mean(np.abs(after - 1))), "fit_median_ratio": float(np.median(after)),
                    "before_fit_mape": float(np.mean(np.abs(before - 1))),
                    "at_bound": [n for n, v, (_, a, b) in zip(names, sol.x, MEMORY_FITTED)
                                 if abs(v - math.log(a)) < 1e-6 or abs(v - math.log(b)) < 1e-6]}


RESERVE_QUANTILE = 0.9


def memory_reserve_frac(rows: Iterable[Row], params_for) -> tuple[float, dict]:
    """``CostParams.mem_reserve_frac``: the 90th percentile over the held-out ``memory`` rows of
    measured / predicted - 1 (floored at 0), predicted with ``params_for`` (the fitted profiles)
    and no reserve. What plans keep free is what the model got wrong on measurements no fit read.
    Returns the fraction and its record (rows, quantile, the held-out share within 25%)."""
    from nereus.fidelity.predict import predict as _predict

    held = [r for r in rows if r.category == "memory" and r.split == "heldout"]
    preds = [_predict(r, lambda g: replace(params_for(g), mem_reserve_frac=0.0)) for r in held]
    under = [p.row.value / p.predicted for p in preds if p.predicted]
    if not under:
        raise SpecError("no predictable held-out memory row")
    q = float(np.quantile(under, RESERVE_QUANTILE))
    return max(0.0, q - 1.0), {"rows": len(under), "quantile": RESERVE_QUANTILE, "measured_over_predicted_p90": q,
                               "within_25pct": sum(1 for u in under if 0.75 <= 1 / u <= 1.25) / len(under)}
