"""A switch the executor rolled back reaches the controller (``report_rollback``): it returns to
the plan the job still runs, audits the rollback, and does not retry a switch for speed at once.
Same scenario as test_controller_api.py: GRPO-7B starting on 8 of 32 H100s."""
from __future__ import annotations

import pytest

from nereus.errors import NereusError
from nereus.planner.online.controller import Controller

from controller_env import env, observed  # noqa: F401 - the scenario's module fixture


def test_a_rolled_back_switch_returns_the_controller_to_the_old_plan_and_is_audited(env):
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e-3, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False, min_dwell=3)
    with pytest.raises(NereusError, match="without a switch"):
        ctl.report_rollback("nothing to undo")
    before = ctl.plan
    d = ctl.step(observed(env, 0, before))
    assert d.action == "switch" and ctl.plan == d.plan != before, d.reason
    ctl.report_rollback("checksum mismatch on rank 1", step=0)
    assert ctl.plan == before
    rec = ctl.audit.records[-1]
    assert rec["decision"] == "rollback" and rec["step"] == 0 and "checksum mismatch" in rec["reason"]
    assert rec["plan"] != rec["failed_plan"]
    with pytest.raises(NereusError):  # one rollback per switch
        ctl.report_rollback("again")
    # the job still runs the old plan: the next decision starts from it, and a switch made for
    # speed waits out the dwell from the failed one instead of retrying at once
    d1 = ctl.step(observed(env, 1, before))
    assert ctl.audit.records[-1]["decision"] == d1.action == "stay" and not d1.must
    assert "within 3 steps of the last switch" in d1.reason and ctl.plan == before


def test_a_switch_the_next_step_ran_on_cannot_be_rolled_back(env):
    """Once a step has run after the switch, the switch was applied: a late report_rollback is refused
    instead of returning the controller to a plan the job no longer runs."""
    ctl = Controller(env.job, env.cluster, transition_cost_fn=lambda a, b: 1e-3, horizon=50, plans=env.plans,
                     initial_gpus=8, build_transition=False, min_dwell=10)
    d = ctl.step(observed(env, 0, ctl.plan))
    assert d.action == "switch", d.reason
    d1 = ctl.step(observed(env, 1, d.plan))
    assert d1.action == "stay", d1.reason
    with pytest.raises(NereusError, match="without a switch"):
        ctl.report_rollback("too late")
    assert ctl.plan == d.plan
