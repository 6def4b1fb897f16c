"""Online calibration: corrections of the cost model learned from a running job.

Times. Each step the controller divides every observed model-stage time by what the *uncorrected*
model predicts for the same plan and workload. Two models of that ratio, per model-stage:

- per config: every parallel config actually run keeps the median of its recent ratios, bounded to
  [lo, hi] (robust to a noisy or straggling step; one broken measurement cannot make a stage free);
- shape: a Bayesian linear model of the log-ratio over config features (``features``: log2 of tp,
  pp, dp, micro-batch; recomputation; ZeRO-3), fitted to the per-config medians. Its intercept
  carries a bias common to every config; its slopes say how the model's error changes along an
  axis (e.g. "the model overrates TP8 against TP2"), which a single multiplier per model-stage can
  never express, so the controller's *ranking* of configs it has not run can change. The slopes
  have a zero-mean prior (``slope_prior`` per doubling): until two configs along an axis have been
  run, an unseen config inherits the common bias, and ``sd`` tells how unsure that is.

A config that was run uses its own median; one never run uses the shape model (the model-stage's
latest factor when no features are given). What measurement noise leaves uncertain in a factor
(``se``, ``dependence``): a config run knows its factor to the standard error of its median (the
noise of one observation, pooled over the model-stage's configs, / sqrt(observations)); a config
never run inherits the noise of the configs the shape model was fitted to, through its weights (a
slope fitted to noise between two nearby configs, extrapolated two doublings away, multiplies it).
The controller weighs a predicted saving against that (``admission.py``). Factors feed the planner two ways: exactly per config
when the controller re-predicts a plan, and per stage (``CostParams.stage_factor``, a time-weighted
geometric mean over the model-stages of the stage) for the solver, which only knows stage factors.

Transitions: measured seconds against the planner's prediction, as ``factor x predicted + fixed``
(the fixed part is what a layout change the bandwidth bound calls free really costs, e.g. starting
an inference engine with a new TP).

Memory is judged apart, by the reserves of ``reserve.py``.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Hashable, Mapping, Sequence

import numpy as np

from nereus.planner.cost.params import STAGES, CostParams


FIXED_MAX_S = 600.0
"""Bound on the learned fixed cost of a layout change (one broken measurement cannot make every
switch look like an hour)."""


class ShapeModel:
    """Bayesian linear regression of log(observed / predicted) on config features, centred on the
    configs run (so a bias common to them lands in the intercept, never in a slope)."""

    def __init__(self, slope_prior: float = 0.25, intercept_prior: float = 1.0, noise: float = 0.05) -> None:
        self.slope_prior, self.intercept_prior, self.noise = slope_prior, intercept_prior, noise
        self._fit: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def fit(self, rows: Sequence[tuple[np.ndarray, float, int]]) -> None:
        """``rows``: (features with a leading 1, log-ratio median, observations) per config run."""
        x = np.array([r[0] for r in rows], float)
        y = np.array([r[1] for r in rows], float)
        w = np.array([r[2] for r in rows], float) / self.noise**2
        center = (w[:, None] * x).sum(axis=0) / w.sum()
        center[0] = 0.0
        x = x - center
        prior = np.full(x.shape[1], 1 / self.slope_prior**2)
        prior[0] = 1 / self.intercept_prior**2
        a = x.T @ (w[:, None] * x) + np.diag(prior)
        cov = np.linalg.inv(a)
        self._gain = cov @ (x.T * w)
        """Maps the rows' log-ratios to the coefficients (what noise in a row does to a prediction)."""
        self._fit = (self._gain @ y, cov, center)

    def predict(self, feats: np.ndarray) -> tuple[float, float]:
        """(mean, sd) of the log-ratio at ``feats``."""
        if self._fit is None:
            return 0.0, self.intercept_prior
        mean, cov, center = self._fit
        f = feats - center
        return float(f @ mean), float(math.sqrt(max(0.0, f @ cov @ f)))

    def weights(self, feats: np.ndarray) -> np.ndarray:
        """d(predicted log-ratio at ``feats``) / d(each row's log-ratio): how the noise of the
        configs run carries over to a config never run (a slope fitted to noise extrapolates it)."""
        if self._fit is None:
            return np.zeros(0)
        return (feats - self._fit[2]) @ self._gain


