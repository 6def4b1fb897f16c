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
from nereus.fidelity.predict import predict, row_gpu
from nereus.planner.cost.params import CostParams

FITTED: tuple[tuple[str, float, float], ...] = (
    ("mfu_train", 0.15, 0.80),
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
    mine = [r for r in fit_rows(list(rows))
            if row_gpu(r) == gpu or (r.category == "collectives" and row_gpu(r) in family)]
    usable = [r for r in mine if predict(r, lambda _: base).predicted is not None]
    if not usable:
        raise SpecError(f"no predictable fit-split row for gpu {gpu!r}: cannot fit a profile")
    engines = sorted({engine_of(r.engine) for r in usable if r.category in ("decode", "prefill")})
    names = [n for n, _, _ in FITTED]
    lo = [math.log(b) for _, b, _ in FITTED] + [math.log(b) for _ in engines for b, _ in ENGINE_BOUNDS]
    hi = [math.log(b) for _, _, b in FITTED] + [math.log(b) for _ in engines for _, b in ENGINE_BOUNDS]
    x0 = [math.log(_start(n, base)) for n in names]
    for _ in engines:
        x0 += [math.log(base.decode_step_overhead_s), math.log(base.decode_overhead_per_seq_s)]
    x0 = np.clip(np.array(x0), np.array(lo) + 1e-9, np.array(hi) - 1e-9)
    measured = np.log([r.value for r in usable])

    def params_of(x: np.ndarray) -> CostParams:
        kw = {n: float(math.exp(v)) for n, v in zip(names, x[:len(names)])}
        eo = tuple((e, float(math.exp(x[len(names) + 2 * i])), float(math.exp(x[len(names) + 2 * i + 1])))
                   for i, e in enumerate(engines))
        return replace(base, **kw, engine_overhead=eo)

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
