"""Executor pieces without torch.distributed: checksums, region slicing, layout vs the planner's
holdings, and whole transitions applied by threads over the mock transport."""
import functools
import random
import threading
import time

from dataclasses import replace

import pytest
import torch

from nereus.errors import TransitionError
from nereus.executor.apply import FaultSpec, apply_transition, round_groups
from nereus.executor.layout import rank_regions
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
from nereus.executor.store import ShardStore, checksum, narrowed, region_slices
from nereus.executor.transport import MockHub, MockTransport
from nereus.models.spec import preset
from nereus.planner.transition.emu import holdings
from nereus.planner.transition.build import plan_transition
from nereus.planner.transition.types import Holding, Region

JOB = tiny_job(preset("tiny-4l-128h"))


def test_checksum_detects_flip_and_swap():
    t = torch.randn(64, 32)
    assert checksum(t) == checksum(t.clone())
    flipped = t.clone()
    flipped.view(-1).view(torch.int32)[17] ^= 1
    assert checksum(flipped) != checksum(t)
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum(swapped) != checksum(t)
    assert 0 <= checksum(torch.full((1000,), -1.0)) < 2**63


def test_region_slices_worked_example():
    outer = Region("actor", "w", "param", (128, 0), (128, 128), "fp32")
    inner = Region("actor", "w", "exp_avg", (192, 0), (64, 128), "fp32")
    assert region_slices(outer, inner) == (slice(64, 128), slice(0, 128))
    with pytest.raises(TransitionError, match="not inside"):
        region_slices(inner, outer)


def test_narrowed_is_the_same_view_as_region_slices():
    rng = random.Random(3)
    for _ in range(200):
        lengths = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        offsets = tuple(rng.randint(0, 10) for _ in lengths)
        outer = Region("actor", "w", "param", offsets, lengths, "fp32")
        lo = [rng.randint(0, n - 1) for n in lengths]
        inner = Region("actor", "w", "param", tuple(o + a for o, a in zip(offsets, lo)),
                       tuple(rng.randint(1, n - a) for n, a in zip(lengths, lo)), "fp32")
        t = torch.randn(lengths).movedim(0, -1).contiguous().movedim(-1, 0)  # also a non-row-major layout
        got, want = narrowed(t, outer, inner), t[region_slices(outer, inner)]
        assert got.data_ptr() == want.data_ptr() and got.shape == want.shape and got.stride() == want.stride()
    outer = Region("actor", "w", "param", (128, 0), (128, 128), "fp32")
    for bad in (Region("actor", "w", "param", (64, 0), (64, 128), "fp32"),
                Region("actor", "w", "param", (192, 0), (128, 128), "fp32")):
        with pytest.raises(TransitionError, match="not inside"):
            narrowed(torch.empty(128, 128), outer, bad)


@pytest.mark.parametrize("impl", ["as installed", "python xxhash"])
def test_checksum_is_xxh3_of_the_bytes_for_any_dtype_and_shape(impl, monkeypatch):
    """The system libxxhash (where present) and the Python package give the same value, so
    ranks with and without libxxhash agree."""
    import xxhash

    from nereus.executor.reshard import checksum as store

    if impl == "python xxhash":
        monkeypatch.setattr(store, "_XXH3", None)
    elif store._XXH3 is None:
        pytest.skip("no system libxxhash with XXH3_64bits_dispatch here (or NEREUS_PY_XXHASH is set)")
    for t in (torch.randn(5, 7), torch.randn(3).bfloat16(), torch.tensor(2.0), torch.randn(4, 6).t(), torch.empty(0),
              torch.randn(100_003)):
        raw = t.contiguous().numpy().tobytes() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy().tobytes()
        assert checksum(t) == xxhash.xxh3_64_intdigest(raw) & 0x7FFFFFFFFFFFFFFF


@pytest.mark.parametrize("kw", [dict(tp=2, pp=2), dict(dp=4), dict(tp=2, dp=2), dict(pp=2, dp=2, zero=0),
                                dict(tp=2, first_gpu=2)])
def test_layout_matches_planner_holdings(kw):
    plan = make_plan(**kw)
    mine = sorted(Holding(g, r) for role in JOB.roles for g in range(4)
                  for r in rank_regions(JOB.model(role), plan.home(role), g, role, role == "actor"))
    assert tuple(mine) == holdings(JOB, plan, mixed_precision=False)


