"""This rank's part of a transition plan, before any byte moves: its new regions (``_NewLayout``),
every piece as a wire view in canonical order (``_wire``, ``_prepare``), neighbouring pieces
joined (``_merged``), rounds merged into exchanges (``round_groups``), and the arena reserved
ahead of the first transition (``reserve_arena``). All functions of the plan and this rank's
store: every rank derives the same exchanges and the same piece order."""
from __future__ import annotations

from collections import defaultdict

import torch

from nereus.errors import TransitionError
from nereus.executor.arena import carve, layout_of, mostly_dead
from nereus.executor.reshard.checksum import checksum
from nereus.executor.reshard.program import _joins, program
from nereus.executor.reshard.recipe import Geometry, dense, geometry, join_key, join_record, recipe, same_items
from nereus.executor.reshard.recipe import view as view_of
from nereus.executor.store import TORCH_DTYPES, ShardStore, contains, cover_error, narrowed
from nereus.planner.transition.types import Region, TransitionPlan


class _NewLayout:
    """The rank's destination regions being filled, with the pieces that land in each."""

    def __init__(self, store: ShardStore, plan: TransitionPlan, rank: int, major: dict[tuple[str, str], int]) -> None:
        rec = self.recipe = recipe(plan, rank, major)
        self.kept = rec.kept
        held = rec.held
        held_t = [store.get(r) for r in held]
        # a kept region keeps its whole arena buffer mapped: where most of that buffer dies at
        # commit, the region moves to the new arena (a local copy) so the buffer can be freed
        self.relocated = [r for r, move in zip(held, mostly_dead(held_t)) if move]
        layout = rec.layouts.get(tuple(self.relocated))  # a function of the regions: kept on the recipe
        if layout is None:
            layout = rec.layouts[tuple(self.relocated)] = layout_of(rec.fresh + self.relocated, TORCH_DTYPES, major)
        made = carve(layout, len(rec.fresh) + len(self.relocated), store.device)
        self.fresh_t = made[:len(rec.fresh)]
        """The new regions' tensors, in ``recipe.fresh`` order."""
        self.tensors: dict[Region, torch.Tensor] = dict(zip(held + rec.fresh + self.relocated, held_t + made))
        for r, t in zip(self.relocated, made[len(rec.fresh):]):
            t.copy_(store.get(r))
        self.relocated_bytes = sum(r.nbytes for r in self.relocated)
        self._allocated = sum(t.nbytes for t in made)
        self._filled: dict[Region, list[Region]] | None = None
        self._homes: dict[tuple[str, str, str], list[tuple[Region, torch.Tensor, list[Region]]]] | None = None
        self.bases: tuple | None = None
        """(source tensors per recipe slot, new tensors, their ``Geometry``): set by ``_prepare``."""

    @property
    def filled(self) -> dict[Region, list[Region]]:
        """Per new region, the pieces that land in it (recorded while the recipe's cover is not
        checked yet: read by that check alone)."""
        if self._filled is None:
            self._filled = {r: [] for r in self.recipe.fresh}
        return self._filled

    @filled.setter
    def filled(self, value: dict[Region, list[Region]]) -> None:
        self._filled = value

    def _home(self, piece: Region) -> tuple[Region, torch.Tensor, list[Region]]:
        if self._homes is None:  # per (model, tensor, kind): the new regions, their tensors and pieces
            self._homes = defaultdict(list)
            for r, pieces in self.filled.items():
                self._homes[r.key].append((r, self.tensors[r], pieces))
        for home in self._homes.get(piece.key, ()):
            if contains(home[0], piece):
                return home
        raise TransitionError(f"transfer of {piece.tensor}/{piece.kind} at {piece.offsets}+{piece.lengths} lands in "
                              "no destination region of this rank")

    def target(self, piece: Region) -> torch.Tensor:
        r, t, pieces = self._home(piece)
        pieces.append(piece)
        return t if r.offsets == piece.offsets and r.lengths == piece.lengths else narrowed(t, r, piece)

    def wire_target(self, piece: Region, dim: int, record: bool = True) -> torch.Tensor:
        """``_wire(target(piece))`` in one view (``record=False``: a joined piece, whose parts
        were recorded)."""
        r, t, pieces = self._home(piece)
        if record:
            pieces.append(piece)
        return _wire_at(t, r, piece, dim)

    def allocated_bytes(self) -> int:
        return self._allocated

    def check_complete(self, rank: int) -> None:
        """The plan's pieces tile every new region exactly: no overlap, no gap (checked on the
        plan, before the exchange, once per recipe: a function of the plan alone; that the right
        bytes landed is what the piece checksums check)."""
        if self.recipe.cover_checked:
            return
        for r, pieces in self.filled.items():
            why = cover_error(r, pieces)
            if why is not None:
                raise TransitionError(f"rank {rank}: {why}")
        self.recipe.cover_checked = self.recipe.ops is not None

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


