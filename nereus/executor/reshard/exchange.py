"""One exchange of a transition on one rank: post, hash at both ends, copy locally, compare."""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from nereus.errors import TransitionError
import nereus.executor.reshard.checksum as checksum_mod
from nereus.executor.reshard.program import Exchange
from nereus.executor.reshard.faults import _Corruption, _corrupt_packed, _flip_bit
from nereus.executor.store import ShardStore
from nereus.executor.transport import Transport
from nereus.planner.transition.types import Region


def _run_round(x: Exchange, views: list[torch.Tensor], store: ShardStore, rank: int, transport: Transport,
               timeout_s: float, counters: dict, sums, rnd: str, verify_previous=None,
               corrupt: "_Corruption | None" = None):
    """One compiled exchange (``reshard.program``) over this transition's ``views``. Receives are
    posted first (small pieces bucketed, large ones landing directly in their destination
    region), then each outgoing message right after this rank checksummed the pieces it carries,
    from their source regions (``sums``: ``program.source_sums``); while the bytes move, the
    local copies run (each hashed at both ends) and the previous exchange's comparison. Every
    piece that arrives is checksummed where it landed, in its destination region, once its
    message was unpacked (bytes still in cache); one small message per peer, posted right after
    the data, carries the sender's checksums. Returns the comparison of this exchange's pieces
    with their sources' checksums (run by the next exchange, or after the last)."""
    t0 = time.perf_counter()
    counters["sent"] += x.sent
    out = [(peer, views[m] if type(m) is int else [views[i] for i in m]) for peer, m in x.sends]
    inc = [(peer, views[m] if type(m) is int else [views[i] for i in m]) for peer, m in x.recvs]
    sums_out: dict[int, list[int]] = defaultdict(list)
    per_message = iter(x.send_sums)
    posted = transport.start(before_send=lambda peer, buf, parts: sums_out[peer].extend(sums(next(per_message))),
                             after_pack=(lambda sends, carried: _corrupt_packed(sends, carried, corrupt))
                             if corrupt is not None and corrupt.armed("corrupt-pack") else None,
                             messages=(out, inc))
    del out, inc
    if posted is not None:
        counters["staging_peak"] = max(counters["staging_peak"], x.staging)
        counters["staged"] += x.staging
    # the sender's checksums follow its data on each peer's stream, so they arrive with the data's
    # tail instead of costing one more round trip after it
    for peer, values in sorted(sums_out.items()):
        transport.submit_send(peer, torch.tensor(values, dtype=torch.int64, device=store.device))
    sums_in: dict[int, torch.Tensor] = {}
    for peer, regions in sorted(x.recv_regions.items()):
        sums_in[peer] = torch.empty(len(regions), dtype=torch.int64, device=store.device)
        transport.submit_recv(peer, sums_in[peer])
    posted_sums = transport.start()
    copies = _copy_locally(x, views, sums, counters, corrupt)
    if verify_previous is not None:
        verify_previous()
    t1 = time.perf_counter()
    got: dict[int, list[int]] = defaultdict(list)
    """Per peer, in message order: the checksums of the pieces that landed, where they landed."""

    def arrived(i: int, buf: torch.Tensor) -> None:
        if corrupt.armed("corrupt") and buf.numel():
            _flip_bit(buf)  # the fault: one bit flipped in flight
            corrupt.fired = True

    unpack_fault = corrupt is not None and corrupt.armed("corrupt-unpack")
    staged_lists = {id(p) for p in posted.staged if p is not None} if unpack_fault and posted is not None else set()
    checksums_of = checksum_mod.checksums_of

    def landed(peer: int, parts: list[torch.Tensor]) -> None:
        if (unpack_fault and corrupt.armed("corrupt-unpack") and parts and parts[0].numel()
                and (id(parts) in staged_lists or not staged_lists)):
            _flip_bit(parts[0])  # the fault: a bit of an unpacked piece flipped in its destination region
            corrupt.fired = True
        got[peer] += checksums_of(parts)

    deadline = time.monotonic() + timeout_s  # one deadline for the exchange: its data and its checksums
    transport.finish(posted, timeout_s, on_arrival=arrived if corrupt is not None and corrupt.armed("corrupt") else None,
                     landed=landed, deadline=deadline)
    del posted  # staging buffers go back to the arena now, not when the next exchange has run
    transport.finish(posted_sums, timeout_s, deadline=deadline)
    counters["arrived"] += x.incoming
    counters["prepare_s"] += t1 - t0
    counters["exchange_s"] += time.perf_counter() - t1

    def verify() -> None:
        t2 = time.perf_counter()
        for region, want, have in copies:
            if have != want:
                raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {_where(region)} differs "
                                      "from its source after the local copy")
        for peer, regions in sorted(x.recv_regions.items()):
            expected = sums_in[peer].tolist()
            have = got[peer]
            if have != expected:
                k = next((k for k, (a, b) in enumerate(zip(have, expected)) if a != b), min(len(have), len(expected)))
                where = _where(regions[k]) if k < len(have) else f"{len(have)} pieces landed"
                raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {where}, piece {k + 1} of "
                                      f"{len(expected)} from rank {peer}, differs from its source after it landed")
        counters["received"] += x.incoming
        counters["verify_s"] += time.perf_counter() - t2

    return verify


def _copy_locally(x: Exchange, views: list[torch.Tensor], sums, counters: dict,
                  corrupt: "_Corruption | None") -> list[tuple[Region, int, int]]:
    """Run this exchange's local copies; (piece, its source's checksum, its target's checksum
    after the copy) each. On the host each target is hashed right after its copy (its bytes still
    in cache; the source's checksum is the one its sends took, or taken here); on a device every
    copy's two ends are hashed together, one read-back each, not 2 host syncs per copy."""
    if not x.copies:
        return []
    want = sums([(h, src) for src, _, h, _, _ in x.copies])
    have: list[int] = []
    host = checksum_mod.on_host(views[x.copies[0][1]])
    hash_one = checksum_mod.host_sums
    copied = 0
    for src, dst, _, nbytes, _ in x.copies:
        target = views[dst]
        target.copy_(views[src])
        if corrupt is not None and corrupt.armed("corrupt-copy") and target.numel():
            _flip_bit(target)  # the fault: a bit of the first copy's first element flipped after the copy
            corrupt.fired = True
        if host:
            have += hash_one([target])
        copied += nbytes
    counters["copied"] += copied
    if not host:
        have = checksum_mod.checksums_of([views[c[1]] for c in x.copies])
    return [(c[4], w, h) for c, w, h in zip(x.copies, want, have)]


def _where(r: Region) -> str:
    return f"{r.model}:{r.tensor}/{r.kind} at {r.offsets}+{r.lengths}"
