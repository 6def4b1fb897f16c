"""Apply a TransitionPlan on one rank: rounds, per-message checksums, then commit or roll back.

Call order (every rank of the world calls ``apply_transition`` with the same plan):
1. allocate the rank's new regions from the arena, in storage order (kept regions are reused as
   they are; one is copied only to free a mostly dead arena buffer), build this rank's view of
   every piece it sends, receives or copies in the piece's canonical order (row-major after
   moving the tensor's storage dim first, ``TransitionPlan.major``: a function of the region
   alone, the same at both ends whatever their memory layout), and check the plan's pieces
   tile every new region exactly (no overlap, no gap: ``store.cover_error``);
2. one max-reduce over ranks: the bytes each round stages on the busiest rank, and whether any
   rank failed to prepare (then every rank rolls back before a byte moves);
3. for each exchange (consecutive planner rounds, merged while staging stays within
   ``staging_bytes``), in (round, op id) order: sends/receives through the transport (small
   pieces bucketed, dense ones in place), then local copies. End to end: the sender hashes each
   piece it sends from its source region, in canonical order, and posts those hashes behind
   the data; the receiver hashes the same piece read back from its destination region once the
   message has been unpacked there, and a local copy is hashed at both ends after it ran. Since
   the pieces tile every new region exactly, every element of every destination region is
   compared with its source, after the last step that could misplace or corrupt it;
4. vote (one ``transport.max_ints``, which also spreads the Adam step counts): commit only if
   every rank verified everything. Commit swaps the
   store's contents at once, so the old shards live until then; any exception, timeout or
   "no" vote leaves the store untouched (rollback) and raises TransitionError (``RolledBack``).
   A yes-voter waits longer than a no-voter (``vote_wait_s``): its posted yes would let a late
   peer commit, so giving up early would split the ranks.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

import torch

from nereus.errors import TransitionError
from nereus.gcpause import gc_paused
from nereus.executor.arena import empty_regions, mostly_dead, trim_cache
from nereus.executor.store import (TORCH_DTYPES, ShardStore, SourceSums, checksum, checksums_of, contains, cover_error,
                                   narrowed)
from nereus.executor.transport import Transport
from nereus.planner.transition.types import Region, TransferOp, TransitionPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """A failure to inject (tests and ``reshard-check --inject-fault``)."""

    rank: int
    round: int
    kind: str = "raise"
    """``raise``: an exception on that rank before it posts the exchange holding ``round``;
    ``hang``: it stops answering there for ``hang_s``; ``after-receive``: an exception on that
    rank once that exchange's bytes have arrived (the data moved, nothing verified or committed
    yet); ``corrupt``: one bit of the first message that rank receives in that exchange flips
    before it is unpacked (a byte corrupted in flight: only the receiver can tell);
    ``corrupt-copy``: one bit of the first element of the first local copy that rank makes in
    that exchange flips after the copy (memory or a copy gone wrong: only the destination's
    checksum can tell); ``corrupt-pack``: one bit of that rank's packed staging copy of an
    outgoing message flips after packing, before its checksums are taken and it is posted (in a
    strided piece where the message carries one: the case a hash of the packed copy cannot see);
    ``corrupt-unpack``: one bit of the first piece that rank unpacks from a staged message (else
    of the first piece it receives) flips in its destination region before it is hashed there.
    The four ``corrupt`` kinds fire in the exchange holding ``round``, or the first one after it
    where there is something of their kind to corrupt;
    ``slow-vote``: that rank verifies everything, then stalls ``hang_s`` before it votes (a
    straggler; ``round`` is ignored); ``kill``: that rank's process dies of SIGKILL before it
    posts the exchange holding ``round`` (no exception, no vote, no goodbye: its peers learn of it
    from the transport, a closed connection or the timeout, and roll back)."""
    hang_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")


FAULT_KINDS = ("raise", "hang", "after-receive", "corrupt", "corrupt-copy", "corrupt-pack", "corrupt-unpack",
               "slow-vote", "kill")
CORRUPTIONS = ("corrupt", "corrupt-copy", "corrupt-pack", "corrupt-unpack")


class _Corruption:
    """An injected corruption (``FaultSpec`` kinds in ``CORRUPTIONS``): armed from the exchange
    holding its round until it has fired once."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fired = False

    def armed(self, kind: str) -> bool:
        return self.kind == kind and not self.fired


