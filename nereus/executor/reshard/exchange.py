"""One exchange of a transition on one rank: post, hash at both ends, copy locally, compare."""
from __future__ import annotations

import time
from collections import Counter, defaultdict

import torch

from nereus.errors import TransitionError
import nereus.executor.reshard.checksum as checksum_mod
from nereus.executor.reshard.checksum import SourceSums, checksums_of
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
    incoming = 0
    local: list[tuple] = []
    landing: dict[int, Region] = {}
    for what, peer, view, nbytes, region in items:
        if what == "send":
            transport.submit_send(peer, view)
            counters["sent"] += nbytes
        elif what == "recv":
            transport.submit_recv(peer, view)
            landing[id(view)] = region
            incoming += nbytes
        else:
            local.append((peer, view, nbytes, region))
    sums_out: dict[int, list[int]] = defaultdict(list)
    posted = transport.start(before_send=lambda peer, buf, parts: sums_out[peer].extend(sums.message(buf, parts)),
                             after_pack=(lambda sends, carried: _corrupt_packed(sends, carried, sums, corrupt))
                             if corrupt is not None and corrupt.armed("corrupt-pack") else None)
    recv_peers = [peer for peer, _ in posted.recvs] if posted else []
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
    for peer, n in sorted(Counter(op[1] for op in items if op[0] == "recv").items()):
        sums_in[peer] = torch.empty(n, dtype=torch.int64, device=store.device)
        transport.submit_recv(peer, sums_in[peer])
    posted_sums = transport.start()
    copies: list[tuple[Region, int, int]] = []
    copied: list[tuple[Region, torch.Tensor, torch.Tensor]] = []
    on_host = store.device.type == "cpu" and not checksum_mod.DEVICE_HASH_ON_CPU
    for source, target, nbytes, region in local:
        target.copy_(source)
        if corrupt is not None and corrupt.armed("corrupt-copy") and target.numel():
            _flip_bit(target)  # the fault: a bit of the first copy's first element flipped after the copy
            corrupt.fired = True
        if on_host:  # both ends hashed right after the copy, bytes still in cache
            copies.append((region, sums(source), checksum_mod.checksum(target)))
        else:
            copied.append((region, source, target))
        counters["copied"] += nbytes
    if copied:  # on a device: every copy's two ends hashed together, one read-back each, not 2 host syncs per copy
        copies = list(zip([r for r, _, _ in copied], sums.many([s for _, s, _ in copied]),
                          checksums_of([t for _, _, t in copied])))
    del copied
    if verify_previous is not None:
        verify_previous()
    t1 = time.perf_counter()
    got: dict[int, list[tuple[Region, int]]] = defaultdict(list)

    def arrived(i: int, buf: torch.Tensor) -> None:
        if corrupt.armed("corrupt") and buf.numel():
            _flip_bit(buf)  # the fault: one bit flipped in flight
            corrupt.fired = True

    staged_lists = {id(p) for p in posted.staged if p is not None} if posted is not None else set()

    def landed(peer: int, parts: list[torch.Tensor]) -> None:
        if (corrupt is not None and corrupt.armed("corrupt-unpack") and parts and parts[0].numel()
                and (id(parts) in staged_lists or not staged_lists)):
            _flip_bit(parts[0])  # the fault: a bit of an unpacked piece flipped in its destination region
            corrupt.fired = True
        got[peer].extend(zip((landing[id(part)] for part in parts), checksums_of(parts)))

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
        for peer in sorted(set(recv_peers)):
            expected = sums_in[peer].tolist()
            for k, (region, have) in enumerate(got[peer]):
                if have != expected[k]:
                    raise TransitionError(f"rank {rank}: checksum mismatch in round {rnd}: {_where(region)}, piece "
                                          f"{k + 1} of {len(expected)} from rank {peer}, differs from its source "
                                          f"after it landed")
        counters["received"] += incoming
        counters["verify_s"] += time.perf_counter() - t2

    return verify


def _where(r: Region) -> str:
    return f"{r.model}:{r.tensor}/{r.kind} at {r.offsets}+{r.lengths}"
