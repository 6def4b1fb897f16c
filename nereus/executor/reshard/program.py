"""This rank's exchanges of a transition compiled once per (plan, rank, tensor strides, exchanges,
bucket size) and replayed by every later transition of the same plan (``program``).

What a transition derives per piece is a function of the plan and of the tensors' strides alone:
which messages go to which peer, which pieces each carries (packed or in place, in the order the
transport lays them out: ``Transport._messages``), which source pieces each message's checksums
are taken from, the local copies, and each piece's view as ``as_strided`` parameters over the
tensor of its region. ``Program`` holds all of it as lists of indices, so a warm transition makes
one ``as_strided`` per distinct piece (``views``) and posts prebuilt messages: no per-piece
grouping, lookups or hashing bookkeeping. Only the tensors are new each time.

It is kept on the recipe's ``Geometry`` (``reshard.recipe``): a recipe belongs to one plan object
and rank, and a ``Geometry`` to the strides of that rank's tensors, so a program is never reused
for another plan, rank or memory layout; within it, one program per (exchanges, bucket size).

Example (the benchmark's tiny Llama, TP4 -> TP2xDP2, rank 0): 480 ops in one exchange, 120
messages out, 120 in, 120 local copies; ``views`` is one list comprehension of 588 ``as_strided``
calls (each source piece once, each destination piece once), then the exchange posts the 240
prebuilt messages."""
from __future__ import annotations

from collections import defaultdict

import torch

from nereus.executor.reshard.recipe import dense, geometry
from nereus.executor.store import TORCH_DTYPES
from nereus.executor.transport import SEND_GROUP_BYTES
from nereus.planner.transition.types import Region


