"""A controlled world for the controller's unit tests: the planner's own cost model with other
coefficients and seeded noise. It is NOT the simulator's ground truth (that is ``truth/``, which
shares no code with the cost model); it exists because a controller test needs a world whose bias is
known and whose memory model is the planner's, so that a test of admission, hysteresis or
calibration mechanics is not confounded by out-of-memory surprises. The simulator never uses it.

The world composes the
analytic per-model-stage estimates (nereus.planner.cost.model) with *other* efficiencies per stage
(``TRUE_PARAMS``: slower training matmuls, lower HBM efficiency, slower links, more decode overhead,
a heavier inference stage) and seeded multiplicative log-normal noise per step and model-stage, so
online calibration has a real bias to learn. Transitions cost the makespan the transition planner
schedules (its bandwidth bound above ``schedules.SCHEDULE_MAX_GPUS`` GPUs, the limit the simulator's
schedules use; see ``ModelWorld``), times ``transition_slowdown``
(the real network is slower than the planner assumes), and block the job while they run.

Observations are the ground truth's ``Observation`` (the lengths are the workload's: no sampling
here) and layout changes are priced once per pair by the truth's ``LayoutChangePrices``.

Step composition and memory accounting: nereus.planner.cost.plan_times (shared with the controller, which
evaluates the same way with the planner's CostParams times its learned correction factors).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from nereus.planner.cost.params import CostParams
from nereus.planner.plan import Plan
from nereus.planner.cost.plan_times import PlanTimes, as_batch, compose_step, evaluate_times, workload_key
from nereus.planner.specs import ClusterSpec, JobSpec, Workload
from nereus.simulator.schedules import SCHEDULE_MAX_GPUS
from nereus.simulator.truth.machine import LayoutChangePrices, Observation

GENERATION = "actor/generation"

TRUE_PARAMS = CostParams(
    mfu_train=0.37, mfu_prefill=0.50, mfu_decode=0.40, hbm_eff=0.72, intra_link_eff=0.70,
    inter_link_eff=0.60, allreduce_latency_s=4.5e-6, p2p_latency_s=10e-6, decode_step_overhead_s=2.2e-3,
    stage_factor=(("generation", 1.0), ("inference", 1.12), ("training", 1.0)),
)
"""The "real" machine: every efficiency differs from CostParams() defaults, by stage."""


class ModelWorld:
    """Noiseless evaluations are cached per (plan, workload); noise is a deterministic function of
    (seed, step, model-stage)."""

    def __init__(self, job: JobSpec, cluster: ClusterSpec, params: CostParams = TRUE_PARAMS, noise: float = 0.03,
                 seed: int = 0, transition_slowdown: float = 1.25, transition: str = "auto",
                 transition_fn: Callable[[Plan, Plan], float] | None = None) -> None:
        """``transition``: "makespan" schedules every transition with the transition planner
        (greedy schedule; exact, but about 30 s per large 1,024-GPU layout change); "bound" uses its
        bandwidth bound ``transition_cost`` (0.93-1.13x the greedy schedule's makespan on the
        transition benchmark's plan pairs); "auto" (default): makespan when both plans use at
        most ``SCHEDULE_MAX_GPUS`` GPUs, else the bound. All are multiplied by ``transition_slowdown``."""
        if transition not in ("auto", "bound", "makespan"):
            raise ValueError(f"transition must be 'auto', 'bound' or 'makespan', got {transition!r}")
        self.transition = transition
        self.job, self.cluster, self.params = job, cluster, params
        self.noise, self.seed, self.transition_slowdown = noise, seed, transition_slowdown
        self._transition_fn = transition_fn
        self._times: dict[tuple, PlanTimes] = {}
        self._noise: dict[int, np.ndarray] = {}
        self.prices = LayoutChangePrices(lambda a, b: self.transition_slowdown * self._planned_makespan(a, b))
        self._stages = job.model_stages()

    def times(self, plan: Plan, w: Workload) -> PlanTimes:
        key = (plan.key(), workload_key(w))
        hit = self._times.get(key)
        if hit is None:
            hit = self._times[key] = evaluate_times(self.job, self.cluster, plan, w, self.params)
        return hit

    def noise_factors(self, step: int) -> np.ndarray:
        f = self._noise.get(step)
        if f is None:
            rng = np.random.default_rng([self.seed, step])
            f = self._noise[step] = np.exp(rng.normal(0.0, self.noise, len(self._stages)))
        return f

    def observe(self, plan: Plan, w: Workload, step: int) -> Observation:
        """The step as the job experiences it: noisy stage times, composed step time, peak memory."""
        t = self.times(plan, w)
        f = self.noise_factors(step)
        stage_s = {ms: t.stage_s[ms] * float(f[i]) for i, ms in enumerate(self._stages)}
        step_s = compose_step(self.job, plan, stage_s, t.weight_sync_s) if t.feasible else math.inf
        batch = as_batch(self.job, plan)
        if batch is not plan and GENERATION in stage_s:  # a streaming rollout logs its batch's latency
            stage_s[GENERATION] = self.times(batch, w).stage_s[GENERATION] * float(f[self._stages.index(GENERATION)])
        return Observation(stage_s, step_s, t.feasible, max(t.peak_mem_gib.values()), w.response_len_mean,
                           w.response_len_max, w.p90, t.violations)

    def step_s(self, plan: Plan, w: Workload, step: int) -> float:
        return self.observe(plan, w, step).step_s

    def transition_s(self, a: Plan, b: Plan) -> float:
        """Blocking time of the transition a -> b: the transition planner's makespan, slowed down."""
        return self.prices(a, b)

    def _planned_makespan(self, a: Plan, b: Plan) -> float:
        if self._transition_fn is not None:
            return self._transition_fn(a, b)
        from nereus.planner.transition.build import plan_transition, transition_cost

        big = max(a.num_gpus, b.num_gpus) > SCHEDULE_MAX_GPUS
        if self.transition == "bound" or (self.transition == "auto" and big):
            return float(transition_cost(a, b, self.cluster, self.job))
        return float(plan_transition(self.job, self.cluster, a, b, scheduler="greedy", materialize=False).makespan_s)

