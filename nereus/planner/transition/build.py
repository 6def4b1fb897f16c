"""Transition A -> B end to end: ``plan_transition`` / ``build_transition`` (pieces -> source
choice -> schedule -> assembled plan), the bandwidth bound ``transition_cost`` the solver and the
controller price switches with, and the CLI's JSON record."""
from __future__ import annotations

import time
from functools import lru_cache
from typing import Any, Mapping

from nereus.errors import TransitionError
from nereus.gcpause import gc_paused
from nereus.planner.cost.params import CostParams
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig
from nereus.planner.transition.graph import assemble
from nereus.planner.transition.loads import role_loads
from nereus.planner.transition.pieces import (_PHASES, add_bytes, choose_sources, compute_pieces, link_bandwidths,
                                              same_holdings, seconds)
from nereus.planner.transition.schedule import ScheduleProblem
from nereus.planner.transition.schedule_cpsat import schedule_transition
from nereus.planner.transition.types import TransitionPlan


def plan_transition(job: JobSpec, cluster: ClusterSpec, plan_a: Plan, plan_b: Plan, *, mixed_precision: bool = True,
                    time_limit_s: float = 2.0, scheduler: str = "auto", capacity_bytes: float | None = None,
                    resident_bytes: float | Mapping[int, float] | None = None,
                    bandwidth_override: float | tuple[float, float] | None = None,
                    materialize: bool | None = None, include_optimizer: bool = True) -> TransitionPlan:
    """Plan the transition A -> B over every model of ``job`` (see ``build_transition``)."""
    return build_transition(job, cluster, plan_a, plan_b, mixed_precision=mixed_precision, time_limit_s=time_limit_s,
                            scheduler=scheduler, capacity_bytes=capacity_bytes, resident_bytes=resident_bytes,
                            bandwidth_override=bandwidth_override, materialize=materialize,
                            include_optimizer=include_optimizer).plan


@gc_paused()
def build_transition(job: JobSpec, cluster: ClusterSpec, plan_a: Plan, plan_b: Plan, *, mixed_precision: bool = True,
                     time_limit_s: float = 2.0, scheduler: str = "auto", capacity_bytes: float | None = None,
                     resident_bytes: float | Mapping[int, float] | None = None,
                     bandwidth_override: float | tuple[float, float] | None = None,
                     materialize: bool | None = None, include_optimizer: bool = True):
    """Plan the transition and return a ``TransitionResult`` (``.plan``, ``.graph()``).

    ``materialize``: expand per-region holdings and ops (None: only when the destination has at
    most 300,000 holdings; the 1,024-GPU benchmark plans buckets and reports op counts).
    """
    if scheduler not in ("auto", "cpsat", "greedy"):
        raise TransitionError(f"scheduler must be 'auto', 'cpsat' or 'greedy', got {scheduler!r}")
    for p in (plan_a, plan_b):
        if p.num_gpus > cluster.num_gpus:
            raise TransitionError(f"a plan uses {p.num_gpus} GPUs but the cluster has {cluster.num_gpus}")
    t0 = time.perf_counter()
    clock = [("start", t0)]
    pieces = compute_pieces(job, plan_a, plan_b, mixed_precision=mixed_precision, include_optimizer=include_optimizer)
    clock.append(("pieces", time.perf_counter()))
    bw_intra, bw_inter = link_bandwidths(cluster, bandwidth_override=bandwidth_override)
    choose_sources(pieces, cluster, bw_intra, bw_inter)
    clock.append(("choice", time.perf_counter()))
    cap = float(capacity_bytes if capacity_bytes is not None else cluster.gpu.usable_bytes)
    best = None
    original = list(pieces.moves)
    # chunking granularities: finer chunks interleave better but cost time; a second, finer try
    # only when the first schedule is more than 5% above the bound and the problem is not huge
    for parts in (8, 24):
        if best is not None and (best[1].makespan_s <= 1.05 * best[0].lower_bound_s or len(original) > 20_000):
            break
        pieces.moves[:] = original  # from_pieces splits long moves in place
        problem = ScheduleProblem.from_pieces(pieces, cluster, bw_intra, bw_inter, cap, resident_bytes,
                                              hbm_bps=cluster.gpu.hbm_bytes_per_s * CostParams().hbm_eff,
                                              host_bps=CostParams().host_link_gbps * 1e9, chunk_parts=parts)
        clock.append(("buckets", time.perf_counter()))
        sched = schedule_transition(problem, scheduler=scheduler, time_limit_s=time_limit_s)
        clock.append(("schedule", time.perf_counter()))
        if best is None or sched.makespan_s < best[1].makespan_s * (1 - 1e-9):
            best = (problem, sched, list(pieces.moves))
    problem, sched, moves = best
    pieces.moves[:] = moves
    _PHASES[:] = [(f"{name}{i}", t - clock[i][1]) for i, (name, t) in enumerate(clock[1:])]
    return assemble(job, cluster, plan_a, plan_b, pieces, problem, sched, t0, mixed_precision=mixed_precision,
                    include_optimizer=include_optimizer, materialize=materialize)


