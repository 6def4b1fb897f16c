"""Online controller: each RL step, stay on the current plan or switch to a better one.

A training loop (verl, OpenRLHF, a custom loop; see ``adapters.py``) calls ``step(metrics)`` once per
step with what it measured; the answer applies to the next step. Per step:

1. calibrate (``calibration.py``): every model-stage's observed time / the uncorrected model's
   prediction for the same plan and workload (per config, plus a shape model across configs); the
   observed peak memory against the predicted one, and an OOM, teach a memory reserve;
2. forecast the response length over the horizon (``forecast.py``) within the cap. The cap is what
   the trainer says (``response_len_cap``), else the last cap it said, else the job's
   ``sequence.response_len_max``: the observed longest response of a step is noise, never a cap change;
3. must-switch when the current plan is predicted infeasible next step (OOM ahead, or fewer GPUs than
   it uses), or a step ran out of memory: to the feasible candidate with the lowest transition cost
   + predicted time over the horizon (a baseline whose pools no longer fit re-picks its pools);
4. may-switch when the predicted saving summed over the horizon exceeds the transition cost by the
   margin, the same candidate has won ``patience`` steps in a row, and at least ``min_dwell`` steps
   passed since the last switch (hysteresis against flapping on noise);
5. probe (``explore``, adaptive mode): when the model is visibly wrong on the current config of a
   model-stage and a plausible candidate changes that stage to a config never run, run it once if
   its optimistic time (shape model at mean - kappa sd) would repay a round trip: the only way to
   learn that the model's *ranking* of configs is wrong (at most ``max_probes`` per GPU count);
6. log every decision with its numbers (``audit.py``).

Memory: a plan that ran is judged by its own measured underestimate (and a plan that ran at the
forecast cap and length is feasible, whatever the model says); a plan never run by the reserve
calibration learned; a plan that ran out of memory is out.

Candidates come from the plan solver for the forecast workload, cached by workload bucket
(log-spaced response-length buckets, GPU count, cap, quantized calibration, the memory reserve on a
grid of 4 memory quanta, 4 GiB on a large GPU): a step whose bucket is cached does not re-solve and costs a few milliseconds; a re-solve
is warm-started from the current plan. Besides the fastest plan, the solver is asked for the best
plan with the current plan's pools and TP/PP kept (cheap to reach: only DP-internal knobs change),
and the fastest plan comes with its other generation TPs (scored with the learned corrections,
which the solver's stage-level factors cannot express). Every candidate is scored by saving x
horizon - transition cost, so a slightly slower plan that is much cheaper to reach can win; the
transition planner is asked only about the few fastest candidates.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from nereus.errors import NereusError
from nereus.models.inventory import check_tp
from nereus.models.spec import ModelSpec
from nereus.planner.online.audit import AuditLog
from nereus.planner.online.calibration import OnlineCalibration
from nereus.planner.online.types import Decision, StepMetrics
from nereus.planner.cost.params import CostParams
from nereus.planner.online.forecast import LengthForecaster
from nereus.planner.plan import GiB, Plan, StagePlacement
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache, keep_layout
from nereus.planner.online.restart import TRANSITION_MODES, Emitter, RestartCost, restart_seconds
from nereus.planner.cost.plan_times import PlanTimes, compose_step, evaluate_times
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
    times: tuple[float, ...] = ()
    """Predicted step time at each forecast point of the horizon (inf where it does not fit)."""

    @property
    def net_s(self) -> float:
        return self.horizon_s + self.cost_s


def _trapezoid(times, offsets) -> float:
    """Seconds over the horizon from step times at the forecast points (trapezoid rule)."""
    total, prev_k, prev_t = times[0], offsets[0], times[0]
    for k, t in zip(offsets[1:], times[1:]):
        total += (k - prev_k) * (t + prev_t) / 2
        prev_k, prev_t = k, t
    return total


class Controller:
    """See the module docstring. ``rule`` restricts the layouts it may choose (baselines);
    ``mode="always"`` switches to the best plan every step, ignoring transition cost."""

    def __init__(self, job: JobSpec, cluster: ClusterSpec, params: CostParams | None = None, horizon: int = 200,
                 margin: float = 0.25, audit_path: str | None = None, *, initial_plan: Plan | None = None,
                 initial_gpus: int | None = None, initial_workload: Workload | None = None,
                 total_steps: int | None = None, patience: int = 2, min_dwell: int = 5, mode: str = "adaptive",
                 rule: LayoutRule = FREE, bucket_ratio: float = 1.04, solve_bucket_ratio: float = 1.25,
                 calib_resolution: float = 0.25, library_size: int = 16, min_gain: float = 0.01,
                 forecast_window: int = 60, time_limit_s: float = 5.0, seed: int = 0,
                 build_transition: bool = True, transition_cost_fn: Callable[[Plan, Plan], float] | None = None,
                 plans: PlanCache | None = None, audit: AuditLog | None = None, explore: bool = True,
                 max_probes: int = 1, probe_threshold: float = 0.10, probe_window: float = 0.10,
                 probe_kappa: float = 1.0, cost_queries: int = 3, transition_mode: str = "live",
                 framework: str | None = None, emitter: Emitter | None = None,
                 restart_cost: RestartCost | None = None) -> None:
        if mode not in MODES:
            raise NereusError(f"controller: mode must be one of {MODES}, got {mode!r}")
        self._init_restart_mode(transition_mode, framework, emitter, restart_cost)
        build_transition = build_transition and transition_mode == "live"  # restart mode relaunches, no graph
        self.job, self.cluster = job, cluster
        self.base_params = params or CostParams()
        self.horizon, self.margin, self.mode = int(horizon), float(margin), mode
        self.total_steps, self.patience, self.min_dwell = total_steps, int(patience), int(min_dwell)
        self.rule, self.bucket_ratio, self.calib_resolution = rule, bucket_ratio, calib_resolution
        self.solve_bucket_ratio, self.library_size = solve_bucket_ratio, library_size
        self.min_gain = min_gain
        """Savings below this fraction of the step time are treated as model noise (no switch)."""
        self.explore, self.max_probes, self.probe_threshold = explore and mode == "adaptive", max_probes, probe_threshold
        self.probe_window, self.probe_kappa = probe_window, probe_kappa
        self._probes_left = max_probes
        self._on_plan = 0
        self.cost_queries = cost_queries
        """Candidates (the fastest over the horizon) whose transition cost is asked each step."""
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
        self._cap = int(job.sequence.response_len_max)
        self._eval: dict[tuple, PlanTimes] = {}
        self._stage_memo: dict[tuple, object] = {}
        """Stage estimates shared by the library's plans (``evaluate_times``'s memo)."""
        self._cost: dict[tuple, float] = {}
        self._streak: tuple[tuple, int] = ((), 0)
        self._last_switch = -10**9
        self._last_cost_raw = 0.0
        self._reserve = 0.0
        self._plan_reserve: dict[tuple, float] = {}
        self._keys: dict[int, tuple] = {}
        self._ran_ok: dict[tuple, tuple[int, float]] = {}
        """Per plan run without OOM: (cap, largest mean response length) it ran at."""
        self._h = 1
        self._prev_plan: Plan | None = None
        """The plan before the last switch, until the next step's metrics say the switch was applied."""
        if initial_plan is None:
            w0 = initial_workload or self._base_w
            initial_plan = self.plans.best(rule, w0, self.gpus, self.base_params)
            if initial_plan is None:
                raise NereusError(f"controller: no feasible {rule.name} plan for the initial workload on {self.gpus} "
                                  f"GPUs ({self.plans.last_message})")
        self.plan = initial_plan
        self._library[initial_plan.key()] = (initial_plan, "initial")

    # ---- public API ------------------------------------------------------------------------------
    def step(self, m: StepMetrics) -> Decision:
        """Ingest step ``m.step``'s metrics; decide the plan of the next step."""
        t0 = time.perf_counter()
        self._prev_plan = None  # this step ran: the last switch, if any, was applied
        solves0 = self.plans.solves
        w_obs = self._observed_workload(m)
        self._calibrate(m, w_obs)
        cap = self._next_cap(m)
        self.forecaster.observe(m.step, m.response_len_mean, cap, m.response_len_p90)
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
        if regime_change:
            self._probes_left = self.max_probes
        must = self._must_reason(m, cur)
        cands = self._candidates(ws, offsets, bool(must))
        d = self._decide(m, cur, cands, must, regime_change)
        d = self._with_launch_config(d)
        d = replace(d, resolved=self.plans.solves > solves0, overhead_s=time.perf_counter() - t0)
        self._log(m, ws, cur, cands, d)
        return d

    def report_transition(self, measured_s: float) -> None:
        """The caller applied the last switch; its measured time calibrates future cost predictions
        (``OnlineCalibration.transition_model``: a factor on the planner's estimate + a fixed part)."""
        self.calibration.update_transition(measured_s, self._last_cost_raw)

    def report_rollback(self, reason: str, step: int | None = None) -> None:
        """The caller's transition to the last switch's plan rolled back (every rank kept the old
        layout): the controller returns to the plan the job still runs and audits it (decision
        ``rollback``). The dwell keeps counting from the failed switch, so a switch made for speed
        is not retried at once (a must-switch still is, next step); the streak and the steps on
        the plan start over; the failed transition's time does not calibrate transition costs
        (``report_transition`` is not called for it)."""
        prev = self._prev_plan
        if prev is None:
            raise NereusError("controller: report_rollback without a switch to roll back")
        failed, self.plan, self._prev_plan = self.plan, prev, None
        self._on_plan = 0
        self._streak = ((), 0)
        self.audit.record({"step": step, "decision": "rollback", "reason": reason, "plan": _layout(prev),
                           "failed_plan": _layout(failed)})

    def close(self) -> None:
        self.audit.close()

    # ---- calibration and forecast ----------------------------------------------------------------
    def _next_cap(self, m: StepMetrics) -> int:
        """The response cap of the next step. The observed longest response is an outcome (noisy,
        at most the cap), never read as a cap change: the cap is what the trainer says
        (``response_len_cap``), else the last cap it said, else the job's; an observed response
        longer than that (a job spec older than the trainer's setting) raises it to that length."""
        if m.response_len_cap:
            self._cap = int(m.response_len_cap)
        elif int(m.response_len_max) > self._cap:
            self._cap = int(m.response_len_max)
        return self._cap

    def _mem_quantum(self) -> float:
        """The step, in GiB, by which memory reserves are rounded up: 1 GiB, or 1/64 of a GPU's usable
        memory where that is less (a 1 GiB quantum on a device of a few GiB, or the demo's MiB
        budgets, would reserve most of it for any underestimate)."""
        return min(1.0, self.cluster.gpu.usable_bytes / GiB / 64)

    def _observed_workload(self, m: StepMetrics) -> Workload:
        b = self._base_w
        mx = max(int(m.response_len_max), int(math.ceil(m.response_len_mean)))
        p90 = None if m.response_len_p90 is None else min(float(m.response_len_p90), mx)
        return replace(b, prompt_len=int(m.prompt_len or b.prompt_len), response_len_mean=float(m.response_len_mean),
                       response_len_max=mx, response_len_p90=p90)

    def _stage_info(self, plan: Plan) -> tuple:
        """Each stage's name, key and features, memoised per plan object (plans are frozen; the
        controller asks often)."""
        hit = self._keys.get(id(plan))
        if hit is None or hit[0] is not plan:
            if len(self._keys) > 4096:
                self._keys.clear()
            hit = self._keys[id(plan)] = (plan, tuple((s.name, _stage_key(s), features(s)) for s in plan.stages))
        return hit[1]

    def _reserve_for(self, plan: Plan) -> float:
        """Memory held back when judging ``plan``: its own measured underestimate once it has run
        (a plan that ran out of memory keeps all of it), else the reserve calibration learned."""
        return self._plan_reserve.get(plan.key(), self._reserve)

    def _times(self, plan: Plan, w: Workload) -> PlanTimes:
        """The uncorrected model's times and memory of ``plan`` on ``w``, with the plan's memory
        reserve (cached per plan, workload and reserve)."""
        r = self._reserve_for(plan)
        key = (plan.key(), w.prompt_len, w.response_len_mean, w.response_len_max, w.response_len_p90, r)
        t = self._eval.get(key)
        if t is None:
            if len(self._eval) > 20000:
                self._eval.clear()
            cluster = self.plans.cluster_for(self.cluster.num_gpus, r)
            t = self._eval[key] = evaluate_times(self.job, cluster, plan, w, self.base_params, self._stage_memo)
        return t

    def _calibrate(self, m: StepMetrics, w: Workload) -> None:
        # the observed lengths on the forecast's bucket grid (within bucket_ratio / 2, below the
        # step-to-step sampling noise): noisy steps then share one model evaluation
        mean = self._bucket(w.response_len_mean)
        mx = max(int(self._bucket(w.response_len_max)), math.ceil(mean))
        w = replace(w, response_len_mean=mean, response_len_max=mx,
                    response_len_p90=None if w.response_len_p90 is None else min(self._bucket(w.response_len_p90), mx))
        pred = self._times(self.plan, w)
        peaks = {ms: v for ms, v in pred.peak_mem_gib.items() if not ms.endswith("/generation")}
        usable = self.cluster.gpu.usable_bytes / GiB
        key = self.plan.key()
        q = self._mem_quantum()
        if m.oom:
            stage = m.oom_stage if m.oom_stage in pred.peak_mem_gib else None
            peak = pred.peak_mem_gib[stage] if stage else max(pred.peak_mem_gib.values())
            self.calibration.update_memory(None, peak, oom=True, memory_gib=usable, step_gib=q)
            self._plan_reserve[key] = usable  # this plan is out
        elif m.peak_mem_gib is not None and peaks:
            self.calibration.update_memory(float(m.peak_mem_gib), max(peaks.values()), memory_gib=usable, step_gib=q)
            under = q * math.ceil(max(0.0, float(m.peak_mem_gib) - max(peaks.values())) / q)
            self._plan_reserve[key] = max(self._plan_reserve.get(key, 0.0), float(under))
        if not m.oom and m.stage_times:  # evidence: this plan ran at this cap and mean length
            cap_mean = self._ran_ok.get(key)
            if cap_mean is None or cap_mean[0] != self._cap:
                cap_mean = (self._cap, 0.0)
            self._ran_ok[key] = (self._cap, max(cap_mean[1], float(m.response_len_mean)))
        self._reserve = self.calibration.reserve_gib
        if not m.stage_times or m.oom:
            return
        self._on_plan += 1
        for ms, obs in m.stage_times.items():
            if ms in pred.stage_s:
                s = self.plan.stage(ms)
                self.calibration.update(ms, float(obs), pred.stage_s[ms], _stage_key(s), features(s))

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
        t = self._times(plan, w)
        if not t.feasible and not (self._proven(plan, w) and all(map(math.isfinite, t.stage_s.values()))):
            return math.inf, False
        return compose_step(self.job, plan, self._corrected(plan, t.stage_s), t.weight_sync_s), True

    def _proven(self, plan: Plan, w: Workload, slack: float = 0.05) -> bool:
        """Measurement beats the memory model: ``plan`` already ran without OOM at ``w``'s cap and a
        mean length within ``slack`` of ``w``'s."""
        ev = self._ran_ok.get(plan.key())
        return ev is not None and ev[0] == w.response_len_max and w.response_len_mean <= ev[1] * (1 + slack)

    def _corrected(self, plan: Plan, stage_s, kappa: float = 0.0) -> dict[str, float]:
        """Stage times x the learned factors (``kappa`` > 0: optimistic by kappa sd where the
        config was never run)."""
        cal, out = self.calibration, {}
        for name, key, feats in self._stage_info(plan):
            f = cal.factor(name, key, feats)
            if kappa:
                f *= math.exp(-kappa * cal.sd(name, key, feats))
            out[name] = stage_s[name] * f
        return out

    def _score(self, c: _Candidate, ws: list[Workload], offsets: tuple[int, ...]) -> None:
        """Predicted seconds over the horizon (trapezoid over the forecast points)."""
        if c.plan.num_gpus > self.gpus:
            c.horizon_s, c.feasible_next = math.inf, False
            return
        times = [self.predict(c.plan, w)[0] for w in ws]
        c.feasible_next = math.isfinite(times[0])
        c.times = tuple(times)
        c.horizon_s = _trapezoid(times, offsets)

    def transition_cost(self, a: Plan, b: Plan) -> float:
        """Predicted seconds of a -> b (transition planner's estimate x learned correction; in restart
        mode the checkpoint-and-relaunch estimate x the same correction, see ``restart_cost_s``)."""
        if self.transition_mode == "restart":
            return self.restart_cost_s(a, b)
        if a.layout_key() == b.layout_key():
            return 0.0
        key = (a.layout_key(), b.layout_key())
        c = self._cost.get(key)
        if c is None:
            c = self._cost[key] = float(self._transition_cost_fn(a, b) if self._transition_cost_fn is not None
                                        else self.plans.transition_cost(a, b))
        return self.calibration.predict_transition(c)

    # ---- restart mode (transition_mode="restart") ---------------------------------------------------
    def _init_restart_mode(self, transition_mode: str, framework: str | None, emitter: Emitter | None,
                           restart_cost: RestartCost | None) -> None:
        """``transition_mode``: "live" (the executor reshards in place, priced by the transition
        planner) or "restart" (the framework saves a checkpoint and relaunches with the new launch
        configuration, priced by ``restart.restart_seconds``; every change of launch configuration,
        knobs included, is a relaunch). ``framework`` (e.g. "verl") with ``emitter`` (the frameworks
        package's ``launch_config``): a restart-mode switch carries the new plan as that framework's
        launch configuration (``Decision.framework_config``); no framework: none."""
        if transition_mode not in TRANSITION_MODES:
            raise NereusError(f"controller: transition_mode must be one of {TRANSITION_MODES}, got {transition_mode!r}")
        if framework is not None and emitter is None:
            raise NereusError(f"controller: framework={framework!r} needs emitter= (the frameworks package's "
                              f"launch_config; the planner does not import the emitters)")
        self.transition_mode, self.framework, self._emitter = transition_mode, framework, emitter
        self.restart_cost = restart_cost or RestartCost()

    def restart_cost_s(self, a: Plan, b: Plan) -> float:
        """Predicted seconds of switching a -> b by checkpoint and relaunch (0 when the launch
        configuration does not change), x the transition calibration learned from reported restarts."""
        if a.key() == b.key():
            return 0.0
        key = (a.layout_key(), b.layout_key())  # the raw estimate, which report_transition calibrates
        c = self._cost.get(key)
        if c is None:
            c = self._cost[key] = restart_seconds(self.job, self.cluster, a, b, self.restart_cost)
        return self.calibration.predict_transition(c)

    def _with_launch_config(self, d: Decision) -> Decision:
        """A restart-mode switch carries the new plan as the framework's launch configuration."""
        if d.action != "switch" or self.transition_mode != "restart" or self.framework is None:
            return d
        from nereus.planner.solver import PlanProblem

        problem = PlanProblem(job=self.job, cluster=self.plans.cluster_for(d.plan.num_gpus), workload=self._ws0,
                              params=self.calibration.params(self.base_params))
        return replace(d, framework_config=dict(self._emitter(self.framework, problem, d.plan)))

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
        ratio = round(4 * w.p90 / w.response_len_mean) / 4  # coarse tail shape, so the cache key is stable
        return replace(w, response_len_mean=mean, response_len_p90=round(min(float(w.response_len_max), ratio * mean), 1))

    def _ask(self, origin: str, rule: LayoutRule, w: Workload) -> None:
        if rule.anchor is not None or rule.placement == "colocated":
            # pools fixed: the solver only picks knobs inside each stage, which per-stage factors do
            # not reorder; asking with the base parameters lets calibration move without re-solves
            params, ckey = self.base_params, ()
        else:
            params, ckey = self.calibration.solver_params(self.base_params, self.calib_resolution)
        try:
            # the solver plans with the memory reserve on a grid of 4 quanta (rounded up): a reserve that
            # creeps up by a GiB does not re-solve everything
            grid = 4.0 * self._mem_quantum()
            reserve = grid * math.ceil(self._reserve / grid)
            p = self.plans.best(rule, self._solver_workload(w), self.gpus, params, ckey, hint=self.plan,
                                reserve_gib=reserve)
        except NereusError:
            p = None
        if p is not None:
            self._add(p, origin)
            if rule.name == "free" and self.explore and origin in ("best-horizon", "best-next"):
                # the same plan with the other generation TPs: the solver ranks them with stage-level
                # factors only, the controller with the per-config and shape corrections it learned
                for q in gen_tp_variants(p, self.job.model("actor"), self.cluster.gpus_per_node):
                    if q.key() not in self._library:
                        self._add(q, "gen-tp")

    def _add(self, p: Plan, origin: str) -> None:
        self._library.pop(p.key(), None)
        self._library[p.key()] = (p, origin)
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
        cur = self.plan.key()
        cur_s = self._cur_horizon_s
        out = []
        for key, (p, origin) in self._library.items():
            # plans for fewer GPUs than granted stay in the library but are only scored when forced
            if key == cur or p.num_gpus > self.gpus or (p.num_gpus < self.gpus and not must):
                continue
            c = _Candidate(p, origin, cost_s=math.inf)
            self._score(c, ws, offsets)
            out.append(c)
        # the transition planner is only asked about the few fastest candidates that could pay for
        # themselves (a bound per layout pair is tenths of a second at 1,024 GPUs)
        could = sorted((c for c in out if c.feasible_next and (must or self.mode == "always" or c.horizon_s < cur_s)),
                       key=lambda c: c.horizon_s)
        for c in could[:self.cost_queries]:
            c.cost_s = self.transition_cost(self.plan, c.plan)
        if must and not any(c.feasible_next for c in out):
            self._ask("best-next", self.rule, ws[0])
            if self.rule.anchor is not None:
                # the pools a baseline keeps no longer fit: a user relaunches with new ones (same TP/PP rule)
                self._ask("re-pool", replace(self.rule, anchor=None), ws[0])
            return self._candidates(ws, offsets, False) if self._library else out
        return out

    def _decide(self, m: StepMetrics, cur: _Candidate, cands: list[_Candidate], must: str,
                regime_change: bool) -> Decision:
        d = self._admit(m, cur, cands, must, regime_change)
        # no probe while a switch is pending behind hysteresis, or within min_dwell of the last switch
        if (d.action == "stay" and not must and self.explore and not d.reason.startswith("worth it")
                and m.step - self._last_switch >= self.min_dwell):
            probe = self._probe(m, cur, cands)
            if probe is not None:
                c, why = probe
                d = self._switch(m, cur, c, "", why)
                self._probes_left -= 1
                self._last_switch = m.step - self.min_dwell  # free to go back as soon as the probe is measured
        return d

    def _probe(self, m: StepMetrics, cur: _Candidate, cands: list[_Candidate]) -> tuple[_Candidate, str] | None:
        """Exploration: run a plan once to measure a config the model cannot be trusted on.

        Only when probes are left in this GPU regime, the current plan ran at least 2 steps, and the
        model is visibly wrong (|log(observed/predicted)| >= probe_threshold) on the current config
        of a model-stage the candidate changes to a config never run. The candidate must look
        plausible (mean prediction within probe_window of the current horizon time) and its
        optimistic time (factors at mean - probe_kappa sd of the shape model) must save more than a
        round trip of transitions x (1 + margin) and min_gain."""
        if self._probes_left <= 0 or self._on_plan < 2 or not math.isfinite(cur.horizon_s):
            return None
        cal, best, best_gain = self.calibration, None, 0.0
        for c in cands:
            if not c.feasible_next or c.horizon_s > (1 + self.probe_window) * cur.horizon_s:
                continue
            changed = [s for s in c.plan.stages if _stage_key(s) != _stage_key(self.plan.stage(s.name))]
            if not any(not cal.seen(s.name, _stage_key(s))
                       and cal.residual(s.name, _stage_key(self.plan.stage(s.name))) >= self.probe_threshold
                       for s in changed):
                continue
            t = self._times(c.plan, self._ws0)
            mean_s = self.predict(c.plan, self._ws0)[0]
            if not math.isfinite(mean_s):
                continue
            opt_s = compose_step(self.job, c.plan, self._corrected(c.plan, t.stage_s, self.probe_kappa), t.weight_sync_s)
            gain = cur.horizon_s - c.horizon_s * opt_s / mean_s
            cost = c.cost_s if math.isfinite(c.cost_s) else self.transition_cost(self.plan, c.plan)
            if gain > max(self.min_gain * cur.horizon_s, 2 * cost * (1 + self.margin)) and gain > best_gain:
                c.cost_s = cost
                best, best_gain = c, gain
        if best is None:
            return None
        return best, (f"probe: the model is off by >= {self.probe_threshold:.0%} on the current config; measured, "
                      f"this plan could save up to {best_gain:.1f}s over the horizon (optimistic), "
                      f"> 2 x {best.cost_s:.1f}s x (1 + {self.margin:g})")

    def _admit(self, m: StepMetrics, cur: _Candidate, cands: list[_Candidate], must: str,
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
        if not math.isfinite(best.net_s):  # every alternative fails later in the horizon, or its cost is unknown
            self._streak = ((), 0)
            return self._stay(cur, best, "", "no alternative is feasible over the whole horizon at a known cost")
        if not math.isfinite(cur.horizon_s):
            return self._admit_before_failure(m, cur, best, regime_change)
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
        held = self._hysteresis(m, cur, best, regime_change)
        if held is not None:
            return held
        return self._switch(m, cur, best, "", f"saving {saving:.1f}s over the horizon > {best.cost_s:.1f}s "
                                              f"x (1 + {self.margin:g})")

    def _hysteresis(self, m: StepMetrics, cur: _Candidate, best: _Candidate, regime_change: bool) -> Decision | None:
        """A worthwhile switch that costs time waits for ``min_dwell`` steps after the last one and
        for the same winner ``patience`` steps in a row (not after a change of GPU count)."""
        if best.cost_s <= 0 or regime_change:
            return None
        key = best.plan.layout_key()
        n = self._streak[1] + 1 if self._streak[0] == key else 1
        self._streak = (key, n)
        if m.step - self._last_switch < self.min_dwell:
            return self._stay(cur, best, "", f"worth it, but within {self.min_dwell} steps of the last switch")
        if n < self.patience:
            return self._stay(cur, best, "", f"worth it {n}/{self.patience} steps in a row (hysteresis)")
        return None

    def _admit_before_failure(self, m: StepMetrics, cur: _Candidate, best: _Candidate, regime_change: bool) -> Decision:
        """The current plan runs next step but is predicted to run out of memory later in the
        horizon, while ``best`` fits all of it. Both are compared over the steps the current plan
        still runs: ``best`` is taken now (with the usual hysteresis) when what it saves there, plus
        the model's error margin (``min_gain`` of that time), exceeds its transition x (1 + margin):
        a costly move waits for the failure, where the must-switch makes it (a forecast failure that
        never comes then costs nothing). A free move (new knobs, same layout) to a plan that fits
        the whole horizon is made at once, whatever it costs per step: the failure forecast is the
        memory model's, the truth tends to fail sooner, and after a crash the raised memory reserve
        may leave no plan predicted to fit. Without this, the infinite horizon time made every saving look like model noise, and
        a plan predicted to fail later was never left for a faster one (in restart mode for 450
        steps after the cluster grew, 12% slower than static)."""
        offsets = self._offsets(m.step)
        k = next((i for i, t in enumerate(cur.times) if not math.isfinite(t)), len(cur.times)) - 1
        cur_pre, best_pre = _trapezoid(cur.times[:k + 1], offsets[:k + 1]), _trapezoid(best.times[:k + 1], offsets[:k + 1])
        fails = offsets[k + 1] if k + 1 < len(offsets) else offsets[-1]
        saving = cur_pre - best_pre
        slack = self.min_gain * cur_pre
        if best.cost_s == 0:
            return self._switch(m, cur, best, "", f"current plan predicted out of memory within {fails} steps; this plan "
                                                  f"fits the whole horizon and costs no transition")
        if saving + slack <= best.cost_s * (1 + self.margin):
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"current plan predicted out of memory within {fails} steps; it stays until "
                                             f"then (before that the best alternative saves {saving:.1f}s, which with "
                                             f"{slack:.1f}s of model error does not repay {best.cost_s:.1f}s x "
                                             f"(1 + {self.margin:g}))")
        held = self._hysteresis(m, cur, best, regime_change)
        if held is not None:
            return held
        return self._switch(m, cur, best, "", f"current plan predicted out of memory within {fails} steps; this plan "
                                              f"fits the whole horizon and saves {saving:.1f}s before then (+ "
                                              f"{slack:.1f}s of model error) > {best.cost_s:.1f}s x (1 + {self.margin:g})")

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
        self._last_cost_raw = self._cost.get((self.plan.layout_key(), best.plan.layout_key()), 0.0)
        if best.plan.layout_key() != self.plan.layout_key():
            self._on_plan = 0
        if best.origin == "re-pool":
            self.rule = replace(self.rule, anchor=best.plan)
        self._streak = ((), 0)
        self._prev_plan = self.plan  # report_rollback returns to it
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
    return (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.recompute, getattr(c, "sp", 1), getattr(c, "token_budget", 0),
            s.gpus)


