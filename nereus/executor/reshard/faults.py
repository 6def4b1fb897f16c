"""Failures injected into a transition (tests and ``nereus reshard-check --inject-fault``)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    """A failure to inject (tests and ``reshard-check --inject-fault``)."""

    rank: int
    round: int
    kind: str = "raise"
    """``raise``: an exception on that rank before it posts the exchange holding ``round``;
    ``hang``: it stops answering there for ``hang_s``; ``after-receive``: an exception on that
    rank once that exchange's bytes have arrived (the data moved, nothing verified or committed
    yet); ``corrupt``: one bit of the first message that rank receives in that exchange flips
    before it is unpacked (a byte corrupted in flight: only the receiver can tell);
    ``corrupt-copy``: one bit of the first element of the first local copy that rank makes in
    that exchange flips after the copy (memory or a copy gone wrong: only the destination's
    checksum can tell); ``corrupt-pack``: one bit of that rank's packed staging copy of an
    outgoing message flips after packing, before its checksums are taken and it is posted (in a
    strided piece where the message carries one: the case a hash of the packed copy cannot see);
    ``corrupt-unpack``: one bit of the first piece that rank unpacks from a staged message (else
    of the first piece it receives) flips in its destination region before it is hashed there.
    The four ``corrupt`` kinds fire in the exchange holding ``round``, or the first one after it
    where there is something of their kind to corrupt;
    ``slow-vote``: that rank verifies everything, then stalls ``hang_s`` before it votes (a
    straggler; ``round`` is ignored); ``kill``: that rank's process dies of SIGKILL before it
    posts the exchange holding ``round`` (no exception, no vote, no goodbye: its peers learn of it
    from the transport, a closed connection or the timeout, and roll back)."""
    hang_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {self.kind!r}")


FAULT_KINDS = ("raise", "hang", "after-receive", "corrupt", "corrupt-copy", "corrupt-pack", "corrupt-unpack",
               "slow-vote", "kill")
CORRUPTIONS = ("corrupt", "corrupt-copy", "corrupt-pack", "corrupt-unpack")


class _Corruption:
    """An injected corruption (``FaultSpec`` kinds in ``CORRUPTIONS``): armed from the exchange
    holding its round until it has fired once."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fired = False

    def armed(self, kind: str) -> bool:
        return self.kind == kind and not self.fired


def _flip_bit(t: torch.Tensor) -> None:
    """Flip the lowest bit of the first element of ``t`` (any dtype, any strides) in place."""
    t.as_strided((1,), (1,)).view(torch.uint8)[0] ^= 1


def _corrupt_packed(sends: list, carried: list, corruption: "_Corruption") -> None:
    """``corrupt-pack``: one bit of a packed outgoing message, in a strided piece if one is packed
    (its old sender hash was taken from this very copy), else at the start of the first."""
    packed = [(buf, parts) for (_, buf), parts in zip(sends, carried) if buf is not parts[0]]
    at = None
    for buf, parts in packed:
        pos = 0
        for part in parts:
            if not part.is_contiguous() and part.numel():
                at = (buf, pos)
                break
            pos += part.numel()
        if at is not None:
            break
    if at is None and packed and packed[0][0].numel():
        at = (packed[0][0], 0)
    if at is not None:
        _flip_bit(at[0].view(-1)[at[1]:])
        corruption.fired = True

def _inject(fault: FaultSpec | None, rank: int, lo: int, hi: int, when: str) -> None:
    """The injected failure of ``fault`` if it falls in the exchange of rounds lo..hi at ``when``
    (``before``: before this rank posts; ``after``: once its bytes have arrived)."""
    if fault is None or fault.rank != rank or not lo <= fault.round <= hi:
        return
    if when == "before" and fault.kind == "hang":
        time.sleep(fault.hang_s)
    elif when == "before" and fault.kind == "kill":
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    elif when == "before" and fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} in round {fault.round}")
    elif when == "after" and fault.kind == "after-receive":
        raise RuntimeError(f"injected fault on rank {rank} after the bytes of round {fault.round} arrived")
