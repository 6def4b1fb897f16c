"""Analytic cost model: time (s) and peak memory per GPU (bytes) of one model-stage under one
parallel config, each with a per-component breakdown. Formulas: shared/reference/COST_MODEL.md.

``estimate`` checks the config and dispatches to the stage's pricing: ``generation`` (prefill and
decode), ``passes`` (inference and training), with ``comm`` (collectives), ``memory`` (sizes per
GPU) and ``framework`` (dispatch, host copies, offload) beneath them; ``estimates`` holds the
result types. The names of those modules that callers use are re-exported here.
"""
from __future__ import annotations

from dataclasses import replace

from nereus.errors import SpecError
from nereus.models.inventory import check_tp
from nereus.models.spec import ModelSpec
from nereus.planner.cost.comm import TP_EDGE_COLLECTIVES, ag_s, ar_s, weight_sync_s
from nereus.planner.cost.estimates import NO_OPTIONS, StageEstimate, StageOptions, memoised, trainable
from nereus.planner.cost.framework import (
    CONTROLLER_TRAIN_TENSORS,
    controller_transfer_s,
    engine_wake_s,
    fsdp_cpu_floor_s,
    host_copy_s,
    offload_s,
    optimizer_offload_s,
    param_offload_s,
)
from nereus.planner.cost.generation import (
    decode_iteration_s,
    decode_step_s,
    decode_terms,
    eager_launch_s,
    estimate_generation,
    prefill_s,
)
from nereus.planner.cost.memory import (
    GiB,
    engine_memory_util,
    kv_budget_full,
    kv_bytes_per_token_per_gpu,
    model_state_bytes,
    params_per_gpu,
)
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.passes import (
    estimate_inference,
    estimate_training,
    fp8_linear_s,
    logprob_vocab_s,
    padded_tokens,
    seq_moments,
)
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

__all__ = ["CONTROLLER_TRAIN_TENSORS", "GiB", "NO_OPTIONS", "TP_EDGE_COLLECTIVES", "StageEstimate", "StageOptions",
           "ag_s", "ar_s", "controller_transfer_s", "decode_iteration_s", "decode_step_s", "decode_terms",
           "eager_launch_s", "engine_memory_util", "engine_wake_s", "estimate", "fp8_linear_s", "fsdp_cpu_floor_s",
           "host_copy_s", "kv_budget_full", "kv_bytes_per_token_per_gpu", "logprob_vocab_s", "model_state_bytes",
           "offload_s", "offloaded", "optimizer_offload_s", "padded_tokens", "param_offload_s", "params_per_gpu", "prefill_s",
           "seq_moments", "trainable", "validate_config", "weight_sync_s"]


def validate_config(job: JobSpec, cluster: ClusterSpec, model_stage: str, cfg: ParallelConfig) -> ModelSpec:
    role, _, stage = model_stage.partition("/")
    if model_stage not in job.model_stages():
        raise SpecError(f"job has no model-stage {model_stage!r}; it has {list(job.model_stages())}")
    model = job.model(role)
    check_tp(model, cfg.tp)
    if cfg.tp > cluster.gpus_per_node:
        # a rollout engine's TP group may span whole nodes (vLLM multi-node TP over Ray, as NeMo RL
        # runs TP 16 / 32; priced with the inter-node link, ``generation``); Megatron TP stays in a node
        if stage != "generation":
            raise SpecError(f"tp({cfg.tp}) > gpus_per_node({cluster.gpus_per_node}): {stage} TP stays inside "
                            "a node (only a rollout engine's TP may span nodes)")
        if cfg.tp % cluster.gpus_per_node:
            raise SpecError(f"generation tp({cfg.tp}) spans nodes but is not a multiple of gpus_per_node"
                            f"({cluster.gpus_per_node}): a TP group across nodes takes whole nodes")
    if cfg.pp > model.layers:
        raise SpecError(f"pp({cfg.pp}) > layers({model.layers}) of {model.name}")
    if cfg.gpus > cluster.num_gpus:
        raise SpecError(
            f"tp({cfg.tp}) * pp({cfg.pp}) * dp({cfg.dp}) = {cfg.gpus} GPUs > cluster's {cluster.num_gpus}"
        )
    return model