_COST_CACHE: dict[tuple, float] = {}


def transition_cost(plan_a: Plan, plan_b: Plan, cluster: ClusterSpec, job: JobSpec | None = None) -> float:
    """Seconds to move from ``plan_a`` to ``plan_b``: a bandwidth bound (max over GPUs of send or
    receive time, models' sources chosen one model at a time). It is ``plan_transition``'s
    ``lower_bound_s`` up to the joint source choice and local-copy time: on the benchmark's plan
    pairs (benchmarks/transition_scaling.py) it was 1.00-1.18x that bound and 0.93-1.13x the
    scheduled makespan. Cached by ``layout_key`` and per model move (its placement with ep/etp);
    the per-GPU loads come from ``loads.role_loads`` (no piece list). Identical layouts cost 0."""
    if plan_a.layout_key() == plan_b.layout_key():
        return 0.0
    if job is None:
        raise TransitionError("transition_cost needs the job (model shapes) to size the transition")
    key = (plan_a.layout_key(), plan_b.layout_key(), cluster, job)
    hit = _COST_CACHE.get(key)
    if hit is None:
        hit = _lower_bound(job, cluster, plan_a, plan_b)
        if len(_COST_CACHE) > 4096:
            _COST_CACHE.clear()
        _COST_CACHE[key] = hit
    return hit


def _lower_bound(job: JobSpec, cluster: ClusterSpec, plan_a: Plan, plan_b: Plan) -> float:
    """Per-GPU send and receive time summed over models, each model's source choice made (and
    cached) on its own, so candidate plans that share a model's move are cheap."""
    send: dict[int, list[int]] = {}
    recv: dict[int, list[int]] = {}
    for role in job.roles:
        pa, pb = plan_a.home(role), plan_b.home(role)
        if same_holdings(pa, pb):
            continue
        key = lambda p: (p.name, p.first_gpu, p.gpus, p.config.tp, p.config.pp, p.config.dp, p.config.zero,  # noqa: E731
                         p.config.ep, p.config.etp)
        rs, rr = _role_loads(job, cluster, role, key(pa), key(pb))
        for into, loads in ((send, rs), (recv, rr)):
            for g, (intra, inter) in loads:
                add_bytes(into, g, 0, intra)
                add_bytes(into, g, 1, inter)
    bw_intra, bw_inter = link_bandwidths(cluster)
    return max(max(seconds(send, bw_intra, bw_inter).values(), default=0.0),
               max(seconds(recv, bw_intra, bw_inter).values(), default=0.0))


@lru_cache(maxsize=1024)
def _role_loads(job: JobSpec, cluster: ClusterSpec, role: str, a: tuple, b: tuple) -> tuple[tuple, tuple]:
    """(send, receive) bytes per GPU, (within its node, across nodes), for moving one model from
    placement ``a`` to ``b``."""
    def placement(k: tuple) -> StagePlacement:
        return StagePlacement(name=k[0], config=ParallelConfig(tp=k[3], pp=k[4], dp=k[5], zero=k[6], ep=k[7], etp=k[8]),
                              pool=0,
                              first_gpu=k[1], gpus=k[2])

    bw_intra, bw_inter = link_bandwidths(cluster)
    send, recv = role_loads(job, cluster, role, placement(a), placement(b), bw_intra, bw_inter)
    return (tuple(sorted((g, tuple(v)) for g, v in send.items())),
            tuple(sorted((g, tuple(v)) for g, v in recv.items())))


def describe(tp: TransitionPlan) -> dict[str, Any]:
    """The ``--json`` record of the CLI contract."""
    return {"bytes_moved": int(tp.bytes_moved), "bytes_kept": int(tp.bytes_kept), "makespan_s": float(tp.makespan_s),
            "lower_bound_s": float(tp.lower_bound_s), "peak_mem_frac": float(tp.peak_mem_frac),
            "ops": int(dict(tp.stats).get("ops", len(tp.ops))), "plan_s": float(tp.plan_s)}
