"""Problem, constraints, solution and evaluation records of the global plan solver.

These are the names other packages (controller, simulator, baselines, CLI) code against; fields
are added with defaults, never renamed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from nereus.errors import NereusError, SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.plan import Plan
from nereus.planner.specs import TRAINABLE, ClusterSpec, JobSpec, Workload

PLACEMENTS = ("any", "colocated", "disaggregated")
STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE")


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConstraints:
    fixed_tp_pp: tuple[tuple[str, int, int], ...] = ()
    """(model_stage, tp, pp) pinned, e.g. the static baseline; DP and the pool stay free."""
    placement: str = "any"
    """"any"; "colocated" (every model-stage on all GPUs, verl-like); "disaggregated" (no two
    decision units share a GPU, OpenRLHF-like: rollout engines apart from actor training)."""
    fixed_placement: Plan | None = None
    """Keep the pools of this plan; choose only the parallel configs."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise SpecError(f"plan constraints: placement must be one of {PLACEMENTS}, got {self.placement!r}")
        for item in self.fixed_tp_pp:
            if len(item) != 3 or int(item[1]) < 1 or int(item[2]) < 1:
                raise SpecError(f"plan constraints: fixed_tp_pp entries are (model_stage, tp, pp), got {item!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateSettings:
    """Which parallel configs the option tables enumerate (small sets keep the model small)."""

    tps: tuple[int, ...] = (1, 2, 4, 8)
    max_pp: int = 16
    micro_batches: tuple[int, ...] = (1, 2, 4)
    zeros: tuple[int, ...] = (1, 3)
    recompute: tuple[bool, ...] = (False, True)
    frozen_zeros: tuple[int, ...] = (1,)
    """ZeRO stages of a frozen model's (reference, reward) weights: 1 replicates them over DP; 3
    shards them (verl's FSDP reference, OpenRLHF's eval engine under ``--ds.zero_stage 3``), each
    forward all-gathering them. ``(1,)`` by default, which keeps the default search as it was."""
    sps: tuple[int, ...] = (1, 2)
    """Ulysses sequence-parallel degrees of training and inference units (taken from DP ranks; one
    that does not divide dp, or tp * sp that does not divide the heads, is skipped)."""
    cps: tuple[int, ...] = (1,)
    """Context-parallel degrees (Megatron ring attention, taken from DP ranks like sp; never combined
    with sp > 1). ``(1, 2, 4)`` lets the solver split long sequences that way; off by default, which
    keeps the default search (and its 1,024-GPU solve time) as it was."""
    offload: tuple[bool, ...] = (False,)
    """Trainable models may keep their optimizer state in host memory, paying
    ``cost.offload_s`` (out and back once per step); ``(False, True)`` lets the solver choose."""
    kv_fractions: tuple[float, ...] = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.08)
    """Generation KV budget levels as fractions of the budget on an otherwise empty GPU: the
    discretisation that keeps "KV depends on what else is resident" linear."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanProblem:
    job: JobSpec
    cluster: ClusterSpec
    workload: Workload
    params: CostParams = field(default_factory=CostParams)
    current_plan: Plan | None = None
    transition_cost: Callable[[Plan, Plan], float] | None = None
    """Seconds to move from the first plan to the second."""
    amortize_steps: float = 0.0
    """When > 0 the objective adds transition_cost(current_plan, new) / amortize_steps."""
    constraints: PlanConstraints = field(default_factory=PlanConstraints)
    candidates: CandidateSettings = field(default_factory=CandidateSettings)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSolution:
    status: str
    objective: float
    """Predicted step time in seconds (plus the amortized transition cost when asked)."""
    bound: float
    """Proven lower bound on the objective (seconds); equals objective when OPTIMAL."""
    gap: float
    """(objective - bound) / objective; 0 when proven optimal."""
    plan: Plan | None
    wall_s: float
    backend: str
    message: str = ""
    """Why INFEASIBLE (the binding constraint with numbers), or notes."""

    def to_dict(self) -> dict[str, Any]:
        if self.plan is None:
            return {"status": self.status, "step_time_s": None, "solve_s": self.wall_s, "gap": None,
                    "backend": self.backend, "model_stages": [], "message": self.message}
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731  (JSON has no NaN)
        return {**self.plan.to_dict(), "status": self.status, "solve_s": self.wall_s, "gap": finite(self.gap),
                "backend": self.backend, "objective_s": self.objective, "bound_s": finite(self.bound)}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEvaluation:
    step_time_s: float
    feasible: bool
    violations: tuple[str, ...]
    stage_time_s: tuple[tuple[str, float], ...]
    stage_mem_gib: tuple[tuple[str, float], ...]
    """Peak memory per GPU over the GPUs of the stage's pool while it runs (GiB)."""
    phase_makespan_s: tuple[float, ...]
    weight_sync_s: float
    peak_mem_gib: float
    capacity_gib: float


# ---- the default transition cost ----------------------------------------------------------------
# Transition cost used when ``PlanProblem.transition_cost`` is not given: the transition planner's
# bandwidth bound (``nereus.planner.transition.build.transition_cost``), or, where it cannot size the move
# (e.g. the plans span different GPU counts), bytes of every re-laid-out model state over the
# scale-out bandwidth of the smaller of the two pools.
def bytes_over_bandwidth(problem: PlanProblem, old: Plan, new: Plan) -> float:
    c, p = problem.cluster, problem.params
    bw = c.gpu.inter_node_gbps * 1e9 * p.inter_link_eff
    total = 0.0
    for role in problem.job.roles:
        a, b = old.home(role), new.home(role)
        if (a.first_gpu, a.gpus, a.config.tp, a.config.pp, a.config.dp, a.config.zero) == \
           (b.first_gpu, b.gpus, b.config.tp, b.config.pp, b.config.dp, b.config.zero):
            continue
        nbytes = (16 if role in TRAINABLE else 2) * problem.job.model(role).num_params()
        total += nbytes / (min(a.gpus, b.gpus) * bw)
    return total


def default_transition_cost(problem: PlanProblem) -> Callable[[Plan, Plan], float]:
    def cost(old: Plan, new: Plan) -> float:
        try:
            from nereus.planner.transition.build import transition_cost

            return float(transition_cost(old, new, problem.cluster, problem.job))
        except (ImportError, NereusError):
            return bytes_over_bandwidth(problem, old, new)

    return cost
