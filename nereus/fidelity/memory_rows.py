"""Peak-memory rows (weights, KV pools, training peaks allocated or reserved): predicted by the
planner's own memory terms at the row's configuration."""
from __future__ import annotations

from dataclasses import replace

from nereus.fidelity.catalog import (
    resolve_model,
)
from nereus.fidelity.corpus import Row
from nereus.fidelity.rows import Unsupported, _int, _model, _one_model_job, _replica_cluster
from nereus.planner.cost.model import (
    GiB,
    estimate,
    params_per_gpu,
)
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import (
    GPUSpec,
    ParallelConfig,
    RolloutSpec,
    Workload,
)

# ---- peak memory ------------------------------------------------------------------------------------------
MEMORY_METRICS = ("weights_gib", "kv_cache_gib", "peak_allocated_gib", "peak_reserved_gib")
NOSP_REPLICATED_HIDDEN = 10.0
"""Activation bytes per token per layer, in units of h x (dtype bytes / 2), that tensor parallelism
without sequence parallelism leaves whole on every rank: the two norm inputs, the residual adds and
their dropout masks (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", eq. 2: 10 sbh of the 34 sbh a layer keeps stay unsplit). A row with
``sequence_parallel=0`` is predicted with that share replicated and the rest split by TP."""


def _memory_gpu(row: Row, gpu: GPUSpec) -> GPUSpec:
    """The row's GPU with the total memory its log states (``total_gib``: what the engine saw), if any."""
    total = row.num("total_gib")
    return replace(gpu, memory_gib=total) if total else gpu


def _memory(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """Peak memory per GPU in GiB, by the planner's memory terms (``estimate``'s breakdown, less the
    plan reserve ``mem_reserve_frac`` that only plans keep):

    - ``weights_gib``: an engine's weights on one GPU of the most loaded stage
      (``params_per_gpu`` x the row's dtype bytes);
    - ``kv_cache_gib``: the KV pool an engine gets at its memory fraction (``kv_budget_full``) on a GPU
      of the total memory the log states;
    - ``peak_allocated_gib`` / ``peak_reserved_gib``: a training step's allocator peak: the
      model states in the framework's layout, the activations of the largest micro-batch (with or
      without full recomputation), the logits and their copies, the workspace; reserved adds the
      allocator's slack (``mem_fragmentation``), allocated does not. The CUDA context and NCCL's
      buffers sit outside both (``GPUSpec.reserved_gib`` holds them back in plans)."""
    from nereus.planner.cost.estimates import reserve_bytes
    from nereus.planner.cost.memory import kv_budget_full

    m = row.metric
    if m not in MEMORY_METRICS:
        raise Unsupported(f"memory metric {m!r} not modelled")
    dtype = (row.get("dtype") or "bf16").lower()
    if row.get("phase") == "engine_profile":
        model, gpu_run = _model(row, _memory_gpu(row, gpu))
        if dtype in ("fp32", "float32"):
            model = replace(model, dtype_bytes=4)
        tp, pp = _int(row, "tp", 1), _int(row, "pp", 1)
        weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
        if m == "weights_gib":
            return weights / GiB
        if m != "kv_cache_gib":
            raise Unsupported(f"engine metric {m!r}: only weights_gib and kv_cache_gib are modelled")
        job = replace(_one_model_job(model), rollout=RolloutSpec(gpu_memory_utilization=row.num("gpu_memory_utilization")))
        return kv_budget_full(job, _replica_cluster(gpu_run, tp * pp), weights, p) / GiB
    if row.get("phase") != "train_step":
        raise Unsupported("memory row of an unknown phase (engine_profile / train_step)")
    rec = row.get("recompute", "none")
    if rec not in ("none", "full"):
        raise Unsupported(f"recompute={rec}: the cost model keeps every activation or recomputes whole layers")
    if row.get("pp_schedule", "1F1B") != "1F1B":
        raise Unsupported(f"pipeline schedule {row.get('pp_schedule')}: the cost model holds 1F1B's in-flight micro-batches")
    model, why = resolve_model(row.model)
    if model is None:
        raise Unsupported(why)
    tp, pp, cp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "cp", 1)
    gpus = row.gpus or _int(row, "gpus")
    dp = _int(row, "dp", gpus // (tp * pp * cp))
    seq, mb = _int(row, "seq_len"), _int(row, "micro_batch", 1)
    if pp > 1 and row.num("pp_microbatches"):
        mb = max(1, mb // _int(row, "pp_microbatches"))
    micro = _int(row, "pp_microbatches", 1) if pp > 1 else 1
    fsdp = "fsdp" in (row.get("sharding") or "")
    zero = 3 if fsdp else (1 if row.get("dist_opt") == "1" else 0)
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp * cp, cp=cp, micro_batch=mb, zero=zero, recompute=rec == "full")
    if row.get("sequence_parallel") == "0" and tp > 1:
        h, scale = model.hidden, model.dtype_bytes / 2
        full = (p.act_coeff_hidden * h + p.act_coeff_ffn * model.ffn + p.act_coeff_kv * model.kv_dim) * scale
        p = replace(p, act_bytes_replicated=NOSP_REPLICATED_HIDDEN * h * scale,
                    act_bytes_sharded=full - NOSP_REPLICATED_HIDDEN * h * scale)
    # one optimizer step of micro-batches of mb sequences: the peak is the largest one's, times the
    # 1F1B schedule's in-flight micro-batches (min(pp, micro-batches))
    w = Workload(sequences=max(1, mb * micro * dp), prompt_len=max(1, seq - 1), response_len_mean=1, response_len_max=1)
    e = estimate(_one_model_job(model), _replica_cluster(gpu, gpus), "actor/training", cfg, w, p)
    peak = e.mem_bytes - reserve_bytes(e)
    if m == "peak_reserved_gib":  # the caching allocator's slack over the transients that come and go
        b = e.mem_breakdown
        peak += (p.mem_fragmentation - 1) * (b.get("activations", 0.0) + b.get("logits", 0.0))
    elif m != "peak_allocated_gib":
        raise Unsupported(f"training metric {m!r}: peak_allocated_gib or peak_reserved_gib")
    return peak / GiB


