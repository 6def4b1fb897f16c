"""The end of a transition: the commit vote, how long a rank waits for it, and ``RolledBack``."""
from __future__ import annotations

import time

from nereus.errors import TransitionError


class RolledBack(TransitionError):
    """A transition that rolled back on this rank, with how far it got (tests and reports)."""

    def __init__(self, message: str, *, bytes_received: int, exchanges_done: int, vote_completed: bool = True,
                 groups_rebuilt: bool = False, groups_lost: bool = False) -> None:
        super().__init__(message)
        self.bytes_received = bytes_received
        self.exchanges_done = exchanges_done
        self.groups_rebuilt = groups_rebuilt
        """True when the transport aborted its communicators and rebuilt the process groups (NCCL):
        every group object made before is gone; every ``Engine`` of the process has rebound."""
        self.groups_lost = groups_lost
        """True when the communicators were aborted and not rebuilt (NCCL: the vote or the second
        agreement did not complete on every rank): this process can run no collective again and
        should end (the message says so); its store holds the old layout intact."""
        self.vote_completed = vote_completed
        """False whenever the vote failed on this rank (timeout or error), whatever this rank voted:
        a yes-voter's peer may have committed; and no rank may rebuild the groups collectively
        after a vote that did not complete, since a peer may be dead."""


def vote_wait_s(timeout_s: float, exchanges: int, ok: bool) -> float:
    """How long a rank waits for the commit vote. A "no" cannot be outvoted, so its voter rolls
    back after ``timeout_s`` whatever happens. A "yes" stays posted in the collective even if its
    voter stops waiting (gloo and NCCL do not take back a posted all-reduce), so a live but slow
    peer arriving later would complete the vote with it and commit while this rank rolled back.
    A yes-voter therefore waits out a live peer's longest path to the vote: the staging
    agreement, then per exchange the data and the checksums, each bounded by ``timeout_s``."""
    return timeout_s if not ok else timeout_s * (2 * exchanges + 2)


def transition_worst_case_s(timeout_s: float, exchanges: int) -> float:
    """The longest one rank can spend in a transition whose waits are bounded by ``timeout_s``:
    the staging agreement, one deadline per exchange, a yes-voter's ``vote_wait_s`` and the
    second agreement before a rebuild. NCCL's process-group timeout must be above it (else its
    watchdog acts on a wait the executor is still bounding itself: ``apply_transition`` refuses
    to start otherwise, and ``nccl_pg_timeout_s`` gives a timeout that fits)."""
    return timeout_s * (1 + exchanges) + vote_wait_s(timeout_s, exchanges, True) + timeout_s


def nccl_pg_timeout_s(timeout_s: float, exchanges: int) -> float:
    """A process-group timeout above ``transition_worst_case_s`` with a margin (and at least 10 min)."""
    return max(600.0, 2 * transition_worst_case_s(timeout_s, exchanges) + 60.0)


def agree_on_rebuild(store, world: int, attempt: int, timeout_s: float) -> bool:
    """The second, bounded agreement before a collective rebuild of the process groups: each rank
    counts itself in under ``nereus-rebuild/<attempt>/ready`` in the rendezvous ``store`` and waits
    at most ``timeout_s`` for all ``world``. True: every rank is alive and rebuilding (the rebuild
    itself is then bounded by the process-group timeout). False (a peer died, or the store is
    gone with the rank that hosted it): no rebuild; the caller reports its groups gone instead of
    blocking forever in a collective."""
    key = f"nereus-rebuild/{attempt}/ready"
    deadline = time.monotonic() + timeout_s
    try:
        count = store.add(key, 1)
        while count < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
            count = store.add(key, 0)
    except Exception:  # noqa: BLE001 - the store is unreachable (its host died): no agreement
        return False
    return True
