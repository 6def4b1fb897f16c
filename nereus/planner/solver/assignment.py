"""A solved assignment (slot tree + unit -> slot + unit -> option), its exact objective, and its
conversion into a :class:`Plan` with concrete GPU ranges.

Slots are the pools: a forest in which a child lies inside its parent and siblings are disjoint
(a laminar family of aligned power-of-two blocks). Any such forest whose children fit in their
parent can be packed onto buddy-aligned GPU ranges by placing children largest first, so the
solvers reason about the tree and this module picks the positions.
"""
from __future__ import annotations

from dataclasses import dataclass

from nereus.errors import SpecError
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.schedules import ROLLOUT, TRAINER, idle_shares, step_time
from nereus.planner.solver.candidates import ACTOR, GEN, KIB, Option, Tables
from nereus.planner.specs import ClusterSpec

GiB = 1024**3


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    slot_size: tuple[int, ...]
    slot_parent: tuple[int, ...]
    """Parent slot index, or -1 for a top-level pool."""
    unit_slot: tuple[int, ...]
    unit_option: tuple[Option, ...]

    def chain(self, slot: int) -> tuple[int, ...]:
        """The slot and its ancestors: the pools covering the GPUs owned by ``slot`` alone."""
        out = [slot]
        while self.slot_parent[out[-1]] >= 0:
            out.append(self.slot_parent[out[-1]])
        return tuple(out)

    def covers(self, unit: int, slot: int) -> bool:
        return self.unit_slot[unit] in self.chain(slot)

    def overlap(self, u: int, v: int) -> bool:
        return self.covers(u, self.unit_slot[v]) or self.covers(v, self.unit_slot[u])


def check_structure(a: Assignment, num_gpus: int) -> None:
    """Children strictly smaller than and fitting in their parent; top level fits the cluster."""
    load = {i: 0 for i in range(-1, len(a.slot_size))}
    for k, (size, par) in enumerate(zip(a.slot_size, a.slot_parent)):
        if par >= 0 and not size < a.slot_size[par]:
            raise SpecError(f"slot {k} (size {size}) is not smaller than its parent {par} ({a.slot_size[par]})")
        load[par] += size
    for k, used in load.items():
        cap = num_gpus if k < 0 else a.slot_size[k]
        if used > cap:
            raise SpecError(f"slot {k}: children need {used} GPUs > {cap}")
    for u, o in enumerate(a.unit_option):
        if o.size != a.slot_size[a.unit_slot[u]]:
            raise SpecError(f"unit {u}: option for {o.size} GPUs in a slot of {a.slot_size[a.unit_slot[u]]}")


def objective(t: Tables, a: Assignment) -> tuple[float, bool, tuple[float, ...], float]:
    """(objective seconds, memory-feasible, phase makespans, weight sync) of an assignment."""
    used = sorted(set(a.unit_slot))
    ms = [0.0] * t.n_phases
    feasible = True
    for k in used:
        cov = [u for u in range(len(t.units)) if a.covers(u, k)]
        for ph in range(t.n_phases):
            ms[ph] = max(ms[ph], sum(a.unit_option[u].durations[ph] for u in cov))
        mem = sum(a.unit_option[u].resident_kib for u in cov) + max(a.unit_option[u].transient_kib for u in cov)
        feasible &= mem <= t.capacity_kib
    g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
    sync = t.sync_s(a.unit_option[g], a.unit_option[tr].size, a.overlap(g, tr))
    if t.schedule.is_async and any(a.overlap(g, v) for v in range(len(t.units)) if v != g):
        feasible = False  # an async plan's rollout pool is its own
    return step_time(t.schedule, ms, sync), feasible, tuple(ms), sync


def place(a: Assignment, num_gpus: int) -> tuple[int, ...]:
    """First GPU of every slot: children packed largest first inside their parent."""
    first = [0] * len(a.slot_size)
    cursor = {-1: 0}
    order = sorted(range(len(a.slot_size)), key=lambda k: (len(a.chain(k)), -a.slot_size[k], k))
    for k in order:
        par = a.slot_parent[k]
        base = 0 if par < 0 else first[par]
        off = cursor.get(par, 0)
        first[k] = base + off
        cursor[par] = off + a.slot_size[k]
        cursor[k] = 0
    for k, f in enumerate(first):
        if f % a.slot_size[k] and a.slot_size[k] != num_gpus:
            raise SpecError(f"slot {k} of {a.slot_size[k]} GPUs placed unaligned at {f}")
    return tuple(first)


def to_plan(t: Tables, a: Assignment, cluster: ClusterSpec, *, status: str, solve_s: float, gap: float,
            backend: str, firsts: tuple[int, ...] | None = None) -> Plan:
    obj, _, ms, sync = objective(t, a)
    firsts = firsts or place(a, cluster.num_gpus)
    pool_of = {k: i for i, k in enumerate(sorted(set(a.unit_slot), key=lambda k: (firsts[k], -a.slot_size[k])))}
    stages = []
    kv = None
    for u, unit in enumerate(t.units):
        o, k = a.unit_option[u], a.unit_slot[u]
        cov_slots = [s for s in set(a.unit_slot) if k in a.chain(s)]
        peak = 0
        for s in cov_slots:
            cov = [v for v in range(len(t.units)) if a.covers(v, s)]
            peak = max(peak, sum(a.unit_option[v].resident_kib for v in cov) + o.transient_kib)
        if unit.name == GEN:
            kv = o.kv_budget_bytes
        for ms_name, st in zip(unit.stages, o.stage_times):
            stages.append(StagePlacement(name=ms_name, config=o.config, pool=pool_of[k], first_gpu=firsts[k],
                                         gpus=o.size, time_s=st, mem_gib=peak * KIB / GiB))
    order = {ms: i for i, ms in enumerate(_stage_order(t))}
    stages.sort(key=lambda s: order[s.name])
    offloaded = tuple(u.name for u, o in zip(t.units, a.unit_option) if o.offload)
    extras = (("weight_sync_s", sync), ("phase_makespan_s", tuple(ms)),
              ("generation_kv_budget_gib", None if kv is None else kv / GiB), ("offload", offloaded))
    if t.schedule.kind != "sync":  # the schedule, each model-stage's pool (rollout / trainer) and their idle shares
        pools = {s.name: ROLLOUT if s.name == GEN else TRAINER for s in stages}
        extras += (("schedule", t.schedule.fixed(t.schedule.kind).to_dict()), ("stage_pools", pools),
                   ("idle_share", idle_shares(t.schedule, ms, sync)))
    return Plan(stages=tuple(stages), step_time_s=obj, status=status, solve_s=solve_s, gap=gap, backend=backend,
                extras=extras)


def _stage_order(t: Tables) -> list[str]:
    pairs = sorted(((ph, ms) for u in t.units for ms, ph in zip(u.stages, u.phases)), key=lambda x: x[0])
    return [ms for _, ms in pairs]