def _flip_bit(t: torch.Tensor) -> None:
    """Flip the lowest bit of the first element of ``t`` (any dtype, any strides) in place."""
    t.as_strided((1,), (1,)).view(torch.uint8)[0] ^= 1


def _corrupt_packed(sends: list, carried: list, sums: SourceSums, corruption: "_Corruption") -> None:
    """``corrupt-pack``: one bit of a packed outgoing message, in a strided piece if one is packed
    (its old sender hash was taken from this very copy), else at the start of the first."""
    packed = [(buf, parts) for (_, buf), parts in zip(sends, carried) if sums.made_for_message(buf)]
    at = None
    for buf, parts in packed:
        pos = 0
        for part in parts:
            if not part.is_contiguous() and part.numel():
                at = (buf, pos)
                break
            pos += part.numel()
        if at is not None:
            break
    if at is None and packed and packed[0][0].numel():
        at = (packed[0][0], 0)
    if at is not None:
        _flip_bit(at[0].view(-1)[at[1]:])
        corruption.fired = True


class RolledBack(TransitionError):
    """A transition that rolled back on this rank, with how far it got (tests and reports)."""

    def __init__(self, message: str, *, bytes_received: int, exchanges_done: int, vote_completed: bool = True,
                 groups_rebuilt: bool = False) -> None:
        super().__init__(message)
        self.bytes_received = bytes_received
        self.exchanges_done = exchanges_done
        self.groups_rebuilt = groups_rebuilt
        """True when the transport aborted its communicators and rebuilt the process groups (NCCL):
        every group object made before is gone; callers rebuild theirs (``Engine`` does)."""
        self.vote_completed = vote_completed
        """False only when this rank voted yes and the vote never completed here: a peer that
        completed it later may have committed (reported in the message; see ``vote_wait_s``)."""


