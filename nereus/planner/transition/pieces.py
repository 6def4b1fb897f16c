"""Pieces of a transition A -> B: which bytes each GPU needs and which GPU each piece comes from.

A piece is a destination box x an overlapping source box; each is kept in place, copied locally
or transferred. ``build.py`` goes on from here: (src, dst) buckets -> schedule (``schedule.py``)
-> ops (``graph.py``).

Layer templates: every layer whose (stage in A, stage in B) pair is the same has the same
shards, so it is planned once and its pieces carry a multiplicity; the per-layer ops are
expanded only when the plan is materialised. That is what keeps 70B on 1,024 GPUs tractable.

Source choice (a greedy with a proven bound): a destination piece can come from any GPU that
holds its source box (DP replicas; KV replicas when tp > kv_heads). Same GPU first (local copy),
then GPUs on the destination's node, then any; among those, the least-loaded sender, pieces in
decreasing size (LPT). When the candidate sets are disjoint groups of GPUs (DP replica groups
of one model, the usual case) this is Graham list scheduling on identical machines per group,
so the most-loaded sender carries at most OPT + largest piece <= 2 OPT (LPT: 4/3 OPT).
``tests/unit/test_transition_choice.py`` checks it against brute force.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterator, Mapping

from nereus.errors import TransitionError
from nereus.gcpause import gc_paused
from nereus.models.inventory import TensorInfo, storage_dim, tensor_inventory
from nereus.planner.cost.params import CostParams
from nereus.planner.transition.emu import (OPTIMIZER_KINDS, dp_sharded, expert_grid, head_of, kinds_of, layer_stages,
                                           stages_holding, tp_box, zero_box)
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.transition.regions import BoxIndex, intersect, volume
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig
from nereus.planner.transition.types import DTYPE_BYTES, TransitionPlan


@dataclass(frozen=True, slots=True)
class Template:
    """Tensors with identical shape and split (the same tensor of every layer whose stages in A
    and in B are the same; gate/up_proj; k/v_proj) and kinds with identical shards and dtype
    (master, exp_avg, exp_avg_sq), planned once."""

    model: str
    tensors: tuple[str, ...]
    kinds: tuple[str, ...]
    dtype: str
    major: int = 0
    """The dim stored outermost (``storage_dims``): long moves are cut along it, so each piece
    stays one dense block of memory at both ends."""

    @property
    def mult(self) -> int:
        return len(self.tensors) * len(self.kinds)


@dataclass(slots=True)
class Pieces:
    """Output of the piece computation, in template coordinates (before layer expansion)."""

    templates: list[Template] = field(default_factory=list)
    kept: list[tuple[int, tuple, int]] = field(default_factory=list)
    """(template, box, gpu): identical box already on the GPU."""
    moves: list[list] = field(default_factory=list)
    """[template, dst_gpu, piece_box, src_box, candidates, src_gpu (-1 until chosen), bytes]."""
    src_units: list[tuple[int, tuple, int, int, bool]] = field(default_factory=list)
    """(template, box, gpu, bytes, kept) for every source holding (template scale)."""
    bytes_kept: int = 0
    dst_bytes: int = 0


def _layer_groups(layers: int, pp_a: int, pp_b: int, max_group: int) -> list[list[int]]:
    """Layers grouped by (stage in A, stage in B), at most ``max_group`` per group; ordered by
    first layer. Smaller groups give the scheduler finer pieces to interleave; larger ones keep
    big clusters fast."""
    sa, sb = layer_stages(layers, pp_a), layer_stages(layers, pp_b)
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(layers):
        groups.setdefault((sa[i], sb[i]), []).append(i)
    return sorted(g[j:j + max_group] for g in groups.values() for j in range(0, len(g), max_group))


def _role_templates(job: JobSpec, role: str, pa: StagePlacement, pb: StagePlacement) -> Iterator[tuple[TensorInfo, tuple[str, ...]]]:
    model = job.model(role)
    inv = tensor_inventory(model, head_of(role))
    by_layer: dict[int, list[TensorInfo]] = {}
    for t in inv:
        if t.layer is None:
            yield t, (t.name,)
        else:
            by_layer.setdefault(t.layer, []).append(t)
    max_group = model.layers  # per-layer templates did not pay off: long moves are cut along their storage dim instead
    for layers in _layer_groups(model.layers, pa.config.pp, pb.config.pp, max_group):
        rep = layers[0]
        prefix = f"layers.{rep}."
        same_split: dict[tuple, list[TensorInfo]] = {}  # e.g. gate/up_proj, k/v_proj, the two norms
        for t in by_layer[rep]:
            same_split.setdefault((t.shape, t.tp_dim, t.tp_max) + ((t.expert,) if t.expert is not None else ()),
                                  []).append(t)  # a routed expert's placement depends on its index
        for ts in same_split.values():
            yield ts[0], tuple(f"layers.{i}.{t.name[len(prefix):]}" for t in ts for i in layers)


@lru_cache(maxsize=65536)
def _box_grid(shape: tuple[int, ...], tp_dim: int | None, tp_max: int | None, zsplit: bool, tp: int,
              dp: int) -> tuple[tuple[int, int, tuple], ...]:
    """(tp_rank, dp_rank, box) of every shard of a tensor under (tp, dp, DP-sharded or not): it
    depends on the tensor's shape and split only, not on its name or stage, so it is computed once."""
    t = TensorInfo("t", shape, tp_dim, tp_max, None, "layer")
    out = []
    tp_boxes = [tp_box(t, tp, r) for r in range(tp)]
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            box = zero_box(tp_boxes[tp_rank], dp, dp_rank) if zsplit else tp_boxes[tp_rank]
            if box is not None:
                out.append((tp_rank, dp_rank, box))
    return tuple(out)


