"""Pieces of every size class through gloo (``DistTransport``): empty, tiny, bucketed (coalesced
into one message per peer and dtype) below ``BUCKET_BYTES``, at it and above it (dense, in place),
strided (staged), in fp32 and bf16, round-trip bit-exactly, each landing once, in the transport's
order; a message corrupted in flight is seen where it landed; a transition whose bucketed pieces
are corrupted in flight, after packing or after unpacking rolls every rank back."""
import pytest
import torch

from nereus.executor.launch import launch
from nereus.executor.transport import BUCKET_BYTES

pytestmark = pytest.mark.dist

_B = BUCKET_BYTES // 4
SIZES = (0, 7, 1000, _B - 1, _B, _B + 1, 4 * _B, 1 << 19)
"""fp32 elements per piece (bf16: half the bytes): empty, tiny, small, just below / at / above
the bucket limit, 4x it and 2 MiB."""


def _pieces(seed: int, dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    out.append(torch.randn(64, 300, generator=g).to(dtype)[:, 1:])  # strided: staged
    return out


def _exchange(rank: int, world: int, corrupt_second: bool) -> dict:
    from nereus.executor.transport import DistTransport

    t = DistTransport(rank)
    t.tag = 77
    peers = [p for p in range(world) if p != rank]
    got: dict[int, list] = {p: [] for p in peers}
    for dtype in (torch.float32, torch.bfloat16):
        for p in peers:
            for piece in _pieces(100 * rank + p, dtype):
                t.submit_send(p, piece)
    dests = {p: [torch.empty_like(x) for d in (torch.float32, torch.bfloat16) for x in _pieces(100 * p + rank, d)]
             for p in peers}
    for p in peers:
        for x in dests[p]:
            t.submit_recv(p, x)
    seen = []

    def arrived(i, buf):
        seen.append(i)
        if corrupt_second and len(seen) == 2 and buf.numel():
            buf.view(-1)[0] += 1

    posted = t.start()
    t.finish(posted, 60.0, on_arrival=arrived,
             landed=lambda peer, parts: got[peer].append([(id(x), x.clone()) for x in parts]))
    want = {p: [x for d in (torch.float32, torch.bfloat16) for x in _pieces(100 * p + rank, d)] for p in peers}
    exact = {p: all(torch.equal(a, b) for a, b in zip(dests[p], want[p])) for p in peers}
    landed_in_order = {}
    for p in peers:  # each submitted tensor seen once, holding its final bytes, in the transport's order
        # (per dtype: the bucket of small ones, then the large ones, each in submission order)
        seen_ids = [i for m in got[p] for i, _ in m]
        by_id = {i: c for m in got[p] for i, c in m}
        order = {id(x): k for k, x in enumerate(dests[p])}
        per_dtype = [[order[i] for i in seen_ids if by_id[i].dtype == d] for d in (torch.float32, torch.bfloat16)]
        expected = [[k for k in ks if dests[p][k].nbytes < BUCKET_BYTES] + [k for k in ks if dests[p][k].nbytes >= BUCKET_BYTES]
                    for ks in ([k for k, x in enumerate(dests[p]) if x.dtype == d] for d in (torch.float32, torch.bfloat16))]
        landed_in_order[p] = (sorted(seen_ids) == sorted(order) and per_dtype == expected
                              and all(torch.equal(by_id[id(x)], x) for x in dests[p]))
    return {"exact": exact, "in_order": landed_in_order, "seen": len(seen), "messages": len(posted.recvs)}


def test_pieces_of_every_size_class_round_trip_bit_exact():
    out = launch(_exchange, 3, False, timeout_s=120)
    for r in out:
        assert all(r["exact"].values()) and all(r["in_order"].values()), r
        assert r["seen"] == r["messages"]


def test_a_message_corrupted_in_flight_is_seen_where_it_landed():
    out = launch(_exchange, 2, True, timeout_s=120)
    assert all(not all(r["exact"].values()) for r in out)
    assert all(all(r["in_order"].values()) for r in out)  # landed saw the corrupted bytes as they are


def _transition(rank: int, world: int, kind: str | None, fault_rank: int) -> dict:
    from nereus.executor.apply import FaultSpec, apply_transition
    from nereus.executor.reshard.vote import RolledBack
    from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
    from nereus.executor.store import ShardStore
    from nereus.executor.transport import DistTransport
    from nereus.models.spec import preset
    from nereus.planner.transition.build import plan_transition

    job = tiny_job(preset("tiny-4l-128h"))
    a, b = make_plan(tp=world), make_plan(tp=world // 2, dp=2, zero=0)
    tplan = plan_transition(job, local_cluster(world), a, b, mixed_precision=True, scheduler="greedy")
    store = ShardStore()
    init_store(store, job, a, rank, seed=0, precision="bf16-mixed")
    before = store.checksums()
    t = DistTransport(rank)
    fault = FaultSpec(rank=fault_rank, round=0, kind=kind) if kind else None
    try:
        rep = apply_transition(store, tplan, rank, t, timeout_s=30, fault=fault)
    except RolledBack as e:
        return {"rolled_back": True, "intact": store.checksums() == before, "why": str(e)}
    return {"rolled_back": False, "bad": len(mismatches(store, job, 0)), "staged": rep.bytes_staged}


@pytest.mark.parametrize("kind", [None, "corrupt-unpack", "corrupt-pack"])  # in-flight "corrupt": test_fault_dist.py
def test_a_transition_with_bucketed_pieces_commits_bit_exact_or_rolls_every_rank_back(kind):
    out = launch(_transition, 4, kind, 1, timeout_s=240)
    if kind is None:
        assert all(not r["rolled_back"] and r["bad"] == 0 for r in out), out
        assert any(r["staged"] for r in out)  # bucketed (coalesced) pieces were in the messages
    else:
        assert all(r["rolled_back"] and r["intact"] for r in out), out
