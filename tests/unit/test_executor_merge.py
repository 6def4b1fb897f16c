"""Neighbouring pieces joined before they move (``apply._merged``): the planner cuts long moves
into ranges, often below the bucket size; joined, they move in place as one dense block. Both
ends must join the same pieces in the same order, every element must still be hashed at both
ends, and the transition must stay bit-exact (threads over the mock transport)."""
import gc
import threading

from nereus.executor.apply import _merged, _NewLayout, _prepare, apply_transition, round_groups
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, restrict, tiny_job
from nereus.executor.store import ShardStore, contains
from nereus.executor.transport import MockHub, MockTransport
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

JOB = tiny_job(preset("tiny-4l-128h"))
A, B = make_plan(tp=4), make_plan(tp=2, dp=2, zero=0)
TPLAN = restrict(plan_transition(JOB, local_cluster(4), A, B, mixed_precision=True, scheduler="greedy"), "actor")
MAJOR = {(m, t): d for m, t, d in TPLAN.major}


def _items(rank):
    store = ShardStore()
    init_store(store, JOB, A, rank, 0, roles=("actor",), precision="bf16-mixed")
    new = _NewLayout(store, TPLAN, rank, MAJOR)
    items, staged = _prepare(TPLAN, store, new, rank, 1 << 18, MAJOR)
    (lo, hi), = round_groups(staged, None)
    flat = [x for rnd in range(lo, hi + 1) for x in items.get(rnd, ())]
    return flat, _merged(flat, store, new, MAJOR)


def _same_cover(before, after) -> bool:
    """Every piece of ``before`` lies in exactly one piece of ``after`` with the same direction
    and peer, and each piece of ``after`` is exactly as big as the pieces it holds (their union)."""
    before, after = [x for x in before if x[0] != "copy"], [y for y in after if y[0] != "copy"]
    held = {id(y): 0 for y in after}
    for x in before:
        homes = [y for y in after if y[0] == x[0] and y[1] == x[1] and contains(y[4], x[4])]
        if len(homes) != 1:
            return False
        held[id(homes[0])] += x[4].numel
    return all(held[id(y)] == y[4].numel for y in after)


def test_neighbouring_pieces_are_joined_the_same_way_at_both_ends():
    per_rank = [_items(r) for r in range(4)]
    joined_any = False
    for rank, (before, after) in enumerate(per_rank):
        assert sum(x[3] for x in before) == sum(x[3] for x in after)  # same bytes
        assert len(after) <= len(before)
        joined_any |= len(after) < len(before)
        assert _same_cover(before, after), rank  # the same elements of each tensor to/from each peer
        for x in after:  # a joined piece is still one view of exactly its region's size
            assert x[2].numel() == x[4].numel
    assert joined_any, "the planner's cut pieces were not joined (nothing tested)"
    # sender and receiver agree: rank s's joined sends to d are rank d's joined receives from s, in order
    for s in range(4):
        for d in range(4):
            sends = [x[4] for x in per_rank[s][1] if x[0] == "send" and x[1] == d]
            recvs = [x[4] for x in per_rank[d][1] if x[0] == "recv" and x[1] == s]
            assert sends == recvs, (s, d)


def test_a_transition_with_joined_pieces_is_bit_exact():
    hub = MockHub(4)
    stores = [ShardStore() for _ in range(4)]
    for r, s in enumerate(stores):
        init_store(s, JOB, A, r, 0, roles=("actor",), precision="bf16-mixed")
    out: list = [None] * 4

    def run(r):
        try:
            out[r] = apply_transition(stores[r], TPLAN, r, MockTransport(r, hub), timeout_s=20, staging_bytes=None)
        except Exception as e:  # noqa: BLE001 - reported below
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(not isinstance(o, Exception) and o is not None for o in out), out
    for s in stores:
        assert mismatches(s, JOB, 0) == []
    assert sum(o.bytes_sent + o.bytes_copied for o in out) == TPLAN.bytes_moved


def test_reserve_arena_carves_the_transitions_buffers_at_start_and_leaves_the_store_unchanged():
    """``reserve_arena`` takes from a cold arena the host memory the transition will ask for (new
    regions, staging and checksum buffers), touches it and hands it back to the cache; asked again
    for the same transition it reuses those buffers; the store's bytes never change."""
    from nereus.executor import arena
    from nereus.executor.apply import reserve_arena
    from nereus.executor.store import checksum

    gc.collect()  # earlier tests' garbage may still hold arena buffers: freed later, they would count as reserved
    arena.release_cached()
    assert arena.cached_bytes() == 0
    store = ShardStore()
    init_store(store, JOB, A, 1, 0, roles=("actor",), precision="bf16-mixed")
    before = {k: checksum(t) for k, t in store.items()}
    reserved = reserve_arena(store, TPLAN, 1, staging_bytes=None)
    assert reserved == arena.cached_bytes() > 0
    assert reserve_arena(store, TPLAN, 1, staging_bytes=None) == reserved  # the same buffers, reused
    assert {k: checksum(t) for k, t in store.items()} == before
    arena.release_cached()