def _holder_map(job: JobSpec, role: str, t: TensorInfo, kind: str, p: StagePlacement,
                intern: dict | None = None) -> dict[tuple, list[int]]:
    """Box -> GPUs holding it (ascending: the grid runs DP-major, TP-minor, stages in order), for
    one tensor kind under placement ``p``. ``intern`` shares equal GPU lists between tensors, so
    the source choice can cache per list object."""
    model, c = job.model(role), p.config
    out: dict[tuple, list[int]] = {}
    grid = _box_grid(t.shape, t.tp_dim, t.tp_max, dp_sharded(kind, p), c.tp, c.dp) if t.expert is None else \
        _expert_grid(t, model.experts, kind, p)
    for s in stages_holding(model, t, c.pp, head_of(role)):
        base = p.first_gpu + c.tp * c.dp * s
        for tp_rank, dp_rank, box in grid:
            out.setdefault(box, []).append(base + tp_rank + c.tp * dp_rank)
    if intern is not None:
        for box, v in out.items():
            if len(v) > 1:
                out[box] = intern.setdefault(tuple(v), v)
    return out


def _expert_grid(t: TensorInfo, experts: int, kind: str, p: StagePlacement) -> tuple:
    """``_box_grid`` of a routed-expert tensor (``emu.expert_grid``: EP by expert index, etp
    inside the expert, ZeRO over expert-dp)."""
    return expert_grid(t.shape, t.tp_dim, t.expert, experts, "exp_avg" if kind in OPTIMIZER_KINDS else kind, p)


