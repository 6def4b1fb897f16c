"""Baselines for an asynchronous job (rollout and trainer on disjoint pools; SIMULATED).

- ``static-split``: the solver's plan for step 0 (its schedule and split), pools and TP/PP kept, DP
  scaled with the GPUs; knobs re-tuned (the ``static`` controller on the async job).
- ``hindsight-split``: the best single split for the whole trace, chosen knowing it: the oracle's
  dynamic programming inside one (schedule, rollout share of the GPUs) at a time, TP/PP and knobs free.
- ``verl-one-step-off``: verl's one-step-off policy with its docs' split, rollout : trainer = 1 : 3
  (4 : 12 of 16 H20 in docs/advance/one_step_off.md).
- ``verl-fully-async``: verl's fully-async policy at 1 : 1 (64 : 64 of 128 GPUs in
  docs/advance/fully_async.md), staleness and sync interval the job's.
- ``verl-fully-async-dynamic``: the same with ``use_dynamic_resource_scheduling`` (hybrid rollout
  replicas on the trainer's GPUs, verl 0.9.1's default policy; ``truth/verl_dynamic.py``).

verl's layout rules as for the ``verl`` policy (``policies.framework_tp_pp``): FSDP training TP1
PP1, rollout at the fixed TP of verl's examples; knobs re-tuned by the controller. The split is
rounded to whole rollout replicas (and to nodes when the pool spans nodes).
"""
from __future__ import annotations

from dataclasses import replace

from nereus.errors import SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.online.controller import Controller
from nereus.planner.online.plan_cache import LayoutRule, PlanCache, static_rule
from nereus.planner.plan import Plan
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig
from nereus.simulator.policies import SOLVE_BUCKET_RATIO, framework_tp_pp
from nereus.simulator.truth.timeline import DYNAMIC, schedule_of

ASYNC_POLICIES = ("static-split", "hindsight-split", "verl-one-step-off", "verl-fully-async", "verl-fully-async-dynamic")
ASYNC_ONLINE = ("static-split", "verl-one-step-off", "verl-fully-async", "verl-fully-async-dynamic")
VERL_SPLIT = {"verl-one-step-off": (1, 3), "verl-fully-async": (1, 1), "verl-fully-async-dynamic": (1, 1)}
"""rollout : trainer GPUs of verl's documented runs."""


def sync_job(job: JobSpec) -> JobSpec:
    """The job with synchronous steps (the sync policies run on it)."""
    return job if job.schedule.kind == "sync" else replace(job, schedule=ScheduleSpec())


def policy_job(name: str, job: JobSpec) -> JobSpec:
    """The job a policy plans for: verl's baselines their own schedule (the job's staleness, at least
    1; fully-async's sync interval the job's), the others the job as given."""
    if name == "verl-one-step-off":
        return replace(job, schedule=ScheduleSpec(kind="one_step_off", staleness=max(1, job.schedule.bound)))
    if name.startswith("verl-fully-async"):
        s = max(1, job.schedule.bound)
        return replace(job, schedule=ScheduleSpec(kind="fully_async", staleness=s,
                                                  sync_every=min(s, job.schedule.sync_every)))
    return job


def mark(name: str):
    """What the policy's runtime adds to each plan it runs (dynamic scheduling is verl's runtime)."""
    if name != "verl-fully-async-dynamic":
        return lambda p: p
    return lambda p: replace(p, extras=tuple((k, v) for k, v in p.extras if k != DYNAMIC) + ((DYNAMIC, True),))


def split_anchor(job: JobSpec, cluster: ClusterSpec, gpus: int, name: str) -> Plan:
    """verl's fixed pools: the rollout first (a 1 : 3 or 1 : 1 share of ``gpus``, whole replicas of
    the rollout TP and whole nodes beyond one), the trainer's model-stages on the rest."""
    r, t = VERL_SPLIT[name]
    fixed = {n: (tp, pp) for n, tp, pp in framework_tp_pp(job)}
    tp = fixed["actor/generation"][0]
    unit = tp if gpus <= cluster.gpus_per_node else cluster.gpus_per_node
    roll = max(unit, round(gpus * r / (r + t) / unit) * unit)
    if roll >= gpus:
        raise SpecError(f"{name}: {gpus} GPUs leave no trainer pool at a {r} : {t} split")
    from nereus.planner.plan import StagePlacement

    stages = [StagePlacement(name="actor/generation", config=ParallelConfig(tp=tp, dp=roll // tp), pool=0,
                             first_gpu=0, gpus=roll)]
    for ms in job.model_stages():
        if ms == "actor/generation":
            continue
        mtp, mpp = fixed.get(ms, (1, 1))
        stages.append(StagePlacement(name=ms, config=ParallelConfig(tp=mtp, pp=mpp, dp=(gpus - roll) // (mtp * mpp)),
                                     pool=1, first_gpu=roll, gpus=gpus - roll))
    return Plan(stages=tuple(stages), backend=name)


def make_async_controller(name: str, job: JobSpec, cluster: ClusterSpec, w0, gpus0: int, *, plans: PlanCache,
                          total_steps: int | None, horizon: int = 200, margin: float = 0.25, audit=None,
                          seed: int = 0, params: CostParams | None = None) -> Controller:
    base = params or CostParams()
    common = dict(initial_gpus=gpus0, initial_workload=w0, total_steps=total_steps, horizon=horizon, margin=margin,
                  params=base, plans=plans, build_transition=False, seed=seed, audit=audit,
                  solve_bucket_ratio=SOLVE_BUCKET_RATIO)
    if name == "static-split":
        from nereus.planner.online.plan_cache import FREE

        first = plans.best(FREE, w0, gpus0, base)
        if first is None:
            raise SpecError(f"static-split: no feasible plan for the first step on {gpus0} GPUs ({plans.last_message})")
        return Controller(job, cluster, rule=static_rule(first), initial_plan=first, **common)
    anchor = split_anchor(job, cluster, gpus0, name)
    rule = LayoutRule(name=name, placement="disaggregated", fixed_tp_pp=framework_tp_pp(job), anchor=anchor)
    first = plans.best(rule, w0, gpus0, base)
    if first is None:
        raise SpecError(f"{name}: no feasible plan at its fixed split on {gpus0} GPUs ({plans.last_message})")
    return Controller(job, cluster, rule=rule, initial_plan=first, **common)


def split_family(plan: Plan) -> tuple:
    """(schedule, rollout share of the GPUs): what ``hindsight-split`` holds fixed."""
    from fractions import Fraction

    return (schedule_of(plan)[0], Fraction(plan.stage("actor/generation").gpus, plan.num_gpus))


def is_async(plan: Plan) -> bool:
    return schedule_of(plan)[0] != "sync"


def idle_summary(result_idle, steps_async: int) -> dict:
    """Idle shares of a run from per-step (rollout idle, trainer idle, sync) seconds over its async steps."""
    if not steps_async:
        return {}
    r, t, s, wall = (sum(x[i] for x in result_idle) for i in range(4))
    wall = wall or 1.0
    return {"idle_share_rollout": r / wall, "idle_share_trainer": t / wall, "sync_share": s / wall,
            "async_steps": steps_async}
