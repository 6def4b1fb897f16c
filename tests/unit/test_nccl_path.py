"""The NCCL path's rules, each checked on CPU (mock transport, gloo in one process, a HashStore,
monkeypatched torch.distributed): no GPU is needed to see them broken.

- the group is joined with the device bound (eager NCCL init), the watchdog told not to tear the
  process down, and an all-ranks warm-up;
- a failed vote marks ``vote_completed`` False on every rank, whatever it voted; a rebuild needs a
  second, bounded agreement; otherwise ``RolledBack`` says the groups are gone;
- the process-group timeout must be above the transition's worst case;
- a rank aborts its data communicators as soon as it decides to roll back, before the vote;
- ``device_hash`` works in bounded memory and gives the same value for any chunk size;
- every Engine of the process rebinds after a rebuild;
- HF gathers send host tensors on the gloo side group under NCCL;
- torchrun results go through the rendezvous store captured at init;
- one deadline per exchange.
"""
import os
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import nereus.executor.launch as launch_mod
import nereus.executor.parallel as parallel_mod
from nereus.errors import TransitionError
from nereus.executor.apply import FaultSpec, RolledBack, apply_transition
from nereus.executor.reshard import checksum as checksum_mod
from nereus.executor.reshard.vote import agree_on_rebuild, nccl_pg_timeout_s, transition_worst_case_s
from nereus.executor.scenario import init_store, local_cluster, make_plan, tiny_job
from nereus.executor.store import ShardStore
from nereus.executor.transport import MockHub, MockTransport
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

JOB = tiny_job(preset("tiny-4l-128h"))
A, B = make_plan(tp=2), make_plan(dp=2)
TPLAN = plan_transition(JOB, local_cluster(2), A, B, mixed_precision=False, scheduler="greedy")


def _stores():
    stores = [ShardStore() for _ in range(2)]
    for r, s in enumerate(stores):
        init_store(s, JOB, A, r, seed=0)
    return stores


def _run(transports, stores, fault=None, timeout_s=2.0, plan=TPLAN):
    results: list = [None] * len(stores)

    def run(r):
        try:
            results[r] = apply_transition(stores[r], plan, r, transports[r], timeout_s=timeout_s, fault=fault)
        except TransitionError as e:
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return results


# ---- joining the group ---------------------------------------------------------------------------
def test_an_nccl_group_is_joined_with_the_device_bound_the_watchdog_tamed_and_a_warm_up(monkeypatch):
    seen = {}

    def init(backend, **kw):
        seen.update(kw, backend=backend, env={k: os.environ.get(k) for k in launch_mod.NCCL_ENV})

    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # what a cluster might preset
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(launch_mod, "_set_device", lambda backend, local_rank: seen.setdefault("set_device", local_rank))
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.setdefault("warm_up", t.device))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: torch.empty(1, device="meta"))
    monkeypatch.setattr("torch.distributed.distributed_c10d._get_default_store", lambda: "the-store")
    monkeypatch.setattr(launch_mod, "_JOINED", {})
    launch_mod.join_group("nccl", 3, init_method="file:///x", rank=3, world=4, pg_timeout_s=900.0)
    assert seen["device_id"] == torch.device("cuda", 3) and seen["set_device"] == 3
    assert seen["env"] == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0"}  # before init
    assert "warm_up" in seen
    assert launch_mod.rendezvous_store() == "the-store" and launch_mod.joined_timeout_s() == 900.0
    seen.clear()
    launch_mod.join_group("gloo", 1, init_method="file:///x", rank=1, world=4)
    assert "device_id" not in seen and "warm_up" not in seen


# ---- the vote, the second agreement, lost groups ------------------------------------------------------
def test_a_no_voter_whose_vote_times_out_does_not_count_it_complete():
    """The exact rule: rank 1 fails in the exchange (votes no), rank 0 never reaches the vote in
    time. Before, only yes-voters marked the vote incomplete and rank 1 went on to rebuild."""
    hub = MockHub(2)
    transports = [MockTransport(r, hub, streaming=False) for r in range(2)]
    stores = _stores()
    gate = threading.Event()
    real = transports[0].max_ints
    calls = [0]

    def late_max_ints(values, timeout_s):
        calls[0] += 1
        if calls[0] == 2:  # rank 0's vote: arrives after rank 1 gave up
            gate.wait(5)
        return real(values, timeout_s)

    transports[0].max_ints = late_max_ints
    real1 = transports[1].max_ints

    def max_ints1(values, timeout_s):
        try:
            return real1(values, timeout_s)
        finally:
            if values[0]:  # rank 1's "no" vote has returned or timed out
                gate.set()

    transports[1].max_ints = max_ints1
    results = _run(transports, stores, FaultSpec(rank=1, round=0, kind="raise"), timeout_s=0.5)
    assert isinstance(results[1], RolledBack), results
    assert results[1].vote_completed is False and results[1].groups_lost
    assert "after_rollback(vote_completed=False)" in transports[1].events