def _kind_groups(role: str, mixed_precision: bool, include_optimizer: bool) -> list[tuple[tuple[str, ...], str]]:
    """Kinds that share boxes and dtype under every layout: (kinds, dtype)."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for kind, dtype in kinds_of(role, mixed_precision=mixed_precision, include_optimizer=include_optimizer):
        groups.setdefault((dtype, kind in OPTIMIZER_KINDS), []).append(kind)
    return [(tuple(k), d) for (d, _), k in groups.items()]


def same_holdings(pa: StagePlacement, pb: StagePlacement) -> bool:
    """True when two placements hold exactly the same regions on the same GPUs (ZeRO 1 and 2
    shard alike, see emu.py)."""
    ca, cb = pa.config, pb.config
    return ((pa.first_gpu, ca.tp, ca.pp, ca.dp, ca.ep, ca.etp) == (pb.first_gpu, cb.tp, cb.pp, cb.dp, cb.ep, cb.etp)
            and all(dp_sharded(k, pa) == dp_sharded(k, pb) for k in ("param", "exp_avg")))


def compute_pieces(job: JobSpec, plan_a: Plan, plan_b: Plan, *, mixed_precision: bool = True,
                   include_optimizer: bool = True, skip_unchanged: bool = False,
                   roles: tuple[str, ...] | None = None) -> Pieces:
    """Every destination box of B split into pieces by the source boxes of A, classified as
    kept (same box, same GPU), local copy (the GPU holds a larger box containing it) or move.
    ``skip_unchanged`` leaves out models whose holdings do not change (cost estimates only)."""
    out = Pieces()
    intern: dict[tuple[int, ...], list[int]] = {}
    for role in roles or job.roles:
        pa, pb = plan_a.home(role), plan_b.home(role)
        if skip_unchanged and same_holdings(pa, pb):
            continue
        for kinds, dtype in _kind_groups(role, mixed_precision, include_optimizer):
            for t, names in _role_templates(job, role, pa, pb):
                ti = len(out.templates)
                out.templates.append(Template(role, names, kinds, dtype, storage_dim(t)))
                _template_pieces(out, ti, _holder_map(job, role, t, kinds[0], pa, intern), _holder_map(job, role, t, kinds[0], pb),
                                 template_cuts(job, role, t, kinds[0], pa, pb), DTYPE_BYTES[dtype] * len(names) * len(kinds))
    return out


def template_cuts(job: JobSpec, role: str, t: TensorInfo, kind: str, pa: StagePlacement, pb: StagePlacement) -> dict:
    """Destination box -> ((source box, intersection, elements), ...) of one tensor template and
    kind between placements ``pa`` and ``pb`` (routed experts by their expert grid)."""
    if t.expert is None:
        return _cuts(t.shape, t.tp_dim, t.tp_max, (dp_sharded(kind, pa), pa.config.tp, pa.config.dp),
                     (dp_sharded(kind, pb), pb.config.tp, pb.config.dp))
    experts = job.model(role).experts
    return _box_cuts(tuple(b for _, _, b in _expert_grid(t, experts, kind, pa)),
                     tuple(b for _, _, b in _expert_grid(t, experts, kind, pb)))


@lru_cache(maxsize=4096)
def _box_cuts(boxes_a: tuple, boxes_b: tuple) -> dict:
    """``_cuts`` from the two box sets themselves (routed experts: ``_expert_grid``)."""
    index = BoxIndex(sorted(set(boxes_a)))
    out = {}
    for box in sorted(set(boxes_b)):
        cuts = ((sbox, intersect(box[0], box[1], sbox[0], sbox[1])) for sbox in index.overlapping(*box))
        out[box] = tuple((sbox, cut, volume(cut[1])) for sbox, cut in cuts)
    return out


@lru_cache(maxsize=4096)
def _cuts(shape: tuple[int, ...], tp_dim: int | None, tp_max: int | None, grid_a: tuple, grid_b: tuple) -> dict:
    """Destination box -> ((source box, intersection, elements), ...) for one tensor shape and
    the two shard grids (DP-sharded, tp, dp): the same for every layer and stage, so computed once."""
    boxes_a = {box for _, _, box in _box_grid(shape, tp_dim, tp_max, *grid_a)}
    boxes_b = {box for _, _, box in _box_grid(shape, tp_dim, tp_max, *grid_b)}
    index = BoxIndex(sorted(boxes_a))
    out = {}
    for box in sorted(boxes_b):
        cuts = ((sbox, intersect(box[0], box[1], sbox[0], sbox[1])) for sbox in index.overlapping(*box))
        out[box] = tuple((sbox, cut, volume(cut[1])) for sbox, cut in cuts)
    return out


def _template_pieces(out: Pieces, ti: int, src: dict, dst: dict, cuts: dict, unit_bytes: int) -> None:
    if src == dst:  # nothing changes for this tensor kind: every holding is kept in place
        for box, gpus in dst.items():
            b = volume(box[1]) * unit_bytes
            out.dst_bytes += b * len(gpus)
            out.bytes_kept += b * len(gpus)
            for g in gpus:
                out.kept.append((ti, box, g))
                out.src_units.append((ti, box, g, b, True))
        return
    src_sets = {box: frozenset(g) for box, g in src.items()}
    kept_at: set[tuple[tuple, int]] = set()
    moves, kept = out.moves, out.kept
    for box, gpus in dst.items():
        nbytes = volume(box[1]) * unit_bytes
        out.dst_bytes += nbytes * len(gpus)
        here = src_sets.get(box, ())
        for g in gpus:
            if g in here:
                kept.append((ti, box, g))
                out.bytes_kept += nbytes
                kept_at.add((box, g))
                continue
            for sbox, cut, n in cuts[box]:
                if g in src_sets[sbox]:
                    moves.append([ti, g, cut, sbox, (g,), g, n * unit_bytes])
                else:
                    moves.append([ti, g, cut, sbox, src[sbox], -1, n * unit_bytes])
    for box, gpus in src.items():
        b = volume(box[1]) * unit_bytes
        for g in gpus:
            out.src_units.append((ti, box, g, b, (box, g) in kept_at))


def choose_sources(pieces: Pieces, cluster: ClusterSpec, bw_intra: float, bw_inter: float) -> dict[int, float]:
    """Pick the sender of every move (see module docstring for the rule and its bound).
    Returns the resulting send time per GPU (``seconds`` of the byte loads the greedy kept)."""
    load: dict[int, list[int]] = {}
    flex: list[tuple[float, int, list, tuple, int]] = []
    gpn = cluster.gpus_per_node
    split: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for i, m in enumerate(pieces.moves):
        dst, cands = m[1], m[4]
        if m[5] >= 0:
            continue  # local copy: no link used
        key = (id(cands), dst // gpn)
        hit = split.get(key)
        if hit is None:  # candidate lists are shared objects: split each by node once
            hit = split[key] = (tuple(c for c in cands if c // gpn == dst // gpn), tuple(cands))
        same = hit[0]
        cands = same or hit[1]
        link = 0 if same else 1
        if len(cands) == 1:
            m[5] = cands[0]
            add_bytes(load, cands[0], link, m[6])
        else:
            flex.append((-(m[6] / (bw_intra if same else bw_inter)), i, m, cands, link))
    flex.sort(key=lambda x: (x[0], x[1]))
    for (_, _, m, _, _), g in zip(flex, least_loaded(((x[2][6], x[4], x[3]) for x in flex), load, bw_intra, bw_inter)):
        m[5] = g
    return seconds(load, bw_intra, bw_inter)


def add_bytes(load: dict[int, list[int]], gpu: int, link: int, nbytes: int) -> None:
    """Add ``nbytes`` to ``gpu``'s bytes over ``link`` (0: within its node, 1: across nodes)."""
    v = load.get(gpu)
    if v is None:
        v = load[gpu] = [0, 0]
    v[link] += nbytes


