"""What both async emitters share: the plan's schedule, the shape of its rollout and trainer pools, and the skeletons of split plans.

An asynchronous plan (``nereus plan --schedule one_step_off|fully_async|auto``) carries its
schedule in the plan's extras (``schedule``: kind, staleness, sync_every) and puts generation on a
GPU range of its own (the rollout pool); every other model-stage is on the trainer side
(``stage_pools``). The frameworks launch such a plan with their own async trainers
(``verl_async.py``, ``openrlhf_async.py``).
"""
from __future__ import annotations

from dataclasses import replace

from nereus.frameworks.common import GEN, gpu_range, units
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import ClusterSpec, ParallelConfig

MAX_SPLITS = 4
"""Rollout / trainer splits the closest-plan search tries per engine, nearest the optimum's first."""


def schedule_of(plan: Plan) -> ScheduleSpec:
    """The schedule ``plan`` was solved for (``sync`` when its extras name none), with its
    staleness bound in force (``one_step_off`` without a bound: 1)."""
    d = dict(plan.extras).get("schedule")
    if not d or d.get("kind", "sync") == "sync":
        return ScheduleSpec()
    s = ScheduleSpec.from_value(dict(d))
    return s.fixed(s.kind)


def is_async(plan: Plan) -> bool:
    return schedule_of(plan).is_async


def job_for(job, schedule: ScheduleSpec):
    """``job`` with ``schedule`` decided (a plan of ``schedule: auto`` was solved for one kind)."""
    return replace(job, schedule=schedule)


def shaped(s: StagePlacement, cluster: ClusterSpec) -> bool:
    """Whether ``s``'s GPUs are ``nnodes x n_gpus_per_node`` as a launcher takes them: part of one
    node, or whole nodes."""
    node = cluster.gpus_per_node
    if s.gpus <= node:
        return s.first_gpu // node == (s.first_gpu + s.gpus - 1) // node
    return s.first_gpu % node == 0 and s.gpus % node == 0


def shape_gap(label: str, s: StagePlacement, cluster: ClusterSpec, keys: str) -> list[str]:
    if shaped(s, cluster):
        return []
    return [f"the {label} pool ({gpu_range(s)}, {s.gpus} GPUs) is neither part of one node nor whole nodes of "
            f"{cluster.gpus_per_node}: {keys} puts the same number of GPUs on each of its nodes"]


def trainer_side(plan: Plan) -> list[StagePlacement]:
    """Home placements of every unit but generation (actor, ref, critic, reward)."""
    return [s for n, s in units(plan).items() if n != GEN]


def _sizes(cluster: ClusterSpec) -> list[int]:
    """Pool sizes a launcher can take: whole nodes on a multi-node cluster, powers of two (and the
    rest) on one node."""
    n, node = cluster.num_gpus, cluster.gpus_per_node
    if cluster.nodes > 1:
        return list(range(node, n, node))
    out, s = set(), 1
    while s < n:
        out.add(s)
        out.add(n - s)
        s *= 2
    return sorted(out)


def split_skeletons(job, cluster: ClusterSpec, near: Plan, *, reward_apart: bool) -> list[tuple[str, Plan]]:
    """Skeleton plans (for ``PlanConstraints.fixed_placement``) that split the cluster into a
    rollout pool at GPU 0, optionally a reward-model pool after it, and one trainer pool holding
    every other model (the rest of the cluster), each pool launchable (``shaped``); at most
    MAX_SPLITS, those nearest ``near``'s pool sizes first."""
    names = [n for n in units_of(job) if n != GEN]
    has_reward = "reward/inference" in names
    u = units(near)
    want_r = u[GEN].gpus if GEN in u else 0
    want_q = u["reward/inference"].gpus if "reward/inference" in u else 0
    sizes, n = _sizes(cluster), cluster.num_gpus
    combos = [(r, q) for r in sizes for q in ([0] if not (has_reward and reward_apart) else sizes) if r + q < n]
    out = []
    for r, q in sorted(combos, key=lambda c: (abs(c[0] - want_r) + abs(c[1] - want_q), c)):
        pools = {GEN: (0, r)}
        if q:
            pools["reward/inference"] = (r, q)
        for name in names:
            pools.setdefault(name, (r + q, n - r - q))
        stages = tuple(StagePlacement(name=name, config=ParallelConfig(dp=g), pool=i, first_gpu=f, gpus=g)
                       for i, (name, (f, g)) in enumerate(pools.items()))
        skel = Plan(stages=stages)
        if not all(shaped(s, cluster) for s in stages):
            continue
        label = f"rollout {r} GPUs" + (f", reward {q}" if q else "") + f", trainer {n - r - q}"
        out.append((label, skel))
        if len(out) == MAX_SPLITS:
            break
    return out


def units_of(job) -> list[str]:
    """The decision units of ``job``: one home model-stage per model, plus generation."""
    from nereus.frameworks.common import UNITS

    stages = set(job.model_stages())
    return [u for u in UNITS if u in stages]