def test_executor_refuses_zero3_instead_of_holding_a_different_layout():
    """ZeRO-3 shards params along DP in the planner's holdings; the executor cannot run that, so it
    says so (it used to build whole TP shards silently, a layout the planner's transitions never target)."""
    from nereus.errors import SpecError

    plan = make_plan(dp=2, zero=3)
    with pytest.raises(SpecError, match=r"ZeRO-3 \(zero=3, dp=2\)"):
        rank_regions(JOB.model("actor"), plan.home("actor"), 0, "actor", True)
    assert rank_regions(JOB.model("actor"), make_plan(dp=2, zero=2).home("actor"), 0, "actor", True)


class CorruptingTransport(MockTransport):
    """Flips one bit of the first bucket it sends: the receiver's checksum must catch it."""

    flipped = False

    def _post_sends(self, sends):
        sends = list(sends)
        for i, (peer, buf) in enumerate(sends):
            if not self.flipped and buf.dtype == torch.float32 and buf.numel():
                buf = buf.clone()
                buf.view(torch.int32)[0] ^= 1
                sends[i] = (peer, buf)
                self.flipped = True
                break
        return super()._post_sends(sends)


def _in_threads(run, world: int) -> None:
    """``run(rank)`` on ``world`` threads at once (one per rank of the mock transport); all end."""
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)


def _apply_threads(a, b, world, fault=None, transport_cls=MockTransport, corrupt_rank=None, staging_bytes=0,
                   steps=None, timeout_s=5.0):
    tplan = plan_transition(JOB, local_cluster(world), a, b, mixed_precision=False, scheduler="greedy")
    hub = MockHub(world)
    stores = [ShardStore() for _ in range(world)]
    for r, s in enumerate(stores):
        init_store(s, JOB, a, r, seed=0)
        if steps is not None:
            s.step["actor"] = steps[r]
    before = [s.checksums() for s in stores]
    results: list = [None] * world

    def run(r):
        cls = transport_cls if corrupt_rank in (None, r) else MockTransport
        try:
            results[r] = apply_transition(stores[r], tplan, r, cls(r, hub), timeout_s=timeout_s, fault=fault,
                                          staging_bytes=staging_bytes)
        except TransitionError as e:
            results[r] = e

    _in_threads(run, world)
    return tplan, stores, before, results


def test_mock_transition_tp2pp2_to_dp4_is_bit_exact_and_bucketed():
    tplan, stores, _, results = _apply_threads(make_plan(tp=2, pp=2), make_plan(dp=4, zero=1), 4)
    assert all(not isinstance(r, Exception) for r in results), results
    for rank, s in enumerate(stores):
        assert mismatches(s, JOB, seed=0) == []
        assert sorted(s) == sorted(h.region for h in tplan.dst if h.gpu == rank)
    assert sum(r.bytes_sent + r.bytes_copied for r in results) == tplan.bytes_moved
    kept = set(tplan.kept)
    for rank, r in enumerate(results):  # old state + new regions, plus at most the staged traffic
        held = sum(h.region.nbytes for h in tplan.src if h.gpu == rank)
        new = sum(h.region.nbytes for h in tplan.dst if h.gpu == rank and h not in kept)
        assert held + new <= r.peak_bytes <= held + new + r.bytes_sent + r.bytes_received
    # bucketing: per round at most one data and one checksum message per peer, not one per region
    for r in results:
        assert r.messages <= 2 * 3 * tplan.rounds
    assert len(tplan.ops) > 10 * sum(r.messages for r in results) / 4


def test_the_commit_vote_carries_the_adam_step_count_to_every_rank():
    """A rank that held no optimizer state for a model (step 0) gets the step count with the vote;
    a rolled-back transition leaves every rank's count as it was."""
    class Counting(MockTransport):
        collectives = 0

        def max_ints(self, values, timeout_s):
            Counting.collectives += 1
            return super().max_ints(values, timeout_s)

    _, stores, _, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2, steps=[7, 0], transport_cls=Counting)
    assert all(not isinstance(r, Exception) for r in results), results
    assert [s.step["actor"] for s in stores] == [7, 7]
    assert Counting.collectives == 2 * 2  # per rank: the staging spread, then one vote that carries the steps
    _, stores, _, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2, steps=[7, 0],
                                           fault=FaultSpec(rank=0, round=0), timeout_s=1.0)
    assert all(isinstance(r, TransitionError) for r in results)
    assert [s.step["actor"] for s in stores] == [7, 0]


