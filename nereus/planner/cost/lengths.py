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
