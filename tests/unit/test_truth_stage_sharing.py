"""Model-stages that differ only in their role share the ground truth's training / inference run
(SIMULATED): with four 8B models (PPO), the actor's and the reference's inference are the same
computation, the critic's and the reward's (value heads) another; a truth that shares them gives
bit for bit the step times of one that computes every model-stage alone, with fewer runs, and a key
that forgot the value head would be caught."""
import numpy as np
import pytest

from nereus.models.spec import preset
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec
from nereus.simulator import oracle as offline
from nereus.simulator.trace import parse_trace
from nereus.simulator.truth import machine
from test_sim_speed_pin import _plan

H100 = ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=2)
M8 = preset("llama-3.1-8b")
JOB = JobSpec(algorithm="ppo", models=(("actor", M8), ("critic", M8), ("ref", M8), ("reward", M8)),
              batch=BatchSpec(prompts=32, samples_per_prompt=4, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=1024, response_len_max=4096))
TRACE = "step,response_len_mean,response_len_max,gpus\n0,600,4096,8\n12,1800,4096,16\n"


def _ppo_plan(gpus: int, tp: int, zero: int, mb: int = 1, pp: int = 1):
    """``_plan``'s layout with the critic's and the reward's stages beside the actor's (same pool)."""
    from dataclasses import replace

    base = _plan(gpus, tp, zero, mb=mb, pp=pp)
    act_inf = base.stage("actor/inference")
    extra = [replace(act_inf, name=n) for n in ("critic/inference", "reward/inference")]
    extra.append(replace(base.stage("actor/training"), name="critic/training"))
    return replace(base, stages=base.stages + tuple(extra))


def _matrix(trace, plans, kernel_of=None):
    calls = []
    gt = machine.GroundTruth(JOB, H100, trace, seed=3, block=8)
    orig = gt._train_infer
    gt._train_infer = lambda key, *a: calls.append(key) or orig(key, *a)
    if kernel_of is not None:
        gt._kernel_of = kernel_of
    gpus = np.array([r.gpus for r in trace.rows])
    return offline.step_time_matrix(gt, plans, offline.usable_steps(plans, gpus), len(trace)), len(calls)


@pytest.fixture(scope="module")
def world():
    trace = parse_trace(TRACE, "roles")
    plans = [_ppo_plan(g, tp, zero, mb) for g in (8, 16) for tp in (1, 2) for zero in (1, 3) for mb in (1, 2)]
    return trace, plans


def test_shared_role_runs_equal_each_model_stage_alone(world):
    trace, plans = world
    assert {s.name for s in plans[0].stages} >= {"critic/inference", "reward/inference", "critic/training"}
    shared, n_shared = _matrix(trace, plans)
    alone, n_alone = _matrix(trace, plans, kernel_of=lambda name: ("alone", name))
    assert np.isfinite(shared).sum() > 20
    assert shared.tobytes() == alone.tobytes()
    assert n_shared < n_alone


def test_a_key_without_the_value_head_would_be_caught(world):
    trace, plans = world
    shared, _ = _matrix(trace, plans)
    gt = machine.GroundTruth(JOB, H100, trace)
    wrong = lambda name: gt._kernel_of(name)[:3]  # noqa: E731 (critic inference = actor inference)
    assert not np.array_equal(shared, _matrix(trace, plans, kernel_of=wrong)[0])
