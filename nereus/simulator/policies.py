"""The policies the simulator compares. All online policies are the same ``Controller`` (same
forecast, calibration, caching and admission logic); they differ only in which layouts they may
choose (``LayoutRule``) and whether they weigh transition cost:

- ``adaptive``: any layout, cost-aware admission (Nereus).
- ``always``: any layout, switches to the best plan for the next step every step (ignores cost).
- ``static``: the initial plan's TP/PP and pools, DP scaling with the GPUs (the paper's baseline);
  like a real job it still changes micro-batch, recomputation, ZeRO stage and generation waves to
  stay within memory; when no such setting fits, the step is infeasible.
- ``verl``: every model-stage colocated on all GPUs (hybrid engine), FSDP training (TP1 PP1),
  rollout with a fixed TP; the per-step weight reshard is in every step's time (weight sync).
- ``openrlhf``: disaggregated fixed pools per model (chosen once by the solver for the first
  step, then only scaled with the GPUs), DeepSpeed-style TP1 PP1 training, fixed rollout TP.
- ``oracle``: offline, see ``oracle.py``.
"""
from __future__ import annotations

from nereus.errors import SpecError
from nereus.planner.online.controller import Controller
from nereus.planner.cost.params import CostParams
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache, static_rule
from nereus.planner.specs import ClusterSpec, JobSpec, Workload

POLICIES = ("static", "adaptive", "always", "oracle", "verl", "openrlhf")
ONLINE = ("static", "adaptive", "always", "verl", "openrlhf")


def rollout_tp(job: JobSpec) -> int:
    """The rollout TP a verl/OpenRLHF user picks for this actor size (their examples: TP2 for 7-8B,
    TP4 for 30B-class, TP8 for 70B)."""
    n = job.model("actor").num_params()
    return 2 if n < 20e9 else 4 if n < 40e9 else 8


def framework_tp_pp(job: JobSpec) -> tuple[tuple[str, int, int], ...]:
    """FSDP / DeepSpeed ZeRO-3 training and inference (TP1 PP1), rollout engine with a fixed TP."""
    fixed = [("actor/generation", rollout_tp(job), 1)]
    for role in job.roles:
        fixed.append((f"{role}/training" if role in ("actor", "critic") else f"{role}/inference", 1, 1))
    return tuple(fixed)


def make_controller(name: str, job: JobSpec, cluster: ClusterSpec, w0: Workload, gpus0: int, *,
                    total_steps: int | None, plans: PlanCache, horizon: int = 200, margin: float = 0.25,
                    audit=None, seed: int = 0, params: CostParams | None = None) -> Controller:
    """A controller that behaves like policy ``name`` from its first step on."""
    base = params or CostParams()
    if name not in ONLINE:
        raise SpecError(f"unknown online policy {name!r}; choose from {ONLINE}")
    common = dict(initial_gpus=gpus0, initial_workload=w0, total_steps=total_steps, horizon=horizon, margin=margin,
                  params=base, plans=plans, build_transition=False, seed=seed, audit=audit)
    if name in ("adaptive", "always"):
        return Controller(job, cluster, mode=name, rule=FREE, **common)
    if name == "static":
        first = plans.best(FREE, w0, gpus0, base)
        if first is None:
            raise SpecError(f"static: no feasible plan for the first step on {gpus0} GPUs ({plans.last_message})")
        return Controller(job, cluster, rule=static_rule(first), initial_plan=first, **common)
    fixed = framework_tp_pp(job)
    if name == "verl":
        return Controller(job, cluster, rule=LayoutRule(name="verl", placement="colocated", fixed_tp_pp=fixed), **common)
    pools = LayoutRule(name="openrlhf-pools", placement="disaggregated", fixed_tp_pp=fixed)
    first = plans.best(pools, w0, gpus0, base)
    if first is None:
        raise SpecError(f"openrlhf: no feasible disaggregated plan for the first step on {gpus0} GPUs "
                        f"({plans.last_message})")
    rule = LayoutRule(name="openrlhf", placement="disaggregated", fixed_tp_pp=fixed, anchor=first)
    return Controller(job, cluster, rule=rule, initial_plan=first, **common)