def test_the_rebuild_agreement_is_bounded_and_needs_every_rank():
    store = dist.HashStore()
    out = [None] * 3

    def rank(r, world):
        out[r] = agree_on_rebuild(store, world, attempt=1, timeout_s=2.0)

    threads = [threading.Thread(target=rank, args=(r, 3)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == [True, True, True]
    t0 = time.monotonic()  # one rank dead: the others give up within the bound instead of blocking in a rebuild
    got = [agree_on_rebuild(store, 3, attempt=2, timeout_s=0.3) for _ in range(2)]
    assert got == [False, False] and time.monotonic() - t0 < 2.0

    class Gone:
        def add(self, key, n):
            raise RuntimeError("Connection reset by peer")  # the store's host (rank 0) died

    assert agree_on_rebuild(Gone(), 2, 1, 1.0) is False


def test_a_rebuild_runs_only_after_the_agreement(monkeypatch):
    """``abort_and_rebuild``: the groups are re-created only if every rank agreed."""
    import torch.distributed.distributed_c10d as c10d

    calls = []
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(c10d, "_abort_process_group", lambda *a: calls.append("abort"))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch_mod, "_JOINED", {"store": dist.HashStore(), "timeout_s": 900.0})
    assert parallel_mod.abort_and_rebuild(True, 0.2) is False  # the peer never agreed
    assert calls == ["abort"]


# ---- timeouts ---------------------------------------------------------------------------------------
def test_an_nccl_transition_refuses_to_start_under_a_process_group_timeout_below_its_worst_case():
    worst = transition_worst_case_s(2.0, TPLAN.rounds)
    hub = MockHub(2)
    stores = _stores()
    before = [s.checksums() for s in stores]
    results = _run([MockTransport(r, hub, streaming=False, pg_timeout_s=worst) for r in range(2)], stores)
    assert all(isinstance(r, RolledBack) and "process-group timeout" in str(r) and r.bytes_received == 0
               for r in results), results
    assert [s.checksums() for s in stores] == before
    hub = MockHub(2)
    ok = _run([MockTransport(r, hub, streaming=False, pg_timeout_s=nccl_pg_timeout_s(2.0, TPLAN.rounds))
               for r in range(2)], _stores())
    assert not any(isinstance(r, Exception) for r in ok), ok


def test_one_deadline_bounds_a_whole_exchange():
    """A peer whose every message comes just within the timeout cannot stretch an exchange."""

    class Slow(MockTransport):
        def _wait(self, recvs, timeout_s):
            for _ in recvs:
                if timeout_s < 0.3:
                    raise TransitionError(f"rank {self.rank}: timed out")
                time.sleep(0.3)

    t = Slow(0, MockHub(1))
    for _ in range(4):
        t.submit_recv(1, torch.zeros(1 << 17))  # 4 messages of 512 KiB: each its own message
    posted = t.start()
    t0 = time.monotonic()
    with pytest.raises(TransitionError):
        t.finish(posted, timeout_s=1.0)  # 4 x 0.3 s > 1 s
    assert time.monotonic() - t0 < 1.2


# ---- abort as soon as a rank decides to roll back ----------------------------------------------------
def test_a_failing_rank_aborts_its_communicators_before_the_vote():
    hub = MockHub(2)
    transports = [MockTransport(r, hub, streaming=False) for r in range(2)]
    rnd = TPLAN.ops[-1].round
    results = _run(transports, _stores(), FaultSpec(rank=1, round=rnd, kind="after-receive"))
    assert all(isinstance(r, RolledBack) for r in results), results
    ev = [e for e in transports[1].events if e in ("abort", "collective")]
    assert ev == ["collective", "abort", "collective"], ev  # staging agreement, abort, then the vote
    ev0 = [e for e in transports[0].events if e in ("abort", "collective")]
    assert ev0 == ["collective", "collective", "abort"], ev0  # the peer learns of it from the vote


# ---- device hash -----------------------------------------------------------------------------------
def _reference_device_hash(t):
    """The device hash as first written: the whole piece at once (about 12x its size in int64)."""
    m = checksum_mod._M32
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32).to(torch.int64) & m if nbytes % 4 == 0 else raw.to(torch.int64)
    pos = torch.arange(words.numel(), dtype=torch.int64) & m
    sums = []
    for p1, p2, p3, seed in checksum_mod._LANES:
        h = (words * p1 + pos * p2 + (seed ^ (nbytes & m))) & m
        h = h ^ (h >> 15)
        h = (h * p3) & m
        h = h ^ (h >> 13)
        h = (h * p1) & m
        h = h ^ (h >> 16)
        sums.append(h.sum() & m)
    return ((sums[0] << 31) ^ sums[1]) & 0x7FFFFFFFFFFFFFFF


