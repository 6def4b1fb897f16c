"""Paths of ``apply_transition`` the other executor tests did not reach (found by mutation testing):
a rank that stops answering, a piece whose destination the rank does not hold, staging buffers in
the reported peak, and kept regions moved out of a mostly dead arena buffer (verified after the
copy). Threads over the mock transport, as in test_executor_apply.py."""
import threading
from dataclasses import replace

import pytest

from nereus.errors import TransitionError
from nereus.executor import arena
from nereus.executor.apply import FaultSpec, apply_transition
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
from nereus.executor.store import ShardStore
from nereus.executor.transport import MockHub, MockTransport
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

JOB = tiny_job(preset("tiny-4l-128h"))


def _stores(plan, world):
    stores = [ShardStore() for _ in range(world)]
    for r, st in enumerate(stores):
        init_store(st, JOB, plan, r, seed=0)
    return stores


def _apply(stores, tplan, hub=None, **kw):
    """Every rank on its own thread; each result is an ApplyReport or the TransitionError raised."""
    hub = hub or MockHub(len(stores))
    out: list = [None] * len(stores)
    transport = kw.pop("transport", {})  # every rank's transport alike (popped once, not by the first thread)

    def run(r):
        try:
            out[r] = apply_transition(stores[r], tplan, r, MockTransport(r, hub, **transport), **kw)
        except TransitionError as e:
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


def _tplan(a, b, world=2):
    return plan_transition(JOB, local_cluster(world), a, b, mixed_precision=False, scheduler="greedy")


def test_a_rank_that_stops_answering_past_the_timeout_makes_every_rank_roll_back():
    a, b = make_plan(tp=2), make_plan(dp=2)
    stores = _stores(a, 2)
    before = [st.checksums() for st in stores]
    out = _apply(stores, _tplan(a, b), timeout_s=0.3, fault=FaultSpec(rank=1, round=0, kind="hang", hang_s=1.5))
    assert all(isinstance(r, TransitionError) for r in out), out
    assert "timed out" in str(out[0]) or "timeout" in str(out[0]) or "did not" in str(out[0]), out[0]
    assert [st.checksums() for st in stores] == before


def test_a_piece_sent_to_a_rank_without_its_destination_region_rolls_back_naming_the_piece():
    """B places the actor on GPU 0 alone: a transfer redirected to GPU 1 lands nowhere there."""
    a, b = make_plan(tp=2), make_plan()
    tplan = _tplan(a, b)
    i = next(i for i, op in enumerate(tplan.ops) if op.dst_gpu == 0 and op.src_gpu == 1)
    stray = replace(tplan.ops[i], src_gpu=0, dst_gpu=1)
    stores = _stores(a, 2)
    before = [st.checksums() for st in stores]
    out = _apply(stores, replace(tplan, ops=tplan.ops[:i] + (stray,) + tplan.ops[i + 1:]), timeout_s=5.0)
    assert all(isinstance(r, TransitionError) for r in out), out
    assert "lands in no destination region of this rank" in str(out[1]), out[1]
    assert [st.checksums() for st in stores] == before


def test_staging_buffers_count_in_the_reported_peak():
    """Every piece below the bucket size is packed through a staging buffer: the peak is the old
    state plus the new regions plus the largest exchange's staging, not the first two alone."""
    a, b = make_plan(tp=2), make_plan(dp=2, zero=0)
    tplan = _tplan(a, b)
    stores = _stores(a, 2)
    held = [st.nbytes() for st in stores]
    out = _apply(stores, tplan, timeout_s=5.0, staging_bytes=None, transport={"bucket_bytes": 1 << 30})
    kept = set(tplan.kept)
    for rank, r in enumerate(out):
        assert not isinstance(r, Exception), r
        new = sum(h.region.nbytes for h in tplan.dst if h.gpu == rank and h not in kept)
        assert r.bytes_staged > 0
        assert held[rank] + new < r.peak_bytes <= held[rank] + new + r.bytes_staged, (rank, r.peak_bytes)


