"""Where the controller's candidate plans come from: the plan solver (brief A), behind a cache.

A ``LayoutRule`` says which layouts a policy may use: anything (adaptive), the initial TP/PP with
its pools scaled to the GPU count (static: DP follows the GPUs), colocated with fixed TP (verl-like),
disaggregated fixed pools with fixed TP (OpenRLHF-like). Inside a rule the solver still picks the
non-layout knobs (micro-batch, recompute, ZeRO stage, KV budget / waves), as a real job would.

``PlanCache.best`` solves once per key (rule, GPU count, workload bucket, calibration bucket and the
parameters it gives, memory reserve, and the anchor plan for "keep the current layout" queries; a pure
function of its key, so policies that share one cache decide as they would alone) and remembers
infeasibility too, so the steady state of a run costs dictionary look-ups, not solves.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from nereus.errors import InfeasibleError, SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import workload_key
from nereus.planner.plan import Plan
from nereus.planner.specs import ClusterSpec, JobSpec, Workload

Solver = Callable[..., Any]


def scale_plan(plan: Plan, gpus: int) -> Plan | None:
    """``plan``'s pools stretched (or shrunk) to ``gpus`` GPUs, TP/PP kept and DP scaled; None when
    the pools cannot be scaled to whole DP groups."""
    n = plan.num_gpus
    if n == gpus:
        return plan
    stages = []
    for s in plan.stages:
        first, size = s.first_gpu * gpus, s.gpus * gpus
        if first % n or size % n:
            return None
        first, size = first // n, size // n
        tp_pp = s.config.tp * s.config.pp
        if size % tp_pp:
            return None
        try:  # e.g. a sequence-parallel degree that no longer divides the scaled DP
            stages.append(replace(s, first_gpu=first, gpus=size, config=replace(s.config, dp=size // tp_pp)))
        except SpecError:
            return None
    try:
        return replace(plan, stages=tuple(stages))
    except SpecError:
        return None


def tp_pp_of(plan: Plan) -> tuple[tuple[str, int, int], ...]:
    return tuple((s.name, s.config.tp, s.config.pp) for s in plan.stages)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutRule:
    """Which layouts a policy may choose (see the module docstring)."""

    name: str = "free"
    placement: str = "any"
    fixed_tp_pp: tuple[tuple[str, int, int], ...] = ()
    anchor: Plan | None = None
    """Pools to keep (scaled to the GPU count); None: the solver chooses pools."""
    zeros: tuple[int, ...] = ()
    """ZeRO stages the trainable models may use (e.g. ``(3,)``: verl's FSDP, OpenRLHF's
    ``--ds.zero_stage 3``); empty: the cache's candidate settings."""
    frozen_zeros: tuple[int, ...] = ()
    """ZeRO stages of the frozen models (``CandidateSettings.frozen_zeros``; ``(3,)``: sharded like
    verl's FSDP reference); empty: the cache's candidate settings."""
    offload: tuple[bool, ...] = ()
    """Optimizer offload choices of the trainable models (``CandidateSettings.offload``; ``(False,
    True)``: the solver offloads where it pays, as verl's ``optimizer_offload`` is switched on at
    32-70B); empty: the cache's candidate settings."""

    def constraints(self, gpus: int) -> Any:
        from nereus.planner.solver import PlanConstraints

        fixed = None
        if self.anchor is not None:
            fixed = scale_plan(self.anchor, gpus)
            if fixed is None:
                raise InfeasibleError(f"{self.name}: the pools of the fixed placement ({self.anchor.num_gpus} GPUs) "
                                      f"cannot be scaled to {gpus} GPUs")
        return PlanConstraints(fixed_tp_pp=self.fixed_tp_pp, placement=self.placement, fixed_placement=fixed)

    def key(self) -> tuple:
        return (self.name, self.placement, self.fixed_tp_pp, None if self.anchor is None else self.anchor.layout_key(),
                self.zeros, self.frozen_zeros) + ((self.offload,) if self.offload else ())

    def candidate_settings(self, base: Any) -> Any:
        """``base`` (``CandidateSettings``) with this rule's ZeRO stages and offload choices."""
        if not self.zeros and not self.frozen_zeros and not self.offload:
            return base
        return replace(base, **({"zeros": self.zeros} if self.zeros else {}),
                       **({"frozen_zeros": self.frozen_zeros} if self.frozen_zeros else {}),
                       **({"offload": self.offload} if self.offload else {}))


FREE = LayoutRule()


def keep_layout(plan: Plan, within: LayoutRule | None = None) -> LayoutRule:
    """The current plan's pools and TP/PP: reachable by changing knobs and DP-internal state only
    (and only to the ZeRO stages and offload choices ``within`` allows)."""
    return LayoutRule(name="keep", fixed_tp_pp=tp_pp_of(plan), anchor=plan,
                      zeros=within.zeros if within else (), frozen_zeros=within.frozen_zeros if within else (),
                      offload=within.offload if within else ())


