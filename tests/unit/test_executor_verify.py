"""End-to-end verification of a transition (threads over the mock transport): the plan's pieces
must tile every destination region exactly, and every destination piece, hashed where it
landed after unpacking and local copies, must equal its source's hash. Also mixed-precision
state (bf16 params, fp32 master and moments) moving under the planner's default kinds."""
import threading
from dataclasses import replace

import pytest
import torch

import nereus.executor.transport as transport_mod
from nereus.errors import SpecError, TransitionError
from nereus.executor.apply import FaultSpec, apply_transition
from nereus.executor.layout import state_kinds
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
from nereus.executor.store import ShardStore, cover_error
from nereus.executor.transport import MockHub, MockTransport
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition
from nereus.planner.transition.emu import kinds_of
from nereus.planner.transition.types import Region

JOB = tiny_job(preset("tiny-4l-128h"))


def _box(rows: tuple[int, int], cols: tuple[int, int] = (0, 8)) -> Region:
    return Region("actor", "w", "param", (rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0]), "fp32")


def test_cover_error_sees_an_overlap_that_a_gap_of_the_same_size_hides_from_a_count():
    whole = _box((0, 4))
    assert cover_error(whole, [_box((0, 2)), _box((2, 4))]) is None
    assert cover_error(whole, [_box((0, 4), (0, 5)), _box((0, 4), (5, 8))]) is None  # same rows, split columns
    assert cover_error(whole, [_box((2, 4)), _box((0, 1)), _box((1, 2))]) is None  # any order
    # 16 + 16 = 32 elements, as many as the region: row 1 twice, row 3 never
    assert "overlap" in cover_error(whole, [_box((0, 2)), _box((1, 3))])
    assert "overlap" in cover_error(whole, [_box((0, 4), (0, 5)), _box((0, 4), (4, 7)), _box((0, 4), (7, 8))])
    assert cover_error(whole, [_box((0, 2)), _box((3, 4))]) == (
        "the plan fills 24 of the 32 elements of w/param at (0, 0)+(4, 8)")


def _run(tplan, stores, fault=None, timeout_s=5.0):
    hub = MockHub(len(stores))
    results: list = [None] * len(stores)

    def run(r):
        try:
            results[r] = apply_transition(stores[r], tplan, r, MockTransport(r, hub), timeout_s=timeout_s, fault=fault)
        except TransitionError as e:
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return results


def _stores(plan, world, precision="fp32"):
    stores = [ShardStore() for _ in range(world)]
    for r, s in enumerate(stores):
        init_store(s, JOB, plan, r, seed=0, precision=precision)
    return stores


def test_overlapping_pieces_with_the_right_element_count_roll_back_before_any_byte_moves():
    a, b = make_plan(tp=2), make_plan()
    tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=False, scheduler="greedy")
    # a piece rank 0 receives, moved one row up inside its destination region: it overlaps the
    # piece before it by one row and leaves the last row empty; the element count still adds up
    i, op = next((i, op) for i, op in enumerate(tplan.ops) if op.src_gpu == 1 and op.dst_gpu == 0
                 and op.region.tensor.endswith("up_proj.weight") and op.region.offsets[0] > 0)
    moved = replace(op.region, offsets=(op.region.offsets[0] - 1,) + op.region.offsets[1:])
    ops = tplan.ops[:i] + (replace(op, region=moved),) + tplan.ops[i + 1:]
    stores = _stores(a, 2)
    before = [s.checksums() for s in stores]
    results = _run(replace(tplan, ops=ops), stores)
    assert all(isinstance(r, TransitionError) for r in results), results
    assert "overlap" in str(results[0]) and f"{op.region.tensor}/{op.region.kind}" in str(results[0])
    assert results[0].bytes_received == 0
    assert [s.checksums() for s in stores] == before


