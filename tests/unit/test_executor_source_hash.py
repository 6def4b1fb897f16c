"""The sender's checksum of every piece is taken from its source region, never from a copy made
for the message: a fault in packing (``corrupt-pack``), in unpacking (``corrupt-unpack``) or in
a local copy must roll every rank back. Threads over the mock transport."""

import pytest
import torch

import nereus.executor.reshard.checksum as store_mod
from nereus.errors import TransitionError
from nereus.executor.apply import FaultSpec, _NewLayout, _prepare
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
from nereus.executor.store import ShardStore, SourceSums, checksum
from nereus.executor.transport import BUCKET_BYTES
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

from test_executor_verify import _run  # threads over the mock transport, one per rank

JOB = tiny_job(preset("tiny-4l-128h"))


def _zero1_case(precision="bf16-mixed"):
    """TP2 -> DP2 with ZeRO-1, the planner's own plan: the ZeRO shares of the row-parallel
    weights' moments are strided on the sender (their storage dim is not the share's dim)."""
    a, b = make_plan(tp=2), make_plan(dp=2, zero=1)
    tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=precision == "bf16-mixed", scheduler="greedy")
    stores = [ShardStore() for _ in range(2)]
    for r, s in enumerate(stores):
        init_store(s, JOB, a, r, seed=0, precision=precision)
    return tplan, stores


def _strided_send(tplan, stores):
    """(rank, round, piece) of a packed send whose source view is strided."""
    for rank, store in enumerate(stores):
        major = {(m, t): d for m, t, d in tplan.major}
        items, _ = _prepare(tplan, store, _NewLayout(store, tplan, rank, major), rank, BUCKET_BYTES, major)
        for rnd, its in sorted(items.items()):
            for it in its:
                if it[0] == "send" and not it[2].is_contiguous():
                    return rank, rnd, it[4]
    raise AssertionError("no strided send in this plan")


def _rolled_back_everywhere(results, stores, before):
    assert all(isinstance(r, TransitionError) for r in results), results
    assert [s.checksums() for s in stores] == before


def test_a_strided_piece_corrupted_after_packing_rolls_every_rank_back():
    """The review's reproduction: one bit of the sender's packed copy of a strided ZeRO share,
    flipped after packing. Hashing that copy (the old sender hash) committed it silently."""
    tplan, stores = _zero1_case()
    rank, rnd, piece = _strided_send(tplan, stores)
    before = [s.checksums() for s in stores]
    results = _run(tplan, stores, FaultSpec(rank=rank, round=rnd, kind="corrupt-pack"))
    _rolled_back_everywhere(results, stores, before)
    assert "differs from its source after it landed" in str(results[1 - rank])
    assert "another rank failed to verify" in str(results[rank])


def test_without_the_fault_the_same_transition_commits_bit_exact():
    tplan, stores = _zero1_case()
    results = _run(tplan, stores)
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(mismatches(s, JOB, seed=0) == [] for s in stores)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_piece_corrupted_after_unpacking_rolls_every_rank_back(precision):
    tplan, stores = _zero1_case(precision)
    op = next(op for op in tplan.ops if not op.is_copy and op.region.nbytes < BUCKET_BYTES)
    before = [s.checksums() for s in stores]
    results = _run(tplan, stores, FaultSpec(rank=op.dst_gpu, round=op.round, kind="corrupt-unpack"))
    _rolled_back_everywhere(results, stores, before)
    assert "differs from its source after it landed" in str(results[op.dst_gpu])


def test_a_corrupted_local_copy_rolls_every_rank_back():
    tplan, stores = _zero1_case()
    op = next(op for op in tplan.ops if op.is_copy)
    before = [s.checksums() for s in stores]
    results = _run(tplan, stores, FaultSpec(rank=op.src_gpu, round=op.round, kind="corrupt-copy"))
    _rolled_back_everywhere(results, stores, before)
    assert "differs from its source after the local copy" in str(results[op.src_gpu])


def test_the_sender_hash_never_reads_the_packed_copy():
    """``SourceSums.message`` with a packed buffer that is all garbage: the hashes are those of
    the source views themselves (strided or not), and a local copy's source hash is too."""
    store = ShardStore()
    init_store(store, JOB, make_plan(), 0, seed=0)
    region, t = next((r, t) for r, t in store.items() if t.dim() == 2 and t.shape[1] > 2)
    strided, dense = t[:, 1:], t[:2]
    sums = SourceSums(store)
    garbage = torch.full((strided.numel() + dense.numel(),), float("nan"))
    assert sums.message(garbage, [strided, dense]) == [checksum(strided.contiguous()), checksum(dense)]
    assert sums(strided) == checksum(strided.contiguous())


@pytest.mark.parametrize("native", [True, False])
def test_a_large_strided_tensor_hashes_in_chunks_to_its_contiguous_copys_value(native, monkeypatch):
    if not native:
        monkeypatch.setattr(store_mod, "_XXH3_LIB", None)
    monkeypatch.setattr(store_mod, "HASH_CHUNK_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(300, 70, generator=g)[:, 3:50], torch.randn(3, 5000, generator=g).bfloat16()[:, 1:],
              torch.randn(40, 6, 9, generator=g).transpose(0, 2), torch.randn(9000, generator=g)[::3]):
        assert not t.is_contiguous() and t.nbytes > 4096
        assert checksum(t) == checksum(t.contiguous())
    base = torch.randn(300, 70, generator=g)
    before = checksum(base[:, 3:50])
    base[299, 49] = base[299, 49].neg()
    assert checksum(base[:, 3:50]) != before  # the last element of the last chunk counts