def static_rule(initial: Plan) -> LayoutRule:
    """The paper's baseline: the initial plan's TP/PP and pools, DP scaling with the GPUs."""
    return LayoutRule(name="static", fixed_tp_pp=tp_pp_of(initial), anchor=initial)


class PlanCache:
    def __init__(self, job: JobSpec, cluster: ClusterSpec, *, time_limit_s: float = 5.0, seed: int = 0,
                 backend: str = "cpsat", solve_fn: Solver | None = None, candidates: Any = None,
                 deterministic: bool = False) -> None:
        self.job, self.cluster = job, cluster
        self.deterministic = deterministic
        """Solve with CP-SAT's deterministic time limit (the simulator: the same plans on an idle or a
        loaded machine; see ``solve``)."""
        self.candidates = candidates
        """Optional ``CandidateSettings`` restricting the configs the solver enumerates (e.g. what an
        executor supports)."""
        self.time_limit_s, self.seed, self.backend = time_limit_s, seed, backend
        self._solve_fn = solve_fn
        self._plans: dict[tuple, Plan | None] = {}
        self._costs: dict[tuple, float] = {}
        self.solves = 0
        self.solve_s = 0.0
        self.last_message = ""
        self.log: list[tuple[str, int, float, float]] = []
        """(rule, gpus, mean response length, seconds) of every solve, for diagnostics."""

    def transition_cost(self, a: Plan, b: Plan) -> float:
        """The transition planner's bandwidth bound for a -> b, cached here so that every
        controller sharing this cache asks once per layout pair."""
        key = (a.layout_key(), b.layout_key())
        hit = self._costs.get(key)
        if hit is None:
            from nereus.planner.transition.build import transition_cost

            hit = self._costs[key] = float(transition_cost(a, b, self.cluster_for(max(a.num_gpus, b.num_gpus)), self.job))
        return hit

    def cluster_for(self, gpus: int, reserve_gib: float = 0.0) -> ClusterSpec:
        """The cluster resized to ``gpus`` GPUs, with ``reserve_gib`` more memory per GPU held back
        (a memory margin the online calibration learned)."""
        c = self.cluster if gpus == self.cluster.num_gpus else self.cluster.with_gpus(gpus)
        if reserve_gib > 0:  # never all of it: a GPU spec needs some memory left
            held = min(c.gpu.reserved_gib + reserve_gib, 0.99 * c.gpu.memory_gib)
            c = replace(c, gpu=replace(c.gpu, reserved_gib=held))
        return c

    def best(self, rule: LayoutRule, w: Workload, gpus: int, params: CostParams, calib_key: tuple = (),
             hint: Plan | None = None, reserve_gib: float = 0.0) -> Plan | None:
        """Fastest plan under ``rule`` for ``w`` on ``gpus`` GPUs (None when infeasible), cached.

        The answer is a pure function of the key (every input the solve reads), so controllers that
        share this cache (the policies of one ``simulate()`` call) get the plan each would have solved
        alone, whoever asked first. ``hint`` (the asker's current plan) is therefore not handed to the
        solver: it is not in the key, and a step-time solve does not read it (only a transition-aware
        one, ``amortize_steps`` > 0, would, which this cache never asks for)."""
        key = (rule.key(), gpus, workload_key(w), calib_key, params, reserve_gib)
        if key in self._plans:
            return self._plans[key]
        plan = self._solve(rule, w, gpus, params, None, reserve_gib)
        self._plans[key] = plan
        return plan

    def _solve(self, rule: LayoutRule, w: Workload, gpus: int, params: CostParams, hint: Plan | None,
               reserve_gib: float = 0.0) -> Plan | None:
        from nereus.planner.solver import PlanProblem, solve

        from nereus.planner.solver import CandidateSettings

        t0 = time.perf_counter()
        self.solves += 1
        try:
            cands = rule.candidate_settings(self.candidates if self.candidates is not None else CandidateSettings())
            problem = PlanProblem(job=self.job, cluster=self.cluster_for(gpus, reserve_gib), workload=w, params=params,
                                  current_plan=hint if hint is not None and hint.num_gpus <= gpus else None,
                                  constraints=rule.constraints(gpus), candidates=cands)
            fn = self._solve_fn or solve
            sol = fn(problem, backend=self.backend, time_limit_s=self.time_limit_s, workers=1, seed=self.seed,
                     deterministic=self.deterministic)
        except InfeasibleError as e:
            self.last_message = str(e)
            return None
        finally:
            self.solve_s += time.perf_counter() - t0
            self.log.append((rule.name, gpus, w.response_len_mean, time.perf_counter() - t0))
        if sol.plan is None or sol.status == "INFEASIBLE":
            self.last_message = sol.message
            return None
        return sol.plan