def vote_wait_s(timeout_s: float, exchanges: int, ok: bool) -> float:
    """How long a rank waits for the commit vote. A "no" cannot be outvoted, so its voter rolls
    back after ``timeout_s`` whatever happens. A "yes" stays posted in the collective even if its
    voter stops waiting (gloo and NCCL do not take back a posted all-reduce), so a live but slow
    peer arriving later would complete the vote with it and commit while this rank rolled back.
    A yes-voter therefore waits out a live peer's longest path to the vote: the staging
    agreement, then per exchange the data and the checksums, each bounded by ``timeout_s``."""
    return timeout_s if not ok else timeout_s * (2 * exchanges + 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyReport:
    rank: int
    rounds: int
    exchanges: int
    """Exchanges the rounds ran in (consecutive rounds merged, see ``round_groups``)."""
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    bytes_staged: int
    """Bytes sent or received through a staging buffer on this rank (packed small pieces, and
    pieces that are not one dense block of memory); the rest moved in place."""
    messages: int
    regions_verified: int
    peak_bytes: int
    """Bytes this rank held at the transition's high point: the old state (kept until commit),
    the newly allocated regions, and the largest exchange's staging buffers (packed sends,
    staged receives)."""
    seconds: float
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds per phase on this rank: allocate (new regions and this rank's piece views), prepare (posting, packing, and while the bytes
    move: sender checksums and local copies), exchange (packing, the wire and waiting on peers; ``wire_s`` is the wire and waiting
    part alone), verify (receiver checksums; runs during the next round's transfer, so it is
    also inside that round's prepare), vote+commit."""

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}


class _NewLayout:
    """The rank's destination regions being filled, with the pieces that land in each."""

    def __init__(self, store: ShardStore, plan: TransitionPlan, rank: int, major: dict[tuple[str, str], int]) -> None:
        kept = {h.region for h in plan.kept if h.gpu == rank}
        self.tensors: dict[Region, torch.Tensor] = {}
        self.filled: dict[Region, list[Region]] = {}
        self.kept = kept
        self.by_key: dict[tuple[str, str, str], list[Region]] = defaultdict(list)
        fresh = []
        for h in plan.dst:
            if h.gpu != rank:
                continue
            self.by_key[h.region.key].append(h.region)
            if h.region in kept:
                self.tensors[h.region] = store.get(h.region)
            else:
                fresh.append(h.region)
                self.filled[h.region] = []
        # a kept region keeps its whole arena buffer mapped: where most of that buffer dies at
        # commit, the region moves to the new arena (a local copy) so the buffer can be freed
        held = sorted(kept)
        self.relocated = [r for r, move in zip(held, mostly_dead([self.tensors[r] for r in held])) if move]
        self.tensors.update(empty_regions(fresh + self.relocated, TORCH_DTYPES, store.device, major))
        for r in self.relocated:
            self.tensors[r].copy_(store.get(r))
        self.relocated_bytes = sum(r.nbytes for r in self.relocated)

    def target(self, piece: Region) -> torch.Tensor:
        if piece in self.filled:  # a whole new region (the common case)
            self.filled[piece].append(piece)
            return self.tensors[piece]
        for r in self.by_key.get(piece.key, ()):
            if r not in self.kept and contains(r, piece):
                self.filled[r].append(piece)
                return narrowed(self.tensors[r], r, piece)
        raise TransitionError(f"transfer of {piece.tensor}/{piece.kind} at {piece.offsets}+{piece.lengths} lands in "
                              "no destination region of this rank")

    def allocated_bytes(self) -> int:
        return sum(self.tensors[r].numel() * self.tensors[r].element_size()
                   for r in (*self.filled, *self.relocated))

    def check_complete(self, rank: int) -> None:
        """The plan's pieces tile every new region exactly: no overlap, no gap (checked on the
        plan, before the exchange; that the right bytes landed is what the piece checksums check)."""
        for r, pieces in self.filled.items():
            why = cover_error(r, pieces)
            if why is not None:
                raise TransitionError(f"rank {rank}: {why}")

    def verify_relocated(self, store: ShardStore, rank: int, major: dict[tuple[str, str], int]) -> None:
        """A kept region copied to the new arena holds its old bytes (compared in canonical order)."""
        for r in self.relocated:
            if checksum(_wire(self.tensors[r], r, major)) != checksum(_wire(store.get(r), r, major)):
                raise TransitionError(f"rank {rank}: checksum mismatch: {r.tensor}/{r.kind} at {r.offsets}+{r.lengths} "
                                      "differs after its copy to the new arena")


def _wire(view: torch.Tensor, region: Region, major: dict[tuple[str, str], int]) -> torch.Tensor:
    """The piece as it travels: its storage dim moved first (``TransitionPlan.major``), so a
    piece cut along that dim of a tensor stored that way is one dense block, sent and received
    in place; anything else is packed/staged by the transport in this same element order."""
    d = major.get((region.model, region.tensor), 0)
    return view if d == 0 else view.movedim(d, 0)


def _run_round(items: list[tuple], store: ShardStore, rank: int, transport: Transport, timeout_s: float,
               counters: dict, sums: SourceSums, rnd: str, verify_previous=None,
               corrupt: "_Corruption | None" = None):
    """One exchange of prepared items (``_prepare``). Receives are posted first (the transport
    buckets the small pieces; large ones land directly in their destination region), then each
    outgoing message right after this rank checksummed the pieces it carries, from their source
    regions; while the bytes move, the local copies run (each hashed at both ends) and the
    previous exchange's comparison. Every piece that arrives is checksummed where it landed, in
    its destination region, once its message was unpacked (bytes still in cache); one small
    message per peer, posted right after the data, carries the sender's checksums. Returns the
    comparison of this exchange's pieces with their sources' checksums (run by the next
    exchange, or after the last)."""
    t0 = time.perf_counter()
    incoming = 0
    local: list[tuple] = []
    landing: dict[int, Region] = {}
    for what, peer, view, nbytes, region in items:
        if what == "send":
            transport.submit_send(peer, view)
            counters["sent"] += nbytes
        elif what == "recv":
            transport.submit_recv(peer, view)
            landing[id(view)] = region
            incoming += nbytes
        else:
            local.append((peer, view, nbytes, region))
    sums_out: dict[int, list[int]] = defaultdict(list)
    posted = transport.start(before_send=lambda peer, buf, parts: sums_out[peer].extend(sums.message(buf, parts)),
                             after_pack=(lambda sends, carried: _corrupt_packed(sends, carried, sums, corrupt))
                             if corrupt is not None and corrupt.armed("corrupt-pack") else None)
    recv_peers = [peer for peer, _ in posted.recvs] if posted else []
    if posted is not None:
        staging = sum(b.numel() * b.element_size() for i, (_, b) in enumerate(posted.recvs) if posted.staged[i])
        staging += sum(b.numel() * b.element_size() for _, b in posted.sends if sums.made_for_message(b))
        counters["staging_peak"] = max(counters["staging_peak"], staging)
        counters["staged"] += staging
    # the sender's checksums follow its data on each peer's stream, so they arrive with the data's
    # tail instead of costing one more round trip after it
    for peer, values in sorted(sums_out.items()):
        transport.submit_send(peer, torch.tensor(values, dtype=torch.int64, device=store.device))
    sums_in: dict[int, torch.Tensor] = {}
    for peer, n in sorted(Counter(op[1] for op in items if op[0] == "recv").items()):
        sums_in[peer] = torch.empty(n, dtype=torch.int64, device=store.device)
        transport.submit_recv(peer, sums_in[peer])
    posted_sums = transport.start()
    copies: list[tuple[Region, int, int]] = []
    for source, target, nbytes, region in local:
        target.copy_(source)
        if corrupt is not None and corrupt.armed("corrupt-copy") and target.numel():
            _flip_bit(target)  # the fault: a bit of the first copy's first element flipped after the copy
            corrupt.fired = True
        copies.append((region, sums(source), checksum(target)))
        counters["copied"] += nbytes
    if verify_previous is not None:
        verify_previous()
    t1 = time.perf_counter()
    got: dict[int, list[tuple[Region, int]]] = defaultdict(list)

    def arrived(i: int, buf: torch.Tensor) -> None:
        if corrupt.armed("corrupt") and buf.numel():
            _flip_bit(buf)  # the fault: one bit flipped in flight
            corrupt.fired = True

    staged_lists = {id(p) for p in posted.staged if p is not None} if posted is not None else set()

    def landed(peer: int, parts: list[torch.Tensor]) -> None:
        if (corrupt is not None and corrupt.armed("corrupt-unpack") and parts and parts[0].numel()
                and (id(parts) in staged_lists or not staged_lists)):
            _flip_bit(parts[0])  # the fault: a bit of an unpacked piece flipped in its destination region
            corrupt.fired = True
        got[peer].extend(zip((landing[id(part)] for part in parts), checksums_of(parts)))

    transport.finish(posted, timeout_s, on_arrival=arrived if corrupt is not None and corrupt.armed("corrupt") else None,
                     landed=landed)
    del posted  # staging buffers go back to the arena now, not when the next exchange has run
    transport.finish(posted_sums, timeout_s)
    counters["arrived"] += incoming
    counters["prepare_s"] += t1 - t0
    counters["exchange_s"] += time.perf_counter() - t1

    def verify() -> None:
        t2 = time.perf_counter()
        for region, want, have in copies:
            if have != want:
                raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {_where(region)} differs "
                                      "from its source after the local copy")
        for peer in sorted(set(recv_peers)):
            expected = sums_in[peer].tolist()
            for k, (region, have) in enumerate(got[peer]):
                if have != expected[k]:
                    raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {_where(region)}, piece "
                                          f"{k + 1} of {len(expected)} from rank {peer}, differs from its source "
                                          f"after it landed")
        counters["received"] += incoming
        counters["verify_s"] += time.perf_counter() - t2

    return verify


