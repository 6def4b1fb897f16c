"""Apply a TransitionPlan on one rank: rounds, per-message checksums, then commit or roll back.

Call order (every rank of the world calls ``apply_transition`` with the same plan):
1. allocate the rank's new regions from the arena, in storage order (kept regions are reused as
   they are; one is copied only to free a mostly dead arena buffer), build this rank's view of
   every piece it sends, receives or copies in the piece's canonical order (row-major after
   moving the tensor's storage dim first, ``TransitionPlan.major``: a function of the region
   alone, the same at both ends whatever their memory layout), and check the plan's pieces
   tile every new region exactly (no overlap, no gap: ``store.cover_error``);
2. one max-reduce over ranks: the bytes each round stages on the busiest rank, and whether any
   rank failed to prepare (then every rank rolls back before a byte moves);
3. for each exchange (consecutive planner rounds, merged while staging stays within
   ``staging_bytes``), in (round, op id) order: sends/receives through the transport (small
   pieces bucketed, dense ones in place), then local copies. End to end: the sender hashes each
   piece it sends from its source region, in canonical order, and posts those hashes behind
   the data; the receiver hashes the same piece read back from its destination region once the
   message has been unpacked there, and a local copy is hashed at both ends after it ran. Since
   the pieces tile every new region exactly, every element of every destination region is
   compared with its source, after the last step that could misplace or corrupt it;
4. vote (one ``transport.max_ints``, which also spreads the Adam step counts): commit only if
   every rank verified everything. Commit swaps the
   store's contents at once, so the old shards live until then; any exception, timeout or
   "no" vote leaves the store untouched (rollback) and raises TransitionError (``RolledBack``).
   A yes-voter waits longer than a no-voter (``vote_wait_s``): its posted yes would let a late
   peer commit, so giving up early would split the ranks.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from nereus.errors import TransitionError
from nereus.gcpause import gc_paused
from nereus.executor.arena import trim_cache
from nereus.executor.reshard.exchange import _run_round
from nereus.executor.reshard.faults import (CORRUPTIONS, FAULT_KINDS, FaultSpec, _Corruption,  # noqa: F401 - re-exported
                                            _inject)
from nereus.executor.reshard.pieces import (STAGING_BYTES, _merged, _NewLayout, _prepare,  # noqa: F401 - re-exported
                                            reserve_arena, round_groups)
from nereus.executor.reshard.program import program
from nereus.executor.reshard.recipe import recipe
from nereus.executor.reshard.vote import RolledBack, transition_worst_case_s, vote_wait_s
from nereus.executor.store import ShardStore
from nereus.executor.transport import Transport
from nereus.planner.transition.types import TransitionPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class ApplyReport:
    rank: int
    rounds: int
    exchanges: int
    """Exchanges the rounds ran in (consecutive rounds merged, see ``round_groups``)."""
    bytes_sent: int
    bytes_received: int
    bytes_copied: int
    bytes_staged: int
    """Bytes sent or received through a staging buffer on this rank (packed small pieces, and
    pieces that are not one dense block of memory); the rest moved in place."""
    messages: int
    regions_verified: int
    peak_bytes: int
    """Bytes this rank held at the transition's high point: the old state (kept until commit),
    the newly allocated regions, and the largest exchange's staging buffers (packed sends,
    staged receives)."""
    seconds: float
    phases: tuple[tuple[str, float], ...] = ()
    """Seconds per phase on this rank: allocate (new regions and this rank's piece views), prepare (posting, packing, and while the bytes
    move: sender checksums and local copies), exchange (packing, the wire and waiting on peers; ``wire_s`` is the wire and waiting
    part alone), verify (receiver checksums; runs during the next round's transfer, so it is
    also inside that round's prepare), vote+commit."""

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__}

