"""A policy's simulated result does not depend on which other policies share its ``simulate()``
call (they share a plan cache and a ground truth: both must hold pure-function results only), nor
on whether the online policies run in one process or in forked workers (issue 29)."""
import math

import pytest

from nereus.planner.specs import load_cluster, load_job
from nereus.simulator.simulate import simulate
from nereus.simulator.trace import parse_trace

TRACE = """# growing lengths and a GPU jump: adaptive switches at least once
step,response_len_mean,response_len_max,gpus
0,1500,4096,8
5,2500,4096,8
8,5000,16384,32
15,8000,16384,32
"""
MIX = ["static", "verl", "openrlhf", "openrlhf-colocate", "always", "adaptive-restart", "adaptive", "hindsight"]
"""Others first, so that adaptive meets a cache they filled."""


def _sig(r):
    nan = lambda xs: tuple(None if isinstance(x, float) and math.isnan(x) else x for x in xs)  # noqa: E731
    return {"step_s": nan(r.step_s), "transition_s": r.transition_s, "restart_s": r.restart_s, "ooms": r.ooms,
            "dropped": r.dropped, "plans": tuple(r.plans[k].key() if k >= 0 else None for k in r.plan_index),
            "note": r.note}


@pytest.fixture(scope="module")
def world():
    return load_job("examples/grpo-7b.yaml"), load_cluster("examples/cluster-h100-4n.yaml"), parse_trace(TRACE, "mix")


@pytest.fixture(scope="module")
def mixed(world):
    job, cluster, trace = world
    return simulate(job, cluster, trace, MIX, time_limit_s=1.0, seed=0)


def test_adaptive_alone_equals_adaptive_among_all_policies(world, mixed):
    job, cluster, trace = world
    alone = simulate(job, cluster, trace, ["adaptive"], time_limit_s=1.0, seed=0)["adaptive"]
    assert sum(t > 0 for t in alone.transition_s) >= 1  # the comparison covers a switch
    assert _sig(alone) == _sig(mixed["adaptive"])


@pytest.mark.parametrize("name", ["static", "always"])
def test_other_online_policies_alone_equal_them_in_the_mix(world, mixed, name):
    job, cluster, trace = world
    alone = simulate(job, cluster, trace, [name], time_limit_s=1.0, seed=0)[name]
    assert _sig(alone) == _sig(mixed[name])


def test_forked_workers_give_the_same_results(world, mixed):
    """workers=2 (online policies in forked processes, each with its own plan cache, the offline
    candidates' solves beside them) equals workers=1 for every policy, the offline one included."""
    job, cluster, trace = world
    forked = simulate(job, cluster, trace, MIX, time_limit_s=1.0, seed=0, workers=2)
    for name in MIX:
        assert _sig(forked[name]) == _sig(mixed[name]), name
