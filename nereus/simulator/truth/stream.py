"""A streaming rollout pool at request level (the ground truth of ``fully_async``; SIMULATED).

The same engine as ``engine.py`` (continuous batching per DP replica: FCFS admission while fewer
than ``max_seqs`` run and the KV budget has room for the prompt + what was generated, one token per
running sequence per decode iteration at ``A[running] + beta x KV tokens held``, preemption by
recompute of the most recently admitted sequence when the next iteration has no KV slot), but fed
as a stream: batches are released into the replicas' queues at times the trainer decides (the
staleness bound), so a batch's tail overlaps the next batch's start, and the pool can be stopped at
any time for a weight sync, after which every running sequence (a partial rollout) has its prompt
and generated tokens prefilled again under the new weights. Replicas can be added and removed
(verl's hybrid replicas on the trainer's GPUs), their unfinished sequences handed to the others.

Per replica an event loop (finishes, admissions, preemptions, a stop time); replicas are advanced
to the same global times by the caller (``timeline.py``), so between two global events they are
independent. Decode to a stop time takes the whole iterations that fit before it (the one under way continues
at the next advance, so no work is lost).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

import numpy as np

from nereus.simulator.truth.engine import WATERMARK, split_replicas


class Replica:
    """One engine replica fed by a queue (see the module docstring)."""

    def __init__(self, pool: "StreamPool", kv: float) -> None:
        self.pool, self.kv = pool, kv
        self.clock = 0.0
        self.tick = 0
        self.queue: deque[int] = deque()
        self.run: dict[int, tuple[int, int]] = {}   # seq -> (finish tick, admission tick)
        self.heap: list[tuple[int, int]] = []
        self.order: list[int] = []                  # admission order (preemption victim: the last running)
        self.used = 0                               # KV tokens held by the running
        self.busy_s = 0.0

    # ---- sequences -----------------------------------------------------------------------------
    def _ctx(self, s: int) -> int:
        """Tokens in a running sequence's KV (prompt + generated)."""
        fin, at = self.run[s]
        p = self.pool
        return int(p.prompt[s]) + int(p.gen[s]) + (self.tick - at)

    def _admit(self) -> None:
        p = self.pool
        room = self.kv * (1 - WATERMARK)
        tokens = 0
        while self.queue and len(self.run) < p.max_seqs:
            s = self.queue[0]
            need = int(p.prompt[s]) + int(p.gen[s]) + 1
            if self.used + len(self.run) + need > room:
                if not self.run:
                    raise ValueError("stream: a sequence does not fit in the KV budget on its own")
                break
            self.queue.popleft()
            left = int(p.length[s]) - int(p.gen[s])
            self.run[s] = (self.tick + left, self.tick)
            heapq.heappush(self.heap, (self.tick + left, s))
            self.order.append(s)
            ctx = int(p.prompt[s]) + int(p.gen[s])
            self.used += ctx
            tokens += ctx
        if tokens:
            dt = p.prefill(tokens)
            self.clock += dt
            self.busy_s += dt

    def _preempt(self) -> None:
        p = self.pool
        while self.order and self.order[-1] not in self.run:
            self.order.pop()
        s = self.order.pop()
        ctx = self._ctx(s)
        p.gen[s] = ctx - int(p.prompt[s])
        del self.run[s]
        self.used -= ctx
        self.queue.appendleft(s)
        p.preemptions += 1

    def _finish(self) -> None:
        p = self.pool
        while self.heap and self.heap[0][0] <= self.tick:
            f, s = heapq.heappop(self.heap)
            if self.run.get(s, (None,))[0] != f:
                continue  # preempted or re-admitted since
            del self.run[s]
            self.used -= int(p.prompt[s]) + int(p.length[s])
            p.gen[s] = p.length[s]
            p.done(s, self.clock)

    def _next_finish(self) -> int:
        while self.heap and self.run.get(self.heap[0][1], (None,))[0] != self.heap[0][0]:
            heapq.heappop(self.heap)
        return self.heap[0][0]

    def advance(self, until: float = math.inf, batch: int | None = None) -> None:
        """Run to time ``until`` (idle when nothing is left), or until ``batch`` has no sequence left
        here (then the clock is that finish)."""
        p = self.pool
        while True:
            if batch is not None and p.left_here(self, batch) == 0:
                return
            self._admit()
            n = len(self.run)
            if n == 0:
                if batch is not None:
                    raise ValueError(f"stream: batch {batch} is not in this replica's queue")
                self.clock = max(self.clock, until)
                return
            free = self.kv - self.used
            if free < n:
                self._preempt()
                continue
            k = min(self._next_finish() - self.tick, int(free // n))
            a = float(p.a[min(n, len(p.a) - 1)])
            dt = until - self.clock
            if math.isfinite(dt):
                if dt <= 0:
                    return
                qa, qb = p.beta * n / 2, a + p.beta * self.used - p.beta * n / 2  # cost(k) = qa k^2 + qb k
                kt = int(math.floor((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))) if qa > 0 else int(dt // qb)
                if kt < k:
                    if kt > 0:
                        self._decode(kt, n, a)
                    return  # the iteration under way at the stop is taken up by the next advance
            self._decode(max(k, 1), n, a)
            self._finish()

    def _decode(self, k: int, n: int, a: float) -> None:
        dt = k * a + self.pool.beta * (k * self.used + n * k * (k - 1) / 2)
        self.clock += dt
        self.busy_s += dt
        self.tick += k
        self.used += n * k
        self.pool.last_work = max(self.pool.last_work, self.clock)

    def evict(self) -> list[int]:
        """Every unfinished sequence, taken off this replica (generated tokens kept)."""
        out = []
        for s in list(self.run):
            self.pool.gen[s] = self._ctx(s) - int(self.pool.prompt[s])
            out.append(s)
        self.run.clear()
        self.heap.clear()
        self.order.clear()
        self.used = 0
        out += list(self.queue)
        self.queue.clear()
        return out

    def resume(self) -> None:
        """After a pause (weight sync): the running sequences' KV is recomputed under the new weights."""
        tokens = sum(self._ctx(s) for s in self.run)
        if tokens:
            dt = self.pool.prefill(tokens)
            self.clock += dt
            self.busy_s += dt


class StreamPool:
    """The rollout pool's replicas over a whole trace: ``lengths`` [steps, sequences] (step k's batch
    is batch k), ``prompt`` [steps] tokens; ``a``/``beta``/``prefill(tokens) -> s`` the engine's
    costs; ``kv`` tokens per replica."""

    def __init__(self, lengths: np.ndarray, prompt: np.ndarray, dp: int, a: np.ndarray, beta: float, kv: float,
                 prefill: Callable[[float], float], max_seqs: int) -> None:
        t, n = lengths.shape
        self.a, self.beta, self.prefill, self.max_seqs = a, beta, prefill, max_seqs
        self.length = lengths.reshape(-1).astype(np.int64)
        self.prompt = np.repeat(np.asarray(prompt, dtype=np.int64), n)
        self.gen = np.zeros(t * n, dtype=np.int64)
        self.batch_of = np.repeat(np.arange(t), n)
        self.n_per = n
        self.finished_at = np.full(t * n, math.nan)
        self.batch_left = np.full(t, n, dtype=np.int64)
        self.batch_done = np.full(t, math.nan)
        self.finished = 0
        self.preemptions = 0
        self.last_work = 0.0
        """Latest time a replica decoded (the pool's idle stretch starts there when it runs dry)."""
        self.replicas = [Replica(self, kv) for _ in range(dp)]
        self._home: dict[int, Replica] = {}
        self._left: dict[tuple[int, int], int] = {}

    def done(self, s: int, clock: float) -> None:
        b = int(self.batch_of[s])
        self.finished_at[s] = clock
        self.finished += 1
        self.batch_left[b] -= 1
        rep = self._home.pop(s)
        self._left[(id(rep), b)] -= 1
        if self.batch_left[b] == 0:
            self.batch_done[b] = clock

    def left_here(self, rep: Replica, batch: int) -> int:
        return self._left.get((id(rep), batch), 0)

    def _place(self, rep: Replica, seqs) -> None:
        for s in seqs:
            s = int(s)
            self._home[s] = rep
            key = (id(rep), int(self.batch_of[s]))
            self._left[key] = self._left.get(key, 0) + 1
            rep.queue.append(s)

    def release(self, batch: int) -> None:
        """Batch ``batch``'s sequences into the active replicas' queues, in contiguous chunks."""
        ids = np.arange(batch * self.n_per, (batch + 1) * self.n_per)
        chunks = split_replicas(ids[None, :] + 1, len(self.replicas))[0]
        for rep, chunk in zip(self.replicas, chunks):
            self._place(rep, chunk[chunk > 0] - 1)

    def advance(self, until: float) -> None:
        for rep in self.replicas:
            rep.advance(until)

    def advance_to_batch(self, batch: int) -> float:
        """Run until ``batch`` is complete (every replica then at that time); its completion time."""
        for rep in self.replicas:
            if self.left_here(rep, batch):
                rep.advance(batch=batch)
        t = float(self.batch_done[batch])
        self.advance(t)
        return t

    def pause(self, seconds: float) -> None:
        """A weight sync: every replica waits ``seconds``, then recomputes its partial rollouts."""
        now = max(r.clock for r in self.replicas)
        for rep in self.replicas:
            rep.clock = now + seconds
            rep.resume()

    def _move(self, seqs: list[int], to: list[Replica]) -> None:
        for s in seqs:
            rep = self._home.pop(s)
            self._left[(id(rep), int(self.batch_of[s]))] -= 1
        for k, rep in enumerate(to):  # round robin: least-loaded routing of equal requests
            self._place(rep, seqs[k::len(to)])

    def add_replicas(self, count: int, kv: float, now: float) -> list[Replica]:
        """Hybrid replicas join at ``now``: every unfinished sequence is aborted and routed again over
        all replicas (verl's rebalance), partial ones prefilled again."""
        new = [Replica(self, kv) for _ in range(count)]
        for rep in new:
            rep.clock = now
        moved = [s for rep in self.replicas for s in rep.evict()]
        self.replicas += new
        self._move(moved, self.replicas)
        return new

    def remove_replicas(self, gone: list[Replica]) -> None:
        """Hybrid replicas leave: their unfinished sequences go back to the standalone replicas."""
        moved = [s for rep in gone for s in rep.evict()]
        self.replicas = [r for r in self.replicas if r not in gone]
        self._move(moved, self.replicas)

    @property
    def clock(self) -> float:
        return max(r.clock for r in self.replicas)

    def running(self) -> bool:
        return any(r.run or r.queue for r in self.replicas)
