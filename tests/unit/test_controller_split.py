"""The online controller re-plans an asynchronous job's rollout / trainer split like any other
dimension: as the mean response grows, generation outgrows training and the rollout pool gets
more GPUs; on a flat, noisy trace it stays. GRPO-8B, one-step-off, 128 H100s; observed stage
times are the planner's own predictions for the plan that ran (this tests the controller's logic,
not the cost model)."""
from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from nereus.planner.cost.plan_times import evaluate_times
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import load_cluster, load_job

ROOT = Path(__file__).resolve().parents[2]
JOB = replace(load_job(ROOT / "examples/grpo-8b.yaml"), schedule=ScheduleSpec(kind="one_step_off"))
CLUSTER = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(128)


def _run(means, noise: float = 0.0, seed: int = 0, engine_restart_s: float = 0.0) -> tuple[list[int], int]:
    """Rollout-pool sizes the run went through, and its number of switches."""
    r = random.Random(seed)
    cap = max(int(max(means) * 1.5), JOB.sequence.response_len_max)
    w0 = JOB.workload().with_lengths(mean=means[0], max_=cap)
    # by default engine_restart_s=0: steps of a few seconds here would never repay a 48 s engine start over the
    # 30-step horizon; this tests the re-split logic (test_controller_dead_ends tests the engine term)
    ctl = Controller(JOB, CLUSTER, horizon=30, build_transition=False, total_steps=len(means), initial_workload=w0,
                     engine_restart_s=engine_restart_s)
    splits, switches = [ctl.plan.stage("actor/generation").gpus], 0
    for step, mean in enumerate(means):
        times = evaluate_times(JOB, CLUSTER, ctl.plan, w0.with_lengths(mean=mean, max_=cap), ctl.base_params).stage_s
        d = ctl.step(StepMetrics(step=step, response_len_mean=mean * (1 + noise * r.gauss(0, 1)), response_len_max=cap,
                                 response_len_cap=cap,
                                 stage_times={k: v * (1 + noise * r.gauss(0, 1)) for k, v in times.items()}))
        if d.action == "switch":
            switches += 1
            assert dict(d.plan.extras)["schedule"]["kind"] == "one_step_off"
            splits.append(d.plan.stage("actor/generation").gpus)
    return splits, switches


def test_the_rollout_pool_grows_with_the_responses():
    splits, switches = _run([256 * 1.04 ** k for k in range(70)])  # 256 -> 3,900 tokens
    # generation outgrows training first (the rollout pool grows); at the longest responses
    # training's attention (s^2) catches up, and the split may move back part of the way
    assert max(splits) > splits[0] and splits[1] > splits[0], splits
    assert switches <= 4, splits


def test_a_new_engine_start_is_not_repaid_by_steps_of_a_few_seconds():
    """The same growth with the published engine start (``RestartCost.engine_start_s``, 47.85 s) on
    every re-split: over a 30-step horizon of steps of a few seconds none pays, the split stays."""
    from nereus.planner.online.restart import RestartCost

    splits, switches = _run([256 * 1.04 ** k for k in range(70)], engine_restart_s=RestartCost().engine_start_s)
    assert switches == 0 and splits == splits[:1], splits


def test_a_flat_noisy_trace_keeps_the_split():
    splits, switches = _run([1024.0] * 40, noise=0.05)
    assert switches <= 1 and len(set(splits)) <= 2, (splits, switches)


def test_restart_mode_relaunches_verl_async_with_the_new_split():
    """A framework that cannot reshard live gets the new split as its relaunch: the switch carries
    verl's async launch (rollout.* and trainer.* pool sizes of the new plan)."""
    from nereus.frameworks import launch_config

    means = [256 * 1.04 ** k for k in range(70)] + [256 * 1.04 ** 69] * 400  # then a long plateau
    cap = max(int(max(means) * 1.5), JOB.sequence.response_len_max)
    w0 = JOB.workload().with_lengths(mean=means[0], max_=cap)
    ctl = Controller(JOB, CLUSTER, horizon=200, total_steps=len(means), initial_workload=w0,
                     transition_mode="restart", framework="verl", emitter=launch_config)
    for step, mean in enumerate(means):
        times = evaluate_times(JOB, CLUSTER, ctl.plan, w0.with_lengths(mean=mean, max_=cap), ctl.base_params).stage_s
        d = ctl.step(StepMetrics(step=step, response_len_mean=mean, response_len_max=cap, response_len_cap=cap,
                                 stage_times=dict(times)))
        if d.action == "switch" and d.plan.stage("actor/generation").gpus != 64:
            fc = d.framework_config
            assert "one_step_off_policy" in " ".join(fc["command"]), fc["command"]
            kv = dict(a.split("=", 1) for a in fc["args"] if "=" in a)
            rollout_nodes, trainer_nodes = int(kv["rollout.nnodes"]), int(kv["trainer.nnodes"])
            assert rollout_nodes + trainer_nodes == CLUSTER.nodes and rollout_nodes != 64 // CLUSTER.gpus_per_node, kv
            if fc["expresses_plan_as_is"]:  # else the launch holds the closest split verl can run, its gaps named
                assert rollout_nodes == d.plan.stage("actor/generation").gpus // CLUSTER.gpus_per_node, kv
            else:
                assert fc["gaps"], fc
            return
    raise AssertionError("the restart-mode controller never moved the split")
