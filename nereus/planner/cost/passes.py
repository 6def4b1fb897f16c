"""Inference and training passes: FLOPs (6N / 8N with recompute, attention from E[s^2]),
micro-batches of fixed size or token budget, padding, TP/SP/CP/PP/DP/FSDP communication, the
optimizer step, offload, the log-prob pass over the vocabulary; memory of activations, logits
and model states."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec
from nereus.planner.cost import moe
from nereus.planner.cost.comm import TP_EDGE_COLLECTIVES, a2a_s, ag_s, ar_s, group_bw, ring_kv_exposed_s
from nereus.planner.cost.estimates import NO_OPTIONS, StageEstimate, StageOptions, finish, memoised, trainable
from nereus.planner.cost.framework import fsdp_cpu_floor_s, optimizer_offload_s, param_offload_s
from nereus.planner.cost.lengths import expected_max, response_quantiles
from nereus.planner.cost.memory import split_model_state_bytes, GiB, model_state_bytes, params_per_gpu
from nereus.planner.cost.params import CostParams, p2p_s
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload


def seq_moments(w: Workload) -> tuple[float, float]:
    """(E[s], E[s^2]) of sequence lengths s = prompt + response: attention work grows with s^2,
    so a long tail costs more than its share of tokens."""
    return _moments(w.prompt_len, w.response_len_mean, w.response_len_p90, w.response_len_max)


@lru_cache(maxsize=4096)
def _moments(prompt: int, mean: float, p90: float | None, cap: int) -> tuple[float, float]:
    s = [prompt + x for x in response_quantiles(mean, p90, cap)]
    return sum(s) / len(s), sum(x * x for x in s) / len(s)


def _micro_batches(w: Workload, cfg: ParallelConfig, per_step: int, padded: bool = False,
                   pad_to: int = 0) -> tuple[int, float, float]:
    """(micro-batches per data group per optimizer step, mean tokens of a micro-batch, tokens of the
    largest one) for fixed ``micro_batch`` sequences or a ``token_budget`` per GPU (packing; a
    sequence longer than the budget gets a micro-batch of its own). ``padded``: every sequence is
    padded to the batch's longest (time: the expected longest; memory: the cap, which a padded
    batch reaches whenever one row does). ``pad_to`` > 0: every sequence is ``pad_to`` tokens wide
    (``padded_tokens``); a token budget still counts the real tokens."""
    groups = cfg.dp // cfg.seq_split
    seqs = w.sequences / (per_step * groups)
    s_mean = w.prompt_len + w.response_len_mean
    longest = w.prompt_len + expected_max(w.sequences, w.response_len_mean, w.response_len_p90, w.response_len_max)
    s_real = s_mean
    if pad_to:
        s_mean = longest = float(max(pad_to, w.prompt_len + 1))
    if padded:  # a padded batch is as wide as its longest row, which may reach the cap any step
        b = cfg.micro_batch
        return max(1, math.ceil(seqs / b)), b * longest, b * (w.prompt_len + w.response_len_max)
    if cfg.token_budget:
        budget = cfg.token_budget * cfg.seq_split
        # the budget counts real tokens (verl balances micro-batches on attention-mask lengths), padded or not
        m = max(1, math.ceil(seqs * s_real / budget))
        return m, seqs * s_mean / m, max(float(budget) * s_mean / s_real, longest)
    b = cfg.micro_batch
    m = max(1, math.ceil(seqs / b))
    return m, b * s_mean, worst_micro_batch(w, b, s_mean, longest)


def worst_micro_batch(w: Workload, b: int, s_mean: float, longest: float) -> float:
    """Tokens of the largest micro-batch of ``b`` sequences: the one holding the step's longest.
    A micro-batch holds adjacent sequences, and a prompt's samples are adjacent, so up to
    ``samples_per_prompt`` - 1 of the others share its prompt; with intraclass correlation ``rho``
    (``Workload.response_len_prompt_corr``) each of them is expected at mean + rho x (longest -
    mean) (the regression to the mean of correlated lengths), the rest at the mean. rho = 0: the
    independent bound (b - 1) x mean + longest."""
    rho = w.response_len_prompt_corr
    same = min(b, w.samples_per_prompt) - 1 if rho else 0
    return (b - 1) * s_mean + longest + same * rho * (longest - s_mean)


def _computed(w: Workload, cfg: ParallelConfig, mb_tokens: float, s_sq: float, padded: bool) -> tuple[float, float]:
    """(tokens computed, E[s^2]) of the batch: a padded batch computes every row to the batch's
    expected longest (``mb_tokens`` / micro-batch sequences), not to its own length."""
    if not padded:
        return w.tokens, s_sq
    longest = mb_tokens / max(1, cfg.micro_batch)
    return w.sequences * longest, longest * longest


def padded_tokens(w: Workload, pad_to: int = 0) -> float:
    """Tokens the GEMMs of one pass over the step's sequences process. A framework that does not
    remove padding (verl ``use_remove_padding=False``, its default before v0.4 and still the
    critic's default in many example scripts) runs every sequence at ``pad_to`` = max prompt +
    max response tokens: the rollout pads responses to ``max_response_length`` and prompts to
    ``max_prompt_length`` (verl ``vllm_rollout``: ``pad_2d_list_to_length(..., max_length=
    response_length)``; RL dataset: left-padding to ``max_prompt_length``). With short GSM8K answers
    (~290 real of 1,536 padded tokens) that is 5x the work. Attention is left at the real lengths:
    Hugging Face's FlashAttention-2 path unpads q/k/v inside each layer. No constant is fitted."""
    return float(w.sequences * max(pad_to, w.prompt_len + 1)) if pad_to else float(w.tokens)


def logprob_vocab_s(tokens: float, vocab: int, cfg: ParallelConfig, cluster: ClusterSpec, p: CostParams,
                    training: bool) -> float:
    """The log-probability pass over the vocabulary after the LM head, memory-bound: every one of
    the ``tokens`` x ``vocab`` logits is written in bf16 by the head GEMM, cast to fp32 and put
    through log-softmax (``p.logprob_bytes_per_logit`` HBM bytes per logit, derived from those
    element-wise passes); training adds the backward of log-softmax and the cast
    (``p.logprob_train_extra_bytes_per_logit``). Each GPU holds tokens/dp of the tokens (sequence
    parallel ranks included) and vocab/tp of the vocabulary (vocab-parallel head); the last
    pipeline stage pays it. Bandwidth: the profile's HBM efficiency, fitted on decode rows (fit
    split). A 152k-token vocabulary (Qwen) makes this about 2.4 GB per 1,000 tokens."""
    per_logit = p.logprob_bytes_per_logit + (p.logprob_train_extra_bytes_per_logit if training else 0.0)
    return tokens / cfg.dp * vocab / cfg.tp * per_logit / (p.hbm_eff * cluster.gpu.hbm_bytes_per_s)


@dataclass(frozen=True, slots=True)
class _TrainShape:
    """The terms of a training pass that its ZeRO stage and recomputation leave unchanged (the
    micro-batches, tokens, GEMM efficiency, the seconds of one call of each collective, memory per
    token), computed once for the configs that share them (``estimate_training``'s ``memo``)."""

    m: int
    mb_tokens: float
    tokens: float
    matmul_params: int
    attn: float
    """Attention FLOPs of one epoch without recomputation's extra forward, up to the factor."""
    eff: float
    eff_x: float
    flop_rate: float
    attn_rate: float
    n_micro: int
    layers_here: int
    ar_tp: float
    a2a_sp: float
    pp_p2p: float
    moe_layers: int
    ep_a2a: float
    dense: float
    expert: float
    psi: float
    dp_sync: float
    """Gradient all-reduce below ZeRO-3 (dense and expert groups apart on a mixture of experts)."""
    fsdp_gather: float
    dp_sync_z3: float
    logprob: float
    act: float
    act_recompute: float
    logits: float


def _train_shape(job: JobSpec, cluster: ClusterSpec, model: ModelSpec, cfg: ParallelConfig, w: Workload,
                 p: CostParams, head: str, o: StageOptions) -> _TrainShape:
    """Reads no ZeRO stage and no recomputation from ``cfg``."""
    tp, pp, dp, sp, split = cfg.tp, cfg.pp, cfg.dp, cfg.sp, cfg.seq_split
    E, M = job.batch.ppo_epochs, job.batch.mini_batches
    h, L = model.hidden, model.layers
    _, s_sq = seq_moments(w)
    gpu = cluster.gpu
    m, mb_tokens, mb_worst = _micro_batches(w, cfg, M, job.sequence.padded, o.pad_to)
    # a padded batch computes every row to its longest; pad_to: every row to a fixed width (attention
    # stays at the real lengths there: padded_tokens)
    tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq, True) if job.sequence.padded else (padded_tokens(w, o.pad_to), s_sq)
    eff = p.matmul_eff(p.mfu_train, 2 * mb_tokens / split * h * (h if model.is_moe else model.ffn) / tp)
    eff_x = 0.0
    if model.is_moe:  # the routed experts at their own (smaller) GEMM's efficiency
        eff_x = p.matmul_eff(p.mfu_train, moe.expert_gemm_flops(model, mb_tokens / split / tp, cfg.ep * cfg.etp,
                                                                 cfg.etp))
    n_micro = E * M * m
    act_bytes = mb_tokens / split * h * 2
    layers_here = math.ceil(L / pp)
    pp_p2p = 0.0 if pp == 1 else n_micro * 2 * p2p_s(act_bytes / tp, group_bw(cluster, tp * pp, p), p.p2p_latency_s)
    # gradients reduced once per optimizer step, or after every micro-batch's backward (o.grad_sync)
    syncs = n_micro if o.grad_sync == "micro_batch" else E * M
    moe_layers, ep_a2a, dense, expert = 0, 0.0, 0.0, 0.0
    if model.is_moe:  # all-to-all dispatch + combine per MoE block; the busiest EP rank
        dense, expert = moe.stage_params(model, tp, pp, cfg.ep * cfg.etp, head)
        psi = dense + expert
        moe_layers = moe.moe_layers_per_stage(model, pp)
        ep_a2a = moe.ep_a2a_s(model, cfg, mb_tokens / split / tp, cluster, p)
        # dense grads over dp, the experts' over expert-dp (ep * etp apart)
        gb = o.grad_reduce_bytes or model.dtype_bytes
        dp_sync = syncs * (ar_s(dense * gb, dp, cluster, p, tp * pp)
                           + ar_s(expert * gb, moe.expert_dp(cfg), cluster, p, cfg.ep * cfg.etp))
        act_ffn = moe.act_ffn(model, moe.imbalance(cfg))
    else:
        psi = params_per_gpu(model, tp, pp, head)
        act_ffn = model.ffn
    grad_bytes = psi * (o.grad_reduce_bytes or model.dtype_bytes)
    if not model.is_moe:
        dp_sync = syncs * ar_s(grad_bytes, dp, cluster, p, tp * pp)
    # FSDP: params gathered for forward and backward of every micro-batch, grads reduce-scattered
    fsdp_gather = n_micro * 2 * ag_s(psi * 2, dp, cluster, p, tp * pp)
    dp_sync_z3 = syncs * ag_s(grad_bytes, dp, cluster, p, tp * pp)
    logprob = logprob_vocab_s(tokens * E, model.vocab, cfg, cluster, p, training=True) if head == "lm" else 0.0
    # memory: activations of the largest micro-batch actually formed, not s_max for every sequence
    act_tok_layer = p.act_bytes_per_token(h, act_ffn, model.kv_dim, tp, model.dtype_bytes)
    in_flight = min(pp, m)
    tok = mb_worst / split
    # with recomputation, the kept block inputs: split over TP with sequence parallelism, replicated
    # where the measured activations say the executor replicates the residual (no SP)
    kept_tp = 1 if p.act_bytes_replicated else tp
    vocab_out = model.vocab / tp if head == "lm" else 1
    return _TrainShape(
        m=m, mb_tokens=mb_tokens, tokens=tokens, matmul_params=model.matmul_params(),
        attn=6 * L * model.heads * model.head_dim * w.sequences * s_sq,
        eff=eff, eff_x=eff_x, flop_rate=cfg.gpus * gpu.peak_flops * eff, attn_rate=cfg.gpus * gpu.peak_flops * p.mfu_attn,
        n_micro=n_micro, layers_here=layers_here, ar_tp=ar_s(act_bytes, tp, cluster, p),
        a2a_sp=a2a_s(act_bytes / tp, sp, cluster, p, tp), pp_p2p=pp_p2p, moe_layers=moe_layers, ep_a2a=ep_a2a,
        dense=dense, expert=expert, psi=psi, dp_sync=dp_sync, fsdp_gather=fsdp_gather, dp_sync_z3=dp_sync_z3,
        logprob=logprob, act=in_flight * layers_here * tok * act_tok_layer,
        act_recompute=in_flight * layers_here * tok * model.dtype_bytes * h / kept_tp + tok * act_tok_layer,
        logits=tok * vocab_out * p.logits_bytes * p.logits_copies_train)


