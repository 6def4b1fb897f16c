"""A rank killed with SIGKILL mid-transition, on 3 real gloo processes: no exception, no vote,
no goodbye. The survivors must learn of it from the transport (a closed connection, or the
timeout), roll back within the vote wait, and keep checksums identical to before."""
import time

import pytest

from nereus.executor.apply import FaultSpec, vote_wait_s
from nereus.executor.checks import reshard_case
from nereus.executor.launch import HUNG, launch
from nereus.executor.scenario import local_cluster, make_plan, tiny_job
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

pytestmark = pytest.mark.dist
JOB = tiny_job(preset("tiny-4l-128h"))
WORLD = 3
A, B = make_plan(tp=2), make_plan(tp=2, first_gpu=1)  # gpus 0-1 -> gpus 1-2: rank 2 receives everything
TPLAN = plan_transition(JOB, local_cluster(WORLD), A, B, mixed_precision=False, scheduler="greedy")
TIMEOUT_S = 2.0


def test_a_rank_killed_mid_transition_the_survivors_roll_back_intact():
    assert any(op.dst_gpu == 2 and not op.is_copy for op in TPLAN.ops)
    t0 = time.monotonic()
    out = launch(reshard_case, WORLD, JOB, A, B, TPLAN, 0, FaultSpec(rank=2, round=0, kind="kill"), TIMEOUT_S,
                 timeout_s=90, allow_hung=True)
    wall = time.monotonic() - t0
    assert out[2] is HUNG, "the killed rank returns nothing"
    for o in out[:2]:
        assert o is not HUNG, "a survivor must not hang on the dead rank"
        assert o["rolled_back"] and o["checksums_equal"], o
        assert o["regions"] > 0
        assert any(w in o["error"] for w in ("point-to-point", "did not answer", "collective")), o["error"]
        # within the p2p timeout plus the longest vote wait of a yes-voter, not the 60 s process-group timeout
        assert o["seconds"] < TIMEOUT_S + vote_wait_s(TIMEOUT_S, TPLAN.rounds, True) + 2, o
    assert wall < 90
