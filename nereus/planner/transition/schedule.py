"""Memory-safe schedule of a transition: greedy list scheduling, host staging, the lower bound and an
independent replay (the CP-SAT model and the choice between the two: ``schedule_cpsat.py``).

Tasks are (src, dst) buckets: every region moving from one GPU to another travels in one
bucket, so 70B on 1,024 GPUs has tens of thousands of tasks, not millions. A transfer bucket
occupies its sender's send resource and its receiver's receive resource (duration = bytes /
bandwidth, NVLink inside a node, scale-out across); a local-copy bucket occupies the GPU's copy
engine (bytes / HBM bandwidth). Memory per GPU: resident + source state; a bucket allocates its
bytes on the receiver when it starts; a source region is freed when the last bucket reading it
ends (regions nobody reads and that are not kept are freed at time 0).

Lower bound: max over GPUs of total send, receive or copy time. When memory does not bind it is
the optimum of the *preemptive* open shop (senders as jobs, receivers as machines; Gonzalez and
Sahni 1976), so it is attainable if buckets could be cut anywhere; the gap to it is the price of
whole chunks. Greedy: event-driven dense list scheduling (makespan <= 2 x bound when memory does
not bind). Whenever senders or receivers fall idle, the tasks that can start are started
critical resource first: highest max(unstarted send work of the sender, unstarted receive work
of the receiver), then longest, then task index. On the benchmark's transitions
(benchmarks/transition_scaling.py) this is 1.00-1.07x the bound; the previous rule (each idle
GPU, in index order, took the task whose other end had most work left) reached 1.16x.
It is a heuristic: on synthetic sums of 4-8 weighted random permutations over 8-64 GPUs (every
GPU equally loaded) its median over 20 instances was 1.12-1.34x the bound; rounds of matchings
(a Birkhoff-von Neumann decomposition) would close that gap at the price of cutting buckets
into many more ops.
CP-SAT: one interval per task, no-overlap per resource, a reservoir per tight GPU for memory,
minimise makespan, seeded with the greedy. If the greedy cannot make progress for lack of
memory, the source state of the tight GPUs is staged through host memory first
(``staged_via_host``).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Mapping

from nereus.errors import TransitionError
from nereus.planner.specs import ClusterSpec


@dataclass(slots=True)
class ScheduleProblem:
    src: list[int]
    dst: list[int]
    nbytes: list[int]
    dur: list[float]
    moves: list[list[int]]
    """Indices into Pieces.moves carried by each task."""
    free_groups: list[tuple[int, int, tuple[int, ...]]]
    """(gpu, bytes, reader tasks): source bytes freed when every reader has ended."""
    base_mem: dict[int, float]
    """Bytes on each GPU at time 0 (resident + source state, minus what nobody reads)."""
    capacity: float
    host_bps: float = 25e9
    hold_mem: dict[int, float] = field(default_factory=dict)
    """Bytes on each GPU at time 0 counting every source region (also those nobody reads): what
    stays allocated when the old state is kept until commit, as the executor does for rollback."""
    lower_bound_s: float = 0.0

    @property
    def n(self) -> int:
        return len(self.src)

    @classmethod
    def from_pieces(cls, pieces, cluster: ClusterSpec, bw_intra: float, bw_inter: float, capacity: float,
                    resident_bytes: float | Mapping[int, float] | None, *, hbm_bps: float, host_bps: float,
                    chunk_parts: int = 8) -> "ScheduleProblem":
        """Bucket the moves by (src, dst), split long buckets into chunks, derive memory groups."""
        gpn = cluster.gpus_per_node

        def bw(s: int, d: int) -> float:
            return hbm_bps / 2 if s == d else (bw_intra if s // gpn == d // gpn else bw_inter)

        _split_long_moves(pieces, bw, chunk_parts)
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, m in enumerate(pieces.moves):
            buckets.setdefault((m[5], m[1]), []).append(i)
        chunks = _chunked(pieces, buckets, bw, chunk_parts)
        n = len(chunks)
        p = cls(src=[c[0] for c in chunks], dst=[c[1] for c in chunks], nbytes=[0] * n, dur=[0.0] * n,
                moves=[c[2] for c in chunks], free_groups=[], base_mem={}, capacity=capacity, host_bps=host_bps)
        readers: dict[tuple[int, int], set[int]] = {}  # (template, GPU) names one source box
        moves = pieces.moves
        for t in range(n):
            total = 0
            for i in p.moves[t]:
                m = moves[i]
                total += m[6]
                r = readers.get((m[0], m[5]))
                if r is None:
                    readers[(m[0], m[5])] = {t}
                else:
                    r.add(t)
            p.nbytes[t] = total
            p.dur[t] = total / bw(p.src[t], p.dst[t])
        _memory_groups(p, pieces, readers, resident_bytes)
        p.lower_bound_s = lower_bound(p)
        return p


def _split_long_moves(pieces, bw, parts: int) -> None:
    """Split any move longer than 1/(2 parts) of the busiest GPU's load into ranges along the
    tensor's storage dim (``Template.major``; dim 0 but for row-parallel weights), so every
    piece is still one dense block of memory at both ends: a destination region may be
    assembled from several pieces, and short pieces let the schedule keep every link busy (a
    2 GiB embedding shard would otherwise block a sender)."""
    if parts <= 1 or not pieces.moves:
        return
    G = 1 + max(max(m[5], m[1]) for m in pieces.moves)
    send, recv, copy = [0.0] * G, [0.0] * G, [0.0] * G
    secs = [m[6] / bw(m[5], m[1]) for m in pieces.moves]
    for m, sec in zip(pieces.moves, secs):
        if m[5] == m[1]:
            copy[m[5]] += sec
        else:
            send[m[5]] += sec
            recv[m[1]] += sec
    target = max(max(send), max(recv), max(copy)) / (2 * parts)
    if target <= 0 or max(secs) <= target:
        return
    out = []
    for m, sec in zip(pieces.moves, secs):
        d = pieces.templates[m[0]].major
        if sec <= target or m[2][1][d] <= 1:
            out.append(m)
            continue
        off, ln = m[2]
        k = min(ln[d], int(sec // target) + 1)
        for j in range(k):
            lo, hi = j * ln[d] // k, (j + 1) * ln[d] // k
            sub = (off[:d] + (off[d] + lo,) + off[d + 1:], ln[:d] + (hi - lo,) + ln[d + 1:])
            out.append([m[0], m[1], sub, m[3], m[4], m[5], m[6] * (hi - lo) // ln[d]])
    pieces.moves[:] = out


def _chunked(pieces, buckets: dict, bw, parts: int) -> list[tuple[int, int, list[int]]]:
    """(src, dst, move indices) tasks: a bucket longer than 1/parts of the busiest GPU's load is
    split into chunks of whole moves (largest first onto the lightest chunk), so that the
    non-preemptive schedule can interleave it like a preemptive one would."""
    load: dict[tuple[str, int], float] = {}
    secs: dict[tuple[int, int], float] = {}
    moves = pieces.moves
    for (s, d), ms in buckets.items():
        sec = secs[(s, d)] = sum([moves[i][6] for i in ms]) / bw(s, d)
        for r in ((("copy", s),) if s == d else (("send", s), ("recv", d))):
            load[r] = load.get(r, 0.0) + sec
    target = max(load.values(), default=0.0) / max(parts, 1)
    out = []
    for (s, d) in sorted(buckets):
        ms = buckets[(s, d)]
        sec = secs[(s, d)]
        k = min(len(ms), int(sec // target) + 1) if target > 0 and parts > 1 else 1
        if k <= 1:
            out.append((s, d, ms))
            continue
        bins: list[list] = [[0, j, []] for j in range(k)]
        for i in sorted(ms, key=lambda i: (-pieces.moves[i][6], i)):
            b = min(bins, key=lambda b: (b[0], b[1]))
            b[0] += pieces.moves[i][6]
            b[2].append(i)
        out.extend((s, d, sorted(b[2])) for b in bins if b[2])
    return out


def _memory_groups(p: ScheduleProblem, pieces, readers: dict, resident_bytes) -> None:
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    for ti, box, g, b, kept in pieces.src_units:
        p.base_mem[g] = p.base_mem.get(g, 0.0) + b
        p.hold_mem[g] = p.hold_mem.get(g, 0.0) + b
        if kept:
            continue
        r = readers.get((ti, g))  # a GPU holds one box per template
        if r is None:
            p.base_mem[g] -= b  # nobody reads it and B does not keep it: freed before anything starts
        else:
            key = (g, tuple(sorted(r)))
            groups[key] = groups.get(key, 0) + b
    p.free_groups = [(g, b, r) for (g, r), b in sorted(groups.items())]
    for t in range(p.n):
        p.base_mem.setdefault(p.dst[t], 0.0)
    for g in p.base_mem:
        p.hold_mem.setdefault(g, 0.0)
    if resident_bytes is not None:
        for g in list(p.base_mem):
            extra = resident_bytes.get(g, 0.0) if isinstance(resident_bytes, Mapping) else resident_bytes
            p.base_mem[g] += extra
            p.hold_mem[g] += extra


def _resource_loads(p: ScheduleProblem) -> dict[tuple[str, int], float]:
    load: dict[tuple[str, int], float] = {}
    for t in range(p.n):
        for r in task_resources(p, t):
            load[r] = load.get(r, 0.0) + p.dur[t]
    return load


def task_resources(p: ScheduleProblem, t: int) -> tuple[tuple[str, int], ...]:
    s, d = p.src[t], p.dst[t]
    return (("copy", s),) if s == d else (("send", s), ("recv", d))


def lower_bound(p: ScheduleProblem) -> float:
    """Max over GPUs of the total send, receive or copy time: no schedule can beat it."""
    return max(_resource_loads(p).values(), default=0.0)


@dataclass(slots=True)
class Schedule:
    start: list[float]
    end: list[float]
    makespan_s: float
    scheduler: str
    staged: dict[int, float] = field(default_factory=dict)
    """GPU -> time its freeable source state has been staged to host memory."""
    status: str = ""


# --------------------------------------------------------------------------------------------
# Greedy list scheduling
# --------------------------------------------------------------------------------------------
def greedy(p: ScheduleProblem, staged: Mapping[int, float] | None = None) -> Schedule | None:
    """Event-driven dense list schedule, critical resource first; None when it deadlocks on memory.

    Whenever senders, receivers or copy engines fall idle, the tasks that can start (both ends
    idle, room on the receiver) are started greedily in order of max(unstarted send work of the
    sender, unstarted receive work of the receiver) -- the pair holding the resource that can
    least afford to wait -- then longest first, then task index. A staged GPU does nothing until
    its old state is on the host."""
    staged = dict(staged or {})
    n, src, dst, dur = p.n, p.src, p.dst, p.dur
    G = 1 + max([0, *src, *dst, *p.base_mem])
    rem_send, rem_recv = [0.0] * G, [0.0] * G
    out_q: list[list[int]] = [[] for _ in range(G)]
    in_q: list[list[int]] = [[] for _ in range(G)]
    copy_q: list[list[int]] = [[] for _ in range(G)]
    for t in range(n):
        if src[t] != dst[t]:
            rem_send[src[t]] += dur[t]
            rem_recv[dst[t]] += dur[t]
    for t in sorted(range(n), key=lambda t: (-dur[t], t)):  # queues longest first
        if src[t] == dst[t]:
            copy_q[src[t]].append(t)
        else:
            out_q[src[t]].append(t)
            in_q[dst[t]].append(t)
    mem = [0.0] * G
    for g, b in p.base_mem.items():
        mem[g] = b
    groups_of: list[list[int]] = [[] for _ in range(n)]
    for i, (g, b, readers) in enumerate(p.free_groups):
        if g in staged:
            mem[g] -= b  # staged to host before this GPU does anything
        else:
            for t in readers:
                groups_of[t].append(i)
    return _greedy_run(p, staged, (rem_send, rem_recv), (out_q, in_q, copy_q), mem, groups_of)


def _greedy_run(p: ScheduleProblem, staged: dict[int, float], rem, queues, mem: list[float],
                groups_of: list[list[int]]) -> Schedule | None:
    n, src, dst, nb, dur, cap = p.n, p.src, p.dst, p.nbytes, p.dur, p.capacity
    (rem_send, rem_recv), (out_q, in_q, copy_q) = rem, queues
    G = len(mem)
    send_busy, recv_busy, copy_busy = bytearray(G), bytearray(G), bytearray(G)
    start, end = [-1.0] * n, [0.0] * n
    left = [len(r) for _, _, r in p.free_groups]
    events: list[tuple[float, int]] = []  # (time, task), or (time, -1 - gpu) when a staged GPU is ready
    for g, when in sorted(staged.items()):
        send_busy[g] = recv_busy[g] = copy_busy[g] = 1
        heapq.heappush(events, (when, -1 - g))

    def best_out(s: int) -> tuple[int, float]:  # idle sender s: its best task to an idle receiver
        own, best, key = rem_send[s], -1, -1.0
        for t in out_q[s]:
            d = dst[t]
            if recv_busy[d] or mem[d] + nb[t] > cap:
                continue
            k = rem_recv[d] if rem_recv[d] > own else own
            if k > key:  # ties: queue order (longest first)
                best, key = t, k
        return best, key

    def best_in(d: int) -> tuple[int, float]:  # idle receiver d: its best task from an idle sender
        own, best, key, room = rem_recv[d], -1, -1.0, cap - mem[d]
        for t in in_q[d]:
            s = src[t]
            if send_busy[s] or nb[t] > room:
                continue
            k = rem_send[s] if rem_send[s] > own else own
            if k > key:
                best, key = t, k
        return best, key

    scan = (best_out, best_in)
    now, done = 0.0, 0
    freed_send, freed_recv, freed_copy = list(range(G)), list(range(G)), list(range(G))
    while done < n:
        cand = []  # (-key, -duration, task, side, resource): each idle resource's best task
        for side, freed, busy in ((0, freed_send, send_busy), (1, freed_recv, recv_busy)):
            for g in set(freed):
                if not busy[g]:
                    t, k = scan[side](g)
                    if t >= 0:
                        cand.append((-k, -dur[t], t, side, g))
        heapq.heapify(cand)
        while cand:  # greedy matching, best pair first; a resource whose pick was taken looks again
            _, _, t, side, g = heapq.heappop(cand)
            s, d = src[t], dst[t]
            if send_busy[s] or recv_busy[d] or mem[d] + nb[t] > cap:
                if not (send_busy if side == 0 else recv_busy)[g]:
                    t, k = scan[side](g)
                    if t >= 0:
                        heapq.heappush(cand, (-k, -dur[t], t, side, g))
                continue
            send_busy[s] = recv_busy[d] = 1
            rem_send[s] -= dur[t]
            rem_recv[d] -= dur[t]
            mem[d] += nb[t]
            out_q[s].remove(t)
            in_q[d].remove(t)
            start[t], end[t] = now, now + dur[t]
            heapq.heappush(events, (end[t], t))
        for g in set(freed_copy):
            if not copy_busy[g]:
                for j, t in enumerate(copy_q[g]):
                    if mem[g] + nb[t] <= cap:
                        del copy_q[g][j]
                        copy_busy[g] = 1
                        mem[g] += nb[t]
                        start[t], end[t] = now, now + dur[t]
                        heapq.heappush(events, (end[t], t))
                        break
        freed_send, freed_recv, freed_copy = [], [], []
        if not events:
            return None  # nothing runs and nothing fits: memory deadlock
        now = events[0][0]
        while events and events[0][0] == now:
            t = heapq.heappop(events)[1]
            if t < 0:  # a staged GPU is ready
                g = -1 - t
                send_busy[g] = recv_busy[g] = copy_busy[g] = 0
                freed_send.append(g)
                freed_recv.append(g)
                freed_copy.append(g)
                continue
            done += 1
            s, d = src[t], dst[t]
            if s == d:
                copy_busy[s] = 0
                freed_copy.append(s)
            else:
                send_busy[s] = recv_busy[d] = 0
                freed_send.append(s)
                freed_recv.append(d)
            for gi in groups_of[t]:
                left[gi] -= 1
                if left[gi] == 0:
                    g, b, _ = p.free_groups[gi]
                    mem[g] -= b
                    freed_recv.append(g)
                    freed_copy.append(g)
    return Schedule(start, end, max(end, default=0.0), "greedy", dict(staged))


def staging_plan(p: ScheduleProblem) -> dict[int, float]:
    """GPUs whose source state cannot stay while their destination state arrives: stage the
    freeable part through host memory (time = bytes / host bandwidth)."""
    incoming: dict[int, float] = {}
    for t in range(p.n):
        incoming[p.dst[t]] = incoming.get(p.dst[t], 0.0) + p.nbytes[t]
    freeable: dict[int, float] = {}
    for g, b, _ in p.free_groups:
        freeable[g] = freeable.get(g, 0.0) + b
    out = {}
    for g, inc in incoming.items():
        if p.base_mem.get(g, 0.0) + inc > p.capacity:
            if p.base_mem[g] - freeable.get(g, 0.0) + inc > p.capacity:
                raise TransitionError(
                    f"GPU {g}: destination state needs {(p.base_mem[g] - freeable.get(g, 0.0) + inc) / 2**30:.2f} GiB "
                    f"but capacity is {p.capacity / 2**30:.2f} GiB, even with its old state staged to host")
            out[g] = freeable.get(g, 0.0) / p.host_bps
    return out


# --------------------------------------------------------------------------------------------
# Replay (independent check) and entry point
# --------------------------------------------------------------------------------------------
def replay_peak(p: ScheduleProblem, s: Schedule) -> dict[int, float]:
    """Peak bytes per GPU over the schedule, replayed from start/end times alone: allocations at
    each task's start, frees when the last reader of a source group ends. At equal times frees
    come first (a send has finished before the next receive on that GPU starts)."""
    events: list[tuple[float, int, int, float]] = []
    for t in range(p.n):
        events.append((s.start[t], 1, p.dst[t], float(p.nbytes[t])))
    for g, b, readers in p.free_groups:
        when = s.staged[g] if g in s.staged else max(s.end[r] for r in readers)
        events.append((when, 0, g, -float(b)))
    mem = dict(p.base_mem)
    peak = dict(mem)
    for _, _, g, delta in sorted(events):
        mem[g] = mem.get(g, 0.0) + delta
        if delta > 0 and mem[g] > peak.get(g, 0.0):
            peak[g] = mem[g]
    return peak