def estimate_training(job: JobSpec, cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig,
                      w: Workload, p: CostParams, head: str, o: StageOptions = NO_OPTIONS,
                      memo: dict | None = None) -> StageEstimate:
    """``memo``: a dict the caller keeps for one (job, cluster, workload, params), in which configs
    that differ only in ZeRO stage and recomputation share their ``_TrainShape`` (keyed by the
    model's identity: the caller passes the same object for equal models, ``model.estimate``)."""
    moe.check(model, cfg, "training")
    s = memoised(memo, ("training", id(model), head, o, cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, cfg.sp, cfg.cp, cfg.ep, cfg.etp,
                       cfg.token_budget), lambda: _train_shape(job, cluster, model, cfg, w, p, head, o))
    pp, dp, zero, rc = cfg.pp, cfg.dp, cfg.zero, cfg.recompute
    E, M = job.batch.ppo_epochs, job.batch.mini_batches
    L, gpu = model.layers, cluster.gpu
    m, tokens, n_micro = s.m, s.tokens, s.n_micro
    # compute: 6N (8N with full recompute) per token, attention from E[s^2] of the batch
    n_factor = 8 if rc else 6
    attn = s.attn * (4 / 3 if rc else 1) * E
    flops = n_factor * s.matmul_params * tokens * E
    if model.is_moe:  # the routed experts at their own (smaller) GEMM's efficiency
        if o.fp8_linear:
            raise SpecError(f"fp8_linear on {model.name}: FP8 training of mixture-of-experts models is not modelled")
        routed = n_factor * moe.routed_active_params(model) * tokens * E
        compute, expert_s = moe.split_compute_s(model, flops, routed, cfg.gpus, gpu.peak_flops, s.eff, s.eff_x)
    elif o.fp8_linear:  # the layers' GEMMs in FP8, the LM head's in bf16
        layer_flops = n_factor * L * model.layer_params() * tokens * E
        compute = (flops - layer_flops) / s.flop_rate + fp8_linear_s(model, layer_flops, tokens * E, cfg,
                                                                     s.mb_tokens, gpu, p)
    else:
        compute = flops / s.flop_rate
    attn_s = attn / s.attn_rate
    compute += attn_s
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m}
    # communication
    n_ar = 6 if rc else 4
    t["tp_comm"] = n_micro * s.layers_here * n_ar * s.ar_tp
    if model.is_moe and cfg.etp == 1:  # whole experts: the MoE blocks' MLP collectives become the all-to-all
        t["tp_comm"] -= n_micro * s.moe_layers * n_ar / 2 * s.ar_tp
    t["sp_comm"] = n_micro * s.layers_here * (12 if rc else 8) * s.a2a_sp
    if cfg.cp > 1:  # forward, backward (keys/values again and their gradients back), forward again when recomputing
        t["cp_comm"] = ring_kv_exposed_s(model, cfg, s.mb_tokens, n_micro, 4 if rc else 3, attn_s, cluster, p)
    t["pp_p2p"] = s.pp_p2p
    if model.is_moe:  # all-to-all dispatch + combine per MoE block, forward and backward; the busiest EP rank
        t["ep_comm"] = n_micro * s.moe_layers * (6 if rc else 4) * s.ep_a2a
        t["moe_imbalance"] = (moe.imbalance(cfg) - 1) * expert_s
    psi = s.psi
    if model.is_moe and zero < 3:  # dense grads over dp, the experts' over expert-dp (ep * etp apart)
        t["dp_grad_sync"] = s.dp_sync
    elif zero >= 3:  # FSDP: params gathered for forward and backward of every micro-batch, grads reduce-scattered
        t["fsdp_gather"] = s.fsdp_gather
        t["dp_grad_sync"] = s.dp_sync_z3
    else:
        t["dp_grad_sync"] = s.dp_sync
    opt_share = psi / dp if zero >= 1 else psi
    if model.is_moe and zero >= 1:
        opt_share = s.dense / dp + s.expert / moe.expert_dp(cfg)
    t["optimizer"] = E * M * opt_share * p.optimizer_bytes_per_param / (p.hbm_eff * gpu.hbm_bytes_per_s)
    if head == "lm":
        t["logprob_vocab"] = s.logprob
    if o.param_offload != "none":
        t["param_offload"] = param_offload_s(psi / dp if zero >= 3 else psi, o.param_offload, n_micro, p,
                                             bytes_per_param=4.0, passes_per_micro_batch=2)
    if o.optimizer_offload:
        t["optimizer_offload"] = optimizer_offload_s(opt_share, p)
    if zero >= 3:
        t["fsdp_cpu_bound"] = fsdp_cpu_floor_s(n_micro, s.layers_here, 3 if rc else 2, sum(t.values()), p,
                                               synced=o.pad_to > 0)
    if p.micro_batch_overhead_s or p.optimizer_step_overhead_s:  # host overheads (0 on the GPU presets)
        passes = 4 if rc else 3  # forward, backward (2x), and the forward again when recomputing
        t["overhead"] = (n_micro * passes * p.micro_batch_overhead_s * s.layers_here / L
                         + E * M * p.optimizer_step_overhead_s)
    if model.is_moe:
        resident = split_model_state_bytes(s.dense, s.expert, dp, moe.expert_dp(cfg), zero, model.dtype_bytes)
    else:
        resident = model_state_bytes(psi, dp, zero, model.dtype_bytes)
    transient = {"activations": s.act_recompute if rc else s.act, "logits": s.logits,
                 "fsdp_unsharded": fsdp_unsharded_bytes(psi, cfg, s.layers_here, model.dtype_bytes),
                 "workspace": p.workspace_gib * GiB}
    if p.grad_resident_frac < 1:  # gradients freed after each optimizer step exist only while training runs
        freed = resident["grads"] * (1 - p.grad_resident_frac)
        resident["grads"] -= freed
        transient["grads_in_training"] = freed
    return finish(ms, cfg, t, "training", p, resident, transient, cluster)


