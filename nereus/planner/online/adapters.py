"""Adapters from what RL frameworks already log to the controller's ``StepMetrics``.

verl logs a flat dict per step (``trainer.fit`` -> ``logger.log(data=metrics, step=...)``) with keys
such as ``response_length/mean``, ``response_length/max``, ``prompt_length/mean``, ``timing_s/gen``,
``timing_s/old_log_prob``, ``timing_s/ref``, ``timing_s/values``, ``timing_s/reward``,
``timing_s/update_critic``, ``timing_s/update_actor``, ``timing_s/step`` and
``perf/max_memory_allocated_gb``.
OpenRLHF's PPO trainer logs similar per-step stats; its key names vary across versions, so the
mapping is a parameter (``OPENRLHF_KEYS`` is the default we could check, override as needed).

Usage inside a verl loop::

    decision = controller.step(from_verl(metrics, step=global_step, gpus_available=world_size,
                                         response_len_cap=config.data.max_response_length))

No framework logs how strongly one prompt's response lengths go together, and it sets the longest
micro-batch (``cost.passes.worst_micro_batch``); pass it from the batch itself::

    corr = prompt_length_correlation(batch.batch["response_mask"].sum(-1).tolist(),
                                     groups=batch.non_tensor_batch["uid"])
    decision = controller.step(from_verl(metrics, step=global_step, response_len_prompt_corr=corr))
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from nereus.errors import SpecError
from nereus.planner.online.controller import StepMetrics

VERL_STAGE_KEYS: Mapping[str, str] = {
    "timing_s/gen": "actor/generation",
    "timing_s/old_log_prob": "actor/inference",
    "timing_s/ref": "ref/inference",
    "timing_s/values": "critic/inference",
    "timing_s/reward": "reward/inference",
    "timing_s/update_critic": "critic/training",
    "timing_s/update_actor": "actor/training",
}
VERL_KEYS: Mapping[str, str] = {
    "response_len_mean": "response_length/mean", "response_len_max": "response_length/max",
    "prompt_len": "prompt_length/mean", "peak_mem_gib": "perf/max_memory_allocated_gb",
    "step_s": "timing_s/step",
}
OPENRLHF_STAGE_KEYS: Mapping[str, str] = {
    "generate_time": "actor/generation",
    "actor_logprob_time": "actor/inference",
    "ref_time": "ref/inference",
    "critic_time": "critic/inference",
    "reward_time": "reward/inference",
    "critic_train_time": "critic/training",
    "actor_train_time": "actor/training",
}
OPENRLHF_KEYS: Mapping[str, str] = {
    "response_len_mean": "response_length", "response_len_max": "response_length_max",
    "prompt_len": "prompt_length", "peak_mem_gib": "max_memory_allocated_gb",
}
GIB_PER_GB = 1e9 / 1024**3


def _get(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        raise SpecError(f"metric {key!r} must be a number, got {v!r}") from None


def prompt_length_correlation(lengths: Sequence[float], *, samples_per_prompt: int | None = None,
                              groups: Sequence[Any] | None = None) -> float | None:
    """Intraclass correlation of one step's response lengths within a prompt (the one-way analysis
    of variance estimator, ICC(1), for groups of unequal size), clipped to [0, 1]: the share of the
    lengths' variance that belongs to the prompt. Groups are given by ``groups`` (one id per
    response, e.g. verl's ``uid``) or by ``samples_per_prompt`` (a prompt's samples adjacent). None
    when it cannot be estimated (fewer than 2 groups, no group of 2, or no variance)."""
    x = np.asarray(lengths, float).ravel()
    if groups is not None:
        if len(groups) != len(x):
            raise SpecError(f"prompt_length_correlation: {len(groups)} group ids for {len(x)} lengths")
        _, g = np.unique(np.asarray(groups, dtype=object).astype(str), return_inverse=True)
    elif samples_per_prompt:
        if len(x) % int(samples_per_prompt):
            raise SpecError(f"prompt_length_correlation: {len(x)} lengths are not a multiple of "
                            f"samples_per_prompt {samples_per_prompt}")
        g = np.arange(len(x)) // int(samples_per_prompt)
    else:
        raise SpecError("prompt_length_correlation: give groups or samples_per_prompt")
    n = np.bincount(g).astype(float)
    k, N = len(n), float(len(x))
    if k < 2 or N <= k:
        return None
    means = np.bincount(g, weights=x) / n
    msb = float(np.sum(n * (means - x.mean()) ** 2)) / (k - 1)
    msw = float(np.sum((x - means[g]) ** 2)) / (N - k)
    n0 = (N - float(np.sum(n * n)) / N) / (k - 1)
    if msb + (n0 - 1) * msw <= 0:
        return None
    return float(np.clip((msb - msw) / (msb + (n0 - 1) * msw), 0.0, 1.0))


def from_metrics(metrics: Mapping[str, Any], *, step: int, keys: Mapping[str, str], stage_keys: Mapping[str, str],
                 gpus_available: int | None = None, response_len_cap: int | None = None,
                 response_len_p90: float | None = None, oom: bool = False,
                 response_len_prompt_corr: float | None = None) -> StepMetrics:
    """Generic adapter: ``keys`` maps StepMetrics fields to metric names, ``stage_keys`` metric
    names to model-stages (a model-stage measured by several keys is summed)."""
    mean = _get(metrics, keys["response_len_mean"])
    mx = _get(metrics, keys["response_len_max"])
    if mean is None or mx is None:
        raise SpecError(f"metrics need {keys['response_len_mean']!r} and {keys['response_len_max']!r}; "
                        f"got keys {sorted(metrics)[:12]}")
    stages: dict[str, float] = {}
    for key, ms in stage_keys.items():
        v = _get(metrics, key)
        if v is not None:
            stages[ms] = stages.get(ms, 0.0) + v
    prompt = _get(metrics, keys["prompt_len"])
    mem = _get(metrics, keys["peak_mem_gib"])
    step_s = _get(metrics, keys["step_s"]) if "step_s" in keys else None
    return StepMetrics(step=int(step), response_len_mean=mean, response_len_max=int(round(max(mx, mean))),
                       response_len_p90=response_len_p90, prompt_len=None if prompt is None else max(1, round(prompt)),
                       stage_times=stages, peak_mem_gib=None if mem is None else mem * GIB_PER_GB,
                       gpus_available=gpus_available, response_len_cap=response_len_cap, oom=oom, step_s=step_s,
                       response_len_prompt_corr=response_len_prompt_corr)


def from_verl(metrics: Mapping[str, Any], *, step: int, **kw: Any) -> StepMetrics:
    """StepMetrics from one step of verl's metric dict (see module docstring)."""
    return from_metrics(metrics, step=step, keys=VERL_KEYS, stage_keys=VERL_STAGE_KEYS, **kw)


def from_openrlhf(metrics: Mapping[str, Any], *, step: int, keys: Mapping[str, str] = OPENRLHF_KEYS,
                  stage_keys: Mapping[str, str] = OPENRLHF_STAGE_KEYS, **kw: Any) -> StepMetrics:
    """StepMetrics from an OpenRLHF-style per-step stats dict (key names overridable)."""
    return from_metrics(metrics, step=step, keys=keys, stage_keys=stage_keys, **kw)
