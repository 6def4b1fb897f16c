"""Online calibration: per model-stage correction of the cost model from a running job.

The analytic model is biased (efficiencies are guesses until measured). Each step the controller
divides every observed model-stage time by what the *uncorrected* model predicts for the same
plan and workload; the correction factor is the median of the recent ratios (robust to a noisy or
straggling step), bounded to [lo, hi] so that one broken measurement cannot make the planner
believe a stage is free or takes forever. The median of a sliding window converges as soon as half
the window is from the current regime. The ratio depends on the parallel config, so every config
actually run keeps its own factor; the model-stage's latest factor covers configs never run.

Factors feed the planner two ways: exactly per model-stage when the controller re-predicts a known
plan, and per stage (``CostParams.stage_factor``, a time-weighted mean over the model-stages of the
stage) for the solver, which only knows stage-level factors.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Hashable, Mapping

import numpy as np

from nereus.planner.cost.params import STAGES, CostParams


class OnlineCalibration:
    def __init__(self, window: int = 15, bounds: tuple[float, float] = (0.25, 4.0)) -> None:
        self.window = window
        self.bounds = bounds
        self._ratios: dict[str, deque[float]] = {}
        self._weight: dict[str, float] = {}
        self._factor: dict[str, float] = {}
        self.transition_ratios: deque[float] = deque(maxlen=window)
        self._committed: dict[str, int] = {}

    def update(self, model_stage: str, observed_s: float, predicted_s: float, config: Hashable = None) -> None:
        """Add one observation (``predicted_s`` from the uncorrected model, same plan and workload).
        ``config`` identifies the parallel config it ran under: the model's bias depends on it, so
        each config observed keeps its own factor (the model-stage's latest factor is the fallback
        for configs never run). Without per-config factors a controller flaps: the factor learned on
        plan B makes plan A look better, and back."""
        if not (observed_s > 0 and predicted_s > 0 and math.isfinite(observed_s) and math.isfinite(predicted_s)):
            return
        lo, hi = self.bounds
        for key in ((model_stage,) if config is None else (model_stage, (model_stage, config))):
            q = self._ratios.setdefault(key, deque(maxlen=self.window))
            q.append(observed_s / predicted_s)
            self._factor[key] = min(hi, max(lo, float(np.median(q))))
        self._weight[model_stage] = predicted_s

    def factor(self, model_stage: str, config: Hashable = None) -> float:
        if config is not None:
            hit = self._factor.get((model_stage, config))
            if hit is not None:
                return hit
        return self._factor.get(model_stage, 1.0)

    def factors(self) -> dict[str, float]:
        """Per model-stage (latest config) factors."""
        return {k: v for k, v in self._factor.items() if isinstance(k, str)}

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
