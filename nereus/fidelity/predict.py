"""A corpus row's prediction by the planner's cost model: the same functions the planner prices
plans with (``nereus.planner.cost``), fed the row's configuration.

- decode: one engine iteration (``decode_iteration_s``) at the row's batch and mean context, plus
  the prefill of that batch for whole-request throughput and latency; an offline max-throughput
  run gets the engine's concurrency (max_num_seqs, capped by what the KV cache holds);
- prefill: ``prefill_s`` of one prompt plus one iteration's overhead;
- collectives: ``allreduce_s`` / ``allgather_s`` at the row's size, GPU count and nodes;
- training: ``estimate(actor/training)`` of one optimizer step of the row's global batch (FP8 rows:
  the layers' GEMMs in FP8, ``StageOptions.fp8_linear``);
- RL stages: ``estimate`` of the matching model-stage of a job built from the row's config;
- async: the step (or a pool's timing) of the row's two-pool asynchronous plan (``async_rows``);
- moe: a mixture-of-experts RL row's step at the expert layout the source states (``_moe``).

A row the model cannot express (request-rate serving runs, dataset-driven lengths, MoE models,
unknown hardware, an RL row without its mean response length) gets no prediction and a reason.
"""
from __future__ import annotations

import math
from dataclasses import replace

from nereus.errors import NereusError
from nereus.fidelity.catalog import (FP8_CAPABLE, eight_bit, engine_of, power_capped, profile_gpu, resolve_gpu,
                                     resolve_model)
from nereus.fidelity.corpus import Row
from nereus.models.spec import ModelSpec
from nereus.planner.cost.model import (GiB, StageOptions, decode_iteration_s, engine_wake_s, estimate,
                                       kv_bytes_per_token_per_gpu, params_per_gpu, prefill_s, weight_sync_s)
from nereus.planner.cost.params import CostParams, allgather_s, allreduce_s
from nereus.planner.specs import (GPUSpec, ParallelConfig, Workload, GPU_PRESETS)

from nereus.fidelity.rows import (ParamsFor, Prediction, Unsupported, _int, _model, _one_model_job,  # noqa: F401
                                  _replica_cluster, row_gpu)
from nereus.fidelity.rl_rows import (RL_STAGES, VERL_MAX_NUM_SEQS, _flag, _rl, controller_width, rl_job,  # noqa: F401
                                     stage_settings)
from nereus.fidelity.memory_rows import MEMORY_METRICS, _memory  # noqa: F401
from nereus.fidelity.async_rows import predict_async


def predict(row: Row, params_for: ParamsFor) -> Prediction:
    gpu, why = resolve_gpu(row.hardware)
    if gpu is None and row.category == "host":  # host time: no GPU enters it; the defaults hold the host fits
        try:
            return Prediction(row, _host(row, None, CostParams()), "", "analytic")
        except Unsupported as e:
            return Prediction(row, None, str(e), "analytic")
    if gpu is None and row.category == "memory" and row.num("total_gib"):  # a GPU outside the presets: its stated memory
        gpu = replace(GPU_PRESETS["l40s"], name=row.hardware, memory_gib=row.num("total_gib"))
    if gpu is None:
        return Prediction(row, None, why)
    prof = profile_gpu(gpu)
    try:
        p = params_for(prof)
        if power_capped(row.hardware):
            gpu = replace(gpu, tflops_bf16=gpu.tflops_bf16 * p.power_cap_flops_scale)
        value = _PREDICTORS[row.category](row, gpu, p)
    except Unsupported as e:
        return Prediction(row, None, str(e), prof)
    except NereusError as e:
        return Prediction(row, None, f"not expressible: {str(e).splitlines()[0]}", prof)
    if value is None or not math.isfinite(value) or value <= 0:
        return Prediction(row, None, "the model predicts no finite value (does not fit in memory)", prof)
    return Prediction(row, float(value), "", prof)


# ---- inference engines -------------------------------------------------------------------------------
def _lengths(row: Row) -> tuple[float, float]:
    inp, out = row.num("input_len"), row.num("output_len")
    if inp is None or out is None:
        raise Unsupported("dataset-driven lengths (e.g. ShareGPT): no fixed input/output length")
    return inp, out