def test_kept_regions_in_a_mostly_dead_arena_buffer_move_out_and_are_verified(monkeypatch):
    """TP2 -> DP2 (ZeRO-0) allocates every replica in one arena buffer per rank; DP2 ZeRO-0 ->
    ZeRO-1 keeps the params (a third of that buffer) and drops the moments, so the params move to
    the new buffer (a verified local copy) and the old one is freed at commit."""
    monkeypatch.setattr(arena, "MIN_WASTE", 0)
    old_limit = arena.cache_limit()
    arena.set_cache_limit(0)
    try:
        plans = [make_plan(tp=2), make_plan(dp=2, zero=0), make_plan(dp=2, zero=1)]
        stores = _stores(plans[0], 2)
        hub = MockHub(2)
        assert all(not isinstance(r, Exception) for r in _apply(stores, _tplan(*plans[:2]), hub=hub, timeout_s=5.0))
        tplan = _tplan(*plans[1:])
        kept = [h.region for h in tplan.kept if h.gpu == 0 and h.region.kind == "param"]
        where = {r: stores[0].get(r).untyped_storage().data_ptr() for r in kept}
        in_arena = [r for r in kept if arena.mostly_dead([stores[0].get(r)], 0)[0]]
        assert in_arena, "the kept params live in a buffer that is mostly dead after this transition"
        out = _apply(stores, tplan, hub=hub, timeout_s=5.0)
        assert all(not isinstance(r, Exception) for r in out), out
        moved = [r for r in in_arena if stores[0].get(r).untyped_storage().data_ptr() != where[r]]
        assert moved == in_arena
        assert out[0].bytes_copied >= sum(r.nbytes for r in moved)
        assert all(mismatches(st, JOB, seed=0) == [] for st in stores)
    finally:
        arena.set_cache_limit(old_limit)
        arena.release_cached()


def test_a_relocated_region_that_differs_from_its_source_rolls_back(monkeypatch):
    """The same relocation with the copy into the new buffer gone wrong (its first element off by
    one): the relocated region's checksum catches it and every rank rolls back."""
    import nereus.executor.apply as apply_mod

    monkeypatch.setattr(arena, "MIN_WASTE", 0)
    real_init = apply_mod._NewLayout.__init__
    relocated = []

    def bad_copy(self, *a, **k):
        real_init(self, *a, **k)
        for r in self.relocated:
            t = self.tensors[r]
            t[(0,) * t.dim()] += 1
            relocated.append(r)

    old_limit = arena.cache_limit()
    arena.set_cache_limit(0)
    try:
        plans = [make_plan(tp=2), make_plan(dp=2, zero=0), make_plan(dp=2, zero=1)]
        stores = _stores(plans[0], 2)
        hub = MockHub(2)
        assert all(not isinstance(r, Exception) for r in _apply(stores, _tplan(*plans[:2]), hub=hub, timeout_s=5.0))
        before = [st.checksums() for st in stores]
        monkeypatch.setattr(apply_mod._NewLayout, "__init__", bad_copy)
        out = _apply(stores, _tplan(*plans[1:]), hub=hub, timeout_s=5.0)
        assert relocated
        assert all(isinstance(r, TransitionError) for r in out), out
        assert any("differs after its copy to the new arena" in str(r) for r in out), out
        assert [st.checksums() for st in stores] == before
    finally:
        arena.set_cache_limit(old_limit)
        arena.release_cached()


def test_rounds_merge_while_their_staging_is_at_most_the_limit_inclusive():
    from nereus.executor.apply import round_groups

    assert round_groups([5, 5, 1], 10) == [(0, 1), (2, 2)]  # 5 + 5 == 10: still one exchange
    assert round_groups([5, 6], 10) == [(0, 0), (1, 1)]
    assert round_groups([12, 0, 0], 10) == [(0, 0), (1, 2)]  # a round over the limit runs alone, unsplit


@pytest.mark.parametrize("staging_bytes", [0, None])
def test_every_byte_one_rank_sends_another_receives_and_the_plan_moves_exactly_those(staging_bytes):
    a, b = make_plan(tp=2, pp=2), make_plan(dp=4, zero=1)
    tplan = _tplan(a, b, 4)
    out = _apply(_stores(a, 4), tplan, timeout_s=5.0, staging_bytes=staging_bytes)
    assert all(not isinstance(r, Exception) for r in out), out
    sent, received = sum(r.bytes_sent for r in out), sum(r.bytes_received for r in out)
    assert sent == received > 0
    assert sent + sum(r.bytes_copied for r in out) == tplan.bytes_moved
    for rank, r in enumerate(out):  # what this rank's part of the plan sends and receives
        assert r.bytes_sent == sum(op.region.nbytes for op in tplan.ops if op.src_gpu == rank != op.dst_gpu)
        assert r.bytes_received == sum(op.region.nbytes for op in tplan.ops if op.dst_gpu == rank != op.src_gpu)
