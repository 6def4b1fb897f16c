"""Transports: how the bytes of a transition round move between ranks.

Protocol (every rank of the transition, once per round, same order on all ranks):
``submit_send(peer, t)`` / ``submit_recv(peer, t)`` any number of times, then ``run(timeout_s)``,
or ``start()`` ... ``finish(pending, timeout_s)`` to do other work while the bytes move; ``start``
takes a hook run before each group of outgoing messages is posted (the executor checksums the
pieces they carry there), ``finish`` hooks that see every incoming message as it arrives and the
submitted tensors it filled once they hold its bytes (the executor checksums the pieces there).
Sends to and receives from one peer are *bucketed*: all tensors of one (peer, dtype) in a round
travel as one flat message, in submission order, so thousands of small regions are a handful of
messages. Both sides submit in op-id order, so the buckets line up without any header.
``max_ints(values)`` is the one collective: an element-wise maximum over ranks (the executor's
"failed to prepare" flag and staged bytes per round, then its commit vote and Adam step counts).
``close`` drops pending work.

- ``DistTransport``: torch.distributed point-to-point; gloo on CPU tensors, NCCL on CUDA
  tensors (the device decides). ``GlooTransport``/``NcclTransport`` are names for it.
  On gloo each message is posted straight on the process group (what ``isend``/``irecv`` do,
  without their per-call checks), the receives of an exchange first and the sends streaming
  after them in 8 MB groups; on NCCL an exchange is one ``batch_isend_irecv`` (one NCCL group),
  since separate groups would deadlock. On NCCL the vote and agreement (``max_ints``) run on a
  gloo side group over the same ranks (host tensors), waits poll completion against a deadline
  (``Work.wait`` does not block the host on NCCL), and a rank that rolls back aborts the
  communicators and rebuilds the groups (``after_rollback``, ``parallel.abort_and_rebuild``).
  The NCCL path is written to be right, not tested here (no GPU): ``benchmarks/gpu_check.sh``.
- ``MockTransport``: threads in one process sharing a ``MockHub``; used by unit tests.
"""
from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from nereus.errors import TransitionError
from nereus.executor.arena import pack as _pack
from nereus.executor.arena import staging as _staging
from nereus.executor.arena import unpack as _unpack


BUCKET_BYTES = 1 << 16
"""Tensors below this size share one message per (peer, dtype); larger ones travel on their own
without a packing copy (both sides decide by size alone, so they agree). 64 KiB: a gloo message
costs about as much CPU as packing and unpacking 64-128 KiB (measured, interleaved in one run:
256 -> 64 KiB cut a transition's CPU 3-6% on the benchmark's many-piece shapes)."""


SEND_GROUP_BYTES = 8 << 20
"""A compiled exchange posts its outgoing messages in groups of at least this size, each right
after the sender hashed the pieces it carries (``Exchange.send_groups``)."""


