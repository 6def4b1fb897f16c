"""Response-length distribution from (mean, p90, max): the long tail dominates generation time.

A log-normal matched to the mean and the 90th percentile, clipped at the cap (truncated responses
pile up at ``max``, as they do in real runs). ``quantiles(k)`` returns ``k`` equally likely lengths,
so "sequences still running at decode position x" is a step function the cost model can sum over.
"""
from __future__ import annotations

import math
from functools import lru_cache
from statistics import NormalDist

_Z90 = 1.2815515655446004
DEFAULT_P90_OVER_MEAN = 1.8


def lognormal_sigma(mean: float, p90: float) -> float:
    """sigma of a log-normal with the given mean and p90 (ratio clamped to what one can express)."""
    r = max(1.0, p90 / mean)
    ln_r = min(math.log(r), _Z90 * _Z90 / 2 - 1e-9)
    return _Z90 - math.sqrt(_Z90 * _Z90 - 2 * ln_r)


@lru_cache(maxsize=4096)
def response_quantiles(mean: float, p90: float | None, max_len: int, k: int = 32) -> tuple[float, ...]:
    """``k`` equally likely response lengths (ascending), each in [1, max_len]; their mean is
    rescaled to ``mean`` where the cap allows it."""
    if p90 is None:
        p90 = min(max_len, mean * DEFAULT_P90_OVER_MEAN)
    sigma = lognormal_sigma(mean, p90)
    mu = math.log(mean) - sigma * sigma / 2
    nd = NormalDist()
    raw = [math.exp(mu + sigma * nd.inv_cdf((i + 0.5) / k)) for i in range(k)]
    # Rescale to hit the mean before clipping; clipping then lowers it, so fix up iteratively.
    target = float(mean)
    scale = target / (sum(raw) / k)
    for _ in range(30):
        vals = [min(float(max_len), max(1.0, x * scale)) for x in raw]
        m = sum(vals) / k
        if abs(m - target) <= 1e-6 * target or m >= max_len:
            break
        scale *= target / m
    return tuple(vals)


@lru_cache(maxsize=4096)
def _fitted(mean: float, p90: float | None, max_len: int) -> tuple[float, float]:
    """(mu, sigma) of the log-normal behind ``response_quantiles``, with the same rescaling, so
    that the clipped distribution's mean is ``mean`` where the cap allows it."""
    if p90 is None:
        p90 = min(max_len, mean * DEFAULT_P90_OVER_MEAN)
    sigma = lognormal_sigma(mean, p90)
    qs = response_quantiles(mean, p90, max_len, 256)
    raw_mu = math.log(mean) - sigma * sigma / 2
    # the rescale factor response_quantiles applied, recovered from its unclipped middle
    nd = NormalDist()
    mid = 128
    raw = math.exp(raw_mu + sigma * nd.inv_cdf((mid + 0.5) / 256))
    scale = qs[mid] / raw if qs[mid] < max_len else 1.0
    return raw_mu + math.log(scale), sigma


@lru_cache(maxsize=65536)
def survival(x: float, mean: float, p90: float | None, max_len: int) -> float:
    """P(length > x) of the clipped distribution: 0 at and beyond the cap, where the truncated
    responses sit."""
    if x >= max_len:
        return 0.0
    if x <= 0:
        return 1.0
    mu, sigma = _fitted(mean, p90, max_len)
    if sigma < 1e-9:  # every response has the mean length
        return 1.0 if x < mean else 0.0
    return 1.0 - NormalDist().cdf((math.log(x) - mu) / sigma)


@lru_cache(maxsize=16384)
def expected_max(n: float, mean: float, p90: float | None, max_len: int) -> float:
    """Expected longest of ``n`` sampled responses (order statistics, Blom's plotting position
    F^-1((n - 0.375)/(n + 0.25))), clipped at the cap: the generation of a step ends with it.
    When n times the mass above the cap reaches about one response, the longest is the cap."""
    if n <= 1:
        return float(min(max_len, mean))
    mu, sigma = _fitted(mean, p90, max_len)
    if sigma < 1e-9:
        return float(min(max_len, mean))
    z = NormalDist().inv_cdf((n - 0.375) / (n + 0.25))
    return float(min(max_len, max(mean, math.exp(mu + sigma * z))))


@lru_cache(maxsize=16384)
def decode_grid(n: float, mean: float, p90: float | None, max_len: int, points: int = 48,
                total: float | None = None) -> tuple[tuple[float, float], ...]:
    """(decode position x, sequences still running at x) on one replica of ``n`` sequences, from 0
    to the expected longest of the ``total`` responses of the step (default n): the step waits for
    the longest response wherever it runs, so the replica holding it decodes until then, at least
    one sequence, n * P(length > x) before. Positions are spaced evenly in probability (denser
    where sequences finish) plus the tail."""
    x_end = expected_max(n if total is None else max(n, total), mean, p90, max_len)
    qs = [q for q in response_quantiles(mean, p90, max_len, points) if q < x_end]
    xs = sorted(set([0.0] + qs + [x_end]))
    return tuple((x, max(1.0, n * survival(x, mean, p90, max_len)) if x < x_end else 0.0) for x in xs)


@lru_cache(maxsize=16384)
def peak_context_per_seq(n: float, mean: float, p90: float | None, max_len: int, prompt: int,
                         total: float | None = None) -> float:
    """Tokens of KV one admitted sequence holds at its expected worst moment, max over decode
    positions x of P(length > x) * (prompt + x): what continuous batching must reserve per slot."""
    grid = decode_grid(n, mean, p90, max_len, total=total)
    return max(max(survival(x, mean, p90, max_len) * (prompt + x) for x, _ in grid), prompt + 1.0)
