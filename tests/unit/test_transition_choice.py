"""Source choice: the greedy's proven bound against brute force, and its preferences
(same GPU, then same node)."""
import itertools

from hypothesis import given, settings, strategies as st

from nereus.planner.specs import GPU_PRESETS, ClusterSpec
from nereus.planner.transition.pieces import Pieces, choose_sources

ONE_NODE = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=1, gpus_per_node=16)
GROUPS = ((0, 1, 2), (3, 4), (5,))


def pieces_of(jobs):
    p = Pieces()
    for i, (group, nbytes) in enumerate(jobs):
        p.moves.append([0, 10 + i % 4, ((0,), (1,)), ((0,), (1,)), GROUPS[group], -1, nbytes])
    return p


def brute_force(jobs) -> float:
    best = float("inf")
    for pick in itertools.product(*(GROUPS[g] for g, _ in jobs)):
        load: dict[int, float] = {}
        for gpu, (_, b) in zip(pick, jobs):
            load[gpu] = load.get(gpu, 0) + b
        best = min(best, max(load.values()))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]), st.integers(1, 50)), min_size=1, max_size=7))
def test_greedy_within_proven_bound_of_optimum(jobs):
    p = pieces_of(jobs)
    load = choose_sources(p, ONE_NODE, 1.0, 1.0)
    got = max(load.values())
    opt = brute_force(jobs)
    assert all(m[5] in GROUPS[g] for m, (g, _) in zip(p.moves, jobs))
    # disjoint replica groups: list scheduling <= OPT + largest piece, and LPT <= 4/3 OPT per group
    assert got <= opt + max(b for _, b in jobs)
    assert got <= 4 / 3 * opt + 1e-9


def test_prefers_same_gpu_then_same_node():
    cluster = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=2, gpus_per_node=4)
    p = Pieces()
    p.moves.append([0, 5, ((0,), (4,)), ((0,), (4,)), (5,), 5, 8])  # local copy stays local
    p.moves.append([0, 6, ((0,), (4,)), ((0,), (4,)), (0, 1, 4), -1, 8])  # GPU 4 shares node 1 with GPU 6
    p.moves.append([0, 7, ((0,), (4,)), ((0,), (4,)), (0, 1, 4), -1, 8])
    load = choose_sources(p, cluster, 10.0, 1.0)
    assert p.moves[0][5] == 5 and p.moves[1][5] == 4 and p.moves[2][5] == 4
    assert load == {4: 1.6}  # both on NVLink rather than one each over the slower scale-out link