class Transport(ABC):
    def __init__(self, rank: int, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.rank = rank
        self.bucket_bytes = bucket_bytes
        self._sends: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self._recvs: dict[tuple[int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        self.messages = 0
        self.bytes_sent = 0
        self.tag = 0
        """Message tag (gloo): ``apply_transition`` sets one per transition."""
        self.wire_s = 0.0
        """Seconds spent posting and waiting (the wire, or peers not ready yet), excluding packing."""

    def submit_send(self, peer: int, tensor: torch.Tensor) -> None:
        self._sends[(peer, tensor.dtype)].append(tensor)

    def submit_recv(self, peer: int, tensor: torch.Tensor) -> None:
        """``tensor`` may be a non-contiguous view (a slice of a destination region)."""
        self._recvs[(peer, tensor.dtype)].append(tensor)

    def _messages(self, queued: dict) -> list[tuple[int, torch.Tensor | list[torch.Tensor]]]:
        """Per message, in order: (peer, the tensor itself, or the tensors a staging buffer
        stands for: the bucket of small ones, or one strided tensor)."""
        msgs: list[tuple[int, torch.Tensor | list[torch.Tensor]]] = []
        limit = self.bucket_bytes
        for (peer, _), ts in sorted(queued.items(), key=_key):
            small, big = [], []
            for t in ts:
                (big if t.nbytes >= limit else small).append(t)
            if small:
                msgs.append((peer, small))
            msgs += [(peer, t if t.is_contiguous() else [t]) for t in big]
        return msgs

    def run(self, timeout_s: float) -> None:
        """Exchange every submitted tensor; raise TransitionError on failure or timeout."""
        self.finish(self.start(), timeout_s)

    def start(self, after_pack=None, messages=None, groups=None) -> "Posted | None":
        """Post every submitted tensor and return at once (the bytes move in the background).

        Message order per (peer, dtype): the bucket of small tensors, then the large ones in
        submission order. ``messages``: (sends, receives) already laid out as ``_messages`` lays
        out the submitted tensors (a compiled exchange: ``reshard.program``), instead of them.
        ``groups``: (end index of each posting group, ``before_group(g)``): the hook runs before
        group g is posted (the caller's checksums of the pieces it carries: ``Exchange.send_groups``).
        Streaming transports (gloo) post the receives first, then the sends group by group, each
        right after its hook ran; the others (NCCL) run every hook, then post the exchange as one
        batch. ``after_pack(sends, carried)`` (fault injection) sees every outgoing (peer, buffer)
        and the tensors each carries once packing is done, before any hook or post."""
        if messages is None:
            out, inc = self._messages(self._sends), self._messages(self._recvs)
            self._sends, self._recvs = defaultdict(list), defaultdict(list)
        else:
            out, inc = messages
        if not out and not inc:
            return None
        bufs = iter(_staging([m for _, m in out + inc]))
        sends = [(peer, m) if type(m) is not list else (peer, _pack(m, next(bufs))) for peer, m in out]
        recvs = [(peer, m) if type(m) is not list else (peer, next(bufs)) for peer, m in inc]
        staged = [m if type(m) is list else None for _, m in inc]
        if after_pack is not None:
            after_pack(sends, [m if type(m) is list else [m] for _, m in out])
        self.messages += len(sends)
        self.bytes_sent += sum(b.nbytes for _, b in sends)
        ends, before_group = groups if groups is not None else ([len(sends)] if sends else [], lambda g: None)
        t0 = time.perf_counter()
        if not self.streaming:  # one batch (an NCCL group): every checksum first, then post everything
            for g in range(len(ends)):
                before_group(g)
            t0 = time.perf_counter()
            recv_handles, send_handles = self._post_together(sends, recvs)
            self.wire_s += time.perf_counter() - t0
            return Posted(recv_handles, send_handles, sends, recvs, staged)
        recv_handles = self._post_recvs(recvs) if recvs else []
        send_handles, lo = [], 0
        for g, hi in enumerate(ends):  # the wire starts early, few posting calls
            t1 = time.perf_counter()
            before_group(g)
            t0 += time.perf_counter() - t1
            send_handles += self._post_sends(sends[lo:hi])
            lo = hi
        self.wire_s += time.perf_counter() - t0
        return Posted(recv_handles, send_handles, sends, recvs, staged)

    def finish(self, pending: "Posted | None", timeout_s: float, on_arrival=None, landed=None,
               deadline: float | None = None, landed_at=None) -> None:
        """Wait for what ``start`` posted, all under one deadline (``deadline``, a
        ``time.monotonic()`` value, else ``timeout_s`` from now): a peer that sends each message
        just within ``timeout_s`` cannot stretch the exchange past it. As each received message
        completes, ``on_arrival(i, buf)`` runs on it, a staged message is scattered into its
        tensors, and ``landed(peer, parts)`` (or ``landed_at(i, parts)``, by message index) sees
        the submitted tensors it filled, in order (their bytes still in cache); then the sends
        are waited for.

        Each peer's messages are handled in their order; across peers, in the order they arrive
        where the transport can tell (``_ready``: gloo), so a rank hashes what one peer sent while
        another's bytes are still on the wire instead of waiting for them in peer order. Example:
        messages [a0, a1, b0] from peers a and b, b0 landed first: b0, then a0, a1."""
        if pending is None:
            return
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        heads: dict[int, deque] = {}
        for i, (peer, _) in enumerate(pending.recvs):
            q = heads.get(peer)
            if q is None:
                q = heads[peer] = deque()
            q.append(i)
        handles, recvs, staged, ready = pending.recv_handles, pending.recvs, pending.staged, self._ready
        while heads:
            done = []  # one sweep over the peers: each one's messages that have landed, in order
            for peer, q in heads.items():
                while q and ready(handles[q[0]]):
                    done.append((peer, q.popleft(), True))
            if not done:  # nothing has landed: wait for the earliest posted of the next ones
                peer = min(heads, key=lambda p: heads[p][0])
                t0 = time.perf_counter()
                self._wait(handles[heads[peer][0]], self._left(deadline, timeout_s))
                self.wire_s += time.perf_counter() - t0
                done.append((peer, heads[peer].popleft(), False))
            else:
                self._left(deadline, timeout_s)
            for peer, i, was_ready in done:
                if was_ready:
                    self._wait_done(handles[i])  # complete: raises its failure, if any
                buf = recvs[i][1]
                if on_arrival is not None:
                    on_arrival(i, buf)
                parts = staged[i]
                if parts is not None:
                    _unpack(buf.view(-1), parts)
                if landed_at is not None:
                    landed_at(i, parts or [buf])
                if landed is not None:
                    landed(peer, parts or [buf])
            for peer in [p for p, q in heads.items() if not q]:
                del heads[peer]
        t0 = time.perf_counter()
        self._wait(pending.send_handles, self._left(deadline, timeout_s))
        self.wire_s += time.perf_counter() - t0

    def _wait_done(self, handles: list) -> None:
        """Wait for handles ``_ready`` found complete (raises the failure of one that failed)."""
        self._wait(handles, 1.0)

    def _ready(self, handles: list) -> bool:
        """Whether a message's receive has completed (checked without waiting); False where the
        transport cannot tell, which keeps the posted order."""
        return False

    def _left(self, deadline: float, timeout_s: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransitionError(f"rank {self.rank}: the exchange did not complete within {timeout_s:g} s")
        return left

    streaming = True
    """Receives and sends may be posted in separate calls (gloo: each message is independent).
    False where one exchange must be one batch (NCCL: separate groups would deadlock, each rank's
    receives waiting on sends queued behind them)."""

    def _post_together(self, sends: list, recvs: list) -> tuple[list, list]:
        """Post receives and sends as one batch: (per-message receive handles, send handles)."""
        return (self._post_recvs(recvs) if recvs else []), (self._post_sends(sends) if sends else [])

    @abstractmethod
    def _post_recvs(self, recvs: list) -> list:
        """Post the receives; per message, in order, the list of handles to wait for before it
        has arrived."""

    @abstractmethod
    def _post_sends(self, sends: list) -> list:
        """Post the sends; handles to wait for."""

    @abstractmethod
    def _wait(self, handles: list, timeout_s: float) -> None: ...

    @abstractmethod
    def max_ints(self, values: list[int], timeout_s: float) -> list[int]:
        """Element-wise maximum over ranks (every rank passes a list of the same length)."""

    def close(self) -> None:
        self._sends.clear()
        self._recvs.clear()

    def after_rollback(self, vote_completed: bool, timeout_s: float) -> bool:
        """Called by a rank that rolls back, after the vote; True if the process groups were
        rebuilt (NCCL only: see ``DistTransport``)."""
        return False

    def abort_now(self) -> None:
        """Called the moment this rank decides to roll back, before the vote: NCCL aborts its
        data communicators at once (work queued on them can never block this rank again); the
        vote runs on the gloo side group, which stays up. Nothing elsewhere."""

    pg_timeout_s: float | None = None
    """The process-group timeout the data groups run under, where known (NCCL: it must exceed
    ``vote.transition_worst_case_s``, checked by ``apply_transition`` before any byte moves)."""


@dataclass(slots=True)
class Posted:
    """What ``start`` posted: the messages in order (per peer, the same order on both sides)."""

    recv_handles: list
    send_handles: list
    sends: list
    """(peer, contiguous buffer) per outgoing message."""
    recvs: list
    """(peer, contiguous buffer) per incoming message: a destination tensor itself, or a staging
    buffer (a bucket, or the contiguous copy of a strided destination)."""
    staged: list
    """Per incoming message: the tensors a staging buffer is scattered into, or None."""


def _key(item) -> tuple[int, str]:
    (peer, dtype), _ = item
    return peer, str(dtype)


class DistTransport(Transport):
    """torch.distributed point-to-point; works for gloo (CPU) and NCCL (CUDA) alike."""

    def __init__(self, rank: int, group=None, bucket_bytes: int = BUCKET_BYTES) -> None:
        import torch.distributed as dist

        super().__init__(rank, bucket_bytes)
        self.group = group
        self.streaming = "nccl" not in str(dist.get_backend(group))  # also "cpu:gloo,cuda:nccl"
        self._pg = group if group is not None else dist.group.WORLD
        members = range(dist.get_world_size()) if group is None else dist.get_process_group_ranks(group)
        self._group_rank = {g: g if group is None else dist.get_group_rank(group, g) for g in members}
        self._vote_group = group
        if not self.streaming:  # NCCL: the vote and the step counts go on a gloo side group (host tensors)
            from nereus.executor.launch import joined_timeout_s
            from nereus.executor.parallel import side_group

            self._vote_group = side_group(tuple(sorted(members)))
            self.pg_timeout_s = joined_timeout_s()

    def _post_together(self, sends: list, recvs: list) -> tuple[list, list]:
        import torch.distributed as dist

        ops = [dist.P2POp(dist.irecv, buf, peer, self.group) for peer, buf in recvs]
        ops += [dist.P2POp(dist.isend, buf, peer, self.group) for peer, buf in sends]
        works = self._batch(ops)
        if len(works) == len(ops):
            return [[w] for w in works[:len(recvs)]], list(works[len(recvs):])
        return ([list(works)] + [[] for _ in recvs[1:]]) if recvs else [], ([] if recvs else list(works))

    def _batch(self, ops: list) -> list:
        try:
            return dist_batch(ops)
        except RuntimeError as e:
            raise self._failed("point-to-point exchange", e) from e

    def _direct(self, post, items: list) -> list:
        """gloo: one send/recv per message straight on the process group (what ``isend`` and
        ``irecv`` do, without their per-call Python checks); one work per message."""
        try:
            return [post([buf], self._group_rank[peer], self.tag) for peer, buf in items]
        except RuntimeError as e:
            raise self._failed("point-to-point exchange", e) from e

    def _ready(self, works: list) -> bool:
        """gloo: every work of the message completed (``is_completed`` does not block). NCCL keeps
        the posted order (its works complete on the device stream)."""
        if not self.streaming:
            return False
        for w in works:
            if not w.is_completed():
                return False
        return True

    def _wait_done(self, works: list) -> None:
        if not self.streaming:
            return self._wait_polled(works, 1.0)
        try:
            for w in works:
                w.wait()  # complete: returns at once, or raises its failure
        except RuntimeError as e:
            raise self._failed("point-to-point exchange", e) from e

    def _post_recvs(self, recvs: list) -> list:  # streaming (gloo) only: NCCL posts through _post_together
        return [[w] for w in self._direct(self._pg.recv, recvs)]

    def _post_sends(self, sends: list) -> list:
        return self._direct(self._pg.send, sends)

    def _failed(self, what: str, e: RuntimeError) -> TransitionError:
        return TransitionError(f"rank {self.rank}: {what} failed: {str(e).splitlines()[0]}")

    def _limit(self, timeout_s: float) -> timedelta:
        return timedelta(seconds=timeout_s)  # a wait's limit is what is left of a deadline: new each time

    def _wait(self, works: list, timeout_s: float) -> None:
        if not self.streaming:
            return self._wait_polled(works, timeout_s)
        limit = self._limit(timeout_s)
        try:
            for w in works:
                if not w.wait(limit):
                    raise TransitionError(f"rank {self.rank}: a peer did not answer within {timeout_s:g} s")
        except RuntimeError as e:
            raise self._failed("point-to-point exchange", e) from e

    def _wait_polled(self, works: list, timeout_s: float) -> None:
        """NCCL: ``Work.wait`` only makes the current stream wait (the host never blocks, so a
        timeout never fires) unless blocking wait is set for the whole job. Poll completion
        against a deadline instead, then order the current stream after the work (its data is
        read by the checksums next)."""
        deadline = time.monotonic() + timeout_s
        try:
            for w in works:
                while not w.is_completed():
                    if time.monotonic() > deadline:
                        raise TransitionError(f"rank {self.rank}: a peer did not answer within {timeout_s:g} s")
                    time.sleep(50e-6)
                w.wait()
        except RuntimeError as e:
            raise self._failed("point-to-point exchange", e) from e

    def after_rollback(self, vote_completed: bool, timeout_s: float) -> bool:
        """NCCL: abort the communicators (work a dead or failed peer left queued would block
        later kernels) and rebuild the groups when the vote completed (every rank is here then);
        gloo: nothing (its messages are tagged per transition, stale ones never match)."""
        if self.streaming:
            return False
        from nereus.executor.parallel import abort_and_rebuild

        return abort_and_rebuild(vote_completed, timeout_s)

    def abort_now(self) -> None:
        if not self.streaming:
            from nereus.executor.parallel import abort_data_groups

            abort_data_groups()

    def max_ints(self, values: list[int], timeout_s: float) -> list[int]:
        import torch.distributed as dist

        t = torch.tensor(list(values), dtype=torch.int64, device="cpu")  # gloo: the world or the side group
        try:
            w = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._vote_group, async_op=True)
            if not w.wait(self._limit(timeout_s)):
                raise TransitionError(f"rank {self.rank}: collective (commit vote or agreement) timed out after {timeout_s:g} s")
        except RuntimeError as e:
            raise self._failed("collective (commit vote or agreement)", e) from e
        return t.tolist()


def dist_batch(ops: list) -> list:
    """``batch_isend_irecv``; one work per op (gloo), or one for the batch (NCCL)."""
    import torch.distributed as dist

    return dist.batch_isend_irecv(ops) if ops else []


GlooTransport = DistTransport
NcclTransport = DistTransport


class MockHub:
    """Shared mailboxes for ``world`` in-process ranks (one thread each)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.boxes: dict[tuple[int, int], queue.Queue] = defaultdict(queue.Queue)
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._posted: dict[int, dict[int, list[int]]] = defaultdict(dict)
        """Collective call k -> rank -> its values. Like a real collective, a rank's contribution
        stays posted when its own wait times out: peers arriving later still count it."""
        self._calls = [0] * world


class MockTransport(Transport):
    """In-process transport: a send clones into the peer's mailbox; a receive waits on it."""

    def __init__(self, rank: int, hub: MockHub, bucket_bytes: int = BUCKET_BYTES, streaming: bool = True,
                 pg_timeout_s: float | None = None) -> None:
        super().__init__(rank, bucket_bytes)
        self.hub = hub
        self.streaming = streaming
        self.pg_timeout_s = pg_timeout_s
        self.events: list[str] = []
        """``abort`` and ``vote`` in the order they happened (tests of the NCCL path's order)."""

    def abort_now(self) -> None:
        self.events.append("abort")

    def after_rollback(self, vote_completed: bool, timeout_s: float) -> bool:
        self.events.append(f"after_rollback(vote_completed={vote_completed})")
        return False

    def _post_sends(self, sends: list) -> list:
        with self.hub._lock:
            for peer, buf in sends:
                self.hub.boxes[(self.rank, peer)].put(buf.clone())
        return []

    def _post_recvs(self, recvs: list) -> list:
        return [[r] for r in recvs]

    def _wait(self, recvs: list, timeout_s: float) -> None:
        for peer, buf in recvs:
            try:
                got = self.hub.boxes[(peer, self.rank)].get(timeout=timeout_s)
            except queue.Empty:
                raise TransitionError(f"rank {self.rank}: peer {peer} did not answer within {timeout_s:g} s") from None
            if got.numel() != buf.numel():
                raise TransitionError(f"rank {self.rank}: message from {peer} has {got.numel()} elements, expected "
                                      f"{buf.numel()}")
            buf.view(-1).copy_(got.view(-1))

    def max_ints(self, values: list[int], timeout_s: float) -> list[int]:
        """Element-wise max over ranks, with a real collective's semantics: the k-th call of every
        rank forms one reduction, and a rank whose wait times out has still contributed (gloo
        does not take back a posted all-reduce), so its peers may complete without it failing."""
        hub = self.hub
        self.events.append("collective")
        with hub._cond:
            k = hub._calls[self.rank]
            hub._calls[self.rank] += 1
            hub._posted[k][self.rank] = list(values)
            hub._cond.notify_all()
            if not hub._cond.wait_for(lambda: len(hub._posted[k]) == hub.world, timeout=timeout_s):
                raise TransitionError(f"rank {self.rank}: collective (commit vote or agreement) timed out after "
                                      f"{timeout_s:g} s")
            return [max(col) for col in zip(*hub._posted[k].values())]