def test_bytes_scattered_to_the_wrong_place_after_the_wire_are_caught(monkeypatch):
    """The bucket arrives intact (a per-message checksum would pass) but two equal-sized pieces
    are unpacked into each other's places: only hashing where they landed sees it."""
    unpack = transport_mod._unpack

    def misplaced(flat, into):
        into = list(into)
        sizes = [t.numel() for t in into]
        pair = next(((i, j) for i in range(len(into)) for j in range(i + 1, len(into)) if sizes[i] == sizes[j]), None)
        if pair is not None:
            i, j = pair
            into[i], into[j] = into[j], into[i]
        unpack(flat, into)

    monkeypatch.setattr(transport_mod, "_unpack", misplaced)
    a, b = make_plan(tp=2), make_plan(dp=2)
    tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=False, scheduler="greedy")
    stores = _stores(a, 2)
    before = [s.checksums() for s in stores]
    results = _run(tplan, stores)
    assert all(isinstance(r, TransitionError) for r in results), results
    assert any("differs from its source after it landed" in str(r) for r in results), results
    assert [s.checksums() for s in stores] == before


def test_a_local_copy_that_goes_wrong_is_caught():
    a, b = make_plan(tp=2), make_plan(dp=2)
    tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=False, scheduler="greedy")
    rnd = next(op.round for op in tplan.ops if op.is_copy and op.src_gpu == 1)
    stores = _stores(a, 2)
    before = [s.checksums() for s in stores]
    results = _run(tplan, stores, fault=FaultSpec(rank=1, round=rnd, kind="corrupt-copy"))
    assert all(isinstance(r, TransitionError) for r in results), results
    assert "differs from its source after the local copy" in str(results[1])
    assert "another rank failed to verify" in str(results[0])
    assert [s.checksums() for s in stores] == before


def test_the_executor_holds_the_planners_kinds():
    for precision, mixed in (("fp32", False), ("bf16-mixed", True)):
        assert state_kinds(True, precision) == kinds_of("actor", mixed_precision=mixed)
        assert state_kinds(False, precision) == kinds_of("ref", mixed_precision=mixed)
    with pytest.raises(SpecError, match="precision must be one of fp32, bf16-mixed, got 'fp16'"):
        state_kinds(True, "fp16")


def test_a_default_mixed_precision_plan_applies_bit_exactly():
    """plan_transition's default (mixed_precision=True): bf16 params, fp32 master and moments,
    ZeRO-1 shares of the master and moments after the move."""
    a, b = make_plan(tp=2, pp=2), make_plan(dp=4, zero=1)
    tplan = plan_transition(JOB, local_cluster(4), a, b, scheduler="greedy")
    assert {(h.region.kind, h.region.dtype) for h in tplan.src} == {
        ("param", "bf16"), ("master", "fp32"), ("exp_avg", "fp32"), ("exp_avg_sq", "fp32")}
    stores = _stores(a, 4, "bf16-mixed")
    results = _run(tplan, stores)
    assert all(not isinstance(r, Exception) for r in results), results
    for rank, s in enumerate(stores):
        assert sorted(s) == sorted(h.region for h in tplan.dst if h.gpu == rank)
        assert mismatches(s, JOB, seed=0) == []
        master = s.find("actor", "layers.0.mlp.up_proj.weight", "master")
        assert master[1].dtype == torch.float32 and master[0].lengths[0] == 256 // 4  # a ZeRO-1 quarter
        assert s.find("actor", "layers.0.mlp.up_proj.weight", "param")[1].dtype == torch.bfloat16
    assert sum(r.bytes_sent + r.bytes_copied for r in results) == tplan.bytes_moved


def test_a_store_holding_a_live_models_leaves_transitions_without_autograd_errors():
    """The demo's store tensors are the engine's weights (leaves that require grad) and callers may
    apply a transition outside ``torch.no_grad``: copies into them must not be autograd ops (the
    demo crashed with "a leaf Variable that requires grad is being used in an in-place operation")."""
    a, b = make_plan(tp=2), make_plan(dp=2, zero=1)
    tplan = plan_transition(JOB, local_cluster(2), a, b, scheduler="greedy")
    stores = _stores(a, 2, "bf16-mixed")
    for s in stores:
        for _, t in s.items():
            if t.is_floating_point():
                t.requires_grad_(True)
    results = _run(tplan, stores)
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(mismatches(s, JOB, seed=0) == [] for s in stores)
