"""One exchange of a transition on one rank: post, hash at both ends, copy locally, compare."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from nereus.errors import TransitionError
import nereus.executor.reshard.checksum as checksum_mod
from nereus.executor.reshard.checksum import SourceSums
from nereus.executor.reshard.faults import _Corruption, _corrupt_packed, _flip_bit
from nereus.executor.store import ShardStore
from nereus.executor.transport import Transport
from nereus.planner.transition.types import Region


def _run_round(items: list[tuple], store: ShardStore, rank: int, transport: Transport, timeout_s: float,
               counters: dict, sums: SourceSums, rnd: str, verify_previous=None,
               corrupt: "_Corruption | None" = None):
    """One exchange of prepared items (``_prepare``). Receives are posted first (the transport
    buckets the small pieces; large ones land directly in their destination region), then each
    outgoing message right after this rank checksummed the pieces it carries, from their source
    regions; while the bytes move, the local copies run (each hashed at both ends) and the
    previous exchange's comparison. Every piece that arrives is checksummed where it landed, in
    its destination region, once its message was unpacked (bytes still in cache); one small
    message per peer, posted right after the data, carries the sender's checksums. Returns the
    comparison of this exchange's pieces with their sources' checksums (run by the next
    exchange, or after the last)."""
    t0 = time.perf_counter()
    incoming = sent = 0
    local: list[tuple] = []
    recv_pieces: dict[int, int] = defaultdict(int)
    submit_send, submit_recv = transport.submit_send, transport.submit_recv
    for it in items:
        what = it[0]
        if what == "send":
            submit_send(it[1], it[2])
            sent += it[3]
        elif what == "recv":
            submit_recv(it[1], it[2])
            recv_pieces[it[1]] += 1
            incoming += it[3]
        else:
            local.append(it)
    counters["sent"] += sent
    sums_out: dict[int, list[int]] = defaultdict(list)
    posted = transport.start(before_send=lambda peer, buf, parts: sums_out[peer].extend(sums.message(buf, parts)),
                             after_pack=(lambda sends, carried: _corrupt_packed(sends, carried, sums, corrupt))
                             if corrupt is not None and corrupt.armed("corrupt-pack") else None)
    if posted is not None:
        staging = sum(b.numel() * b.element_size() for i, (_, b) in enumerate(posted.recvs) if posted.staged[i])
        staging += sum(b.numel() * b.element_size() for _, b in posted.sends if sums.made_for_message(b))
        counters["staging_peak"] = max(counters["staging_peak"], staging)
        counters["staged"] += staging
    # the sender's checksums follow its data on each peer's stream, so they arrive with the data's
    # tail instead of costing one more round trip after it
    for peer, values in sorted(sums_out.items()):
        transport.submit_send(peer, torch.tensor(values, dtype=torch.int64, device=store.device))
    sums_in: dict[int, torch.Tensor] = {}
    for peer, n in sorted(recv_pieces.items()):
        sums_in[peer] = torch.empty(n, dtype=torch.int64, device=store.device)
        transport.submit_recv(peer, sums_in[peer])
    posted_sums = transport.start()
    copies = _copy_locally(local, store, sums, counters, corrupt)
    if verify_previous is not None:
        verify_previous()
    t1 = time.perf_counter()
    got: dict[int, list[tuple[list[torch.Tensor], list[int]]]] = defaultdict(list)
    """Per peer, per message in order: the pieces that landed and their checksums there."""

    def arrived(i: int, buf: torch.Tensor) -> None:
        if corrupt.armed("corrupt") and buf.numel():
            _flip_bit(buf)  # the fault: one bit flipped in flight
            corrupt.fired = True

    staged_lists = {id(p) for p in posted.staged if p is not None} if posted is not None else set()
    unpack_fault = corrupt is not None and corrupt.armed("corrupt-unpack")

    def landed(peer: int, parts: list[torch.Tensor]) -> None:
        if (unpack_fault and corrupt.armed("corrupt-unpack") and parts and parts[0].numel()
                and (id(parts) in staged_lists or not staged_lists)):
            _flip_bit(parts[0])  # the fault: a bit of an unpacked piece flipped in its destination region
            corrupt.fired = True
        got[peer].append((parts, checksum_mod.checksums_of(parts)))

    deadline = time.monotonic() + timeout_s  # one deadline for the exchange: its data and its checksums
    transport.finish(posted, timeout_s, on_arrival=arrived if corrupt is not None and corrupt.armed("corrupt") else None,
                     landed=landed, deadline=deadline)
    del posted  # staging buffers go back to the arena now, not when the next exchange has run
    transport.finish(posted_sums, timeout_s, deadline=deadline)
    counters["arrived"] += incoming
    counters["prepare_s"] += t1 - t0
    counters["exchange_s"] += time.perf_counter() - t1

    def verify() -> None:
        t2 = time.perf_counter()
        for region, want, have in copies:
            if have != want:
                raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {_where(region)} differs "
                                      "from its source after the local copy")
        for peer in sorted(recv_pieces):
            expected = sums_in[peer].tolist()
            have = [h for _, hs in got[peer] for h in hs]
            if have != expected:
                k = next((k for k, (a, b) in enumerate(zip(have, expected)) if a != b), min(len(have), len(expected)))
                part = ([p for ps, _ in got[peer] for p in ps] + [None])[k]
                region = next((it[4] for it in items if it[0] == "recv" and it[2] is part), None)
                where = _where(region) if region is not None else f"{len(have)} pieces landed"
                raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {where}, piece {k + 1} of "
                                      f"{len(expected)} from rank {peer}, differs from its source after it landed")
        counters["received"] += incoming
        counters["verify_s"] += time.perf_counter() - t2

    return verify


def _copy_locally(local: list[tuple], store: ShardStore, sums: SourceSums, counters: dict,
                  corrupt: "_Corruption | None") -> list[tuple[Region, int, int]]:
    """Run this exchange's local copies; (piece, its source's checksum, its target's checksum
    after the copy) each. On the host each target is hashed right after its copy (its bytes still
    in cache; the source's checksum is the one its sends took, or taken here); on a device every
    copy's two ends are hashed together, one read-back each, not 2 host syncs per copy."""
    if not local:
        return []
    want = sums.many([it[1] for it in local])
    have: list[int] = []
    host = checksum_mod.on_host(local[0][2])
    hash_one = checksum_mod.host_sums
    copied = 0
    for _, source, target, nbytes, _ in local:
        target.copy_(source)
        if corrupt is not None and corrupt.armed("corrupt-copy") and target.numel():
            _flip_bit(target)  # the fault: a bit of the first copy's first element flipped after the copy
            corrupt.fired = True
        if host:
            have += hash_one([target])
        copied += nbytes
    counters["copied"] += copied
    if not host:
        have = checksum_mod.checksums_of([it[2] for it in local])
    return [(it[4], w, h) for it, w, h in zip(local, want, have)]


def _where(r: Region) -> str:
    return f"{r.model}:{r.tensor}/{r.kind} at {r.offsets}+{r.lengths}"