def test_mock_fault_rolls_back_every_rank():
    tplan, stores, before, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2,
                                                    fault=FaultSpec(rank=1, round=0))
    assert all(isinstance(r, TransitionError) for r in results)
    assert "injected fault" in str(results[1]) and "rolled back" in str(results[0])
    assert [s.checksums() for s in stores] == before


def test_a_rank_that_cannot_prepare_stops_every_rank_before_any_byte_moves():
    """Rank 1 lacks a region it must send: it fails while preparing, says so in the max-reduce
    that every rank runs before the exchange, and all ranks roll back at once (no timeout)."""
    a, b = make_plan(tp=2), make_plan(dp=2)
    tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=False, scheduler="greedy")
    hub = MockHub(2)
    stores = [ShardStore() for _ in range(2)]
    for r, st in enumerate(stores):
        init_store(st, JOB, a, r, seed=0)
    sent = next(op.region for op in tplan.ops if op.src_gpu == 1 and op.dst_gpu == 0)
    held = stores[1].covering(sent)[0]
    stores[1].replace((r, t) for r, t in stores[1].items() if r != held)
    before = [st.checksums() for st in stores]
    results: list = [None, None]
    sent_by = [None, None]

    def run(r):
        tx = MockTransport(r, hub)
        try:
            apply_transition(stores[r], tplan, r, tx, timeout_s=30.0)
        except TransitionError as e:
            results[r] = e
        sent_by[r] = tx.bytes_sent

    t0 = time.perf_counter()
    _in_threads(run, 2)
    assert time.perf_counter() - t0 < 10  # far below the 30 s timeout
    assert all(isinstance(r, TransitionError) for r in results), results
    assert "holds nothing covering" in str(results[1]) and "failed to prepare" in str(results[0])
    assert sent_by == [0, 0]
    assert [st.checksums() for st in stores] == before


def test_corrupted_bytes_are_caught_and_rolled_back():
    tplan, stores, before, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2,
                                                    transport_cls=CorruptingTransport, corrupt_rank=0)
    assert all(isinstance(r, TransitionError) for r in results)
    assert "checksum mismatch" in str(results[1])
    assert [s.checksums() for s in stores] == before


@pytest.mark.parametrize("staging_bytes", [None, 0], ids=["one-exchange", "round-by-round"])
def test_a_byte_corrupted_in_flight_rolls_back_every_rank_by_the_vote(staging_bytes):
    """Rank 1 sees a flipped bit in what it receives; rank 0 received intact bytes and verified
    them. In one exchange nothing else stops rank 0: only the commit vote can make it roll back,
    so this fails if the vote is ignored (``if ok and vote[0]`` -> ``if False``)."""
    tplan, stores, before, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2,
                                                    fault=FaultSpec(rank=1, round=tplan_last_round(), kind="corrupt"),
                                                    staging_bytes=staging_bytes)
    assert all(isinstance(r, TransitionError) for r in results), results
    assert "checksum mismatch" in str(results[1])
    assert results[1].bytes_received > 0  # the corrupted bytes had arrived
    if staging_bytes is None:
        assert "another rank failed to verify" in str(results[0])  # the vote decided, nothing else
        assert results[0].bytes_received > 0
    assert [s.checksums() for s in stores] == before


def tplan_last_round() -> int:
    """The last planner round of the tp2 -> dp2 transition (the fault fires in the exchange holding it)."""
    return plan_transition(JOB, local_cluster(2), make_plan(tp=2), make_plan(dp=2), mixed_precision=False,
                           scheduler="greedy").rounds - 1


def test_a_rank_failing_after_its_data_arrived_rolls_back_every_rank():
    """Several exchanges; rank 0 fails once the bytes of the last one have arrived: by then data
    has moved in every exchange, and every rank must still end on its old checksums."""
    last = tplan_last_round()
    assert last >= 1, "the scenario needs several exchanges"
    tplan, stores, before, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2,
                                                    fault=FaultSpec(rank=0, round=last, kind="after-receive"),
                                                    staging_bytes=0)
    assert all(isinstance(r, TransitionError) for r in results), results
    assert "after the bytes of round" in str(results[0])
    assert results[0].exchanges_done == tplan.rounds and results[0].bytes_received > 0
    assert "another rank failed to verify" in str(results[1]) and results[1].bytes_received > 0
    assert [s.checksums() for s in stores] == before