def _where(r: Region) -> str:
    return f"{r.model}:{r.tensor}/{r.kind} at {r.offsets}+{r.lengths}"


def _inject(fault: FaultSpec | None, rank: int, lo: int, hi: int, when: str) -> None:
    """The injected failure of ``fault`` if it falls in the exchange of rounds lo..hi at ``when``
    (``before``: before this rank posts; ``after``: once its bytes have arrived)."""
    if fault is None or fault.rank != rank or not lo <= fault.round <= hi:
        return
    if when == "before" and fault.kind == "hang":
        time.sleep(fault.hang_s)
    elif when == "before" and fault.kind == "kill":
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    elif when == "before" and fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} in round {fault.round}")
    elif when == "after" and fault.kind == "after-receive":
        raise RuntimeError(f"injected fault on rank {rank} after the bytes of round {fault.round} arrived")


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


_TAGS = itertools.count(1)
"""Message tag per transition applied in this process (every rank applies the same sequence)."""

STAGING_BYTES = 256 << 20
"""Default bound on one rank's staging buffers in one exchange (see ``round_groups``)."""


def _prepare(plan: TransitionPlan, store: ShardStore, new: _NewLayout, rank: int, bucket_bytes: int,
             major: dict[tuple[str, str], int]):
    """This rank's part of the plan: per round, ("send", peer, wire view, bytes, piece), ("recv",
    peer, wire view, bytes, piece) and ("copy", source wire view, target wire view, bytes, piece)
    items in op-id order, and the bytes per round that go through a staging buffer here (pieces
    below ``bucket_bytes``, packed per peer, and pieces that are not one dense block in storage
    order). A wire view is the piece in its canonical order (``_wire``), the order it travels
    and is checksummed in at both ends."""
    items: dict[int, list[tuple]] = defaultdict(list)
    staged = [0] * plan.rounds
    for op in plan.ops:  # sorted by (round, op id)
        if op.src_gpu != rank and op.dst_gpu != rank:
            continue
        n = op.region.nbytes
        if op.src_gpu == op.dst_gpu:
            items[op.round].append(("copy", _wire(store.read(op.region), op.region, major),
                                    _wire(new.target(op.region), op.region, major), n, op.region))
            continue
        if op.src_gpu == rank:
            what, peer, view = "send", op.dst_gpu, _wire(store.read(op.region), op.region, major)
        else:
            what, peer, view = "recv", op.src_gpu, _wire(new.target(op.region), op.region, major)
        items[op.round].append((what, peer, view, n, op.region))
        if n < bucket_bytes or not view.is_contiguous():
            staged[op.round] += n
    return items, staged