class Exchange:
    """One exchange (rounds ``lo``..``hi``) as indices into the program's views."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.sends: list[tuple[int, int | list[int]]] = []
        """Per outgoing message, in posting order: (peer, view index sent in place, or the
        indices of the views packed into one staging buffer)."""
        self.send_sums: list[list[tuple[int, int]]] = []
        """Per outgoing message: (source checksum id, view index) of each piece it carries."""
        self.send_groups: list[tuple[int, int, int, list[int]]] = []
        """The outgoing messages in posting groups of at least ``SEND_GROUP_BYTES`` (the last may
        be smaller), in order: (end message index, first and end checksum id, view indices). Before
        a group is posted, the pieces it carries that no earlier message carried are hashed from
        their source views, in one call; their checksum ids are consecutive (ids are numbered in
        the order pieces are first hashed), so the values fill ``sums[first:end]``."""
        self.peer_sums: list[tuple[int, list[int]]] = []
        """Per peer sent to, in peer order: the checksum ids of the pieces its messages carry, in
        message order (the checksum message posted behind the data)."""
        self.recvs: list[tuple[int, int | list[int]]] = []
        """Per incoming message, like ``sends``."""
        self.recv_at: list[int] = [0]
        """Per incoming message, where its pieces' checksums start in the exchange's received
        checksums (every peer's, in message order, peers in order), then their count."""
        self.recv_peers: list[tuple[int, int, int]] = []
        """(peer, first, end) of each peer's pieces in those checksums, in peer order."""
        self.recv_regions: dict[int, list[Region]] = {}
        """Per peer: the pieces its messages fill, in order (named when a checksum differs)."""
        self.copies: list[tuple[int, int, int, int, Region]] = []
        """Local copies: (source view, target view, source checksum id, bytes, piece)."""
        self.copy_sums: tuple[int, int, list[int]] = (0, 0, [])
        """The copies' sources no message of the exchange carries: (first and end checksum id,
        view indices), hashed together before the copies run."""
        self.sent = self.incoming = self.staging = 0
        """Bytes sent, bytes received, bytes that go through staging buffers (packed sends and
        staged receives)."""


class Program:
    """This rank's compiled transition (see the module docstring)."""

    def __init__(self, specs: list[tuple[int, tuple | None]], extras: list[Region], exchanges: list[Exchange],
                 sums: int) -> None:
        self.specs = specs
        """Per view: (base tensor index, ``as_strided`` parameters or None for the base itself);
        bases are the recipe's source slots, then its new regions, then ``extras``."""
        self.extras = extras
        """Held regions that joined pieces are read from and no single piece's slot is (none in
        the planner's plans so far: a joined piece lies in the held region of its parts)."""
        self.extra_strides: list[tuple] = []
        """Their tensors' strides at compile time (the recipe's ``Geometry`` covers the others)."""
        self.exchanges = exchanges
        self.sums = sums
        """Distinct source pieces checksummed (a piece sent to several peers or also copied here
        is hashed once per transition)."""

    def views(self, store, src_t: list[torch.Tensor], dst_t: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Every view of this transition over the current tensors; None where a held region a
        joined piece is read from is not held, or not with the strides compiled for (compile
        again: ``program(..., again=True)``)."""
        extra = [store.held(r) for r in self.extras]
        if any(t is None for t in extra) or [t.stride() for t in extra] != self.extra_strides:
            return None
        bases = src_t + dst_t + extra
        offs = [t.storage_offset() for t in bases]
        return [bases[b] if g is None else bases[b].as_strided(g[0], g[1], offs[b] + g[2]) for b, g in self.specs]


def program(rec, geo, groups: list[tuple[int, int]], bucket_bytes: int, store, new, src_t: list[torch.Tensor],
            dst_t: list[torch.Tensor], again: bool = False) -> Program:
    """The cached program of these exchanges and bucket size for ``geo`` (the recipe's geometry
    for the current tensors' strides), compiled on first use (``again``: compiled anew)."""
    key = ("program", tuple(groups), bucket_bytes)
    prog = None if again else geo.cache.get(key)
    if prog is None:
        prog = geo.cache[key] = _compile(rec, geo, groups, bucket_bytes, store, new, src_t, dst_t)
    return prog


def _compile(rec, geo, groups, bucket_bytes, store, new, src_t, dst_t) -> Program:
    n_src = len(src_t)
    specs: list[tuple[int, tuple | None]] = [(s, g) for s, g in enumerate(geo.src)]  # view s: slot s
    contiguous = [t.is_contiguous() if g is None else dense(g[0], g[1]) for t, g in zip(src_t, geo.src)]
    base_of = {}
    for s, (outer, _, _) in enumerate(rec.sources):
        base_of.setdefault(outer, s)
    extras: list[Region] = []
    sum_id: dict[Region, int] = {}
    home_of = {r: i for i, r in enumerate(rec.fresh)}

    def add(base: int, t: torch.Tensor, g) -> int:
        specs.append((base, g))
        contiguous.append(t.is_contiguous() if g is None else dense(g[0], g[1]))
        return len(specs) - 1

    def joined_view(what: str, piece: Region, d: int) -> int:
        if what == "send":
            outer = piece if store.held(piece) is not None else store.covering(piece)[0]
            base = base_of.get(outer)
            if base is None:
                base = base_of[outer] = n_src + len(dst_t) + len(extras)
                extras.append(outer)
            t = store.held(outer)
            return add(base, t, geometry(t, outer, piece, d))
        h = home_of[new._home(piece)[0]]
        return add(n_src + h, dst_t[h], geometry(dst_t[h], rec.fresh[h], piece, d))

    by_round: dict[int, list[int]] = defaultdict(list)
    for k, op in enumerate(rec.ops):
        by_round[op[0]].append(k)
    exchanges = []
    for lo, hi in groups:
        ks = [k for rnd in range(lo, hi + 1) for k in by_round.get(rnd, ())]
        items = []  # (what, peer, view, bytes, piece), the shape ``_joins`` reads
        for k in ks:
            _, what, peer, n, region, s, h = rec.ops[k]
            dst = -1 if h < 0 else add(n_src + h, dst_t[h], geo.dst[k])
            if what == "copy":
                items.append(("copy", s, dst, n, region))
            else:
                items.append((what, peer, s if what == "send" else dst, n, region))
        joins = _joins(items, rec.major)
        if joins is not None:
            items = [items[j] if type(j) is int else (j[0], j[1], joined_view(j[0], j[3], j[4]), j[2], j[3])
                     for j in joins]
        exchanges.append(_layout(Exchange(lo, hi), items, contiguous, sum_id, bucket_bytes))
    prog = Program(_used(specs, exchanges), extras, exchanges, len(sum_id))
    prog.extra_strides = [store.held(r).stride() for r in extras]
    return prog


def _used(specs: list[tuple], exchanges: list[Exchange]) -> list[tuple]:
    """The views the exchanges use, renumbered in order of first use (a piece joined into a
    larger one, or a source slot only joined pieces read, is not made at all)."""
    new: dict[int, int] = {}

    def at(v: int) -> int:
        return new.setdefault(v, len(new))

    def msg(m):
        return at(m) if type(m) is int else [at(v) for v in m]

    for x in exchanges:
        x.sends = [(peer, msg(m)) for peer, m in x.sends]
        x.recvs = [(peer, msg(m)) for peer, m in x.recvs]
        x.copies = [(at(src), at(dst), h, n, r) for src, dst, h, n, r in x.copies]
        x.send_sums = [[(h, at(v)) for h, v in ids] for ids in x.send_sums]
        x.send_groups = [(end, first, stop, [at(v) for v in fresh]) for end, first, stop, fresh in x.send_groups]
        first, stop, fresh = x.copy_sums
        x.copy_sums = (first, stop, [at(v) for v in fresh])
    return [specs[v] for v in new]


def _layout(x: Exchange, items: list[tuple], contiguous: list[bool], sum_id: dict, bucket_bytes: int) -> Exchange:
    """The exchange's messages as ``Transport._messages`` lays out the same submitted tensors:
    per (peer, dtype), in (peer, dtype name) order, the pieces below ``bucket_bytes`` packed into
    one message, then each larger one in submission order (in place where it is one dense block,
    else through its own staging buffer); then the hashing plan (``send_groups``, ``peer_sums``,
    ``copy_sums``, ``recv_at``, ``recv_peers``)."""
    queued: dict[str, dict[tuple[int, torch.dtype], list[tuple]]] = {"send": defaultdict(list),
                                                                     "recv": defaultdict(list)}
    copies = []
    for it in items:
        what = it[0]
        if what == "copy":
            copies.append(it)
            continue
        _, peer, v, n, region = it
        queued[what][(peer, TORCH_DTYPES[region.dtype])].append((v, n, region))
        if what == "send":
            x.sent += n
        else:
            x.incoming += n
    carried: list[list[tuple]] = []
    for what, out in (("send", x.sends), ("recv", x.recvs)):
        for (peer, _), pieces in sorted(queued[what].items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            small = [p for p in pieces if p[1] < bucket_bytes]
            big = [p for p in pieces if p[1] >= bucket_bytes]
            msgs = ([small] if small else []) + [[p] for p in big]
            for m in msgs:
                staged = len(m) > 1 or m[0][1] < bucket_bytes or not contiguous[m[0][0]]
                out.append((peer, [p[0] for p in m] if staged else m[0][0]))
                if staged:
                    x.staging += sum(p[1] for p in m)
                if what == "send":
                    carried.append(m)
                else:
                    x.recv_regions.setdefault(peer, []).extend(p[2] for p in m)
                    x.recv_at.append(x.recv_at[-1] + len(m))
    _hash_plan(x, carried, copies, sum_id)
    return x


def _hash_plan(x: Exchange, carried: list[list[tuple]], copies: list[tuple], sum_id: dict) -> None:
    """Which source pieces are hashed before each posting group and before the copies, with
    checksum ids numbered in that order (each distinct piece once per transition)."""
    peer_sums: dict[int, list[int]] = defaultdict(list)
    size, first, fresh = 0, len(sum_id), []
    for j, ((peer, _), m) in enumerate(zip(x.sends, carried)):
        ids = []
        for v, n, region in m:
            h = sum_id.get(region)
            if h is None:
                h = sum_id[region] = len(sum_id)
                fresh.append(v)
            ids.append(h)
            size += n
        x.send_sums.append(list(zip(ids, (p[0] for p in m))))
        peer_sums[peer] += ids
        if size >= SEND_GROUP_BYTES or j == len(carried) - 1:
            x.send_groups.append((j + 1, first, len(sum_id), fresh))
            size, first, fresh = 0, len(sum_id), []
    x.peer_sums = sorted(peer_sums.items())
    first, fresh = len(sum_id), []
    for _, src, dst, n, region in copies:
        h = sum_id.get(region)
        if h is None:
            h = sum_id[region] = len(sum_id)
            fresh.append(src)
        x.copies.append((src, dst, h, n, region))
    x.copy_sums = (first, len(sum_id), fresh)
    at = 0
    for peer, regions in sorted(x.recv_regions.items()):
        x.recv_peers.append((peer, at, at + len(regions)))
        at += len(regions)


def hash_sources(sums: list, views: list[torch.Tensor], first: int, end: int, fresh: list[int], checksums_of) -> None:
    """``sums[first:end]``: the checksums of the source views ``fresh`` (a posting group's or the
    copies' pieces not hashed before in this transition), each from the source region itself."""
    if fresh:
        sums[first:end] = checksums_of([views[i] for i in fresh])


def _joins(items: list[tuple], major: dict[tuple[str, str], int]) -> list | None:
    """``_merged``'s plan for ``items`` (a function of their pieces alone): per item of the
    result, the index of an item kept as it is, or (what, peer, bytes, joined piece, dim); None
    when nothing joins."""
    runs: dict[tuple, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        if it[0] != "copy":
            r = it[4]
            d = major.get((r.model, r.tensor), 0)
            runs[(it[0], it[1], r.model, r.tensor, r.kind, r.dtype, d, r.offsets[:d] + r.offsets[d + 1:],
                  r.lengths[:d] + r.lengths[d + 1:])].append(i)
    first: dict[int, tuple] = {}
    drop: set[int] = set()
    for key, idx in runs.items():
        if len(idx) < 2:
            continue
        what, peer, d = key[0], key[1], key[6]
        idx.sort(key=lambda i: items[i][4].offsets[d])
        chain = [idx[0]]
        for i in idx[1:] + [None]:
            prev = items[chain[-1]][4]
            if i is not None and items[i][4].offsets[d] == prev.offsets[d] + prev.lengths[d]:
                chain.append(i)
                continue
            if len(chain) > 1:
                lo = items[chain[0]][4]
                joined = Region(lo.model, lo.tensor, lo.kind, lo.offsets, lo.lengths[:d]
                                + (sum(items[j][4].lengths[d] for j in chain),) + lo.lengths[d + 1:], lo.dtype)
                first[min(chain)] = (what, peer, sum(items[j][3] for j in chain), joined, d)
                drop.update(chain)
            chain = [i] if i is not None else []
    if not first:
        return None
    return [first.get(i, i) for i in range(len(items)) if i in first or i not in drop]