def seconds(load: Mapping[int, list[int]], bw_intra: float, bw_inter: float) -> dict[int, float]:
    """Per-GPU seconds of per-GPU [intra-node, inter-node] bytes."""
    return {g: v[0] / bw_intra + v[1] / bw_inter for g, v in load.items()}


def least_loaded(items: Iterator[tuple[int, int, tuple[int, ...]]], load: dict[int, list[int]],
                 bw_intra: float, bw_inter: float) -> Iterator[int]:
    """For each (bytes, link, candidate GPUs) in order, the least-loaded candidate (in seconds;
    ties to the lowest id), adding the bytes to its entry of ``load`` (see ``add_bytes``): the
    greedy of ``choose_sources`` (and ``loads``). Loads are integer bytes per link class, so they
    do not depend on the order they were added in: two callers that add the same bytes in another
    order (``loads`` charges a one-sender piece for all its destinations at once) compare the
    same seconds and break every tie alike."""
    heaps: dict[tuple, list[tuple[float, int]]] = {}

    def sec(g: int) -> float:
        v = load.get(g)
        return 0.0 if v is None else v[0] / bw_intra + v[1] / bw_inter

    for nbytes, link, cands in items:
        h = heaps.get(cands)
        if h is None:
            h = heaps[cands] = [(sec(c), c) for c in cands]
            heapq.heapify(h)
        while True:  # lazy heap: loads are shared by every group a GPU belongs to
            lo, g = heapq.heappop(h)
            now = sec(g)
            if lo == now:
                break
            heapq.heappush(h, (now, g))
        add_bytes(load, g, link, nbytes)
        heapq.heappush(h, (sec(g), g))
        yield g


def link_bandwidths(cluster: ClusterSpec, params: CostParams | None = None,
                    bandwidth_override: float | tuple[float, float] | None = None) -> tuple[float, float]:
    """(intra-node, inter-node) bytes/s per GPU per direction, with achieved link efficiency."""
    if bandwidth_override is not None:
        if isinstance(bandwidth_override, (int, float)):
            return float(bandwidth_override), float(bandwidth_override)
        return float(bandwidth_override[0]), float(bandwidth_override[1])
    p = params or CostParams()
    return (cluster.gpu.intra_node_gbps * 1e9 * p.intra_link_eff, cluster.gpu.inter_node_gbps * 1e9 * p.inter_link_eff)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


_PHASES: list[tuple[str, float]] = []
"""Seconds per phase of the last build_transition (reported in TransitionPlan.stats)."""