def test_a_straggler_at_the_vote_does_not_split_the_ranks():
    """Rank 1 verifies, then stalls past the per-message timeout before voting. Its peer voted yes
    and must not give up and roll back while the straggler, arriving later, completes the vote
    with that posted yes and commits (the ranks would end in different layouts). Both commit."""
    class SlowVoter(MockTransport):  # stalls before its second collective: the commit vote
        def max_ints(self, values, timeout_s):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                time.sleep(0.6)
            return super().max_ints(values, timeout_s)

    tplan, stores, before, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2, staging_bytes=None,
                                                    transport_cls=SlowVoter, corrupt_rank=1, timeout_s=0.25)
    assert not any(isinstance(r, Exception) for r in results), results
    for s in stores:
        assert mismatches(s, JOB, seed=0) == []


def test_a_vote_that_never_completes_is_reported_as_such():
    """Past even the yes-voter's wait the outcome is unknown on that rank: it rolls back and says
    that a peer may have committed, instead of claiming the old layout holds everywhere."""
    _, _, _, results = _apply_threads(make_plan(tp=2), make_plan(dp=2), 2, staging_bytes=None,
                                      fault=FaultSpec(rank=1, round=0, kind="slow-vote", hang_s=1.5), timeout_s=0.2)
    assert isinstance(results[0], TransitionError) and results[0].vote_completed is False
    assert "may have committed" in str(results[0])


def test_mock_collective_keeps_a_timed_out_contribution_like_gloo():
    """A rank whose wait times out has still posted its values; a peer arriving later completes
    the reduction with them (as a real all-reduce does) instead of failing with it."""
    hub = MockHub(2)
    a, b = MockTransport(0, hub), MockTransport(1, hub)
    with pytest.raises(TransitionError, match="timed out"):
        a.max_ints([0, 5], 0.05)
    assert b.max_ints([1, 3], 1.0) == [1, 5]


def test_fault_kinds_are_checked():
    with pytest.raises(ValueError, match="fault kind must be one of"):
        FaultSpec(rank=0, round=0, kind="explode")


def test_transport_buckets_small_and_sends_large_alone():
    hub = MockHub(2)
    tx, rx = MockTransport(0, hub, bucket_bytes=1024), MockTransport(1, hub, bucket_bytes=1024)
    small = [torch.randn(8) for _ in range(20)]
    big = torch.randn(64, 32)
    dst_small = [torch.empty(8) for _ in range(20)]
    dst_big = torch.empty(32, 64).t()  # a non-contiguous destination view
    for t in small + [big]:
        tx.submit_send(1, t)
    for t in dst_small + [dst_big]:
        rx.submit_recv(0, t)
    th = threading.Thread(target=tx.run, args=(5.0,))
    th.start()
    rx.run(5.0)
    th.join()
    assert tx.messages == 2  # one bucket of 20 small tensors, one large tensor alone
    assert all(torch.equal(a, b) for a, b in zip(small, dst_small)) and torch.equal(big, dst_big)


def test_one_batch_per_exchange_gives_the_same_bits():
    """The NCCL-style path (receives and sends of an exchange posted as one batch, every checksum
    first) moves the same bytes as the streaming gloo path."""
    class OneBatch(MockTransport):
        def __init__(self, rank, hub):
            super().__init__(rank, hub, streaming=False)

    tplan, stores, _, results = _apply_threads(make_plan(tp=2, pp=2), make_plan(dp=4, zero=1), 4, transport_cls=OneBatch)
    assert all(not isinstance(r, Exception) for r in results), results
    assert all(mismatches(s, JOB, seed=0) == [] for s in stores)