def _after_rollback(transport: Transport, vote_completed: bool, timeout_s: float) -> tuple[bool, bool, str]:
    """NCCL: work still queued on the communicators (a peer that died, a batch half posted) would
    block later kernels, so the transport aborts them all and, only if the vote completed here
    and every rank then agrees within ``timeout_s`` (the second agreement), rebuilds the groups.
    Returns (rebuilt, lost, what to add to the message); never raises (a store gone with a dead
    rank 0 is a lost group, not a raw error)."""
    try:
        rebuilt = transport.after_rollback(vote_completed, timeout_s)
    except Exception as e:  # noqa: BLE001 - reported as lost groups, with the reason
        return False, not transport.streaming, f"; aborting or rebuilding the process groups failed ({_reason(e)})" \
            + ("; the process groups are gone: end this process" if not transport.streaming else "")
    if rebuilt:
        return True, False, "; process groups rebuilt"
    if transport.streaming:
        return False, False, ""
    return False, True, "; the process groups were aborted and not rebuilt (the vote or the agreement did not " \
        "complete on every rank): no collective can run in this process again, end it"


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


_TAGS = itertools.count(1)
"""Message tag per transition applied in this process (every rank applies the same sequence)."""

@gc_paused()
@torch.no_grad()  # the store's tensors may be a live model's leaves (requires_grad): copies into them are not autograd ops
def apply_transition(store: ShardStore, plan: TransitionPlan, rank: int, transport: Transport, *,
                     timeout_s: float = 60.0, fault: FaultSpec | None = None,
                     staging_bytes: int | None = STAGING_BYTES) -> ApplyReport:
    """Turn this rank's store from plan A's holdings into plan B's; atomic across ranks.

    The planner's rounds run in exchanges of consecutive rounds (``round_groups``): at most
    ``staging_bytes`` staged on any rank in one exchange (default 256 MiB; ``0`` runs the
    planner's rounds one by one, ``None`` all of them in one exchange). Same bytes either way, in
    (round, op id) order."""
    t0 = time.perf_counter()
    counters = {"sent": 0, "received": 0, "arrived": 0, "copied": 0, "prepare_s": 0.0, "exchange_s": 0.0,
                "verify_s": 0.0, "staging_peak": 0, "staged": 0, "exchanges_done": 0}
    held_before = store.nbytes()
    transport.tag = next(_TAGS)  # the same sequence on every rank: leftovers of a failed transition never match
    msgs0, wire0 = transport.messages, transport.wire_s
    ok, reason = True, ""
    new: _NewLayout | None = None
    groups: list[tuple[int, int]] = []
    major = {(m, t): d for m, t, d in plan.major}  # (model, tensor) -> dim stored outermost
    rec = recipe(plan, rank, major)
    rounds = rec.plan_rounds  # a max over every op: taken once per plan
    staged = [0] * rounds
    items: list | None = None
    sums = None
    aborted = [False]

    def abort_now() -> None:  # NCCL: this rank rolls back, so its data communicators go now, before the vote
        if counters["exchanges_started"] and not aborted[0]:
            aborted[0] = True
            transport.abort_now()

    counters["exchanges_started"] = 0
    try:
        worst = transition_worst_case_s(timeout_s, rounds)
        if not transport.streaming and transport.pg_timeout_s is not None and transport.pg_timeout_s <= worst:
            raise TransitionError(f"the process-group timeout ({transport.pg_timeout_s:g} s) is not above this "
                                  f"transition's worst case ({worst:g} s = timeout {timeout_s:g} s x (3 x "
                                  f"{rounds} rounds + 4)): NCCL's watchdog would act first; join with "
                                  f"pg_timeout_s >= vote.nccl_pg_timeout_s(...)")
        new = _NewLayout(store, plan, rank, major)
        items, staged = _prepare(plan, store, new, rank, transport.bucket_bytes, major, views=False)
        new.check_complete(rank)  # the plan covers every new element exactly once: else stop before any byte moves
        counters["copied"] += new.relocated_bytes
        counters["allocate_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - roll back, with the reason
        ok, reason = False, _reason(e)
    try:  # every rank, also one that failed to prepare: the largest staging per round, and any failure
        spread = transport.max_ints([int(not ok)] + staged, timeout_s)
        if ok and spread[0]:
            ok, reason = False, "another rank failed to prepare the transition"
    except TransitionError as e:
        ok, reason = False, reason or str(e)
    if ok:
        try:
            groups = round_groups(spread[1:], staging_bytes)
            src_t, dst_t, geo = new.bases
            prog = program(new.recipe, geo, groups, transport.bucket_bytes, store, new, src_t, dst_t)
            items = prog.views(store, src_t, dst_t)  # every piece's view, one as_strided each
            if items is None:  # a held region only joined pieces are read from changed: compile again
                prog = program(new.recipe, geo, groups, transport.bucket_bytes, store, new, src_t, dst_t, again=True)
                items = prog.views(store, src_t, dst_t)
            verify = None
            sums = [None] * prog.sums  # this transition's source checksums, by id (``Exchange.send_groups``)
            corruption = _Corruption(fault.kind) if fault is not None and fault.rank == rank \
                and fault.kind in CORRUPTIONS else None
            for x in prog.exchanges:
                lo, hi = x.lo, x.hi
                _inject(fault, rank, lo, hi, "before")
                counters["exchanges_started"] += 1
                verify = _run_round(x, items, store, rank,
                                    transport, timeout_s, counters, sums, f"{lo}" if lo == hi else f"{lo}-{hi}", verify,
                                    corrupt=corruption if corruption is not None and fault.round <= hi else None)
                counters["exchanges_done"] += 1
                _inject(fault, rank, lo, hi, "after")
            if verify is not None:
                verify()
            new.verify_relocated(store, rank, major)
        except Exception as e:  # noqa: BLE001 - any failure on this rank means roll back, with its reason
            ok, reason = False, _reason(e)
            abort_now()
    transport.close()
    t_vote = time.perf_counter()
    models = rec.models
    if ok and fault is not None and fault.rank == rank and fault.kind == "slow-vote":
        time.sleep(fault.hang_s)
    vote_completed = True
    try:  # every rank votes, also a failed one, so its peers learn it at once instead of timing out;
        # the same collective spreads each model's Adam step count, so one result decides both
        vote = transport.max_ints([int(not ok)] + [store.step.get(m, 0) for m in models],
                                  vote_wait_s(timeout_s, len(groups), ok))
        if ok and vote[0]:
            ok, reason = False, "another rank failed to verify its regions"
    except TransitionError as e:  # whatever this rank voted: a peer may be dead, so no collective rebuild
        vote_completed = False
        if ok:
            reason = (f"{e}; this rank voted to commit and the vote did not complete here, so a peer that "
                      f"completed it may have committed")
        ok, reason = False, reason or str(e)
    if not ok:
        abort_now()
        rebuilt, lost, why = _after_rollback(transport, vote_completed, timeout_s)
        raise RolledBack(f"transition rolled back on rank {rank}: {reason}; this rank's old layout is intact" + why,
                         bytes_received=counters["arrived"], exchanges_done=counters["exchanges_done"],
                         vote_completed=vote_completed, groups_rebuilt=rebuilt, groups_lost=lost)
    for m, step in zip(models, vote[1:]):
        store.step[m] = step
    items = sums = new.bases = None  # drop this rank's views of the old state, so its buffers are free for the trim
    store.replace(new.tensors)  # handed over: new is dropped below
    trim_cache()  # the old state's buffers are free now: keep at most cache_limit() of them
    phases = tuple((k, round(counters.get(k, 0.0), 6)) for k in ("allocate_s", "prepare_s", "exchange_s", "verify_s"))
    phases += (("vote_commit_s", round(time.perf_counter() - t_vote, 6)),
               ("wire_s", round(transport.wire_s - wire0, 6)))
    return ApplyReport(rank=rank, rounds=rounds, exchanges=len(groups), bytes_sent=counters["sent"], bytes_received=counters["received"],
                       bytes_copied=counters["copied"], bytes_staged=counters["staged"],
                       messages=transport.messages - msgs0,
                       regions_verified=len(new.recipe.fresh), seconds=time.perf_counter() - t0, phases=phases,
                       peak_bytes=held_before + new.allocated_bytes() + counters["staging_peak"])
