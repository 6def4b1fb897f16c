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
   margin, and still does at ``confidence`` standard errors of what measurement noise leaves uncertain
   of the two plans' difference (``admission._noise_band``), the same candidate has won ``patience``
   steps in a row (free switches too), and at least ``min_dwell`` steps passed since the last costly
   switch (hysteresis against flapping on noise). Every plan's seconds include its expected
   crash-restarts (its measured OOM rate x (step + relaunch));
5. probe (``explore``, adaptive mode): when the model is visibly wrong on the current config of a
   model-stage and a plausible candidate changes that stage to a config never run, run it if its
   expected gain under the shape model's doubt, less its first-run crash risk, would repay a round
   trip, and come back when it is measured slower: the only way to learn that the model's
   *ranking* of configs is wrong (at most ``max_probes`` per GPU count, 2: the second measures a
   config the noise band of rule 4 doubts, which waiting would never resolve);
6. log every decision with its numbers (``audit.py``).

Memory (``reserve.py``): a plan that ran, and never ran out of memory, is judged by its own measured
underestimate (and a plan that ran at the forecast cap and length is feasible, whatever the model
says); any other plan by reserves learned in common and per model-stage, which an OOM raises and
which decay as plans run within them, so a plan an OOM condemned can come back. When nothing is
predicted to fit, the controller falls back to the most frugal plan at hand (``library.py``).

