"""Per-GPU send and receive seconds of one model's move, without listing its pieces.

``transition_cost`` (build.py) needs only the per-GPU load of the source choice, not the pieces
themselves. Listing them costs one entry per (destination GPU, source box): a ZeRO-3 model at
DP 1,024 gathered onto 512 GPUs is 512 x 1,024 entries per tensor template, about 5 million
for an 8B model, and it took seconds per plan pair (most of the simulator's controller time at
1,024 GPUs). Here a source box with one candidate sender is charged in one step: its bytes
times the number of destination GPUs that need it, split into those on the sender's node and
the rest, and each receiver's load comes from per-node sums. Only pieces with a choice of
sender (DP replicas; KV replicas) are listed and go through the same least-loaded greedy, in
the same order, as ``pieces.choose_sources``. Receive loads and the total sent equal those of
``compute_pieces`` + ``choose_sources`` up to the order of floating-point additions, and so does
every GPU's send load wherever the greedy meets no tie (``tests/unit/test_transition_loads.py``,
every layout family, MoE included). Where it does, a last-bit difference in a one-sender GPU's
load can break the tie the other way: another assignment by the same greedy, under the same bound.
An independent review found that in about 1% of random single-model moves, and a random plan pair
whose cost moved by 2% (0.553 -> 0.542 s); on the simulator's 47 plan pairs at 1,024 GPUs none did,
and every simulated figure stayed the same. Exact agreement would need both sides to accumulate
integer bytes per link class (not done).
"""
from __future__ import annotations

from nereus.planner.plan import StagePlacement
from nereus.planner.specs import ClusterSpec, JobSpec
from nereus.planner.transition.pieces import _holder_map, _kind_groups, _role_templates, least_loaded, template_cuts
from nereus.planner.transition.types import DTYPE_BYTES


def role_loads(job: JobSpec, cluster: ClusterSpec, role: str, pa: StagePlacement, pb: StagePlacement,
               bw_intra: float, bw_inter: float) -> tuple[dict[int, float], dict[int, float]]:
    """(send, receive) seconds per GPU for moving ``role`` from ``pa`` to ``pb`` (mixed precision,
    optimizer state included, as ``compute_pieces``' defaults)."""
    gpn = cluster.gpus_per_node
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    flex: list[tuple[float, int, int, tuple, float]] = []  # (-cost, order, dst, candidates, bytes)
    intern: dict[tuple[int, ...], list[int]] = {}
    split: dict[tuple[int, int], tuple[int, ...]] = {}
    for kinds, dtype in _kind_groups(role, True, True):
        for t, names in _role_templates(job, role, pa, pb):
            src = _holder_map(job, role, t, kinds[0], pa, intern)
            dst = _holder_map(job, role, t, kinds[0], pb)
            if src == dst:
                continue  # every holding kept in place
            unit = DTYPE_BYTES[dtype] * len(names) * len(kinds)
            _template(src, dst, template_cuts(job, role, t, kinds[0], pa, pb), unit, gpn, bw_intra, bw_inter,
                      send, recv, flex, split)
    flex.sort(key=lambda x: (x[0], x[1]))
    for (_, _, g_dst, _, nbytes), g in zip(flex, least_loaded(((-x[0], x[3]) for x in flex), send)):
        bw = bw_intra if g // gpn == g_dst // gpn else bw_inter
        recv[g_dst] = recv.get(g_dst, 0.0) + nbytes / bw
    return send, recv


def _template(src: dict, dst: dict, cuts: dict, unit: int, gpn: int, bw_intra: float, bw_inter: float,
              send: dict, recv: dict, flex: list, split: dict) -> None:
    src_sets = {box: frozenset(g) for box, g in src.items()}
    for box, gpus in dst.items():
        here = src_sets.get(box, ())
        need = [g for g in gpus if g not in here]  # the rest keep the identical box in place
        if not need:
            continue
        need_set = frozenset(need)
        per_node: dict[int, int] = {}
        for g in need:
            per_node[g // gpn] = per_node.get(g // gpn, 0) + 1
        by_node: dict[int, float] = {}  # bytes of one-sender pieces whose sender is on that node
        own: dict[int, float] = {}  # bytes a destination already holds in a larger box (local copy)
        total = 0.0
        multi = []
        for sbox, _cut, n in cuts[box]:
            holders = src[sbox]
            b = n * unit
            if len(holders) > 1:
                multi.append((holders, src_sets[sbox], b))
                continue
            h = holders[0]
            local = h in need_set
            same = per_node.get(h // gpn, 0) - local
            other = len(need) - local - same
            if same or other:
                send[h] = send.get(h, 0.0) + b * same / bw_intra + b * other / bw_inter
            by_node[h // gpn] = by_node.get(h // gpn, 0.0) + b
            total += b
            if local:
                own[h] = own.get(h, 0.0) + b
        if total:
            for g in need:
                s = by_node.get(g // gpn, 0.0)
                r = (s - own.get(g, 0.0)) / bw_intra + (total - s) / bw_inter
                if r:
                    recv[g] = recv.get(g, 0.0) + r
        for g in need:
            node = g // gpn
            for holders, hs, b in multi:
                if g in hs:
                    continue  # local copy: no link used
                key = (id(holders), node)
                same = split.get(key)
                if same is None:
                    same = split[key] = tuple(c for c in holders if c // gpn == node)
                cands = same or tuple(holders)
                bw = bw_intra if same else bw_inter
                if len(cands) == 1:
                    send[cands[0]] = send.get(cands[0], 0.0) + b / bw
                    recv[g] = recv.get(g, 0.0) + b / bw
                else:
                    flex.append((-(b / bw), len(flex), g, cands, b))
