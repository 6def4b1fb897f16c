"""Online controller: each RL step, stay on the current plan or switch to a better one.

A training loop (verl, OpenRLHF, a custom loop; see ``adapters.py``) calls ``step(metrics)`` once per
step with what it measured; the answer applies to the next step. Per step:

1. calibrate: every model-stage's observed time / the uncorrected model's prediction for the same
   plan and workload (``calibration.py``);
2. forecast the response length over the horizon (``forecast.py``), within the next step's cap;
3. must-switch when the current plan is predicted infeasible next step (OOM ahead, or fewer GPUs than
   it uses): to the feasible candidate with the lowest transition cost + predicted time over the horizon;
4. may-switch when the predicted saving summed over the horizon exceeds the transition cost by the
   margin, the same candidate has won ``patience`` steps in a row, and at least ``min_dwell`` steps
   passed since the last switch (hysteresis against flapping on noise);
5. log every decision with its numbers (``audit.py``).

Candidates come from the plan solver (brief A) for the forecast workload, cached by workload bucket
(log-spaced response-length buckets, GPU count, cap, quantized calibration): a step whose bucket is
cached does not re-solve and costs about a millisecond; a re-solve is warm-started from the current
plan. Transition-aware choice: besides the fastest plan, the solver is asked for the best plan with
the current plan's pools and TP/PP kept (cheap to reach: only DP-internal knobs change), and every
candidate is scored by saving x horizon - transition cost, so a slightly slower plan that is much
cheaper to reach can win.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from nereus.errors import NereusError
from nereus.planner.online.audit import AuditLog
from nereus.planner.online.calibration import OnlineCalibration
from nereus.planner.online.types import Decision, StepMetrics
from nereus.planner.cost.params import CostParams
from nereus.planner.online.forecast import LengthForecaster
from nereus.planner.plan import GiB, Plan, StagePlacement
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache, keep_layout
from nereus.planner.cost.plan_times import PlanTimes, compose_step, evaluate_times, plan_key
from nereus.planner.specs import ClusterSpec, JobSpec, Workload

MODES = ("adaptive", "always")
__all__ = ["Controller", "Decision", "StepMetrics", "MODES"]


@dataclass(slots=True)
class _Candidate:
    plan: Plan
    origin: str
    cost_s: float = 0.0
    horizon_s: float = math.inf
    feasible_next: bool = False

    @property
    def net_s(self) -> float:
        return self.horizon_s + self.cost_s


class Controller:
    """See the module docstring. ``rule`` restricts the layouts it may choose (baselines);
    ``mode="always"`` switches to the best plan every step, ignoring transition cost."""

    def __init__(self, job: JobSpec, cluster: ClusterSpec, params: CostParams | None = None, horizon: int = 200,
                 margin: float = 0.25, audit_path: str | None = None, *, initial_plan: Plan | None = None,
                 initial_gpus: int | None = None, initial_workload: Workload | None = None,
                 total_steps: int | None = None, patience: int = 2, min_dwell: int = 5, mode: str = "adaptive",
                 rule: LayoutRule = FREE, bucket_ratio: float = 1.04, solve_bucket_ratio: float = 1.25,
                 calib_resolution: float = 0.10, library_size: int = 12, min_gain: float = 0.01,
                 forecast_window: int = 60, time_limit_s: float = 5.0, seed: int = 0,
                 build_transition: bool = True, transition_cost_fn: Callable[[Plan, Plan], float] | None = None,
                 plans: PlanCache | None = None, audit: AuditLog | None = None) -> None:
        if mode not in MODES:
            raise NereusError(f"controller: mode must be one of {MODES}, got {mode!r}")
        self.job, self.cluster = job, cluster
        self.base_params = params or CostParams()
        self.horizon, self.margin, self.mode = int(horizon), float(margin), mode
        self.total_steps, self.patience, self.min_dwell = total_steps, int(patience), int(min_dwell)
        self.rule, self.bucket_ratio, self.calib_resolution = rule, bucket_ratio, calib_resolution
        self.solve_bucket_ratio, self.library_size = solve_bucket_ratio, library_size
        self.min_gain = min_gain
        """Savings below this fraction of the step time are treated as model noise (no switch)."""
        self._library: dict[tuple, tuple[Plan, str]] = {}
        self.build_transition = build_transition
        self._transition_cost_fn = transition_cost_fn
        self.plans = plans or PlanCache(job, cluster, time_limit_s=time_limit_s, seed=seed)
        self.calibration = OnlineCalibration()
        self.forecaster = LengthForecaster(window=forecast_window)
        self.audit = audit if audit is not None else AuditLog(audit_path)
        self.gpus = int(initial_gpus or cluster.num_gpus)
        self._prev_gpus = self.gpus
        self._cur_horizon_s = math.inf
        self._base_w = job.workload()
        self._eval: dict[tuple, PlanTimes] = {}
        self._cost: dict[tuple, float] = {}
        self._streak: tuple[tuple, int] = ((), 0)
        self._last_switch = -10**9
        self._last_cost_pred = 0.0
        self._h = 1
        if initial_plan is None:
            w0 = initial_workload or self._base_w
            initial_plan = self.plans.best(rule, w0, self.gpus, self.base_params)
            if initial_plan is None:
                raise NereusError(f"controller: no feasible {rule.name} plan for the initial workload on {self.gpus} "
                                  f"GPUs ({self.plans.last_message})")
        self.plan = initial_plan
        self._library[plan_key(initial_plan)] = (initial_plan, "initial")

    # ---- public API ------------------------------------------------------------------------------
    def step(self, m: StepMetrics) -> Decision:
        """Ingest step ``m.step``'s metrics; decide the plan of the next step."""
        t0 = time.perf_counter()
        solves0 = self.plans.solves
        w_obs = self._observed_workload(m)
        self._calibrate(m, w_obs)
        cap = int(m.response_len_cap or m.response_len_max)
        self.forecaster.observe(m.step, m.response_len_mean, int(m.response_len_max), m.response_len_p90)
        self.gpus = int(m.gpus_available or self.gpus)
        offsets = self._offsets(m.step)
        self._h = offsets[-1]
        ws = [self._forecast_workload(k, cap, w_obs.prompt_len) for k in offsets]
        self._ws0 = ws[0]
        cur = _Candidate(self.plan, "current")
        self._score(cur, ws, offsets)
        self._cur_horizon_s = cur.horizon_s
        regime_change = self.gpus != self._prev_gpus
        self._prev_gpus = self.gpus
        must = self._must_reason(m, cur)
        cands = self._candidates(ws, offsets, bool(must))
        d = self._decide(m, cur, cands, must, regime_change)
        d = replace(d, resolved=self.plans.solves > solves0, overhead_s=time.perf_counter() - t0)
        self._log(m, ws, cur, cands, d)
        return d

    def report_transition(self, measured_s: float) -> None:
        """The caller applied the last switch; its measured time calibrates future cost predictions."""
        self.calibration.update_transition(measured_s, self._last_cost_pred)

    def close(self) -> None:
        self.audit.close()

    # ---- calibration and forecast ----------------------------------------------------------------
    def _observed_workload(self, m: StepMetrics) -> Workload:
        b = self._base_w
        mx = max(int(m.response_len_max), int(math.ceil(m.response_len_mean)))
        p90 = None if m.response_len_p90 is None else min(float(m.response_len_p90), mx)
        return replace(b, prompt_len=int(m.prompt_len or b.prompt_len), response_len_mean=float(m.response_len_mean),
                       response_len_max=mx, response_len_p90=p90)

    def _calibrate(self, m: StepMetrics, w: Workload) -> None:
        if not m.stage_times or m.oom:
            return
        pred = evaluate_times(self.job, self.cluster, self.plan, w, self.base_params)
        for ms, obs in m.stage_times.items():
            if ms in pred.stage_s:
                self.calibration.update(ms, float(obs), pred.stage_s[ms], _stage_key(self.plan.stage(ms)))

    def _offsets(self, step: int) -> tuple[int, ...]:
        h = self.horizon
        if self.total_steps is not None:
            h = max(1, min(h, self.total_steps - step - 1))
        return tuple(sorted({1, max(1, h // 4), max(1, h // 2), max(1, 3 * h // 4), h}))

    def _bucket(self, x: float) -> float:
        r = math.log(self.bucket_ratio)
        return round(math.exp(round(math.log(max(x, 1.0)) / r) * r), 1)

    def _forecast_workload(self, ahead: int, cap: int, prompt: int) -> Workload:
        f = self.forecaster.forecast(ahead, cap)
        mean = min(self._bucket(f.response_len_mean), 0.98 * cap)
        p90 = min(float(cap), max(mean, self._bucket(f.response_len_p90)))
        return replace(self._base_w, prompt_len=prompt, response_len_mean=mean, response_len_max=cap,
                       response_len_p90=p90)

    # ---- prediction ------------------------------------------------------------------------------
    def predict(self, plan: Plan, w: Workload) -> tuple[float, bool]:
        """Calibrated step time and feasibility of ``plan`` on ``w`` (cached per plan and workload)."""
        key = (plan_key(plan), w.prompt_len, w.response_len_mean, w.response_len_max, w.response_len_p90)
        t = self._eval.get(key)
        if t is None:
            if len(self._eval) > 20000:
                self._eval.clear()
            t = self._eval[key] = evaluate_times(self.job, self.cluster, plan, w, self.base_params)
        if not t.feasible:
            return math.inf, False
        f = self.calibration.factor
        keys = {s.name: _stage_key(s) for s in plan.stages}
        return compose_step(self.job, plan, {ms: s * f(ms, keys[ms]) for ms, s in t.stage_s.items()},
                            t.weight_sync_s), True

    def _score(self, c: _Candidate, ws: list[Workload], offsets: tuple[int, ...]) -> None:
        """Predicted seconds over the horizon (trapezoid over the forecast points)."""
        if c.plan.num_gpus > self.gpus:
            c.horizon_s, c.feasible_next = math.inf, False
            return
        times = [self.predict(c.plan, w)[0] for w in ws]
        c.feasible_next = math.isfinite(times[0])
        total, prev_k, prev_t = times[0], offsets[0], times[0]
        for k, t in zip(offsets[1:], times[1:]):
            total += (k - prev_k) * (t + prev_t) / 2
            prev_k, prev_t = k, t
        c.horizon_s = total

    def transition_cost(self, a: Plan, b: Plan) -> float:
        """Predicted seconds of a -> b (transition planner's estimate x learned correction)."""
        if a.layout_key() == b.layout_key():
            return 0.0
        key = (a.layout_key(), b.layout_key())
        c = self._cost.get(key)
        if c is None:
            if self._transition_cost_fn is not None:
                c = self._transition_cost_fn(a, b)
            else:
                from nereus.planner.transition.build import transition_cost

                c = transition_cost(a, b, self.plans.cluster_for(max(a.num_gpus, b.num_gpus)), self.job)
            self._cost[key] = c = float(c)
        return c * self.calibration.transition_factor()

    def _must_reason(self, m: StepMetrics, cur: _Candidate) -> str:
        if m.oom:
            return f"step {m.step} ran out of memory on the current plan"
        if self.plan.num_gpus > self.gpus:
            return f"current plan uses {self.plan.num_gpus} GPUs, only {self.gpus} available"
        if not cur.feasible_next:
            return "current plan predicted out of memory next step"
        return ""

    # ---- candidates and admission ------------------------------------------------------------------
    def _solver_workload(self, w: Workload) -> Workload:
        """``w`` on the coarse grid the solver is asked on (plans are cached per grid cell)."""
        r = math.log(self.solve_bucket_ratio)
        mean = min(round(math.exp(round(math.log(w.response_len_mean) / r) * r), 1), 0.98 * w.response_len_max)
        ratio = round(w.p90 / w.response_len_mean, 1)  # coarse tail shape, so the cache key is stable
        return replace(w, response_len_mean=mean, response_len_p90=round(min(float(w.response_len_max), ratio * mean), 1))

    def _ask(self, origin: str, rule: LayoutRule, w: Workload) -> None:
        params, ckey = self.calibration.solver_params(self.base_params, self.calib_resolution)
        try:
            p = self.plans.best(rule, self._solver_workload(w), self.gpus, params, ckey, hint=self.plan)
        except NereusError:
            p = None
        if p is not None:
            self._library.pop(plan_key(p), None)
            self._library[plan_key(p)] = (p, origin)
            while len(self._library) > self.library_size:
                self._library.pop(next(iter(self._library)))

    def _candidates(self, ws: list[Workload], offsets: tuple[int, ...], must: bool) -> list[_Candidate]:
        """Plans from the solver for the forecast (the fastest under the rule, and the fastest
        keeping the current layout), plus the plans found earlier (a library re-scored every
        step, which costs evaluations, not solves)."""
        if self.mode == "always":
            self._ask("best-next", self.rule, ws[0])
        else:
            self._ask("best-horizon", self.rule, ws[len(ws) // 2])
            if self.plan.num_gpus < self.gpus or (must and self.plan.num_gpus <= self.gpus):
                # the current layout stretched to new GPUs, or re-tuned to fit: cheapest to reach
                self._ask("keep-layout", keep_layout(self.plan), ws[len(ws) // 2])
        cur = plan_key(self.plan)
        cur_s = self._cur_horizon_s
        out = []
        for key, (p, origin) in self._library.items():
            # plans for fewer GPUs than granted stay in the library but are only scored when forced
            if key == cur or p.num_gpus > self.gpus or (p.num_gpus < self.gpus and not must):
                continue
            c = _Candidate(p, origin)
            self._score(c, ws, offsets)
            # the transition planner is only asked about candidates that could pay for themselves
            c.cost_s = self.transition_cost(self.plan, p) if (must or self.mode == "always" or c.horizon_s < cur_s) else math.inf
            out.append(c)
        if must and not any(c.feasible_next for c in out):
            self._ask("best-next", self.rule, ws[0])
            return self._candidates(ws, offsets, False) if self._library else out
        return out

    def _decide(self, m: StepMetrics, cur: _Candidate, cands: list[_Candidate], must: str,
                regime_change: bool) -> Decision:
        """Admission (see the module docstring). A GPU-count change is a new regime: hysteresis
        (patience, dwell) guards against noise, not against a cluster that just grew."""
        feasible = [c for c in cands if c.feasible_next]
        if self.mode == "always":
            best = min(feasible, key=lambda c: self.predict(c.plan, self._ws0)[0]) if feasible else None
            if best is None or (not must and self.predict(best.plan, self._ws0)[0] >= 0.995 * self.predict(cur.plan, self._ws0)[0]):
                return self._stay(cur, best, must, "always: current plan is the best for next step")
            return self._switch(m, cur, best, must, "always: best plan for next step")
        if must:
            if not feasible:
                return self._stay(cur, None, must, "no feasible plan found for next step", feasible=False)
            best = min(feasible, key=lambda c: c.net_s)
            return self._switch(m, cur, best, must, f"must switch: {must}; lowest transition + horizon time")
        if not feasible:
            return self._stay(cur, None, "", "no alternative plan")
        best = min(feasible, key=lambda c: c.net_s)
        saving = cur.horizon_s - best.horizon_s
        if saving <= 0:
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"no alternative is faster over the horizon (the best is {-saving:.1f}s "
                                             f"slower than the current {cur.horizon_s:.0f}s)")
        if saving <= self.min_gain * cur.horizon_s and best.cost_s > 0:
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"saving {saving:.1f}s over the horizon is below {self.min_gain:.0%} of "
                                             f"{cur.horizon_s:.0f}s (within model error)")
        if saving <= best.cost_s * (1 + self.margin) or saving <= 0:
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"saving {saving:.1f}s over the horizon does not repay "
                                             f"{best.cost_s:.1f}s x (1 + {self.margin:g})")
        if best.cost_s > 0 and not regime_change:
            key = best.plan.layout_key()
            n = self._streak[1] + 1 if self._streak[0] == key else 1
            self._streak = (key, n)
            if m.step - self._last_switch < self.min_dwell:
                return self._stay(cur, best, "", f"worth it, but within {self.min_dwell} steps of the last switch")
            if n < self.patience:
                return self._stay(cur, best, "", f"worth it {n}/{self.patience} steps in a row (hysteresis)")
        return self._switch(m, cur, best, "", f"saving {saving:.1f}s over the horizon > {best.cost_s:.1f}s "
                                              f"x (1 + {self.margin:g})")

    def _per_step(self, cur: _Candidate, c: _Candidate | None) -> float:
        if c is None or not math.isfinite(c.horizon_s):
            return 0.0
        return (cur.horizon_s - c.horizon_s) / max(1, self._h) if math.isfinite(cur.horizon_s) else math.inf

    def _stay(self, cur: _Candidate, best: _Candidate | None, must: str, reason: str, feasible: bool = True) -> Decision:
        return Decision(action="stay", plan=self.plan, transition=None, predicted_cost_s=0.0 if best is None else best.cost_s,
                        saving_per_step_s=self._per_step(cur, best), break_even_steps=_break_even(cur, best, self),
                        reason=reason, must=bool(must), feasible=feasible and not must)

    def _switch(self, m: StepMetrics, cur: _Candidate, best: _Candidate, must: str, reason: str) -> Decision:
        trans = None
        if self.build_transition and best.cost_s > 0:
            from nereus.planner.transition.build import plan_transition

            trans = plan_transition(self.job, self.plans.cluster_for(max(self.plan.num_gpus, best.plan.num_gpus)),
                                    self.plan, best.plan)
            st = dict(trans.stats)
            if not st.get("keep_old_fits", True):
                tight = (f"keeping the old state until commit needs {st['peak_mem_bytes_keep_old'] / GiB:.1f} GiB on "
                         f"a GPU of {st['capacity_bytes'] / GiB:.1f} GiB (the executor has no host staging)")
                if not must:  # a switch for speed is not worth a transition that cannot keep its rollback state
                    self._streak = ((), 0)
                    return self._stay(cur, best, "", f"worth it, but {tight}")
                reason += f"; warning: {tight}"
        d = Decision(action="switch", plan=best.plan, transition=trans, predicted_cost_s=best.cost_s,
                     saving_per_step_s=self._per_step(cur, best), break_even_steps=_break_even(cur, best, self),
                     reason=f"{reason} [{best.origin}]", must=bool(must))
        if best.cost_s > 0:
            self._last_switch = m.step
            self._last_cost_pred = best.cost_s
        self._streak = ((), 0)
        self.plan = best.plan
        return d

    def _log(self, m: StepMetrics, ws: list[Workload], cur: _Candidate, cands: list[_Candidate], d: Decision) -> None:
        self.audit.record({
            "step": m.step, "decision": d.action, "must": d.must, "reason": d.reason,
            "forecast": [{"response_len_mean": w.response_len_mean, "response_len_p90": w.response_len_p90,
                          "response_len_max": w.response_len_max} for w in ws[:1] + ws[-1:]],
            "gpus": self.gpus, "current_step_s": self.predict(cur.plan, ws[0])[0], "current_horizon_s": cur.horizon_s,
            "candidates": [{"origin": c.origin, "step_s": self.predict(c.plan, ws[0])[0], "horizon_s": c.horizon_s,
                            "transition_s": c.cost_s, "layout": _layout(c.plan)} for c in cands],
            "transition_s": d.predicted_cost_s, "saving_per_step_s": d.saving_per_step_s,
            "break_even_steps": d.break_even_steps, "plan": _layout(d.plan), "resolved": d.resolved,
            "overhead_ms": d.overhead_s * 1e3, "calibration": self.calibration.to_dict(),
        })


def _stage_key(s: StagePlacement) -> tuple:
    """What a model-stage's calibration factor is specific to: its config and pool size."""
    c = s.config
    return (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.recompute, s.gpus)


def _layout(p: Plan) -> str:
    return " ".join(f"{s.name}:{s.config.label()}@{s.first_gpu}+{s.gpus}" for s in p.stages)


def _break_even(cur: _Candidate, c: _Candidate | None, ctl: Controller) -> float:
    """Steps until the transition is repaid at the predicted per-step saving (inf if never)."""
    per = ctl._per_step(cur, c)
    if c is None or per <= 0:
        return math.inf
    return c.cost_s / per if math.isfinite(per) else 0.0