def _wire_at(t: torch.Tensor, outer: Region, inner: Region, dim: int) -> torch.Tensor:
    """The part of ``t`` (holding ``outer``) that holds ``inner`` (inside it), with ``dim`` moved
    first: the view ``_wire(narrowed(t, outer, inner))`` is, as one ``as_strided``."""
    return view_of(t, geometry(t, outer, inner, dim))


def _source(store: ShardStore, region: Region, dim: int) -> torch.Tensor:
    """``_wire(store.read(region))``: the piece of a held region, in canonical order, one view."""
    t = store.held(region)
    if t is not None:
        return t if dim == 0 else t.movedim(dim, 0)
    outer, t = store.covering(region)
    return _wire_at(t, outer, region, dim)

STAGING_BYTES = 256 << 20
"""Default bound on one rank's staging buffers in one exchange (see ``round_groups``)."""

def _prepare(plan: TransitionPlan, store: ShardStore, new: _NewLayout, rank: int, bucket_bytes: int,
             major: dict[tuple[str, str], int], views: bool = True):
    """This rank's part of the plan: per round, ("send", peer, wire view, bytes, piece), ("recv",
    peer, wire view, bytes, piece) and ("copy", source wire view, target wire view, bytes, piece)
    items in op-id order, and the bytes per round that go through a staging buffer here (pieces
    below ``bucket_bytes``, packed per peer, and pieces that are not one dense block in storage
    order). A wire view is the piece in its canonical order (``_wire``), the order it travels
    and is checksummed in at both ends. A source piece sent to several peers (or also copied
    here) is one view object: its checksum is taken once (``SourceSums``). The region math is
    the plan's recipe (``reshard.recipe``), derived on first use; the views are made here, one
    ``as_strided`` each. ``views=False``: no items (None) once the recipe's cover is checked,
    the staged bytes from the cache (``apply`` runs the compiled program, ``reshard.program``);
    either way ``new.bases`` is (source tensors per slot, new tensors, their ``Geometry``)."""
    rec = new.recipe
    held = None if rec.ops is None else [store.held(outer) for outer in rec.outers]
    if held is None or any(t is None for t in held):
        _derive(rec, plan, store, new, rank, major)
        held = [store.held(outer) for outer in rec.outers]
    src_t = [held[i] for i in rec.slot_outer]
    dst_t = new.fresh_t
    geo = _geometry(rec, src_t, dst_t)
    new.bases = (src_t, dst_t, geo)
    if not views and rec.cover_checked:
        staged = geo.cache.get(("staged", bucket_bytes))
        if staged is None:
            staged = geo.cache[("staged", bucket_bytes)] = [0] * rec.rounds
            for op, d in zip(rec.ops, geo.dense):
                if op[3] < bucket_bytes or not d:
                    staged[op[0]] += op[3]
        return None, list(staged)
    record = not rec.cover_checked  # the pieces each new region gets: read by the cover check alone
    filled = [[] for _ in rec.fresh]
    items: dict[int, list[tuple]] = defaultdict(list)
    staged = [0] * rec.rounds
    src_views: list[torch.Tensor | None] = [None] * len(src_t)
    dst_at = [t.storage_offset() for t in dst_t]
    g_src, g_dst, g_dense = geo.src, geo.dst, geo.dense
    for k, (rnd, what, peer, n, region, s, h) in enumerate(rec.ops):
        if s >= 0:
            v = src_views[s]
            if v is None:
                v = src_views[s] = view_of(src_t[s], g_src[s])
        if h >= 0:
            if record:
                filled[h].append(region)
            g = g_dst[k]
            w = dst_t[h] if g is None else dst_t[h].as_strided(g[0], g[1], dst_at[h] + g[2])
            if what == "copy":
                items[rnd].append(("copy", v, w, n, region))
                continue
            v = w
        items[rnd].append((what, peer, v, n, region))
        if n < bucket_bytes or not g_dense[k]:
            staged[rnd] += n
    new.filled = dict(zip(rec.fresh, filled))
    new._homes = None
    return items, staged