def reserve_arena(store: ShardStore, plan: TransitionPlan, rank: int, *, staging_bytes: int | None = STAGING_BYTES,
                  bucket_bytes: int | None = None) -> int:
    """Reserve, at start, the host memory a transition of ``plan`` will take from the arena: its
    new regions (one buffer per dtype) and the staging buffers of each exchange, carved exactly
    as ``apply_transition`` will ask for them, then every page touched (``arena.prefault_free``)
    and handed back to the arena's cache, so the first transition runs on warm memory like later
    ones. Nothing moves and the store is unchanged; not collective (exchanges are grouped by this
    rank's staged bytes, where a transition uses the busiest rank's: the same with the default
    budget whenever every round fits in one exchange). Returns the bytes reserved; 0 off the host
    (CUDA has its caching allocator). Keep ``arena.cache_limit()`` above it."""
    from nereus.executor.arena import prefault_free

    if store.device.type != "cpu":
        return 0
    _carve_once(store, plan, rank, staging_bytes, bucket_bytes)  # every buffer is free again on return
    return prefault_free()


def _carve_once(store: ShardStore, plan: TransitionPlan, rank: int, staging_bytes: int | None,
                bucket_bytes: int | None) -> None:
    from nereus.executor.transport import BUCKET_BYTES, MockHub, MockTransport, _staging

    major = {(m, t): d for m, t, d in plan.major}
    new = _NewLayout(store, plan, rank, major)
    sizer = MockTransport(rank, MockHub(1), bucket_bytes or BUCKET_BYTES)
    items, staged = _prepare(plan, store, new, rank, sizer.bucket_bytes, major)
    for lo, hi in round_groups(staged, staging_bytes):  # held one exchange at a time, as the transition does
        peers: dict[str, Counter] = {"send": Counter(), "recv": Counter()}
        for it in _merged([x for rnd in range(lo, hi + 1) for x in items.get(rnd, ())], store, new, major):
            if it[0] in ("send", "recv"):
                (sizer.submit_send if it[0] == "send" else sizer.submit_recv)(it[1], it[2])
                peers[it[0]][it[1]] += 1
        out, inc = sizer._messages(sizer._sends), sizer._messages(sizer._recvs)
        sizer.close()
        data = _staging([m for _, m in out + inc])
        sums = [torch.empty(n, dtype=torch.int64, device=store.device) for what in ("send", "recv")
                for _, n in sorted(peers[what].items())]
        sum_bufs = _staging([[t] for t in sums if t.numel()])  # the checksum messages (small: staged)
        del data, sum_bufs