def estimate(job: JobSpec, cluster: ClusterSpec, model_stage: str, cfg: ParallelConfig,
             workload: Workload | None = None, params: CostParams | None = None,
             kv_budget_bytes: float | None = None, options: StageOptions | None = None,
             memo: dict | None = None) -> StageEstimate:
    """Time and memory of ``model_stage`` under ``cfg``. ``kv_budget_bytes`` caps the KV cache of
    generation per GPU (default: what the inference engine may take of an otherwise empty GPU);
    ``options``: padding and offload settings of the framework (``StageOptions``). ``memo``: a dict
    the caller keeps while it prices many configs of one (job, cluster, workload, params), the option
    tables' thousands: a layout is checked once, and the terms that configs differing only in ZeRO
    stage and recomputation share are computed once (same numbers as without it)."""
    if memo is None:
        model = _checked(job, cluster, model_stage, cfg)
    else:
        model = memoised(memo, ("checked", model_stage, cfg.tp, cfg.pp, cfg.gpus, cfg.sp),
                         lambda: _first_equal(job, _checked(job, cluster, model_stage, cfg)))
    w = workload or job.workload()
    p = params or CostParams()
    role, _, stage = model_stage.partition("/")
    head = "value" if role in ("critic", "reward") else "lm"
    o = options or NO_OPTIONS
    if stage == "training":
        e = estimate_training(job, cluster, model_stage, model, cfg, w, p, head, o, memo)
    elif stage == "inference":
        e = estimate_inference(cluster, model_stage, model, cfg, w, p, head, job.sequence.padded, o, memo)
    else:
        e = estimate_generation(job, cluster, model_stage, model, cfg, w, p, kv_budget_bytes)
    if o.controller_width:
        if o.controller_width < w.response_len_max:
            raise SpecError(f"stage options: controller_width({o.controller_width}) must hold the response cap "
                            f"({w.response_len_max}) and the prompt")
        c = controller_transfer_s(stage, w.sequences, o.controller_width, w.response_len_max, p)
        e = replace(e, time_s=e.time_s + c, time_breakdown={**e.time_breakdown, "controller_transfer": c})
    return e


def offloaded(e: StageEstimate, params: CostParams) -> StageEstimate:
    """``e`` of a training stage whose optimizer state a plan keeps in host memory (the plan's
    "offload" extra, which the solver sets when it picks ``CandidateSettings.offload``): the state is
    on the GPU only around the optimizer step (Megatron-LM#2811's optimizer state offloading, verl's
    ``optimizer_offload_step``, verl-project/verl#7804), so it leaves the resident memory of every
    stage (generation's KV cache gets the room) and the training peak is the larger of the forward /
    backward transient and the state loaded for the step; moving it in and out once per step
    (``offload_s``) is paid in the stage's time. (verl's FSDP default loads it for the whole update
    call, verl-project/verl#5282: a peak this counts lower.)"""
    off = offload_s(e.mem_breakdown.get("optimizer", 0.0), params)
    resident, transient = offloaded_memory(e)
    return replace(e, resident_bytes=resident, transient_bytes=transient,
                   time_s=e.time_s + off, time_breakdown={**e.time_breakdown, "optimizer_offload": off})


def offloaded_memory(e: StageEstimate) -> tuple[float, float]:
    """(resident, transient) bytes of training estimate ``e`` with its optimizer state in host memory
    between steps (``offloaded``), without pricing the copies."""
    opt = e.mem_breakdown.get("optimizer", 0.0)
    return e.resident_bytes - opt, max(e.transient_bytes, opt)


def _first_equal(job: JobSpec, model: ModelSpec) -> ModelSpec:
    """The first of the job's models equal to ``model``: stages of equal models (an actor and its
    reference copy) then share the terms ``memo`` keys by the model's identity."""
    return next(m for _, m in job.models if m == model)


def _checked(job: JobSpec, cluster: ClusterSpec, model_stage: str, cfg: ParallelConfig) -> ModelSpec:
    """``validate_config`` and the sequence split's heads: what depends on tp, pp, gpus and sp alone."""
    model = validate_config(job, cluster, model_stage, cfg)
    if cfg.sp > 1 and model.heads % (cfg.sp * cfg.tp):
        raise SpecError(f"sp({cfg.sp}) * tp({cfg.tp}) must divide the {model.heads} attention heads of {model.name} "
                        f"(Ulysses splits heads across the sequence-parallel ranks)")
    return model