class OnlineCalibration:
    def __init__(self, window: int = 15, bounds: tuple[float, float] = (0.25, 4.0), slope_prior: float = 0.25) -> None:
        self.window = window
        self.bounds = bounds
        self.slope_prior = slope_prior
        self._ratios: dict[Hashable, deque[float]] = {}
        self._weight: dict[str, float] = {}
        self._factor: dict[Hashable, float] = {}
        self._feats: dict[tuple[str, Hashable], np.ndarray] = {}
        self._shape: dict[str, ShapeModel] = {}
        self._shape_dirty: set[str] = set()
        self.transition_pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self._committed: dict[str, int] = {}
        self._noise: dict[str, float] = {}
        self._rows: dict[str, list] = {}

    # ---- stage times ------------------------------------------------------------------------------
    def update(self, model_stage: str, observed_s: float, predicted_s: float, config: Hashable = None,
               features: Sequence[float] | None = None) -> None:
        """Add one observation (``predicted_s`` from the uncorrected model, same plan and workload).
        ``config`` identifies the parallel config it ran under, ``features`` its shape features
        (``features()`` of the controller); both optional."""
        if not (observed_s > 0 and predicted_s > 0 and math.isfinite(observed_s) and math.isfinite(predicted_s)):
            return
        lo, hi = self.bounds
        for key in ((model_stage,) if config is None else (model_stage, (model_stage, config))):
            q = self._ratios.setdefault(key, deque(maxlen=self.window))
            q.append(observed_s / predicted_s)
            self._factor[key] = min(hi, max(lo, statistics.median(q)))
        self._noise.pop(model_stage, None)
        if config is not None and features is not None:
            self._feats[(model_stage, config)] = np.concatenate([[1.0], np.asarray(features, float)])
            self._shape_dirty.add(model_stage)
        self._weight[model_stage] = predicted_s

    def _shape_model(self, model_stage: str) -> ShapeModel | None:
        if model_stage in self._shape_dirty:
            run = [(cfg, f) for (ms, cfg), f in self._feats.items() if ms == model_stage]
            rows = [(f, math.log(self._factor[(model_stage, cfg)]), len(self._ratios[(model_stage, cfg)]))
                    for cfg, f in run]
            model = self._shape.setdefault(model_stage, ShapeModel(self.slope_prior))
            model.fit(rows)
            self._rows[model_stage] = [cfg for cfg, _ in run]
            self._shape_dirty.discard(model_stage)
        return self._shape.get(model_stage)

    def seen(self, model_stage: str, config: Hashable) -> bool:
        return (model_stage, config) in self._factor

    def factor(self, model_stage: str, config: Hashable = None, features: Sequence[float] | None = None) -> float:
        if config is not None:
            hit = self._factor.get((model_stage, config))
            if hit is not None:
                return hit
            if features is not None:
                model = self._shape_model(model_stage)
                if model is not None:
                    lo, hi = self.bounds
                    return min(hi, max(lo, math.exp(model.predict(np.concatenate([[1.0], features]))[0])))
        return self._factor.get(model_stage, 1.0)

    def sd(self, model_stage: str, config: Hashable, features: Sequence[float]) -> float:
        """Uncertainty (sd of the log-factor) for ``config``: 0 once it has been run."""
        if (model_stage, config) in self._factor:
            return 0.0
        model = self._shape_model(model_stage)
        if model is None:
            return self.slope_prior
        return model.predict(np.concatenate([[1.0], features]))[1]

    def noise(self, model_stage: str) -> float:
        """sd of one observation's log-ratio about its config's mean, pooled over the configs of
        ``model_stage`` run at least twice (0 before 2 degrees of freedom: no evidence). Not the
        MAD: on a handful of steps it reads 5% noise as 2% (half the ratios can sit together); a
        straggler step only makes the controller more cautious."""
        hit = self._noise.get(model_stage)
        if hit is None:
            ss, dof = 0.0, 0
            for key, q in self._ratios.items():
                if isinstance(key, tuple) and key[0] == model_stage and len(q) >= 2:
                    logs = np.log(np.asarray(q, float))
                    ss, dof = ss + float(((logs - logs.mean()) ** 2).sum()), dof + len(q) - 1
            hit = self._noise[model_stage] = math.sqrt(ss / dof) if dof >= 2 else 0.0
        return hit

    def se(self, model_stage: str, config: Hashable) -> float:
        """Standard error of the log of a run config's median factor: 1.25 x the noise /
        sqrt(observations) (0 for a config never run)."""
        q = self._ratios.get((model_stage, config))
        return 1.2533 * self.noise(model_stage) / math.sqrt(len(q)) if q else 0.0

    def pooled_se(self, model_stage: str) -> float:
        """Uncertainty of the log of ``model_stage``'s median over every config, as the factor of a
        config never run (what it takes without features): the standard error of that median
        (1.25 x the noise / sqrt(observations)) and, in quadrature, the spread between the configs
        run (a config never run may be any of them; 0 with one); 0 with no observation."""
        q = self._ratios.get(model_stage)
        if not q:
            return 0.0
        run = [math.log(f) for key, f in self._factor.items() if isinstance(key, tuple) and key[0] == model_stage]
        between = float(np.std(run, ddof=1)) if len(run) >= 2 else 0.0
        return math.hypot(1.2533 * self.noise(model_stage) / math.sqrt(len(q)), between)

    def dependence(self, model_stage: str, config: Hashable, features: Sequence[float] | None) -> dict:
        """How the log-factor of ``config`` depends on the log-ratios measured on the configs run
        (config run -> coefficient): a config run on its own median alone; one never run on every
        config the shape model was fitted to (its weights); without features, on none. The noise
        part of a factor's uncertainty is sum over runs of (coefficient x ``se``)^2; the prior's
        doubt about configs never run is not in it (the probes act on that, ``admission.py``)."""
        if (model_stage, config) in self._factor:
            return {config: 1.0}
        if features is None or self._shape_model(model_stage) is None:
            return {}
        g = self._shape[model_stage].weights(np.concatenate([[1.0], features]))
        return {cfg: float(c) for cfg, c in zip(self._rows[model_stage], g) if abs(c) > 1e-6}

    def residual(self, model_stage: str, config: Hashable) -> float:
        """|log factor| of a config that was run (how wrong the model is there), else 0."""
        f = self._factor.get((model_stage, config))
        return abs(math.log(f)) if f else 0.0

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
        if measured_s > 0 and predicted_s >= 0 and math.isfinite(measured_s):
            self.transition_pairs.append((measured_s, predicted_s))

    def transition_model(self) -> tuple[float, float]:
        """(factor, fixed seconds): measured ~ factor x predicted + fixed. The factor is the median
        ratio (clamped to the bounds) of transitions whose predicted cost was > 0; the fixed part
        the median measured time of layout changes the model priced at 0 (no model state moved, e.g.
        only the inference engine's layout), at most ``FIXED_MAX_S``."""
        lo, hi = self.bounds
        ratios = [m / p for m, p in self.transition_pairs if p > 0]
        free = [m for m, p in self.transition_pairs if p <= 0]
        k = min(hi, max(lo, float(np.median(ratios)))) if ratios else 1.0
        fixed = min(FIXED_MAX_S, float(np.median(free))) if free else 0.0
        return k, fixed

    def transition_factor(self) -> float:
        return self.transition_model()[0]

    def predict_transition(self, predicted_s: float) -> float:
        k, fixed = self.transition_model()
        return k * predicted_s + fixed

    def to_dict(self) -> Mapping[str, object]:
        k, fixed = self.transition_model()
        return {"model_stage": self.factors(), "stage": self.stage_factors(), "transition": k,
                "transition_fixed_s": fixed}
