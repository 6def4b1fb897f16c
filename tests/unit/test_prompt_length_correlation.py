"""Within-prompt length correlation: measured from a batch, carried by the workload, and setting the
longest micro-batch (``cost.passes.worst_micro_batch``); the controller learns it from its steps."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nereus.errors import SpecError
from nereus.planner.cost.passes import _micro_batches, worst_micro_batch
from nereus.planner.online.adapters import from_verl, prompt_length_correlation
from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.specs import JobSpec, ParallelConfig, SequenceSpec, Workload, load_job

from controller_env import env  # noqa: F401  (fixture)


def _grouped(rng, prompts: int, samples: int, rho: float) -> np.ndarray:
    shared = rng.normal(size=prompts) * np.sqrt(rho)
    return 1000 + 300 * (np.repeat(shared, samples) + rng.normal(size=prompts * samples) * np.sqrt(1 - rho))


def test_the_estimate_recovers_a_known_correlation_and_sees_none_in_independent_lengths():
    rng = np.random.default_rng(0)
    for rho in (0.0, 0.3, 0.7):
        est = np.mean([prompt_length_correlation(_grouped(rng, 256, 8, rho), samples_per_prompt=8) for _ in range(20)])
        assert abs(est - rho) < 0.04, (rho, est)


def test_groups_by_id_in_any_order_give_the_adjacent_estimate():
    rng = np.random.default_rng(1)
    x = _grouped(rng, 64, 4, 0.5)
    uid = np.repeat(np.arange(64), 4).astype(str)
    perm = rng.permutation(len(x))
    a = prompt_length_correlation(x, samples_per_prompt=4)
    assert prompt_length_correlation(x[perm], groups=uid[perm]) == pytest.approx(a, rel=1e-12)
    # unequal groups (a prompt whose samples were filtered) still estimate
    assert 0.3 < prompt_length_correlation(x[:-1], groups=uid[:-1]) < 0.7


def test_the_estimate_refuses_what_it_cannot_group_and_says_when_it_cannot_estimate():
    with pytest.raises(SpecError, match="10 lengths are not a multiple of samples_per_prompt 4"):
        prompt_length_correlation(np.arange(10.0), samples_per_prompt=4)
    with pytest.raises(SpecError, match="3 group ids for 4 lengths"):
        prompt_length_correlation(np.arange(4.0), groups=["a", "b", "c"])
    with pytest.raises(SpecError, match="give groups or samples_per_prompt"):
        prompt_length_correlation(np.arange(4.0))
    assert prompt_length_correlation(np.arange(4.0), samples_per_prompt=4) is None  # one group
    assert prompt_length_correlation(np.full(8, 7.0), samples_per_prompt=2) is None  # no variance


def test_the_longest_micro_batch_grows_with_the_correlation_only_over_a_prompts_own_samples():
    w = Workload(sequences=1024, prompt_len=512, response_len_mean=4000.0, response_len_max=20480,
                 samples_per_prompt=4)
    s_mean, longest = 4512.0, 20992.0
    assert worst_micro_batch(w, 4, s_mean, longest) == pytest.approx(3 * s_mean + longest)  # rho 0: independent
    c = replace(w, response_len_prompt_corr=0.5)
    assert worst_micro_batch(c, 4, s_mean, longest) == pytest.approx(longest + 3 * (s_mean + 0.5 * (longest - s_mean)))
    # a micro-batch of 8 holds two prompts: 3 partners of the longest, 4 at the mean
    assert worst_micro_batch(c, 8, s_mean, longest) == pytest.approx(
        longest + 3 * (s_mean + 0.5 * (longest - s_mean)) + 4 * s_mean)
    assert worst_micro_batch(c, 1, s_mean, longest) == pytest.approx(longest)
    one = replace(c, samples_per_prompt=1)  # no prompt has two samples
    assert worst_micro_batch(one, 4, s_mean, longest) == pytest.approx(3 * s_mean + longest)
    cfg = ParallelConfig(tp=1, pp=1, dp=64, micro_batch=4, zero=3)
    assert _micro_batches(c, cfg, 1)[2] > _micro_batches(w, cfg, 1)[2]
    assert _micro_batches(c, cfg, 1)[1] == _micro_batches(w, cfg, 1)[1]  # the mean micro-batch is the same


def test_the_correlation_is_a_checked_field_of_the_job_and_round_trips():
    with pytest.raises(SpecError, match=r"sequence: response_len_prompt_corr must be <= 1, got 1.5"):
        SequenceSpec(prompt_len=10, response_len_mean=5.0, response_len_max=20, response_len_prompt_corr=1.5)
    with pytest.raises(SpecError, match=r"workload: response_len_prompt_corr must be >= 0"):
        Workload(sequences=4, prompt_len=1, response_len_mean=1.0, response_len_max=2, response_len_prompt_corr=-0.1)
    job = load_job("examples/grpo-7b.yaml")
    d = job.to_dict()
    d["sequence"]["response_len_prompt_corr"] = 0.4
    back = JobSpec.from_dict(d)
    assert back.workload().response_len_prompt_corr == 0.4
    assert back.workload().samples_per_prompt == job.batch.samples_per_prompt
    assert JobSpec.from_dict(back.to_dict()) == back
    assert "response_len_prompt_corr" not in job.to_dict()["sequence"]


def test_the_controller_plans_with_the_correlation_its_steps_measured(env):  # noqa: F811
    ctl = Controller(env.job, env.cluster, plans=env.plans, horizon=20, build_transition=False)
    assert ctl._base_w.response_len_prompt_corr == 0.0
    inf = [s.name for s in ctl.plan.stages if s.name.endswith("/inference")]
    plan = replace(ctl.plan, stages=tuple(replace(s, config=replace(s.config, micro_batch=4)) if s.name in inf else s
                                          for s in ctl.plan.stages))  # micro-batches of 4 in every log-prob pass
    before = ctl._times(plan, env.w).peak_mem_gib
    for step in range(3):
        m = from_verl({"response_length/mean": env.w.response_len_mean,
                       "response_length/max": env.w.response_len_max}, step=step,
                      response_len_prompt_corr=0.52 if step % 2 else 0.46)
        ctl.step(m)
    # the first measurement moves it (0.46 on the 0.05 grid); the means 0.49 and 0.48 stay within a grid step
    assert ctl._base_w.response_len_prompt_corr == pytest.approx(0.45)
    after = ctl._times(plan, replace(env.w, response_len_prompt_corr=0.45)).peak_mem_gib
    assert inf and all(after[s] > before[s] for s in inf)
    assert all(after[s] == before[s] for s in before if s not in inf and not s.endswith("/training"))
    ctl.step(StepMetrics(step=3, response_len_mean=env.w.response_len_mean, response_len_max=env.w.response_len_max,
                         response_len_prompt_corr=float("nan")))  # not measured: ignored
    assert ctl._base_w.response_len_prompt_corr == pytest.approx(0.45)
    for step in range(4, 14):
        ctl.step(StepMetrics(step=step, response_len_mean=env.w.response_len_mean,
                             response_len_max=env.w.response_len_max, response_len_prompt_corr=0.7))
    assert ctl._base_w.response_len_prompt_corr == pytest.approx(0.7)  # the last 10 measured 0.7