def fsdp_unsharded_bytes(psi: float, cfg: ParallelConfig, layers_here: int, dtype_bytes: int) -> float:
    """Parameters ZeRO-3 / FSDP holds unsharded (bf16) while a training step runs: the layer being
    computed and the one prefetched (FSDP2's default ``reshard_after_forward`` frees each after
    use), 2 of the stage's layers; with pipeline parallelism the whole stage, which torchtitan keeps
    unsharded across its micro-batches (``reshard_after_forward=False`` under PP, so every
    micro-batch does not all-gather it again). 0 below ZeRO-3."""
    if cfg.zero < 3 or cfg.dp <= 1:
        return 0.0
    share = 1.0 if cfg.pp > 1 else min(1.0, 2 / max(1, layers_here))
    return dtype_bytes * psi * share


FP8_PEAK_FACTOR = 2.0
"""Dense FP8 tensor-core peak over the bf16 peak on Hopper-class GPUs (H100 SXM: 1,979 vs 989 TFLOP/s)."""


FP8_CAST_BYTES = 3.0
"""HBM bytes per element to cast a GEMM operand to FP8: read bf16 (2), write fp8 (1)."""


def fp8_linear_s(model: ModelSpec, layer_flops: float, tokens: float, cfg: ParallelConfig, mb_tokens: float,
                 gpu, p: CostParams) -> float:
    """Seconds of the decoder layers' linear GEMMs of a training step run in FP8 (Transformer Engine /
    torchao float8 recipes), over the step's ``tokens``: the GEMMs at twice the bf16 peak
    (``FP8_PEAK_FACTOR``) at ``p.mfu_train_fp8`` (size-dependent like the bf16 ones), plus the casts
    of their operands, memory-bound: each linear layer's input activations in the forward and the
    output gradients in the backward (per token: h + q + h + f in, q + 2 kv + h + 2 f + h out per
    layer), and the weights once per micro-batch for forward and backward. Derived, except
    ``mfu_train_fp8``, which the GPU profiles fit on the corpus's FP8 fit rows."""
    h, f, L = model.hidden, model.ffn, model.layers
    eff = p.matmul_eff(p.mfu_train_fp8, 2 * mb_tokens / cfg.seq_split * h * f / cfg.tp)
    gemm = layer_flops / (cfg.gpus * FP8_PEAK_FACTOR * gpu.peak_flops * eff)
    act = (h + model.q_dim + h + f) * (2 if cfg.recompute else 1) + (model.q_dim + 2 * model.kv_dim + h + 2 * f + h)
    micro = tokens / max(1.0, mb_tokens) / cfg.dp  # micro-batches per GPU
    elems = tokens / cfg.dp * L / cfg.pp * act / cfg.tp + micro * 2 * L * model.layer_params() / (cfg.tp * cfg.pp)
    return gemm + elems * FP8_CAST_BYTES / (p.hbm_eff * gpu.hbm_bytes_per_s)


