"""Workload forecast for the controller: where the response length is heading.

Response length in reasoning RL drifts for hundreds of steps (R1-Zero grows roughly linearly;
DeepScaleR dips, then climbs until it hits its cap). A plan is chosen for the steps it will run, so
the controller needs the length ``k`` steps ahead, not the last value. We fit a robust trend
(Theil-Sen: median of pairwise slopes, insensitive to a few outlier steps) over a sliding window,
clip it to the response cap, and restart the window when the regime changes (cap raised or lowered,
GPU count changed), because the old trend says nothing about the new regime.

A trend is only extrapolated as far as the data support it: the slope is shrunk toward 0 by
``z`` standard errors (soft threshold; the standard error from the residuals' spread, as for a
least-squares slope, widened to a Student-t quantile while few points estimate that spread; from 5
points on: of fewer, and after a cap change, the raw slope is all there is). On a flat trace with 5% noise on the observed mean, a few steps'
Theil-Sen slope is +-20 tokens per step and, over a 30-step horizon, forecast 500 or 1,500 tokens
from a level of 1,024: each such swing re-ranked the plans (issue 29, flapping). A real drift
(a ramp, a climb to the cap) is many standard errors from 0 and keeps nearly all of its slope.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.stats import t as student_t

from nereus.planner.cost.lengths import DEFAULT_P90_OVER_MEAN


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthForecast:
    ahead: int
    response_len_mean: float
    response_len_p90: float
    response_len_max: int
    slope_per_step: float


@lru_cache(maxsize=256)
def _t975(dof: int) -> float:
    return float(student_t.ppf(0.975, dof))


class LengthForecaster:
    """Sliding-window Theil-Sen trend of mean response length, clipped at the cap."""

    def __init__(self, window: int = 30, max_slope_frac: float = 0.02, z: float = 2.0) -> None:
        self.window = window
        self.z = z
        """Standard errors by which the slope is shrunk toward 0 (its significance)."""
        self.max_slope_frac = max_slope_frac
        """Bound on |slope| as a fraction of the level per step, so one noisy window cannot
        forecast lengths doubling within 50 steps."""
        self._steps: deque[int] = deque(maxlen=window)
        self._means: deque[float] = deque(maxlen=window)
        self._p90_ratio: deque[float] = deque(maxlen=window)
        self._cap: int | None = None
        self._slope: float | None = None
        self._level: float | None = None

    def observe(self, step: int, mean: float, cap: int, p90: float | None = None) -> None:
        if self._cap is not None and cap != self._cap:
            self.reset(keep=3)
        self._cap = cap
        self._steps.append(step)
        self._means.append(float(mean))
        if p90 is not None and mean > 0:
            self._p90_ratio.append(float(p90) / float(mean))
        self._slope = self._level = None

    def reset(self, keep: int = 0) -> None:
        """Forget all but the last ``keep`` observations (regime change)."""
        for q in (self._steps, self._means, self._p90_ratio):
            tail = list(q)[-keep:] if keep else []
            q.clear()
            q.extend(tail)
        self._slope = self._level = None

    @property
    def observations(self) -> int:
        return len(self._means)

    def slope(self) -> float:
        if self._slope is None:
            self._slope = self._theil_sen()
        return self._slope

    def _theil_sen(self) -> float:
        n = len(self._means)
        if n < 3:
            return 0.0
        x = np.fromiter(self._steps, float, n)
        y = np.fromiter(self._means, float, n)
        i, j = np.triu_indices(n, 1)
        dx = x[j] - x[i]
        ok = dx > 0
        if not ok.any():
            return 0.0
        s = float(np.median((y[j] - y[i])[ok] / dx[ok]))
        if n >= 5:  # fewer points have no spread to judge a trend by (after a cap change: the last 3 steps')
            resid = y - s * x
            resid = resid - np.median(resid)
            sigma = math.sqrt(float((resid ** 2).sum()) / (n - 2))  # not the MAD: of a few points it can read 0
            sxx = float(((x - x.mean()) ** 2).sum())
            se = sigma / math.sqrt(sxx) if sxx > 0 else math.inf
            # only the part of the trend the data support: z standard errors, as a Student-t quantile
            # for the n - 2 degrees of freedom the spread was estimated with (5 points: 3.2 x z / 1.96)
            k = self.z * _t975(n - 2) / 1.959964
            s = math.copysign(max(0.0, abs(s) - k * se), s)
        bound = self.max_slope_frac * float(np.median(y))
        return max(-bound, min(bound, s))

    def level(self) -> float:
        """Trend value at the last observed step (median of detrended points; cached until the
        next observation)."""
        if self._level is None:
            n = len(self._means)
            if n == 0:
                raise ValueError("no observations yet")
            x = np.fromiter(self._steps, float, n)
            y = np.fromiter(self._means, float, n)
            self._level = float(np.median(y - self.slope() * (x - x[-1])))
        return self._level

    def forecast(self, ahead: int, cap: int | None = None) -> LengthForecast:
        """Mean and p90 response length ``ahead`` steps after the last observation, within ``cap``
        (the next step's cap when the trainer knows it; default: the last cap seen)."""
        cap = int(cap if cap is not None else self._cap or 1)
        level = self.level()
        # a noisy downward slope extrapolated over a long horizon would forecast responses of a few
        # tokens: a forecast never falls below half the current level
        mean = min(max(1.0, 0.5 * level, level + self.slope() * ahead), 0.98 * cap)
        ratio = float(np.median(self._p90_ratio)) if self._p90_ratio else DEFAULT_P90_OVER_MEAN
        p90 = min(float(cap), max(mean, ratio * mean))
        return LengthForecast(ahead=ahead, response_len_mean=mean, response_len_p90=p90, response_len_max=cap,
                              slope_per_step=self.slope())
