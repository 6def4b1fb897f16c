"""Per-GPU send and receive bytes (within a node, across nodes) of one model's move, without listing its pieces.

``transition_cost`` (build.py) needs only the per-GPU load of the source choice, not the pieces
themselves. Listing them costs one entry per (destination GPU, source box): a ZeRO-3 model at
DP 1,024 gathered onto 512 GPUs is 512 x 1,024 entries per tensor template, about 5 million
for an 8B model, and it took seconds per plan pair (most of the simulator's controller time at
1,024 GPUs). Here a source box with one candidate sender is charged in one step: its bytes
times the number of destination GPUs that need it, split into those on the sender's node and
the rest, and each receiver's load comes from per-node sums. Only pieces with a choice of
sender (DP replicas; KV replicas) are listed and go through the same least-loaded greedy, in
the same order, as ``pieces.choose_sources``. Both keep integer bytes per GPU and link class
(within a node, across nodes), so the order of additions does not matter: every GPU's send and
receive load equals that of ``compute_pieces`` + ``choose_sources`` exactly and the greedy breaks
every tie alike (``tests/unit/test_transition_loads.py``, every layout family, MoE included, and
random moves). When the loads were float seconds, a last-bit difference broke a tie the other way
in about 1% of random single-model moves (found by an independent review).
"""
from __future__ import annotations

from nereus.planner.plan import StagePlacement
from nereus.planner.specs import ClusterSpec, JobSpec
from nereus.planner.transition.pieces import (_holder_map, _kind_groups, _role_templates, add_bytes, least_loaded,
                                              template_cuts)
from nereus.planner.transition.types import DTYPE_BYTES


def role_loads(job: JobSpec, cluster: ClusterSpec, role: str, pa: StagePlacement, pb: StagePlacement,
               bw_intra: float, bw_inter: float) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(send, receive) bytes per GPU, [within its node, across nodes], for moving ``role`` from
    ``pa`` to ``pb`` (mixed precision, optimizer state included, as ``compute_pieces``' defaults);
    ``pieces.seconds`` turns them into seconds. The bandwidths order the greedy's choices."""
    gpn = cluster.gpus_per_node
    send: dict[int, list[int]] = {}
    recv: dict[int, list[int]] = {}
    flex: list[tuple[float, int, int, tuple, int, int]] = []  # (-cost, order, dst, candidates, bytes, link)
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
    for (_, _, g_dst, _, nbytes, link), _g in zip(flex, least_loaded(((x[4], x[5], x[3]) for x in flex), send,
                                                                      bw_intra, bw_inter)):
        add_bytes(recv, g_dst, link, nbytes)
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
        by_node: dict[int, int] = {}  # bytes of one-sender pieces whose sender is on that node
        own: dict[int, int] = {}  # bytes a destination already holds in a larger box (local copy)
        total = 0
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
                v = send.get(h)
                if v is None:
                    v = send[h] = [0, 0]
                v[0] += b * same
                v[1] += b * other
            by_node[h // gpn] = by_node.get(h // gpn, 0) + b
            total += b
            if local:
                own[h] = own.get(h, 0) + b
        if total:
            for g in need:
                s = by_node.get(g // gpn, 0)
                intra, inter = s - own.get(g, 0), total - s
                if intra or inter:
                    v = recv.get(g)
                    if v is None:
                        v = recv[g] = [0, 0]
                    v[0] += intra
                    v[1] += inter
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
                link = 0 if same else 1
                if len(cands) == 1:
                    add_bytes(send, cands[0], link, b)
                    add_bytes(recv, g, link, b)
                else:
                    flex.append((-(b / (bw_intra if same else bw_inter)), len(flex), g, cands, b, link))