@dataclass(frozen=True, slots=True)
class _InferShape:
    """The terms of an inference pass that its ZeRO stage leaves unchanged (it reads no recomputation),
    computed once for the configs that share them (``estimate_inference``'s ``memo``)."""

    t: dict[str, float]
    """Time terms up to the experts' (ZeRO-3's and the host's come after them)."""
    m: int
    layers_here: int
    psi: float
    act: float
    logits: float


def _infer_shape(cluster: ClusterSpec, model: ModelSpec, cfg: ParallelConfig, w: Workload, p: CostParams, head: str,
                 padded: bool, o: StageOptions) -> _InferShape:
    """Reads no ZeRO stage and no recomputation from ``cfg``."""
    tp, pp, sp, split = cfg.tp, cfg.pp, cfg.sp, cfg.seq_split
    h, L = model.hidden, model.layers
    _, s_sq = seq_moments(w)
    m, mb_tokens, mb_worst = _micro_batches(w, cfg, 1, padded, o.pad_to)
    tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq, True) if padded else (padded_tokens(w, o.pad_to), s_sq)
    attn = 2 * L * model.heads * model.head_dim * w.sequences * s_sq
    flops = 2 * model.matmul_params() * tokens
    eff = p.matmul_eff(p.mfu_prefill, 2 * mb_tokens / split * h * (h if model.is_moe else model.ffn) / tp)
    peak = cfg.gpus * cluster.gpu.peak_flops
    attn_s = attn / (peak * p.mfu_attn)
    if model.is_moe:  # the routed experts at their own (smaller) GEMM's efficiency
        eff_x = p.matmul_eff(p.mfu_prefill, moe.expert_gemm_flops(model, mb_tokens / split / tp, cfg.ep * cfg.etp,
                                                                   cfg.etp))
        compute, expert_s = moe.split_compute_s(model, flops, 2 * moe.routed_active_params(model) * tokens, cfg.gpus,
                                                cluster.gpu.peak_flops, eff, eff_x)
        compute += attn_s
    else:
        compute = flops / (peak * eff) + attn_s
    act_bytes = mb_tokens / split * h * 2
    layers_here = math.ceil(L / pp)
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m,
         "tp_comm": m * (layers_here * 2 + TP_EDGE_COLLECTIVES) * ar_s(act_bytes, tp, cluster, p),
         "sp_comm": m * layers_here * 4 * a2a_s(act_bytes / tp, sp, cluster, p, tp),
         "pp_p2p": 0.0 if pp == 1 else m * p2p_s(act_bytes / tp, group_bw(cluster, tp * pp, p), p.p2p_latency_s)}
    if cfg.cp > 1:
        t["cp_comm"] = ring_kv_exposed_s(model, cfg, mb_tokens, m, 1, attn_s, cluster, p)
    if head == "lm":
        t["logprob_vocab"] = logprob_vocab_s(tokens, model.vocab, cfg, cluster, p, training=False)
    if model.is_moe:  # dispatch + combine per MoE block; the busiest EP rank sets the experts' time
        t["ep_comm"] = m * moe.moe_layers_per_stage(model, pp) * 2 * moe.ep_a2a_s(model, cfg, mb_tokens / split / tp,
                                                                               cluster, p)
        t["moe_imbalance"] = (moe.imbalance(cfg) - 1) * expert_s
    vocab_out = model.vocab / tp if head == "lm" else 1
    act_ffn = moe.act_ffn(model, moe.imbalance(cfg)) if model.is_moe else model.ffn
    act_tok_layer = p.act_bytes_per_token(h, act_ffn, model.kv_dim, tp, model.dtype_bytes)
    tok = mb_worst / split
    return _InferShape(t=t, m=m, layers_here=layers_here, psi=params_per_gpu(model, tp, pp, head, cfg.ep * cfg.etp),
                       act=tok * act_tok_layer, logits=tok * vocab_out * p.logits_bytes)