Candidates come from the plan solver for the forecast workload, cached by workload bucket
(log-spaced response-length buckets, GPU count, cap, quantized calibration, the memory reserve on a
grid of 4 memory quanta, 4 GiB on a large GPU): a step whose bucket is cached does not re-solve and costs a few milliseconds; a re-solve
is warm-started from the current plan. Besides the fastest plan, the solver is asked for the best
plan with the current plan's pools and TP/PP kept (cheap to reach: only DP-internal knobs change);
when more GPUs are granted than the current plan uses, the current plan itself rescaled (DP scaled,
judged by its own measurement: ``CandidateLibrary._add_rescaled``), which the solver, planning with
the shared memory reserves, may not offer;
and the fastest plan comes with its other generation TPs (scored with the learned corrections,
which the solver's stage-level factors cannot express). Every candidate is scored by saving x
horizon - transition cost, so a slightly slower plan that is much cheaper to reach can win; the
transition planner is asked only about the few fastest candidates.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace
from typing import Callable

from nereus.errors import NereusError
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import (PlanTimes, as_batch, compose_step, evaluate_times, overlap_kind,
                                           workload_key)
from nereus.planner.online.admission import AdmissionRules
from nereus.planner.online.audit import AuditLog
from nereus.planner.online.calibration import OnlineCalibration
from nereus.planner.online.forecast import LengthForecaster
from nereus.planner.online.library import (
    Candidate,
    CandidateLibrary,
    engine_changes,
    features,
    gen_tp_variants,
    layout,
    stage_key,
    trapezoid,
)
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache
from nereus.planner.online.reserve import GENERATION, MemoryReserve, MemoryReserves
from nereus.planner.online.restart import Emitter, RestartCost, RestartMode, restart_seconds
from nereus.planner.online.types import Decision, StepMetrics
from nereus.planner.plan import GiB, Plan
from nereus.planner.specs import ClusterSpec, JobSpec, Workload

MODES = ("adaptive", "always")
__all__ = ["Controller", "Decision", "StepMetrics", "MODES", "gen_tp_variants"]


class Controller(CandidateLibrary, AdmissionRules, MemoryReserve, RestartMode):
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
                 max_probes: int = 2, probe_threshold: float = 0.10, probe_window: float = 0.10,
                 probe_kappa: float = 1.0, cost_queries: int = 3, transition_mode: str = "live",
                 framework: str | None = None, emitter: Emitter | None = None,
                 restart_cost: RestartCost | None = None, confidence: float = 3.0,
                 engine_restart_s: float | None = None) -> None:
        if mode not in MODES:
            raise NereusError(f"controller: mode must be one of {MODES}, got {mode!r}")
        self._init_restart_mode(transition_mode, framework, emitter, restart_cost)
        build_transition = build_transition and transition_mode == "live"  # restart mode relaunches, no graph
        self.job, self.cluster = job, cluster
        self.engine_restart_s = float(self.restart_cost.engine_start_s if engine_restart_s is None else engine_restart_s)
        """Seconds a live switch adds when it changes the inference engine's layout (its pool, TP, PP
        or DP): a new engine starts (weights loaded, allocator, CUDA graphs), on top of the transition
        planner's bound (which prices moving state only). Default: the restart
        cost's published ``engine_start_s``; 0 where generation runs in the training processes and
        the transition itself rebuilds it (the demo)."""
        if not (self.engine_restart_s >= 0 and math.isfinite(self.engine_restart_s)):
            raise NereusError(f"controller: engine_restart_s must be >= 0 seconds, got {engine_restart_s}")
        self.base_params = params or CostParams()
        self.horizon, self.margin, self.mode = int(horizon), float(margin), mode
        self.total_steps, self.patience, self.min_dwell = total_steps, int(patience), int(min_dwell)
        self.rule, self.bucket_ratio, self.calib_resolution = rule, bucket_ratio, calib_resolution
        self.solve_bucket_ratio, self.library_size = solve_bucket_ratio, library_size
        self.min_gain = min_gain
        """Savings below this fraction of the step time are treated as model noise (no switch)."""
        self.confidence = float(confidence)
        """Standard errors at which a saving must still exceed the transition x (1 + margin): what
        measurement noise leaves uncertain of the two plans' difference (``_noise_band``; 0: off). 3: one-sided
        0.1% per comparison, as the controller compares a few candidates every step (a 2-sigma rule,
        checked every step of a flat noisy trace, still switched on noise)."""
        self.explore, self.max_probes, self.probe_threshold = explore and mode == "adaptive", max_probes, probe_threshold
        self.probe_window, self.probe_kappa = probe_window, probe_kappa
        self._probes_left = max_probes
        self._on_plan = 0
        self.cost_queries = cost_queries
        """Candidates (the fastest over the horizon) whose transition cost is asked each step."""
        self._library: dict[tuple, tuple[Plan, str]] = {}
        self._pinned: set[tuple] = set()
        """Library plans never evicted: the fastest per generation TP (the current plan never is either)."""
        self._note = ""
        """What the library held at the last scoring (for stay reasons)."""
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
        self._corr: deque[float] = deque(maxlen=10)
        """The last within-prompt length correlations measured (``_learn_corr``)."""
        self._cap = int(job.sequence.response_len_max)
        self._eval: dict[tuple, PlanTimes] = {}
        self._stage_memo: dict[tuple, object] = {}
        """Stage estimates shared by the library's plans (``evaluate_times``'s memo)."""
        self._cost: dict[tuple, float] = {}
        self._engine_s: dict[tuple, float] = {}
        """Per layout pair, the engine start a switch adds (``engine_restart_s`` or 0), not corrected."""
        self._last_engine_s = 0.0
        self._streak: tuple[tuple, int] = ((), 0)
        self._last_switch = -10**9
        self._last_cost_raw = 0.0
        self.memory = MemoryReserves(cluster.gpu.usable_bytes / GiB, self._mem_quantum())
        """Memory reserves per plan, per model-stage and in common, decaying (``reserve.py``)."""
        self._keys: dict[int, tuple] = {}
        self._ran_ok: dict[tuple, tuple[int, float]] = {}
        """Per plan run without OOM: (cap, largest mean response length) it ran at."""
        self._ran_at: dict[int, Plan] = {}
        """Per GPU count, the last plan that ran a step there without OOM (back in the library when
        the job is granted that many GPUs again: ``CandidateLibrary._add_ran_here``)."""
        self._on_key = 0
        """Clean steps on the current plan (its key: layout and knobs) since it started or the job
        last relaunched after an OOM (the probe's way back and the step composition count these)."""
        self._pair = (0.0, 0.0, 0)
        """The current plan's steps not yet in its step-composition factor: (observed s, composed s, steps)."""
        self._first_runs = [0, 0]
        """Plans whose first step this controller saw, and how many of those ran out of memory."""
        self._h = 1
        self._ws0, self._ws, self._offsets_now = self._base_w, [], ()
        """The forecast workloads of the last step and their offsets (the noise band reads them)."""
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
        self._learn_corr(m)
        w_obs = self._observed_workload(m)
        self._calibrate(m, w_obs)
        cap = self._next_cap(m)
        self.forecaster.observe(m.step, m.response_len_mean, cap, m.response_len_p90)
        self.gpus = int(m.gpus_available or self.gpus)
        offsets = self._offsets(m.step)
        self._h = offsets[-1]
        ws = [self._forecast_workload(k, cap, w_obs.prompt_len) for k in offsets]
        self._ws0, self._ws, self._offsets_now = ws[0], ws, offsets
        cur = Candidate(self.plan, "current")
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
        (``OnlineCalibration.transition_model``: a factor on the planner's estimate + a fixed part),
        less the engine start it was priced with (a measured time at or below it teaches nothing)."""
        self.calibration.update_transition(measured_s - self._last_engine_s, self._last_cost_raw)

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
        if prev.key() not in self._library:  # the library always holds the current plan
            self._add(prev, "rollback")
        self._on_plan = self._on_key = 0
        self._probe_from = None  # the probe, if that switch was one, did not run
        self._streak = ((), 0)
        self.audit.record({"step": step, "decision": "rollback", "reason": reason, "plan": layout(prev),
                           "failed_plan": layout(failed)})

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

    def _learn_corr(self, m: StepMetrics) -> None:
        """The within-prompt length correlation every workload is planned with: the mean of the last
        10 measured (``StepMetrics.response_len_prompt_corr``; the job's own value until one is), on
        a 0.05 grid (about one step's estimate noise at a few hundred prompts), moved only when the
        mean leaves the current value by more than a grid step (a mean near a grid boundary would
        otherwise flip it, and every flip is a new workload to solve for)."""
        c = m.response_len_prompt_corr
        if c is None or not math.isfinite(c):
            return
        self._corr.append(min(1.0, max(0.0, float(c))))
        mean = sum(self._corr) / len(self._corr)
        if abs(mean - self._base_w.response_len_prompt_corr) > 0.05:
            self._base_w = replace(self._base_w, response_len_prompt_corr=round(20 * mean) / 20)

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
            hit = self._keys[id(plan)] = (plan, tuple((s.name, stage_key(s), features(s)) for s in plan.stages))
        return hit[1]

    def _times(self, plan: Plan, w: Workload, judged_as: Plan | None = None) -> PlanTimes:
        """The uncorrected model's times and memory of ``plan`` on ``w``, with the plan's memory
        reserve (``judged_as``'s where given; cached per plan, workload and reserve)."""
        r = self._reserve_for(judged_as or plan)
        key = (plan.key(), workload_key(w), r)
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
        key = self.plan.key()
        if self._never_run(self.plan) and self._fits(self.plan, pred):  # the first step of a plan judged to fit
            self._first_runs[0] += 1
            self._first_runs[1] += bool(m.oom)
        if m.oom:
            self._on_key = 0  # the job relaunches: its next step fills the pipeline again
            stage = m.oom_stage if m.oom_stage in pred.peak_mem_gib else None
            self.memory.oom(key, pred.peak_mem_gib, stage, judged_fit=self._fits(self.plan, pred),
                            configs=self._configs(self.plan))
            self._ran_ok.pop(key, None)  # the evidence that it runs at this workload is void
            if (p := self._ran_at.get(self.plan.num_gpus)) is not None and p.key() == key:
                del self._ran_at[self.plan.num_gpus]
        else:
            peaks = {ms: v for ms, v in pred.peak_mem_gib.items() if not ms.endswith("/generation")}
            self.memory.ran(key, peaks, None if m.peak_mem_gib is None else float(m.peak_mem_gib),
                            configs=self._configs(self.plan))
        if not m.oom and m.stage_times:  # evidence: this plan ran at this cap and mean length
            cap_mean = self._ran_ok.get(key)
            if cap_mean is None or cap_mean[0] != self._cap:
                cap_mean = (self._cap, 0.0)
            self._ran_ok[key] = (self._cap, max(cap_mean[1], float(m.response_len_mean)))
            self._ran_at[self.plan.num_gpus] = self.plan
        if not m.stage_times or m.oom:
            return
        self._on_plan += 1
        self._on_key += 1
        like = dict(pred.stage_s)
        batch = as_batch(self.job, self.plan)
        if batch is not self.plan:  # a streaming rollout's logged generation is its batch's latency
            like[GENERATION] = self._times(batch, w, judged_as=self.plan).stage_s[GENERATION]
        for ms, obs in m.stage_times.items():
            if ms in like:
                s = self.plan.stage(ms)
                self.calibration.update(ms, float(obs), like[ms], stage_key(s), features(s))
        kind = overlap_kind(self.job, self.plan)
        # how the stages overlap: the step against their composition, in steady state (a plan's first
        # step fills the pipeline: the trainer waits for a whole first batch, nothing overlaps), two
        # steps at a time (a batch with a long tail makes one step long and the next one short: the
        # sd of log step time, SIMULATED GRPO-8B fully-async on 128 H100s, r1zero_linear, is 0.19 per
        # step and 0.105 per pair of steps, where independent noise would give 0.136)
        if kind is not None and m.step_s and self._on_key >= 2:
            composed = compose_step(self.job, self.plan, self._corrected(self.plan, pred.stage_s), pred.weight_sync_s)
            o, c, n = self._pair if self._on_key > 2 else (0.0, 0.0, 0)
            o, c, n = o + float(m.step_s), c + composed, n + 1
            if n == 2:
                self.calibration.update(kind, o, c, self.plan.layout_key())
                o, c, n = 0.0, 0.0, 0
            self._pair = (o, c, n)

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
        if not self._fits(plan, t) and not (self._proven(plan, w) and all(map(math.isfinite, t.stage_s.values()))):
            return math.inf, False
        step = compose_step(self.job, plan, self._corrected(plan, t.stage_s), t.weight_sync_s)
        x = self._composition(plan, se=False)
        return (step if x is None else step * x[3]), True

    def _composition(self, plan: Plan, se: bool = True) -> tuple[str, object, float, float] | None:
        """(key, row, standard error of its log, factor) of ``plan``'s step composition on an
        overlapping schedule (``overlap_kind``): the plan's own steps where it ran, else the
        schedule's, pooled; None on a sequential one. ``se`` False: the error is not computed (0;
        ``predict``, on every candidate and forecast point, needs the factor only)."""
        kind = overlap_kind(self.job, plan)
        if kind is None:
            return None
        cal, row = self.calibration, plan.layout_key()
        if cal.seen(kind, row):
            return kind, row, cal.se(kind, row) if se else 0.0, cal.factor(kind, row)
        return kind, None, cal.pooled_se(kind) if se else 0.0, cal.factor(kind)

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

    def _score(self, c: Candidate, ws: list[Workload], offsets: tuple[int, ...]) -> None:
        """Predicted seconds over the horizon (trapezoid over the forecast points), with the plan's
        expected crash-restarts (``MemoryReserves.crash_rate`` x (step + ``restart_seconds``) per
        step): a plan that ran out of memory 3 times in 20 steps is not faster for its step time.
        A plan never run carries, once, the crash its first step risks (``first_run_oom_rate``)."""
        if c.plan.num_gpus > self.gpus:
            c.horizon_s, c.feasible_next = math.inf, False
            return
        times = [self.predict(c.plan, w)[0] for w in ws]
        c.feasible_next = math.isfinite(times[0])
        p = self.memory.crash_rate(c.plan.key())
        if p > 0:  # expected crash-restarts: per step p x (the step's work lost + a relaunch)
            crash = self.crash_restart_s(c.plan)
            times = [t + p * (t + crash) for t in times]
        c.times = tuple(times)
        c.horizon_s = trapezoid(times, offsets)
        if c.plan.key() != self.plan.key() and self._never_run(c.plan) and math.isfinite(times[0]):
            # never run: its first step may crash, as first steps here did
            c.first_run_s = self.first_run_oom_rate() * (times[0] + self.crash_restart_s(c.plan))
            c.horizon_s += c.first_run_s

    def _never_run(self, plan: Plan) -> bool:
        """Judged by the memory model alone: never ran, never ran out of memory, and no measurement
        of its own or inherited (a rescaled plan is judged by its parent's, ``MemoryReserves.inherit``)."""
        key, mem = plan.key(), self.memory
        return key not in mem.runs and key not in mem.struck and key not in mem.measured

    def first_run_oom_rate(self) -> float:
        """How often a plan runs out of memory on its first step, as this run measured it: OOMs /
        (first steps + 1), as ``MemoryReserves.crash_rate`` counts a plan's own: 0 until a first
        step crashed. The memory model and its reserves judge a plan never run; this says how often
        that judgement failed here (``benchmarks/simulate_flat_and_dip.py``'s dip trace, SIMULATED:
        the first plan of every policy runs out of memory on step 0)."""
        n, k = self._first_runs
        return k / (n + 1)

    def crash_restart_s(self, plan: Plan) -> float:
        """Seconds a crash of ``plan`` costs besides the lost step: a relaunch (``restart_seconds``)."""
        return restart_seconds(self.job, self.cluster, plan, plan, self.restart_cost)

    def transition_cost(self, a: Plan, b: Plan) -> float:
        """Predicted seconds of a -> b (transition planner's estimate, plus ``engine_restart_s`` where
        the inference engine's layout changes, x learned correction; ``transition_cost_fn``, where
        given, prices the whole switch; in restart mode the checkpoint-and-relaunch estimate x the
        same correction, see ``restart_cost_s``)."""
        if self.transition_mode == "restart":
            return self.restart_cost_s(a, b)
        if a.layout_key() == b.layout_key():
            return 0.0
        key = (a.layout_key(), b.layout_key())
        c = self._cost.get(key)
        if c is None:
            if self._transition_cost_fn is not None:  # the caller's price of the whole switch
                c = float(self._transition_cost_fn(a, b))
            else:  # the transition planner's bound on moving state, and a new engine where one starts
                c = float(self.plans.transition_cost(a, b))
                self._engine_s[key] = self.engine_restart_s if engine_changes(a, b) else 0.0
            self._cost[key] = c
        # the learned correction is for moving state; the engine start is a published time of its own
        return self.calibration.predict_transition(c) + self._engine_s.get(key, 0.0)

    def _log(self, m: StepMetrics, ws: list[Workload], cur: Candidate, cands: list[Candidate], d: Decision) -> None:
        self.audit.record({
            "step": m.step, "decision": d.action, "must": d.must, "reason": d.reason,
            "forecast": [{"response_len_mean": w.response_len_mean, "response_len_p90": w.response_len_p90,
                          "response_len_max": w.response_len_max} for w in ws[:1] + ws[-1:]],
            "gpus": self.gpus, "current_step_s": self.predict(cur.plan, ws[0])[0], "current_horizon_s": cur.horizon_s,
            "candidates": [{"origin": c.origin, "step_s": self.predict(c.plan, ws[0])[0], "horizon_s": c.horizon_s,
                            "transition_s": c.cost_s, "layout": layout(c.plan)} for c in cands],
            "transition_s": d.predicted_cost_s, "saving_per_step_s": d.saving_per_step_s,
            "break_even_steps": d.break_even_steps, "plan": layout(d.plan), "resolved": d.resolved,
            "overhead_ms": d.overhead_s * 1e3, "calibration": self.calibration.to_dict(), "memory": self.memory.to_dict(),
        })
