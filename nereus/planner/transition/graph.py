"""Assembly of a planned transition: rounds, per-region ops, kept holdings, statistics, and the
transition graph (networkx DiGraph). Split from transition.py, which computes pieces, chooses
sources and calls the scheduler."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nereus.errors import TransitionError
from nereus.models.inventory import storage_dims
from nereus.planner.plan import Plan
from nereus.planner.transition.regions import volume
from nereus.planner.specs import ClusterSpec, JobSpec
from nereus.planner.transition.pieces import _PHASES, Pieces
from nereus.planner.transition.types import DTYPE_BYTES, TransitionPlan


@dataclass(slots=True)
class TransitionResult:
    """A planned transition with what produced it; ``graph()`` builds the networkx DAG."""

    plan: TransitionPlan
    pieces: Pieces
    problem: Any
    schedule: Any
    rounds: list[int]

    def graph(self):
        return transition_graph(self)


def task_rounds(problem, sched) -> list[int]:
    """Round of every task, consistent with the timed schedule: one more than any task that ended
    before it started and shares its sender, its receiver, or frees memory on its receiver."""
    events = sorted([(sched.end[t], 0, t) for t in range(problem.n)] + [(sched.start[t], 1, t) for t in range(problem.n)])
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    out = [0] * problem.n
    for _, is_start, t in events:
        s, d = problem.src[t], problem.dst[t]
        if is_start:
            out[t] = 1 + max(sent.get(s, -1), recv.get(d, -1), sent.get(d, -1), recv.get(s, -1) if s == d else -1)
        else:
            sent[s] = max(sent.get(s, -1), out[t])
            recv[d] = max(recv.get(d, -1), out[t])
    return out


def assemble(job: JobSpec, cluster: ClusterSpec, plan_a: Plan, plan_b: Plan, pieces: Pieces, problem, sched, t0: float, *,
             mixed_precision: bool, include_optimizer: bool, materialize: bool | None) -> TransitionResult:
    from nereus.planner.transition.emu import holdings
    from nereus.planner.transition.schedule import replay_peak
    from nereus.planner.transition.types import Holding, Region, TransferOp

    rounds = task_rounds(problem, sched)
    n_ops = sum(pieces.templates[pieces.moves[i][0]].mult for t in range(problem.n) for i in problem.moves[t])
    n_kept = sum(pieces.templates[k[0]].mult for k in pieces.kept)
    if materialize is None:
        materialize = n_ops + n_kept <= 300_000
    ops: tuple = ()
    src = dst = kept = ()
    if materialize:
        raw = []
        for t in range(problem.n):
            clock, rate = sched.start[t], (problem.dur[t] / problem.nbytes[t]) if problem.nbytes[t] else 0.0
            for i in problem.moves[t]:
                ti, d, cut, _, _, s, _ = pieces.moves[i]
                tm = pieces.templates[ti]
                b = volume(cut[1]) * DTYPE_BYTES[tm.dtype]
                for kind in tm.kinds:
                    for name in tm.tensors:
                        raw.append((Region(tm.model, name, kind, cut[0], cut[1], tm.dtype), d, s, rounds[t], clock,
                                    clock + b * rate))
                        clock += b * rate
        raw.sort(key=lambda r: (r[0], r[1], r[2]))
        ops = tuple(sorted((TransferOp(round=r[3], op_id=i, src_gpu=r[2], dst_gpu=r[1], region=r[0], start_s=r[4], end_s=r[5])
                            for i, r in enumerate(raw)), key=lambda o: (o.round, o.op_id)))
        tms = pieces.templates
        kept = tuple(sorted(Holding(g, Region(tms[ti].model, name, kind, box[0], box[1], tms[ti].dtype))
                            for ti, box, g in pieces.kept for kind in tms[ti].kinds for name in tms[ti].tensors))
        src = holdings(job, plan_a, mixed_precision=mixed_precision, include_optimizer=include_optimizer)
        dst = holdings(job, plan_b, mixed_precision=mixed_precision, include_optimizer=include_optimizer)
    peak = replay_peak(problem, sched)
    peak_frac = max(peak.values(), default=0.0) / problem.capacity
    stats = _stats(cluster, pieces, problem, sched, n_ops, materialize, peak, rounds)
    tp = TransitionPlan(src=src, dst=dst, kept=kept, ops=ops, bytes_moved=sum(problem.nbytes), bytes_kept=pieces.bytes_kept,
                        makespan_s=sched.makespan_s, lower_bound_s=problem.lower_bound_s, peak_mem_frac=peak_frac,
                        scheduler=sched.scheduler, staged_via_host=bool(sched.staged),
                        plan_s=time.perf_counter() - t0, stats=stats,
                        major=tuple(sorted((role, name, d) for role in job.roles
                                           for name, d in storage_dims(job.model(role)).items())))
    return TransitionResult(tp, pieces, problem, sched, rounds)


def _stats(cluster: ClusterSpec, pieces: Pieces, problem, sched, n_ops: int, materialized: bool, peak: dict,
           rounds: list[int]) -> tuple:
    keep_old = _keep_old_peak(problem)
    by = {"local": 0, "intra": 0, "inter": 0}
    for t in range(problem.n):
        s, d = problem.src[t], problem.dst[t]
        by["local" if s == d else "intra" if cluster.node_of(s) == cluster.node_of(d) else "inter"] += problem.nbytes[t]
    return (("ops", n_ops), ("buckets", problem.n), ("rounds", 1 + max(rounds, default=-1)), ("materialized", materialized),
            ("bytes_local_copy", by["local"]), ("bytes_intra_node", by["intra"]), ("bytes_inter_node", by["inter"]),
            ("dst_bytes", pieces.dst_bytes), ("peak_mem_bytes", max(peak.values(), default=0.0)),
            ("peak_mem_bytes_keep_old", keep_old), ("keep_old_fits", keep_old <= problem.capacity * (1 + 1e-9)),
            ("capacity_bytes", problem.capacity), ("cpsat_status", sched.status),
            *((f"time_{name}_s", round(sec, 4)) for name, sec in _PHASES))


def _keep_old_peak(problem) -> float:
    """Largest bytes on one GPU when every source region stays until the end (the executor keeps
    the old state until commit so it can roll back): all of the old state, resident bytes and
    everything allocated for the new state; the schedule's own peak frees sources as they are read."""
    alloc: dict[int, float] = {}
    for t in range(problem.n):
        alloc[problem.dst[t]] = alloc.get(problem.dst[t], 0.0) + problem.nbytes[t]
    gpus = set(problem.hold_mem) | set(alloc)
    return max((problem.hold_mem.get(g, 0.0) + alloc.get(g, 0.0) for g in gpus), default=0.0)


