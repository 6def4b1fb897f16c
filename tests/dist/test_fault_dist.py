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
