"""Online calibration: per model-stage correction of the cost model from a running job.

The analytic model is biased (efficiencies are guesses until measured). Each step the controller
divides every observed model-stage time by what the *uncorrected* model predicts for the same
plan and workload; the correction factor is the median of the recent ratios (robust to a noisy or
straggling step), bounded to [lo, hi] so that one broken measurement cannot make the planner
believe a stage is free or takes forever. The median of a sliding window converges as soon as half
the window is from the current regime, and a changed parallel config of a model-stage restarts its
window (its ratio depends on the config), seeded with the previous factor as a prior.

Factors feed the planner two ways: exactly per model-stage when the controller re-predicts a known
plan, and per stage (``CostParams.stage_factor``, a time-weighted mean over the model-stages of the
stage) for the solver, which only knows stage-level factors.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Mapping

import numpy as np

from nereus.planner.cost_params import STAGES, CostParams


class OnlineCalibration:
    def __init__(self, window: int = 15, bounds: tuple[float, float] = (0.25, 4.0)) -> None:
        self.window = window
        self.bounds = bounds
        self._ratios: dict[str, deque[float]] = {}
        self._weight: dict[str, float] = {}
        self._factor: dict[str, float] = {}
        self.transition_ratios: deque[float] = deque(maxlen=window)
        self._committed: dict[str, int] = {}

    def update(self, model_stage: str, observed_s: float, predicted_s: float) -> None:
        """Add one observation (``predicted_s`` from the uncorrected model, same plan and workload)."""
        if not (observed_s > 0 and predicted_s > 0 and math.isfinite(observed_s) and math.isfinite(predicted_s)):
            return
        q = self._ratios.setdefault(model_stage, deque(maxlen=self.window))
        q.append(observed_s / predicted_s)
        self._weight[model_stage] = predicted_s
        lo, hi = self.bounds
        self._factor[model_stage] = min(hi, max(lo, float(np.median(q))))

    def restart(self, model_stage: str) -> None:
        """The model-stage's config changed: keep its factor as a single prior observation."""
        if model_stage in self._factor:
            self._ratios[model_stage] = deque([self._factor[model_stage]], maxlen=self.window)

    def factor(self, model_stage: str) -> float:
        return self._factor.get(model_stage, 1.0)

    def factors(self) -> dict[str, float]:
        return dict(self._factor)

    def stage_factors(self) -> dict[str, float]:
        """Per stage: time-weighted geometric mean of the model-stage factors of that stage."""
        out = {}
        for stage in STAGES:
            items = [(ms, w) for ms, w in self._weight.items() if ms.endswith("/" + stage) and ms in self._factor]
            total = sum(w for _, w in items)
            if total > 0:
                out[stage] = math.exp(sum(w * math.log(self._factor[ms]) for ms, w in items) / total)
        return out

    def params(self, base: CostParams) -> CostParams:
        """``base`` with its stage factors multiplied by the learned ones (what the solver sees)."""
        learned = self.stage_factors()
        if not learned:
            return base
        return base.with_stage_factors(**{s: base.factor(s) * f for s, f in learned.items()})

    def committed(self, resolution: float = 0.10) -> dict[str, int]:
        """Stage factors for the solver as steps of a log grid (factor = (1 + resolution) ** k),
        with hysteresis: a stage's step moves only when its live factor is more than 0.75 of a grid
        step away, so noise around a grid edge does not cause re-solves. Two controllers with the
        same grid steps ask the solver the same question (shared plan caches stay exact)."""
        r = math.log1p(resolution)
        for s, f in self.stage_factors().items():
            k = self._committed.get(s)
            if k is None or abs(math.log(f) - k * r) > 0.75 * r:
                self._committed[s] = round(math.log(f) / r)
        return dict(self._committed)

    def solver_params(self, base: CostParams, resolution: float = 0.10) -> tuple[CostParams, tuple]:
        """``base`` with the committed stage factors applied, and their cache key."""
        steps = self.committed(resolution)
        key = tuple(sorted(steps.items()))
        if not steps:
            return base, key
        r = math.log1p(resolution)
        return base.with_stage_factors(**{s: base.factor(s) * math.exp(k * r) for s, k in steps.items()}), key

    # ---- transitions ----------------------------------------------------------------------------
    def update_transition(self, measured_s: float, predicted_s: float) -> None:
        if measured_s > 0 and predicted_s > 0:
            self.transition_ratios.append(measured_s / predicted_s)

    def transition_factor(self) -> float:
        if not self.transition_ratios:
            return 1.0
        lo, hi = self.bounds
        return min(hi, max(lo, float(np.median(self.transition_ratios))))

    def to_dict(self) -> Mapping[str, object]:
        return {"model_stage": self.factors(), "stage": self.stage_factors(), "transition": self.transition_factor()}
