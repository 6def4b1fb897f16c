"""RL stage rows (verl, NeMo RL, OpenRLHF timings of generation, log-probs, values, updates): the
job a row describes, each model-stage's parallel config and framework settings, and its time by
``estimate``. Also used by the asynchronous rows (``async_rows``)."""
from __future__ import annotations

from nereus.fidelity.catalog import (
    engine_of,
)
from nereus.fidelity.corpus import Row
from nereus.fidelity.rows import Unsupported, _int, _model, _replica_cluster
from nereus.models.spec import ModelSpec
from nereus.planner.cost.model import (
    StageOptions,
    estimate,
    weight_sync_s,
)
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import (
    BatchSpec,
    GPUSpec,
    JobSpec,
    ParallelConfig,
    RolloutSpec,
    SequenceSpec,
    Workload,
)

# ---- RL stages --------------------------------------------------------------------------------------------
RL_STAGES = {"gen": "actor/generation", "generate_sequences": "actor/generation", "old_log_prob": "actor/inference",
             "ref": "ref/inference", "values": "critic/inference", "update_actor": "actor/training",
             "actor_train": "actor/training", "update_critic": "critic/training"}


VERL_MAX_NUM_SEQS = 1024
"""verl's rollout ``max_num_seqs`` default (its trainer config sets it; vLLM's own is 256)."""