def _concurrency(row: Row, model: ModelSpec, gpu: GPUSpec, tp: int, pp: int, inp: float, out: float) -> int:
    b = row.get("batch", "max")
    if b == "online" or row.get("request_rate") not in (None, "inf"):
        raise Unsupported("request-rate serving run: depends on the arrival process")
    if b not in ("max", "unstated", None):
        return max(1, int(float(b)))
    cap = int(row.num("max_num_seqs") or row.num("max_concurrency") or 256)
    kv_room = gpu.usable_bytes * 0.9 - model.dtype_bytes * params_per_gpu(model, tp, pp) - GiB
    per_seq = kv_bytes_per_token_per_gpu(model, tp, pp) * (inp + out)
    n_req = int(row.num("num_requests") or cap)
    return max(1, min(cap, n_req, int(kv_room // per_seq)))


def _decode(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    model, gpu = _model(row, gpu)
    tp, pp = _int(row, "tp", 1), _int(row, "pp", 1)
    inp, out = _lengths(row)
    c = _concurrency(row, model, gpu, tp, pp, inp, out)
    cluster = _replica_cluster(gpu, tp * pp)
    engine = engine_of(row.engine, row.get("vllm_engine"))
    t_iter = decode_iteration_s(model, tp, pp, c, inp + out / 2, cluster, p, engine, eager=_flag(row, "enforce_eager"))
    t_pre = prefill_s(model, tp, pp, inp, c, c, cluster, p)
    batch_s = t_pre + out * t_iter
    replicas = max(1, row.gpus // (tp * pp)) if row.gpus else 1
    m = row.metric
    if m in ("tpot_ms", "median_tpot_ms", "median_itl_ms", "itl_ms"):
        return t_iter * 1e3
    if m == "e2e_latency_ms":
        return batch_s * 1e3
    if m in ("output_tok_s", "throughput_tok_s"):
        return replicas * c * out / batch_s
    if m == "output_tok_s_per_gpu":
        return replicas * c * out / batch_s / max(1, row.gpus)
    if m == "total_tok_s":
        return replicas * c * (inp + out) / batch_s
    raise Unsupported(f"decode metric {m!r} not modelled")


def _prefill(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    model, gpu = _model(row, gpu)
    tp, pp = _int(row, "tp", 1), _int(row, "pp", 1)
    inp, _ = _lengths(row)
    b = row.get("batch", "1")
    if b == "online" or row.get("request_rate") not in (None, "inf"):
        raise Unsupported("request-rate serving run: depends on the arrival process")
    c = max(1, int(float(b))) if b not in ("max", "unstated") else 1
    cluster = _replica_cluster(gpu, tp * pp)
    t = prefill_s(model, tp, pp, inp, c, c, cluster, p) + p.iteration_overhead_s(engine_of(row.engine, row.get("vllm_engine")), c)
    if row.metric in ("ttft_ms", "median_ttft_ms"):
        return t * 1e3
    if row.metric == "input_tok_s":
        return c * inp / t
    raise Unsupported(f"prefill metric {row.metric!r} not modelled")


# ---- collectives ---------------------------------------------------------------------------------------
def _collective(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    op, size = row.get("op"), row.num("msg_bytes")
    n = _int(row, "gpus", row.gpus or 0)
    nodes = _int(row, "nodes", 1)
    if size is None or n < 2:
        raise Unsupported("collective row without message size or with fewer than 2 GPUs")
    intra, inter = gpu.intra_node_gbps * p.intra_link_eff * 1e9, gpu.inter_node_gbps * p.inter_link_eff * 1e9
    kw = dict(nodes=nodes, alpha_inter=p.inter_latency_s, bw_inter=inter)
    if op == "all_reduce":
        t, factor = allreduce_s(size, n, intra, p.allreduce_latency_s, **kw), 2 * (n - 1) / n
    elif op in ("all_gather", "reduce_scatter"):
        t, factor = allgather_s(size, n, intra, p.allreduce_latency_s, **kw), (n - 1) / n
    else:
        raise Unsupported(f"collective {op!r} not modelled")
    if row.metric == "latency_us":
        return t * 1e6
    if row.metric == "busbw_gbs":
        return size * factor / t / 1e9
    if row.metric == "algbw_gbs":
        return size / t / 1e9
    raise Unsupported(f"collective metric {row.metric!r} not modelled")


# ---- training --------------------------------------------------------------------------------------------
def _tokens(text: str | None) -> float | None:
    """'16M' -> 16e6, '4096' -> 4096."""
    if not text:
        return None
    mult = {"k": 1e3, "m": 1e6, "b": 1e9}.get(text[-1].lower(), 1.0)
    try:
        return float(text[:-1] if mult != 1.0 else text) * mult
    except ValueError:
        return None


def model_flops(model: ModelSpec, seqs: float, seq_len: float) -> float:
    """Model FLOPs of one training step (the MFU numerator): 6 N per token plus causal-free attention."""
    return 6 * model.matmul_params() * seqs * seq_len + 6 * model.layers * model.heads * model.head_dim * seqs * seq_len ** 2


def _training(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    fp8 = (row.get("dtype") or "").lower().startswith("fp8")
    if fp8:  # FP8 GEMMs inside bf16 training: the model's sizes stay bf16 (StageOptions.fp8_linear)
        model, why = resolve_model(row.model)
        if model is None:
            raise Unsupported(why)
        if gpu.name not in FP8_CAPABLE:
            raise Unsupported(f"FP8 training on {gpu.name}: no FP8 tensor cores")
        gpu_run = gpu
    else:
        model, gpu_run = _model(row, gpu)
    if "tp" not in row.config:
        raise Unsupported("parallel layout (tp/pp/dp) not stated")
    tp, pp, cp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "cp", 1)
    gpus = row.gpus or _int(row, "gpus")
    dp = _int(row, "dp", gpus // (tp * pp * cp))
    if tp * pp * dp * cp != gpus:
        raise Unsupported(f"tp*pp*dp*cp = {tp * pp * dp * cp} != {gpus} GPUs")
    seq = _int(row, "seq_len")
    mb = _int(row, "micro_batch", 1)
    gb = row.num("global_batch")
    if gb is None:
        tokens = _tokens(row.get("tokens_per_batch"))
        gb = tokens / seq if tokens else mb * _int(row, "grad_accum", 1) * dp
    if pp > 1 and row.num("pp_microbatches"):  # torchtitan: the local batch split into pipeline microbatches
        mb = max(1, mb // _int(row, "pp_microbatches"))
    rec = row.get("recompute", "none")
    zero = 3 if "fsdp" in (row.get("sharding") or "") or "full_shard" in (row.get("sharding") or "") else 1
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp * cp, cp=cp, micro_batch=mb, zero=zero, recompute=rec == "full")
    cluster = _replica_cluster(gpu_run, gpus)
    w = Workload(sequences=max(1, int(round(gb))), prompt_len=max(1, seq - 1), response_len_mean=1, response_len_max=1)
    e = estimate(_one_model_job(model), cluster, "actor/training", cfg, w, p, options=StageOptions(fp8_linear=fp8))
    t = e.time_s
    if row.metric == "tok_s_per_gpu":
        return gb * seq / (t * gpus)
    flops = model_flops(model, gb, seq)
    if row.metric == "mfu":
        return flops / (t * gpus * GPU_PRESETS.get(gpu.name, gpu).peak_flops)
    if row.metric == "tflops_per_gpu":
        return flops / (t * gpus) / 1e12
    raise Unsupported(f"training metric {row.metric!r} not modelled")


HOST_LAYER_METRICS = {"host_ms_per_layer_pass": "layer_cpu_train_s", "host_ms_per_layer_forward": "layer_cpu_fwd_s",
                      "host_ms_per_fsdp_unit_pass": "fsdp_unit_cpu_s", "kv_remap_ms_per_gib": "kv_remap_s_per_gib",
                      "host_ms_per_response": "gen_response_host_s"}
"""``host`` row metric -> the CostParams field (seconds) it measures (per layer and pass, per FSDP
unit and pass, per GiB of KV cache re-created, per generated response converted on the host)."""


def _host(row: Row, gpu: GPUSpec | None, p: CostParams) -> float:
    """Host milliseconds: of one decode iteration outside the forward at the row's batch
    (``CostParams.iteration_overhead_s`` of the row's engine), or of one decoder layer per pass
    (eager dispatch in training or in a no-grad forward; FSDP's hooks per unit)."""
    if row.metric in HOST_LAYER_METRICS:
        return getattr(p, HOST_LAYER_METRICS[row.metric]) * 1e3
    if row.metric == "engine_wake_s":
        return _wake(row, gpu, p)
    if row.metric != "host_ms_per_iteration":
        raise Unsupported(f"host metric {row.metric!r} not modelled")
    b = row.num("batch")
    if b is None or b < 1:
        raise Unsupported("engine host row without a numeric batch")
    return p.iteration_overhead_s(engine_of(row.engine, row.get("vllm_engine")), b) * 1e3


def _wake(row: Row, gpu: GPUSpec | None, p: CostParams) -> float:
    """Seconds of an engine's wake-up (``engine_wake_s``): the row's weights per GPU
    (``model_params_b`` x the dtype's bytes / tp) back over the host link and its KV pool, what
    ``gpu_memory_utilization`` of the GPU leaves beside them, created again."""
    if gpu is None:
        raise Unsupported("wake-up row without a known GPU (its KV pool depends on the GPU's memory)")
    billions, util = row.num("model_params_b"), row.num("gpu_memory_utilization")
    if billions is None or util is None:
        raise Unsupported("wake-up row without model_params_b and gpu_memory_utilization")
    weights = billions * 1e9 * (1 if eight_bit(row.get("weights_dtype")) else 2) / _int(row, "tp", 1)
    return engine_wake_s(weights, gpu.usable_bytes * util - weights - p.workspace_gib * GiB, p)


def _async(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """An asynchronous run's step or pool timing under its two-pool plan (``fidelity.async_rows``)."""
    return predict_async(row, gpu, p)


# ---- mixture-of-experts runs ---------------------------------------------------------------------------
def moe_stage_configs(row: Row, gpus: int) -> tuple[ParallelConfig, ParallelConfig]:
    """(training / scoring layout, generation layout) of a ``moe`` RL row: Megatron tp, cp, pp with
    the source's ep and etp (etp 1 where unstated, Megatron's and NeMo's default), dp the rest (cp
    taken from the data-parallel ranks, as ``_training`` does); vLLM generation at rollout_tp /
    rollout_pp with ``rollout_ep`` (1, vLLM's default, where unstated)."""
    tp, pp, cp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "cp", 1)
    if gpus % (tp * pp * cp):
        raise Unsupported(f"tp*pp*cp = {tp * pp * cp} does not divide {gpus} GPUs")
    dp = gpus // (tp * pp)
    train = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, zero=1, micro_batch=_int(row, "micro_batch_per_gpu", 1),
                           recompute=_flag(row, "grad_ckpt", True), ep=_int(row, "ep", 1), etp=_int(row, "etp", 1))
    rtp, rpp = _int(row, "rollout_tp", tp), _int(row, "rollout_pp", 1)
    if gpus % (rtp * rpp):
        raise Unsupported(f"rollout tp*pp = {rtp * rpp} does not divide {gpus} GPUs")
    gen = ParallelConfig(tp=rtp, pp=rpp, dp=gpus // (rtp * rpp), ep=_int(row, "rollout_ep", 1))
    return train, gen


def moe_estimates(row: Row, gpu: GPUSpec, p: CostParams) -> tuple[dict, float]:
    """Every model-stage's estimate of a ``moe`` RL row at its stated layout, and the weight sync
    (seconds): what ``_moe`` sums, kept whole for breakdowns (``benchmarks/fidelity.py``)."""
    from nereus.models.spec import preset

    if row.get("kind") != "rl":
        raise Unsupported(f"moe row kind {row.get('kind')!r} not modelled")
    try:
        model = preset(row.get("preset") or "")
    except NereusError as e:
        raise Unsupported(f"no MoE preset {row.get('preset')!r}: {str(e).splitlines()[0]}") from None
    gpus = row.gpus
    if not gpus:
        raise Unsupported("GPU count not stated")
    job, w = rl_job(row, model)
    cluster = _replica_cluster(gpu, gpus)
    train, gen = moe_stage_configs(row, gpus)
    ests = {ms: estimate(job, cluster, ms, gen if ms.endswith("generation") else train, w, p)
            for ms in job.model_stages()}
    return ests, weight_sync_s(model, train, gen, cluster, True, p)


def moe_one_step_off_s(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """Seconds of a one-step-off MoE row's step (``moe_one_step_off``)."""
    return moe_one_step_off(row, gpu, p)["step_s"]


def moe_one_step_off(row: Row, gpu: GPUSpec, p: CostParams) -> dict[str, float]:
    """The step of a one-step-off MoE row (with its rollout and trainer pools' times and the sync),
    as ``async_rows`` prices a dense one: generation alone on
    the first ``rollout_gpus`` (rollout_tp / rollout_pp), every other model-stage on the next
    ``train_gpus`` at the stated expert layout, the cross-pool weight sync, ``compose_step``
    (max(rollout, trainer) + the sync that cannot overlap). The run happened, so neither the plans'
    memory reserve nor the allocator's slack may refuse it; each pool's memory is still checked."""
    from nereus.models.spec import preset
    from nereus.planner.cost.plan_times import compose_step, evaluate_times, phase_makespans
    from nereus.planner.plan import Plan, StagePlacement
    from nereus.planner.schedules import ScheduleSpec
    from nereus.planner.specs import ClusterSpec

    p = replace(p, mem_reserve_frac=0.0, mem_fragmentation=1.0)
    model = preset(row.get("preset") or "")
    job, w = rl_job(row, model)
    sched = ScheduleSpec(kind="one_step_off", staleness=_int(row, "staleness", 1))
    job = replace(job, schedule=sched, rollout=replace(job.rollout, sleep=False))
    R, T = _int(row, "rollout_gpus"), _int(row, "train_gpus")
    cluster = ClusterSpec(gpu=gpu, nodes=math.ceil((R + T) / 8), gpus_per_node=8)
    train, _ = moe_stage_configs(row, T)
    rtp, rpp = _int(row, "rollout_tp", 1), _int(row, "rollout_pp", 1)
    if R % (rtp * rpp):
        raise Unsupported(f"rollout tp*pp = {rtp * rpp} does not divide {R} rollout GPUs")
    gen = ParallelConfig(tp=rtp, pp=rpp, dp=R // (rtp * rpp), ep=_int(row, "rollout_ep", 1))
    plan = Plan(stages=tuple(StagePlacement(name=ms, config=gen if ms.endswith("generation") else train,
                                            pool=0 if ms.endswith("generation") else 1,
                                            first_gpu=0 if ms.endswith("generation") else R,
                                            gpus=R if ms.endswith("generation") else T) for ms in job.model_stages()),
                extras=(("schedule", sched.to_dict()),))
    stage_s = {s.name: estimate(job, cluster, s.name, s.config, w, p).time_s for s in plan.stages}
    check = evaluate_times(job, cluster, plan, w, p)
    if check.violations:
        raise Unsupported(f"the plan does not fit: {check.violations[0]}")
    sync = weight_sync_s(model, train, gen, cluster, False, p)
    spans = phase_makespans(job, plan, stage_s)
    return {"step_s": compose_step(job, plan, stage_s, sync), "rollout_s": spans[0], "trainer_s": sum(spans[1:]),
            "weight_sync_s": sync}


def _moe(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """A mixture-of-experts RL row (``kind=rl``): the model from its preset (``nereus.models``), the
    job from the row as for ``rl_stages`` (``rl_job``), every model-stage at the row's expert layout
    (``moe_stage_configs``), generation and weight sync colocated; ``stage=step`` sums them. A
    ``schedule=one_step_off`` row: ``moe_one_step_off_s``."""
    if row.get("schedule") == "one_step_off":
        if row.get("kind") != "rl" or row.get("stage") != "step":
            raise Unsupported("one-step-off moe rows: only kind=rl stage=step is modelled")
        return moe_one_step_off_s(row, gpu, p)
    ests, sync = moe_estimates(row, gpu, p)
    times = {ms: e.time_s for ms, e in ests.items()}
    stage = row.get("stage", "")
    if stage == "step":
        return sum(times.values()) + sync
    if stage in RL_STAGES and RL_STAGES[stage] in times:
        return times[RL_STAGES[stage]]
    raise Unsupported(f"moe RL stage {stage!r} not modelled")


_PREDICTORS = {"decode": _decode, "prefill": _prefill, "collectives": _collective, "training": _training,
               "rl_stages": _rl, "host": _host, "async": _async,
               "memory": _memory, "moe": _moe}