def _merged(items: list[tuple], store: ShardStore, new: _NewLayout, major: dict[tuple[str, str], int]) -> list[tuple]:
    """One exchange's items with the pieces of one tensor going between the same two ranks that
    are neighbours along its storage dim joined into one piece (the planner cuts long moves into
    ranges, often into pieces below the bucket size, which would be packed and unpacked: joined,
    they move in place as one dense block). A function of the plan alone, so sender and receiver
    join the same pieces and keep the same order (a joined piece takes its first part's place);
    each joined piece is hashed whole at both ends, so every element is still compared.

    Example: rows [0, 64) and [64, 128) of ``mlp.up_proj.weight``/exp_avg from rank 0 to rank 2,
    in rounds 3 and 7 of one exchange -> rows [0, 128), at the place of the first."""
    runs: dict[tuple, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if it[0] != "copy":
            r = it[4]
            d = major.get((r.model, r.tensor), 0)
            runs[(it[0], it[1], r.key, r.dtype, d, r.offsets[:d] + r.offsets[d + 1:],
                  r.lengths[:d] + r.lengths[d + 1:])].append(i)
    first: dict[int, tuple] = {}
    drop: set[int] = set()
    for (what, peer, _, _, d, _, _), idx in runs.items():
        if len(idx) < 2:
            continue
        idx.sort(key=lambda i: items[i][4].offsets[d])
        chain = [idx[0]]
        for i in idx[1:] + [None]:
            prev = items[chain[-1]][4]
            if i is not None and items[i][4].offsets[d] == prev.offsets[d] + prev.lengths[d]:
                chain.append(i)
                continue
            if len(chain) > 1:
                lo = items[chain[0]][4]
                joined = replace(lo, lengths=lo.lengths[:d] + (sum(items[j][4].lengths[d] for j in chain),)
                                 + lo.lengths[d + 1:])
                view = _wire(store.read(joined) if what == "send" else new.target(joined), joined, major)
                first[min(chain)] = (what, peer, view, joined.nbytes, joined)
                drop.update(chain)
            chain = [i] if i is not None else []
    if not first:
        return items
    return [first.get(i, it) for i, it in enumerate(items) if i in first or i not in drop]


def round_groups(staged: list[int], staging_bytes: int | None) -> list[tuple[int, int]]:
    """Consecutive planner rounds merged into exchanges, the same on every rank.

    ``staged[r]``: the most bytes any rank stages in round r (packed small pieces, pieces that
    are not one dense block; ``_prepare`` on every rank, then a max over ranks). This executor
    keeps the old shards until commit and allocates every new region up front, so its peak
    memory is old + new whatever the rounds; what an exchange adds is its staging buffers.
    Rounds are merged while the staged bytes of the merged exchange stay within
    ``staging_bytes`` (a single round is never split). Fewer exchanges mean fewer waits on the
    slowest rank. ``None``: one exchange; ``0``: the planner's rounds."""
    rounds = len(staged)
    if rounds == 0:
        return []
    if staging_bytes is None:
        return [(0, rounds - 1)]
    if staging_bytes <= 0:
        return [(r, r) for r in range(rounds)]
    groups: list[tuple[int, int]] = []
    lo, acc = 0, 0
    for r in range(rounds):
        if r > lo and acc + staged[r] > staging_bytes:
            groups.append((lo, r - 1))
            lo, acc = r, 0
        acc += staged[r]
    groups.append((lo, rounds - 1))
    return groups


@gc_paused()
@torch.no_grad()  # the store's tensors may be a live model's leaves (requires_grad): copies into them are not autograd ops
def apply_transition(store: ShardStore, plan: TransitionPlan, rank: int, transport: Transport, *,
                     timeout_s: float = 60.0, fault: FaultSpec | None = None,
                     staging_bytes: int | None = STAGING_BYTES) -> ApplyReport:
    """Turn this rank's store from plan A's holdings into plan B's; atomic across ranks.

    The planner's rounds run in exchanges of consecutive rounds (``round_groups``): at most
    ``staging_bytes`` staged on any rank in one exchange (default 256 MiB; ``0`` runs the
    planner's rounds one by one, ``None`` all of them in one exchange). Same bytes either way, in
    (round, op id) order."""
    t0 = time.perf_counter()
    counters = {"sent": 0, "received": 0, "arrived": 0, "copied": 0, "prepare_s": 0.0, "exchange_s": 0.0,
                "verify_s": 0.0, "staging_peak": 0, "staged": 0, "exchanges_done": 0}
    held_before = store.nbytes()
    transport.tag = next(_TAGS)  # the same sequence on every rank: leftovers of a failed transition never match
    msgs0, wire0 = transport.messages, transport.wire_s
    ok, reason = True, ""
    new: _NewLayout | None = None
    groups: list[tuple[int, int]] = []
    staged = [0] * plan.rounds
    items: dict | None = None
    try:
        major = {(m, t): d for m, t, d in plan.major}  # (model, tensor) -> dim stored outermost
        new = _NewLayout(store, plan, rank, major)
        items, staged = _prepare(plan, store, new, rank, transport.bucket_bytes, major)
        new.check_complete(rank)  # the plan covers every new element exactly once: else stop before any byte moves
        counters["copied"] += new.relocated_bytes
        counters["allocate_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - roll back, with the reason
        ok, reason = False, _reason(e)
    try:  # every rank, also one that failed to prepare: the largest staging per round, and any failure
        spread = transport.max_ints([int(not ok)] + staged, timeout_s)
        if ok and spread[0]:
            ok, reason = False, "another rank failed to prepare the transition"
    except TransitionError as e:
        ok, reason = False, reason or str(e)
    if ok:
        try:
            groups = round_groups(spread[1:], staging_bytes)
            items = {lo: _merged(it, store, new, major)
                     for lo, hi in groups for it in [[x for rnd in range(lo, hi + 1) for x in items.get(rnd, ())]]}
            verify = None
            sums = SourceSums(store)
            corruption = _Corruption(fault.kind) if fault is not None and fault.rank == rank \
                and fault.kind in CORRUPTIONS else None
            for lo, hi in groups:
                _inject(fault, rank, lo, hi, "before")
                verify = _run_round(items[lo], store, rank,
                                    transport, timeout_s, counters, sums, f"{lo}" if lo == hi else f"{lo}-{hi}", verify,
                                    corrupt=corruption if corruption is not None and fault.round <= hi else None)
                counters["exchanges_done"] += 1
                _inject(fault, rank, lo, hi, "after")
            if verify is not None:
                verify()
            new.verify_relocated(store, rank, major)
        except Exception as e:  # noqa: BLE001 - any failure on this rank means roll back, with its reason
            ok, reason = False, _reason(e)
    transport.close()
    t_vote = time.perf_counter()
    models = sorted({h.region.model for h in plan.dst})
    if ok and fault is not None and fault.rank == rank and fault.kind == "slow-vote":
        time.sleep(fault.hang_s)
    vote_completed = True
    try:  # every rank votes, also a failed one, so its peers learn it at once instead of timing out;
        # the same collective spreads each model's Adam step count, so one result decides both
        vote = transport.max_ints([int(not ok)] + [store.step.get(m, 0) for m in models],
                                  vote_wait_s(timeout_s, len(groups), ok))
        if ok and vote[0]:
            ok, reason = False, "another rank failed to verify its regions"
    except TransitionError as e:
        if ok:
            vote_completed = False
            reason = (f"{e}; this rank voted to commit and the vote did not complete here, so a peer that "
                      f"completed it may have committed")
        ok, reason = False, reason or str(e)
    if not ok:
        # NCCL: work still queued on the communicators (a peer that died, a batch half posted)
        # would block later kernels: abort them and, if the vote completed everywhere, rebuild
        # the groups (collective, every rank is rolling back) before handing the old layout back
        rebuilt = transport.after_rollback(vote_completed, timeout_s)
        raise RolledBack(f"transition rolled back on rank {rank}: {reason}; this rank's old layout is intact"
                         + ("; process groups rebuilt" if rebuilt else ""),
                         bytes_received=counters["arrived"], exchanges_done=counters["exchanges_done"],
                         vote_completed=vote_completed, groups_rebuilt=rebuilt)
    for m, step in zip(models, vote[1:]):
        store.step[m] = step
    items = None  # drop this rank's views of the old state, so its buffers are free for the trim
    store.replace(new.tensors.items())
    trim_cache()  # the old state's buffers are free now: keep at most cache_limit() of them
    phases = tuple((k, round(counters.get(k, 0.0), 6)) for k in ("allocate_s", "prepare_s", "exchange_s", "verify_s"))
    phases += (("vote_commit_s", round(time.perf_counter() - t_vote, 6)),
               ("wire_s", round(transport.wire_s - wire0, 6)))
    return ApplyReport(rank=rank, rounds=plan.rounds, exchanges=len(groups), bytes_sent=counters["sent"], bytes_received=counters["received"],
                       bytes_copied=counters["copied"], bytes_staged=counters["staged"],
                       messages=transport.messages - msgs0,
                       regions_verified=len(new.filled), seconds=time.perf_counter() - t0, phases=phases,
                       peak_bytes=held_before + new.allocated_bytes() + counters["staging_peak"])