def rl_job(row: Row, model: ModelSpec) -> tuple[JobSpec, Workload]:
    algo = (row.get("algo") or "grpo").lower()
    algo = "ppo" if algo == "ppo" else "grpo"
    prompts = _int(row, "train_batch", _int(row, "prompts", 0) or None)
    n = _int(row, "rollout_n", 1 if algo == "ppo" else 0) or None
    if n is None:
        raise Unsupported("GRPO-family row without rollout_n")
    mean = row.num("mean_response_len")
    cap = row.num("max_response_len")
    if mean is None or cap is None:
        raise Unsupported("mean or max response length not stated")
    prompt = _int(row, "mean_prompt_len", 0) or _int(row, "max_prompt_len", 0) or _int(row, "context_len", 0) or None
    if prompt is None:
        raise Unsupported("prompt length not stated")
    mini = _int(row, "ppo_mini_batch", prompts)
    roles = [("actor", model), ("ref", model)] + ([("critic", model)] if algo == "ppo" else [])
    if algo == "grpo" and n < 2:
        n = 2
    job = JobSpec(algorithm=algo, models=tuple(roles),
                  batch=BatchSpec(prompts=prompts, samples_per_prompt=n, mini_batches=max(1, prompts // max(1, mini))),
                  sequence=SequenceSpec(prompt_len=prompt, response_len_mean=min(mean, cap), response_len_max=int(cap)),
                  rollout=RolloutSpec(engine=engine_of(row.get("rollout_engine") or row.engine, row.get("vllm_engine")),
                                      sleep="colocate" in (row.get("mode") or "colocate"),
                                      enforce_eager=_flag(row, "enforce_eager"),
                                      gpu_memory_utilization=row.num("gpu_memory_utilization"),
                                      max_num_seqs=_int(row, "max_num_seqs", VERL_MAX_NUM_SEQS if
                                                        row.engine.lower().startswith("verl") else 256)))
    return job, job.workload()


def _flag(row: Row, key: str, default: bool = False) -> bool:
    v = row.get(key)
    return default if v is None else v.strip().lower() in ("1", "true", "yes")


def stage_settings(row: Row, ms: str, tp: int, pp: int, dp: int, fsdp: bool) -> tuple[ParallelConfig, StageOptions]:
    """The parallel config and framework options of one training or inference model-stage of an
    RL row, from the row's verl settings (keys of rl_stages.csv; a key not stated keeps the older
    reading: token budget ``ppo_max_token_len_per_gpu`` when given, else one sequence per
    micro-batch, gradient checkpointing on, remove-padding on, nothing offloaded):

    - micro-batches: ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu`` (actor update),
      ``log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu`` (old and reference
      log-prob), ``critic_use_dynamic_bsz`` with ``critic_max_token_len_per_gpu`` (update) and
      ``critic_forward_max_token_len_per_gpu`` (values); otherwise fixed ``micro_batch_per_gpu``,
      ``log_prob_micro_batch_per_gpu``, ``ref_log_prob_micro_batch_per_gpu``,
      ``critic_micro_batch_per_gpu``, ``critic_forward_micro_batch_per_gpu``;
    - padding: ``remove_padding=0`` (actor and reference) / ``critic_remove_padding=0`` pads every
      sequence to ``max_prompt_len + max_response_len``;
    - offload: ``actor_param_offload`` / ``critic_param_offload`` (verl's per-call offload),
      ``ref_param_offload`` (FSDP CPUOffload, per micro-batch), ``actor_optimizer_offload`` /
      ``critic_optimizer_offload`` (update calls);
    - ``grad_ckpt`` (default on): full recomputation in training;
    - verl with an FSDP actor / critic (unless ``no_sync_grad_accum=1``): gradients reduce-scattered in
      fp32 after every micro-batch (``StageOptions.grad_sync``)."""
    role, _, stage = ms.partition("/")
    budget0 = _int(row, "ppo_max_token_len_per_gpu", 0)
    dyn0 = _flag(row, "use_dynamic_bsz", budget0 > 0)
    if role == "critic":
        dyn = _flag(row, "critic_use_dynamic_bsz", dyn0)
        if stage == "training":
            budget = _int(row, "critic_max_token_len_per_gpu", budget0)
            micro = _int(row, "critic_micro_batch_per_gpu", _int(row, "micro_batch_per_gpu", 1))
        else:
            budget = _int(row, "critic_forward_max_token_len_per_gpu", _int(row, "critic_max_token_len_per_gpu", budget0))
            micro = _int(row, "critic_forward_micro_batch_per_gpu", _int(row, "critic_micro_batch_per_gpu",
                                                                        _int(row, "micro_batch_per_gpu", 1)))
        pad = not _flag(row, "critic_remove_padding", _flag(row, "remove_padding", True))
    elif stage == "training":
        dyn, budget = dyn0, budget0
        micro = _int(row, "micro_batch_per_gpu", 1)
        pad = not _flag(row, "remove_padding", True)
    else:
        dyn = _flag(row, "log_prob_use_dynamic_bsz", dyn0)
        budget = _int(row, "log_prob_max_token_len_per_gpu", budget0)
        micro = _int(row, "log_prob_micro_batch_per_gpu", _int(row, "micro_batch_per_gpu", 1))
        if role == "ref":
            micro = _int(row, "ref_log_prob_micro_batch_per_gpu", micro)
        pad = not _flag(row, "remove_padding", True)
    if dyn and budget <= 0:
        dyn = False
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=3 if fsdp else 1, micro_batch=max(1, micro),
                         token_budget=budget if dyn else 0, recompute=_flag(row, "grad_ckpt", True))
    pad_to = (_int(row, "max_prompt_len", 0) + _int(row, "max_response_len", 0)) if pad else 0
    offload = "none"
    if _flag(row, f"{role}_param_offload"):
        offload = "per_micro_batch" if role == "ref" else "per_call"
    opt_off = stage == "training" and _flag(row, f"{role}_optimizer_offload")
    # verl's FSDP workers reduce-scatter gradients after every micro-batch's backward (no no_sync;
    # later releases: use_no_sync_for_gradient_accumulation, default false) in fp32 (reduce_dtype)
    per_mb = fsdp and row.engine.lower().startswith("verl") and not _flag(row, "no_sync_grad_accum")
    return cfg, StageOptions(pad_to=pad_to, param_offload=offload, optimizer_offload=opt_off,
                             grad_sync="micro_batch" if per_mb else "step", grad_reduce_bytes=4 if per_mb else 0,
                             controller_width=controller_width(row))


def controller_width(row: Row) -> int:
    """verl rows: every worker call moves the batch through verl's driver, each sequence padded to
    ``max_prompt_len + max_response_len`` (``StageOptions.controller_width``); 0 elsewhere."""
    if not row.engine.lower().startswith("verl"):
        return 0
    return _int(row, "max_prompt_len", 0) + _int(row, "max_response_len", 0)


def _rl(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    model, gpu = _model(row, gpu)
    stage = row.get("stage", "")
    gpus = row.gpus
    if not gpus:
        raise Unsupported("GPU count not stated")
    job, w = rl_job(row, model)
    cluster = _replica_cluster(gpu, gpus)
    tp, pp = _int(row, "tp", 1), _int(row, "pp", 1)
    if gpus % (tp * pp):
        raise Unsupported(f"tp*pp = {tp * pp} does not divide {gpus} GPUs")
    fsdp = "fsdp" in (row.get("actor_backend") or "fsdp")
    train, _ = stage_settings(row, "actor/training", tp, pp, gpus // (tp * pp), fsdp)
    rtp = _int(row, "rollout_tp", tp)
    gen = ParallelConfig(tp=rtp, dp=gpus // rtp)

    gen_opts = StageOptions(controller_width=controller_width(row))

    def stage_s(ms: str) -> float:
        if ms.endswith("generation"):
            return estimate(job, cluster, ms, gen, w, p, options=gen_opts).time_s
        cfg, opts = stage_settings(row, ms, tp, pp, gpus // (tp * pp), fsdp)
        return estimate(job, cluster, ms, cfg, w, p, options=opts).time_s

    sync = weight_sync_s(model, train, gen, cluster, True, p)
    if stage == "generate_sequences":
        # verl's worker-side timer: the engine's generate call alone, inside the rollout sharding
        # manager, whose entry (wake-up, weight sync) and exit (sleep) it leaves out, as it leaves out
        # the driver's dispatch and collection of the batch
        e = estimate(job, cluster, "actor/generation", gen, w, p, options=gen_opts)
        return e.time_s - e.time_breakdown.get("engine_wake_sleep", 0.0) - e.time_breakdown.get("controller_transfer", 0.0)
    if stage == "gen" and row.engine.lower().startswith("verl"):
        # verl's trainer-side timer covers the whole generate_sequences call: wake-up, the actor ->
        # rollout weight sync, generation, sleep
        return stage_s("actor/generation") + sync
    if stage in RL_STAGES:
        ms = RL_STAGES[stage]
        if ms not in job.model_stages():
            raise Unsupported(f"stage {stage} has no model-stage in this job")
        return stage_s(ms)
    if stage == "update_weights":
        return sync
    if stage == "step":
        return sum(stage_s(ms) for ms in job.model_stages()) + sync
    raise Unsupported(f"RL stage {stage!r} not modelled")