def features(s: StagePlacement) -> tuple[float, ...]:
    """Shape features of a model-stage's config for the calibration's shape model: log2 of tp,
    pp, dp and the micro-batch (tokens / 4,096 under a token budget), recomputation, ZeRO-3."""
    c = s.config
    budget = getattr(c, "token_budget", 0)
    mb = budget / 4096 if budget else c.micro_batch
    return (math.log2(c.tp), math.log2(c.pp), math.log2(c.dp), math.log2(max(mb, 1e-3)), float(c.recompute),
            float(c.zero >= 3))


def gen_tp_variants(plan: Plan, model: ModelSpec, gpus_per_node: int, tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[Plan]:
    """``plan`` with each other generation TP that splits ``model`` and divides its pool (DP adjusted)."""
    gen = plan.stage("actor/generation")
    c, out = gen.config, []
    for tp in tps:
        try:
            check_tp(model, tp)
        except NereusError:
            continue
        if tp != c.tp and tp <= gpus_per_node and gen.gpus % (tp * c.pp) == 0:
            g = replace(gen, config=replace(c, tp=tp, dp=gen.gpus // (tp * c.pp)))
            out.append(replace(plan, stages=tuple(g if s.name == gen.name else s for s in plan.stages)))
    return out


def _layout(p: Plan) -> str:
    return " ".join(f"{s.name}:{s.config.label()}@{s.first_gpu}+{s.gpus}" for s in p.stages)


def _break_even(cur: _Candidate, c: _Candidate | None, ctl: Controller) -> float:
    """Steps until the transition is repaid at the predicted per-step saving (inf if never)."""
    per = ctl._per_step(cur, c)
    if c is None or per <= 0:
        return math.inf
    return c.cost_s / per if math.isfinite(per) else 0.0
