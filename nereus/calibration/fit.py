"""Turn measurement tables into cost-model parameters, with the quality of every fit.

Three kinds of fit, all scipy ``least_squares`` on *relative* residuals (a 10 us error matters at
4 KiB and not at 64 MiB, so each point weighs by its own scale):

* saturating throughput, for matmul and memory copies: rate(x) = peak * x / (x + half). It is the
  same curve as the cost model's ``matmul_eff`` and, rewritten as time, an alpha-beta line:
  t(x) = x / peak + half / peak, i.e. a fixed per-call cost plus a streaming cost.
* alpha-beta per link class and collective: t = c_a(op, n) * alpha + c_b(op, n) * S / B with the
  ring coefficients of ``cost_params`` (all-reduce 2(n-1) and 2(n-1)/n, all-gather (n-1) and
  (n-1)/n, p2p 1 and 1).
* stage correction: per-stage multiplicative factors (and the decode step overhead) that bring
  the analytic model onto measured stage times.

Parameters are fitted in log space so they stay positive without bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from nereus.errors import NereusError

ROBUST = "soft_l1"
"""A robust loss: one measurement disturbed by a neighbour's job must not drag the curve."""


class FitError(NereusError):
    """Not enough (or unusable) data to fit a parameter."""


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, as a fraction (0.08 = 8%)."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if len(m) == 0:
        return float("nan")
    return float(np.mean(np.abs(p - m) / m))


def heldout_mask(sizes: Sequence[float], every: int = 3) -> np.ndarray:
    """Deterministic hold-out: sort by size, hold out every ``every``-th point, never the smallest
    or the largest, so held-out points test interpolation inside the fitted range."""
    order = np.argsort(np.asarray(sizes, float), kind="stable")
    mask = np.zeros(len(order), bool)
    for rank, idx in enumerate(order):
        if 0 < rank < len(order) - 1 and rank % every == 1:
            mask[idx] = True
    return mask


# ---- saturating throughput ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class SaturatingFit:
    """rate(x) = peak * x / (x + half); x is work per call (FLOPs or bytes), rate is work/s."""

    peak: float
    half: float
    points: int
    fit_mape: float

    def seconds(self, x: np.ndarray | float) -> np.ndarray | float:
        return (np.asarray(x, float) + self.half) / self.peak

    def to_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "half": self.half, "points": self.points, "fit_mape": self.fit_mape}


def fit_saturating(work: Sequence[float], seconds: Sequence[float]) -> SaturatingFit:
    x, t = np.asarray(work, float), np.asarray(seconds, float)
    if len(x) < 2 or np.ptp(x) <= 0:
        raise FitError(f"saturating fit needs >= 2 distinct sizes, got {len(set(x.tolist()))}")
    peak0 = float(np.max(x / t))
    half0 = max(float(np.min(x)), 1e-12)

    def resid(v: np.ndarray) -> np.ndarray:
        return (x + np.exp(v[1])) / np.exp(v[0]) / t - 1.0

    sol = least_squares(resid, [np.log(peak0), np.log(half0)], loss=ROBUST, f_scale=0.05)
    peak, half = float(np.exp(sol.x[0])), float(np.exp(sol.x[1]))
    fit = SaturatingFit(peak=peak, half=half, points=len(x), fit_mape=0.0)
    return SaturatingFit(peak=peak, half=half, points=len(x), fit_mape=mape(fit.seconds(x), t))


# ---- alpha-beta collectives -----------------------------------------------------------------------
def ring_coeffs(op: str, n: int) -> tuple[float, float]:
    """(latency count, bandwidth multiplier) of one collective of S bytes over n ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op == "all_gather":
        return float(n - 1), (n - 1) / n
    if op == "p2p":
        return 1.0, 1.0
    raise FitError(f"unknown collective {op!r}; known: all_reduce, all_gather, p2p")


@dataclass(frozen=True, slots=True, kw_only=True)
class AlphaBetaFit:
    """t = c_a * alpha + c_b * S / bandwidth for one collective on one link class."""

    op: str
    link: str
    alpha_s: float
    bandwidth: float
    """Bytes per second."""
    points: int
    fit_mape: float

    def seconds(self, nbytes: np.ndarray | float, n: int) -> np.ndarray | float:
        ca, cb = ring_coeffs(self.op, n)
        return ca * self.alpha_s + cb * np.asarray(nbytes, float) / self.bandwidth

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "link": self.link, "alpha_s": self.alpha_s, "bandwidth_gbps": self.bandwidth / 1e9,
                "points": self.points, "fit_mape": self.fit_mape}


def fit_alpha_beta(df: pd.DataFrame, op: str, link: str = "intra") -> AlphaBetaFit:
    """Fit one collective's rows (columns: world, bytes, seconds); worlds may be mixed."""
    if len(df) < 2:
        raise FitError(f"alpha-beta fit of {op} on {link} needs >= 2 rows, got {len(df)}")
    coeffs = np.array([ring_coeffs(op, int(n)) for n in df["world"]])
    s, t = df["bytes"].to_numpy(float), df["seconds"].to_numpy(float)
    alpha0 = float(np.min(t)) / max(float(np.max(coeffs[:, 0])), 1.0)
    bw0 = float(np.max(coeffs[:, 1] * s / t))

    def resid(v: np.ndarray) -> np.ndarray:
        return (coeffs[:, 0] * np.exp(v[0]) + coeffs[:, 1] * s / np.exp(v[1])) / t - 1.0

    sol = least_squares(resid, [np.log(alpha0), np.log(bw0)], loss=ROBUST, f_scale=0.05)
    alpha, bw = float(np.exp(sol.x[0])), float(np.exp(sol.x[1]))
    pred = coeffs[:, 0] * alpha + coeffs[:, 1] * s / bw
    return AlphaBetaFit(op=op, link=link, alpha_s=alpha, bandwidth=bw, points=len(t), fit_mape=mape(pred, t))


# ---- generic parameter fit (stage corrections) ----------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ParamFit:
    """Fitted positive parameters by name, with the relative-error quality on the fitted rows."""

    values: tuple[tuple[str, float], ...]
    points: int
    fit_mape: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)


def fit_positive(names: Sequence[str], start: Sequence[float],
                 predict: Callable[[dict[str, float]], np.ndarray], measured: Sequence[float],
                 prior: dict[str, float] | None = None) -> ParamFit:
    """Least-squares fit of positive parameters ``names`` so that ``predict(values)`` matches
    ``measured`` in relative terms. ``predict`` returns one prediction per measured row.

    ``prior`` maps a name to a weight w that adds the residual w * log(value / start): a weak
    pull towards the start value that settles directions the data cannot (a stage factor and a
    per-step overhead trade off exactly when compute is negligible)."""
    m = np.asarray(measured, float)
    if len(m) < len(names):
        raise FitError(f"fitting {list(names)} needs >= {len(names)} measurements, got {len(m)}")
    v0 = np.log(np.asarray(start, float))
    w = np.array([(prior or {}).get(n, 0.0) for n in names])
    has_prior = bool(np.any(w > 0))

    def resid(v: np.ndarray) -> np.ndarray:
        r = np.asarray(predict(dict(zip(names, np.exp(v)))), float) / m - 1.0
        return np.concatenate([r, w * (v - v0)]) if has_prior else r

    sol = least_squares(resid, v0, loss=ROBUST, f_scale=0.1)
    values = dict(zip(names, (float(x) for x in np.exp(sol.x))))
    return ParamFit(values=tuple(values.items()), points=len(m), fit_mape=mape(predict(values), m))
