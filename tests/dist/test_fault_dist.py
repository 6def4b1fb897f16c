"""Faults mid-transition: a rank raises, or a rank stops answering past the timeout. Every rank
must roll back to checksums identical to before, and the test must end in bounded time."""
import time

import pytest

from nereus.executor.apply import FaultSpec
from nereus.executor.checks import reshard_case
from nereus.executor.launch import HUNG, launch
from nereus.executor.scenario import local_cluster, make_plan, tiny_job
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

pytestmark = pytest.mark.dist
JOB = tiny_job(preset("tiny-4l-128h"))
A, B = make_plan(tp=2), make_plan(dp=2, zero=1)
TPLAN = plan_transition(JOB, local_cluster(2), A, B, mixed_precision=False, scheduler="greedy")
TIMEOUT_S = 3.0


def _run(fault):
    t0 = time.monotonic()
    out = launch(reshard_case, 2, JOB, A, B, TPLAN, 0, fault, TIMEOUT_S, timeout_s=60, allow_hung=True)
    return out, time.monotonic() - t0


def test_rank_raises_mid_transition_all_roll_back():
    assert TPLAN.rounds >= 1
    out, wall = _run(FaultSpec(rank=1, round=TPLAN.rounds - 1, kind="raise"))
    assert all(o is not HUNG for o in out)
    for o in out:
        assert o["rolled_back"] and o["checksums_equal"], o
        assert o["seconds"] < 4 * TIMEOUT_S
    assert "injected fault" in out[1]["error"]
    assert wall < 60


def test_rank_hangs_past_timeout_all_roll_back():
    out, wall = _run(FaultSpec(rank=0, round=0, kind="hang", hang_s=5 * TIMEOUT_S))
    for o in out:
        assert o is not HUNG, "the hung rank wakes up, fails and rolls back too"
        assert o["rolled_back"] and o["checksums_equal"], o
    # the healthy rank gives up after its timeouts (p2p, then the vote), not after the 15 s hang
    assert out[1]["seconds"] < 4 * TIMEOUT_S
    assert wall < 60


def _run_with(fault, staging_bytes, timeout_s=TIMEOUT_S):
    return launch(reshard_case, 2, JOB, A, B, TPLAN, 0, fault, timeout_s, staging_bytes, timeout_s=90, allow_hung=True)


def test_a_byte_corrupted_in_one_exchange_rolls_back_every_rank_on_gloo():
    """One exchange (staging_bytes=None): rank 1 receives a flipped bit, rank 0 receives intact
    bytes and verifies them; only the commit vote can stop rank 0. Both keep their checksums."""
    out = _run_with(FaultSpec(rank=1, round=0, kind="corrupt"), None)
    assert all(o is not HUNG for o in out)
    for o in out:
        assert o["rolled_back"] and o["checksums_equal"] and o["bytes_received"] > 0, o
    assert "checksum mismatch" in out[1]["error"]
    assert "another rank failed to verify" in out[0]["error"]


def test_a_rank_failing_after_data_arrived_rolls_back_every_rank_on_gloo():
    """Round by round (staging_bytes=0): rank 1 fails once the last exchange's bytes arrived."""
    assert TPLAN.rounds >= 2
    out = _run_with(FaultSpec(rank=1, round=TPLAN.rounds - 1, kind="after-receive"), 0)
    for o in out:
        assert o is not HUNG and o["rolled_back"] and o["checksums_equal"], o
        assert o["bytes_received"] > 0 and o["exchanges_done"] == TPLAN.rounds, o
    assert "after the bytes of round" in out[1]["error"]


def test_a_straggler_at_the_vote_does_not_split_the_ranks_on_gloo():
    """Rank 1 verifies, then stalls past the per-message timeout before voting: rank 0 (a yes)
    waits for it, and both commit bit-exact (before the fix rank 0 rolled back, rank 1 committed)."""
    out = _run_with(FaultSpec(rank=1, round=0, kind="slow-vote", hang_s=2.0), None, timeout_s=1.0)
    for o in out:
        assert o is not HUNG and not o["rolled_back"], o
        assert o["mismatches"] == [] and o["compared_logits"] and o["logits_max_diff"] <= 1e-5, o