def estimate_inference(cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
                       p: CostParams, head: str, padded: bool = False, o: StageOptions = NO_OPTIONS,
                       memo: dict | None = None) -> StageEstimate:
    """``memo``: as ``estimate_training``'s; configs that differ only in ZeRO stage (and recomputation,
    which inference does not read) share their ``_InferShape``, and so do the stages of equal models
    with the same head (the shape reads no role)."""
    moe.check(model, cfg, "inference")
    s = memoised(memo, ("inference", id(model), head, o, padded, cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, cfg.sp, cfg.cp, cfg.ep,
                        cfg.etp, cfg.token_budget), lambda: _infer_shape(cluster, model, cfg, w, p, head, padded, o))
    L, m, psi, z3 = model.layers, s.m, s.psi, cfg.zero >= 3
    t = dict(s.t)
    if z3:  # FSDP: every micro-batch's forward all-gathers the parameters again (resharded after it)
        t["fsdp_gather"] = m * ag_s(psi * 2, cfg.dp, cluster, p, cfg.tp * cfg.pp)
    if o.param_offload != "none":
        t["param_offload"] = param_offload_s(psi / cfg.dp, o.param_offload, m, p,
                                             bytes_per_param=4.0 if trainable(ms.partition("/")[0]) else model.dtype_bytes)
    if z3:
        t["fsdp_cpu_bound"] = fsdp_cpu_floor_s(m, s.layers_here, 1, sum(t.values()), p, training=False,
                                               synced=o.pad_to > 0)
    if p.infer_pass_overhead_s or p.infer_call_overhead_s:  # host overheads (0 on the GPU presets)
        t["overhead"] = m * p.infer_pass_overhead_s * s.layers_here / L + p.infer_call_overhead_s
    # ZeRO-3 / FSDP (verl's FSDP ref and actor): each rank keeps 1/dp of the weights and gathers the
    # layer it computes (and the one prefetched) for the forward, as the time term above gathers them
    resident = {"weights": model.dtype_bytes * psi / (cfg.dp if z3 else 1)}
    transient = {"activations": s.act, "logits": s.logits, "workspace": p.workspace_gib * GiB}
    if z3:
        transient["fsdp_unsharded"] = fsdp_unsharded_bytes(psi, cfg, s.layers_here, model.dtype_bytes)
    return finish(ms, cfg, t, "inference", p, resident, transient, cluster)