def transition_graph(result: TransitionResult):
    """The transition as a networkx DiGraph (one node per bucket step, payload in attributes).

    Nodes: ``alloc:gD<-gS`` (receiver allocates), ``send:gS->gD`` / ``recv:gS->gD`` (or
    ``copy:gG``), ``free:gG:#i`` (a source group freed). Edges: alloc -> recv, send -> recv (data),
    last reader -> free, and on GPUs where memory binds, free -> alloc when the schedule relies on
    that free (memory edges)."""
    import networkx as nx

    p, s = result.problem, result.schedule
    g = nx.DiGraph()
    step = {}
    for t in range(p.n):
        a, b = p.src[t], p.dst[t]
        attrs = dict(src=a, dst=b, nbytes=int(p.nbytes[t]), start_s=s.start[t], end_s=s.end[t], round=result.rounds[t],
                     regions=sum(result.pieces.templates[result.pieces.moves[i][0]].mult for i in p.moves[t]))
        tag = f"g{a}->g{b}#{t}"
        alloc = f"alloc:{tag}"
        g.add_node(alloc, kind="alloc", gpu=b, nbytes=int(p.nbytes[t]), start_s=s.start[t])
        if a == b:
            step[t] = f"copy:{tag}"
            g.add_node(step[t], kind="copy", **attrs)
        else:
            step[t] = f"recv:{tag}"
            g.add_node(f"send:{tag}", kind="send", **attrs)
            g.add_node(step[t], kind="recv", **attrs)
            g.add_edge(f"send:{tag}", step[t], kind="data")
        g.add_edge(alloc, step[t], kind="alloc")
    tight = {d for d in set(p.dst) if p.base_mem.get(d, 0.0) + sum(p.nbytes[t] for t in range(p.n) if p.dst[t] == d) > p.capacity}
    for i, (gpu, nbytes, readers) in enumerate(p.free_groups):
        node = f"free:g{gpu}:#{i}"
        when = s.staged.get(gpu, max(s.end[r] for r in readers))
        g.add_node(node, kind="free", gpu=gpu, nbytes=int(nbytes), time_s=when, staged=gpu in s.staged)
        for r in readers:  # staged state is read from host memory after it has left the GPU
            g.add_edge(*((node, f"send:g{gpu}->g{p.dst[r]}#{r}" if p.dst[r] != gpu else step[r]) if gpu in s.staged
                         else (step[r], node)), kind="data")
        if gpu in tight:
            for t in range(p.n):
                if p.dst[t] == gpu and s.start[t] >= when:
                    g.add_edge(node, f"alloc:g{p.src[t]}->g{gpu}#{t}", kind="memory")
    if not nx.is_directed_acyclic_graph(g):
        raise TransitionError("transition graph has a cycle (planner bug)")
    return g