def _derive(rec, plan: TransitionPlan, store: ShardStore, new: _NewLayout, rank: int,
            major: dict[tuple[str, str], int]) -> None:
    """The recipe's ops (see ``Recipe.ops``) from the plan, with the lookups that find each
    piece's held region and new region (a missing one raises ``TransitionError``, as before any
    byte moves)."""
    ops, sources, slot_of = [], [], {}
    home_of = {r: i for i, r in enumerate(rec.fresh)}
    top = -1
    for op in plan.ops:  # sorted by (round, op id)
        if op.round > top:
            top = op.round
        src, dst = op.src_gpu, op.dst_gpu
        if src != rank and dst != rank:
            continue
        region = op.region
        d = major.get((region.model, region.tensor), 0)
        s = h = -1
        if src == rank:
            s = slot_of.get(region)
            if s is None:
                outer = region if store.held(region) is not None else store.covering(region)[0]
                s = slot_of[region] = len(sources)
                sources.append((outer, region, d))
        if dst == rank:
            h = home_of[new._home(region)[0]]
        what = "copy" if src == dst else "send" if src == rank else "recv"
        ops.append((op.round, what, dst if what == "send" else src, region.nbytes, region, s, h))
    rec.ops, rec.sources, rec.rounds, rec.geometry = ops, sources, top + 1, None
    at = {}
    rec.slot_outer = [at.setdefault(outer, len(at)) for outer, _, _ in sources]
    rec.outers = list(at)


def _geometry(rec, src_t: list[torch.Tensor], dst_t: list[torch.Tensor]) -> Geometry:
    """The recipe's views as ``as_strided`` parameters for these tensors: the cached ones while
    every tensor has the strides they were computed for, else computed again."""
    strides = tuple(t.stride() for t in src_t) + tuple(t.stride() for t in dst_t)
    if rec.geometry is not None and rec.geometry.strides == strides:
        return rec.geometry
    src = [geometry(t, outer, piece, d) for t, (outer, piece, d) in zip(src_t, rec.sources)]
    dst, dense_ = [], []
    for rnd, what, peer, n, region, s, h in rec.ops:
        g = None if h < 0 else geometry(dst_t[h], rec.fresh[h], region, rec.major.get((region.model, region.tensor), 0))
        dst.append(g)
        t, g = (dst_t[h], g) if what == "recv" else (src_t[s], src[s])
        dense_.append(t.is_contiguous() if g is None else dense(g[0], g[1]))
    rec.geometry = Geometry(strides, src, dst, dense_)
    return rec.geometry


def reserve_arena(store: ShardStore, plan: TransitionPlan, rank: int, *, staging_bytes: int | None = STAGING_BYTES,
                  bucket_bytes: int | None = None) -> int:
    """Reserve, at start, the host memory a transition of ``plan`` will take from the arena: its
    new regions (one buffer per dtype) and the staging buffers of each exchange, carved exactly
    as ``apply_transition`` will ask for them, then every page touched (``arena.prefault_free``)
    and handed back to the arena's cache, so the first transition runs on warm memory like later
    ones; the plan's cover check and this rank's compiled exchanges (``reshard.program``) are done
    here too. Nothing moves and the store is unchanged; not collective (exchanges are grouped by this
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
    try:  # the cover check and the compiled exchanges, once, so the first transition runs warm
        new.check_complete(rank)
    except TransitionError:
        pass  # not here: apply_transition reports it, on every rank, before any byte moves
    if new.recipe.cover_checked:
        program(new.recipe, new.bases[2], round_groups(staged, staging_bytes), sizer.bucket_bytes, store, new,
                new.bases[0], new.bases[1])
    for lo, hi in round_groups(staged, staging_bytes):  # held one exchange at a time, as the transition does
        for it in _merged([x for rnd in range(lo, hi + 1) for x in items.get(rnd, ())], store, new, major):
            if it[0] in ("send", "recv"):
                (sizer.submit_send if it[0] == "send" else sizer.submit_recv)(it[1], it[2])
        out, inc = sizer._messages(sizer._sends), sizer._messages(sizer._recvs)
        sizer.close()
        data = _staging([m for _, m in out + inc])  # (the checksum messages go in place: nothing staged)
        del data


def _merged(items: list[tuple], store: ShardStore, new: _NewLayout, major: dict[tuple[str, str], int]) -> list[tuple]:
    """One exchange's items with the pieces of one tensor going between the same two ranks that
    are neighbours along its storage dim joined into one piece (the planner cuts long moves into
    ranges, often into pieces below the bucket size, which would be packed and unpacked: joined,
    they move in place as one dense block). A function of the plan alone, so sender and receiver
    join the same pieces and keep the same order (a joined piece takes its first part's place);
    each joined piece is hashed whole at both ends, so every element is still compared.

    Example: rows [0, 64) and [64, 128) of ``mlp.up_proj.weight``/exp_avg from rank 0 to rank 2,
    in rounds 3 and 7 of one exchange -> rows [0, 128), at the place of the first."""
    rec = new.recipe
    key = join_key(items)
    hit = rec.joins.get(key)
    if hit is None or not same_items(hit[0], items):
        hit = rec.joins[key] = (join_record(items), _joins(items, major))
    joins = hit[1]
    if joins is None:
        return items
    out = []
    for j in joins:
        if type(j) is int:
            out.append(items[j])
            continue
        what, peer, n, joined, d = j
        view = _source(store, joined, d) if what == "send" else new.wire_target(joined, d, record=False)
        out.append((what, peer, view, n, joined))
    return out


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
