"""This rank's part of a transition plan, before any byte moves: its new regions (``_NewLayout``),
every piece as a wire view in canonical order (``_wire``, ``_prepare``), neighbouring pieces
joined (``_merged``), rounds merged into exchanges (``round_groups``), and the arena reserved
ahead of the first transition (``reserve_arena``). All functions of the plan and this rank's
store: every rank derives the same exchanges and the same piece order."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import torch

from nereus.errors import TransitionError
from nereus.executor.arena import empty_regions, mostly_dead
from nereus.executor.reshard.checksum import checksum
from nereus.executor.store import TORCH_DTYPES, ShardStore, contains, cover_error, narrowed
from nereus.planner.transition.types import Region, TransitionPlan


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