def test_merged_rounds_give_the_same_bits():
    tplan, stores, _, results = _apply_threads(make_plan(pp=2, dp=2, zero=1), make_plan(tp=2, pp=2), 4,
                                               staging_bytes=None)
    assert tplan.rounds > 1 and all(not isinstance(r, Exception) for r in results), results
    assert all(mismatches(s, JOB, seed=0) == [] for s in stores)
    # every round in one exchange, and the phases are disjoint parts of the transition's time
    # (verify runs inside the next exchange's prepare or after the last one: not added again)
    assert all(r.exchanges == 1 for r in results)
    for r in results:
        ph = dict(r.phases)
        assert ph["exchange_s"] > 0 and ph["prepare_s"] > 0
        assert sum(ph[k] for k in ("allocate_s", "prepare_s", "exchange_s", "vote_commit_s")) <= r.seconds + 1e-5


@pytest.mark.parametrize("limit", [0, 1, 20_000, 200_000, None])
def test_round_groups_cover_every_round_once_within_the_staging_limit(limit):
    import random

    rng = random.Random(limit or 0)
    for _ in range(50):
        staged = [rng.choice([0, 0, 5_000, 60_000, 250_000]) for _ in range(rng.randint(1, 12))]
        groups = round_groups(staged, limit)
        assert [r for lo, hi in groups for r in range(lo, hi + 1)] == list(range(len(staged)))
        if limit is None:
            assert groups == [(0, len(staged) - 1)]
        elif limit == 0:
            assert groups == [(r, r) for r in range(len(staged))]
        else:
            for lo, hi in groups:  # merged exchanges stay within the limit ...
                assert hi == lo or sum(staged[lo:hi + 1]) <= limit
                if hi + 1 < len(staged):  # ... and stop only where the next round would not fit
                    assert sum(staged[lo:hi + 2]) > limit
    assert round_groups([], 100) == []


def test_pieces_move_in_place_when_stored_in_the_plans_order():
    """TP2 -> TP1 x DP2: row-parallel TP shards are column blocks of the TP1 tensor. Stored
    split-dim-outermost (the plan's ``major``) every piece is one dense block at both ends, so
    nothing is staged; a plan whose convention differs from the stores' layout (major=()) still
    gives exact bits, through staging buffers."""
    for major, expect_staged in ((None, False), ((), True)):
        a, b = make_plan(tp=2), make_plan(dp=2, zero=0)
        tplan = plan_transition(JOB, local_cluster(2), a, b, mixed_precision=False, scheduler="greedy")
        assert tplan.major
        if major is not None:
            tplan = replace(tplan, major=major)
        hub = MockHub(2)
        stores = [ShardStore() for _ in range(2)]
        for r, st in enumerate(stores):
            init_store(st, JOB, a, r, seed=0)
        results: list = [None, None]

        def run(r):
            results[r] = apply_transition(stores[r], tplan, r, MockTransport(r, hub, bucket_bytes=1), timeout_s=5.0)

        _in_threads(run, 2)
        assert all(r is not None for r in results), results
        assert all(mismatches(st, JOB, seed=0) == [] for st in stores)
        staged = sum(r.bytes_staged for r in results)
        assert (staged > 0) == expect_staged, staged
        assert all(r.bytes_sent > 0 for r in results)


def test_round_by_round_and_merged_exchanges_agree():
    """Same bits whatever the staging limit; the limit sets how many exchanges the rounds run in:
    the planner's rounds (0), all in one (None), and in between for a limit a few rounds fill."""
    messages = {}
    for limit in (0, 2_000_000, None):
        # every piece bucketed: a joined piece crossing the bucket limit would add its own message
        tplan, stores, _, results = _apply_threads(make_plan(tp=2, pp=2), make_plan(dp=4, zero=1), 4,
                                                   staging_bytes=limit,
                                                   transport_cls=functools.partial(MockTransport, bucket_bytes=1 << 30))
        assert all(not isinstance(r, Exception) for r in results), results
        assert all(mismatches(s, JOB, seed=0) == [] for s in stores)
        assert len({r.exchanges for r in results}) == 1
        exchanges = results[0].exchanges
        if limit == 0:
            assert exchanges == tplan.rounds > 1
        elif limit is None:
            assert exchanges == 1
        else:  # 26 rounds staging ~0.35 MB each on the busiest rank: merged in groups under 2 MB
            assert 1 < exchanges < tplan.rounds, (exchanges, tplan.rounds)
        messages[limit] = sum(r.messages for r in results)
    # fewer exchanges, fewer messages (per exchange at most one data and one checksum message per peer)
    assert messages[None] < messages[2_000_000] < messages[0], messages
