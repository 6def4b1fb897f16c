"""The plans of the demo's one-step-off mode (torch-free): which ranks are rollout and which are
trainer in an asynchronous plan, the placements a split may start from (``split_anchors``), the
fastest plan at a given split (``split_plan``), the run's first plan (``initial_split_plan``: verl's
documented 1 : 3 share, the layouts inside each pool the planner's) and its controller
(``make_async_controller``: the sync demo's settings, free to choose any split)."""
from __future__ import annotations

from dataclasses import replace
from itertools import product

from nereus.demo.setup import DemoConfig, budget_for, cap_at
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import ParallelConfig

TRAINER_STAGES = ("actor/inference", "ref/inference", "actor/training")


def rollout_ranks(plan: Plan) -> tuple[int, ...]:
    return tuple(plan.stage("actor/generation").gpu_ids())


def trainer_ranks(plan: Plan) -> tuple[int, ...]:
    return tuple(sorted({g for name in TRAINER_STAGES for g in plan.stage(name).gpu_ids()}))


def split_label(plan: Plan) -> str:
    """``rollout 1 : trainer 3`` and each model-stage's layout with its ranks."""
    parts = []
    for name in ("actor/generation", "actor/training", "ref/inference"):
        s = plan.stage(name)
        c = s.config
        parts.append(f"{name.split('/')[0][0]}{name.split('/')[1][0]}:tp{c.tp}dp{c.dp}@{s.first_gpu}"
                     + (f"-{s.first_gpu + s.gpus - 1}" if s.gpus > 1 else ""))
    return f"rollout {len(rollout_ranks(plan))} : trainer {len(trainer_ranks(plan))} (" + " ".join(parts) + ")"


VERL_SHARE = 0.25
"""verl's one-step-off documentation runs 7B DAPO on 16 GPUs split 4 : 12 (rollout : trainer)."""


def async_job(job):
    return replace(job, schedule=ScheduleSpec(kind="one_step_off"))


def _blocks(first: int, size: int) -> list[tuple[int, int]]:
    """Aligned power-of-two blocks (first_gpu, gpus) inside [first, first + size)."""
    out, s = [], 1
    while s <= size:
        out += [(b, s) for b in range(first, first + size - s + 1) if b % s == 0]
        s *= 2
    return out


def split_anchors(world: int, rollout: int) -> list[Plan]:
    """Every placement with actor/generation on an aligned block of ``rollout`` ranks and actor
    (training, inference) and ref on aligned blocks covering the other ranks (the layouts inside
    are the planner's)."""
    if not 1 <= rollout < world:
        from nereus.errors import SpecError

        raise SpecError(f"demo: the rollout pool needs 1 to world - 1 ({world - 1}) ranks, got {rollout}")

    def sp(name: str, pool: int, block: tuple[int, int]) -> StagePlacement:
        return StagePlacement(name=name, config=ParallelConfig(tp=1, pp=1, dp=block[1]), pool=pool,
                              first_gpu=block[0], gpus=block[1])

    def ranks(*blocks: tuple[int, int]) -> set[int]:
        return {g for b in blocks for g in range(b[0], b[0] + b[1])}

    plans = []
    for gen in (b for b in _blocks(0, world) if b[1] == rollout):
        others = set(range(world)) - ranks(gen)
        inside = [b for b in _blocks(0, world) if ranks(b) <= others]
        for a, r in product(inside, repeat=2):
            if ranks(a, r) != others:
                continue  # a trainer rank holding nothing: not the split asked for
            stages = (sp("actor/training", 0, a), sp("actor/inference", 0, a),
                      sp("ref/inference", 0 if r == a else 1, r), sp("actor/generation", 2, gen))
            plans.append(Plan(stages=stages))
    return plans


def split_plan(job, cluster, params, cfg: DemoConfig, rollout: int, workload) -> Plan:
    """The fastest plan for ``workload`` with ``rollout`` rollout ranks (``split_anchors``)."""
    from nereus.demo.policy import plan_cache
    from nereus.errors import InfeasibleError
    from nereus.planner.online.plan_cache import LayoutRule

    cache = plan_cache(job, cluster, recompute=cfg.recompute)
    best = None
    for i, anchor in enumerate(split_anchors(cfg.world, rollout)):
        p = cache.best(LayoutRule(name=f"split-{rollout}-{i}", anchor=anchor), workload, cluster.num_gpus, params)
        if p is not None and (best is None or p.step_time_s < best.step_time_s):
            best = p
    if best is None:
        raise InfeasibleError(f"demo --schedule one_step_off: no plan with {rollout} rollout rank(s) of {cfg.world} "
                              f"fits a {budget_for(cfg):.1f} MiB budget at cap {workload.response_len_max}; raise "
                              f"--budget-k or change --rollout-ranks")
    return best


def initial_split_plan(job, cluster, params, cfg: DemoConfig) -> tuple[Plan, Plan | None]:
    """(the fastest plan at verl's split for the first step's workload, the planner's own best plan
    for that workload at any split)."""
    from nereus.demo.policy import plan_cache
    from nereus.planner.online.plan_cache import FREE

    rollout = cfg.rollout_ranks or max(1, round(cfg.world * VERL_SHARE))
    w0 = job.workload().with_lengths(mean=4.0, max_=cap_at(cfg, 0))
    best = split_plan(job, cluster, params, cfg, rollout, w0)
    return best, plan_cache(job, cluster, recompute=cfg.recompute).best(FREE, w0, cluster.num_gpus, params)


def make_async_controller(job, cluster, params, plan: Plan, cfg: DemoConfig):
    """The demo's controller settings (``policy.make_demo_controller``), free to choose any split."""
    from nereus.demo.policy import DemoController, audit_path, plan_cache
    from nereus.planner.online.controller import Controller
    from nereus.planner.online.plan_cache import LayoutRule

    ctl = Controller(job, cluster, params=params, horizon=cfg.steps, margin=0.25,
                     audit_path=audit_path(cfg, "one_step_off"), initial_plan=plan, total_steps=cfg.steps,
                     rule=LayoutRule(name="one_step_off"), plans=plan_cache(job, cluster, recompute=cfg.recompute),
                     build_transition=False, patience=1, min_dwell=2, forecast_window=8, engine_restart_s=0.0)
    return DemoController(ctl)