def test_device_hash_gives_the_same_value_for_any_chunk_size():
    g = torch.Generator().manual_seed(1)
    for t in (torch.randn(1000, 37, generator=g), torch.randn(333, generator=g).bfloat16(),
              torch.randn(7, 9, generator=g).bfloat16()[:, 1:6], torch.randn(50, 33, generator=g).bfloat16().t(),
              torch.randn(3, generator=g).bfloat16(), torch.empty(0), torch.tensor(1.5)):
        want = int(_reference_device_hash(t))
        for chunk in (4, 6, 64, 1000, None):
            assert int(checksum_mod.device_hash(t, chunk)) == want, (t.shape, t.dtype, chunk)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of the tensors created inside the mode (a storage counted once, freed when the
    last tensor made on it inside the mode is gone)."""

    def __init__(self):
        super().__init__()
        self.live, self.refs, self.now, self.peak = {}, {}, 0, 0

    def _gone(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.live.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                key = o.untyped_storage().data_ptr()
                if key in inputs and key not in self.live:
                    continue  # a view of memory made outside the mode (the piece itself)
                if key not in self.live:
                    self.live[key] = o.untyped_storage().nbytes()
                    self.refs[key] = 0
                    self.now += self.live[key]
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(o, self._gone, key)
        return out


def test_device_hash_memory_is_bounded_by_its_chunk_not_by_the_piece():
    piece = torch.randn(1 << 21)  # 8 MiB
    chunk = 1 << 20
    with _LiveBytes() as m:
        checksum_mod.device_hash(piece, chunk)
    assert m.peak <= checksum_mod.device_hash_workspace_bytes(chunk), m.peak
    with _LiveBytes() as whole:
        _reference_device_hash(piece)
    assert whole.peak > 8 * piece.nbytes  # the old way: about 12x the piece
    strided = torch.randn(2048, 1025)[:, 1:]  # 8 MiB, not contiguous
    with _LiveBytes() as m:
        checksum_mod.device_hash(strided, chunk)
    assert m.peak <= checksum_mod.device_hash_workspace_bytes(chunk), m.peak


# ---- every Engine rebinds ------------------------------------------------------------------------------
def test_every_engine_of_the_process_rebinds_after_a_rebuild(monkeypatch):
    from nereus.executor.engine import Engine

    monkeypatch.setattr(parallel_mod, "_ON_REBUILD", [])
    plan = make_plan()
    engines = []
    for role in ("actor", "ref"):
        store = ShardStore()
        init_store(store, JOB, plan, 0, seed=0)
        engines.append(Engine(0, 1, JOB.model(role), plan.home(role), store, role=role))
    before = [e.g for e in engines]
    assert parallel_mod._rebind_all() == 2
    assert all(e.g is not g for e, g in zip(engines, before))  # new group objects for both, not only one


# ---- HF gather -------------------------------------------------------------------------------------------
def test_an_hf_gather_under_nccl_sends_host_tensors_on_the_gloo_side_group(monkeypatch):
    from nereus.executor.hf import checkpoint as ckpt_mod

    sent = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(parallel_mod, "side_group", lambda ranks: ("gloo-side", ranks))
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: sent.append((t.device.type, dst, group)))
    store = ShardStore()
    init_store(store, JOB, A, 1, seed=0)
    assert ckpt_mod.gather_state(store, JOB.model("actor"), "actor", A.home("actor"), 1) is None
    assert sent == [("cpu", 0, ("gloo-side", (0, 1)))]


# ---- torchrun results ------------------------------------------------------------------------------------
def _abort_groups(rank, world):
    dist.destroy_process_group()  # what an abort without rebuild leaves: no default group
    return rank + 41


def test_torchrun_results_travel_through_the_store_captured_at_init(monkeypatch, tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    real_init = dist.init_process_group
    monkeypatch.setattr(launch_mod, "torchrun_env", lambda: (0, 1, 0))
    monkeypatch.setattr(launch_mod, "_JOINED", {})
    monkeypatch.setattr(launch_mod, "_CALLS", [0])
    monkeypatch.setattr(launch_mod.atexit, "register", lambda f: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, init_method=None, **kw: real_init(
        backend, init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1, **kw))
    try:
        assert launch_mod.launch(_abort_groups, 1, timeout_s=20) == [41]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
