"""Analytic cost model: time (s) and peak memory per GPU (bytes) of one model-stage under one
parallel config, each with a per-component breakdown. Formulas: shared/reference/COST_MODEL.md.

Memory is split into ``resident`` (state that stays on the GPU for the whole step: a trainable
model's params + grads + optimizer in its training layout; a frozen model's weights) and
``transient`` (working set of the running stage: activations, logits, KV cache, the generation
copy of the actor's weights, workspace). The plan solver adds residents of every model homed on a
pool to the largest transient of the stages the pool runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable, Mapping

from nereus.errors import SpecError
from nereus.models.inventory import check_tp
from nereus.models.spec import ModelSpec
from nereus.planner.cost.lengths import decode_grid, expected_max, peak_context_per_seq, response_quantiles
from nereus.planner.cost.params import CostParams, allgather_s, allreduce_s, alltoall_s, latency_steps, p2p_s
from nereus.planner.specs import TRAINABLE, ClusterSpec, JobSpec, ParallelConfig, Workload

GiB = 1024**3


@dataclass(frozen=True, slots=True)
class StageEstimate:
    model_stage: str
    config: ParallelConfig
    time_s: float
    time_breakdown: Mapping[str, float]
    resident_bytes: float
    transient_bytes: float
    mem_breakdown: Mapping[str, float]
    capacity_bytes: float
    waves: int = 1
    notes: tuple[str, ...] = field(default=())

    @property
    def mem_bytes(self) -> float:
        return self.resident_bytes + self.transient_bytes

    @property
    def fits(self) -> bool:
        return self.mem_bytes <= self.capacity_bytes and math.isfinite(self.time_s)

    def to_dict(self) -> dict:
        return {
            "model_stage": self.model_stage, **self.config.to_dict(), "time_s": self.time_s,
            "time_breakdown": dict(self.time_breakdown), "mem_bytes": self.mem_bytes,
            "resident_bytes": self.resident_bytes, "transient_bytes": self.transient_bytes,
            "mem_breakdown": dict(self.mem_breakdown), "capacity_bytes": self.capacity_bytes,
            "fits": self.fits, "waves": self.waves, "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class StageOptions:
    """How a training framework runs one model-stage beyond its parallel config (verl's FSDP
    worker settings). The planner's own plans use the defaults; ``nereus fidelity`` passes a
    corpus row's settings.

    - ``pad_to``: every sequence of a training / inference micro-batch is padded to this many
      tokens (verl with ``use_remove_padding=False`` pads prompts to ``max_prompt_length`` and
      responses to ``max_response_length``); 0: the tokens actually there (remove-padding / packing).
      A padded batch reaches Hugging Face's flash-attention path with its padding mask, which
      unpads it again in every layer (``_get_unpad_data``: ``nonzero`` and ``.item()``, a host-
      device synchronisation per layer; huggingface/transformers#28160, Dao-AILab/flash-attention
      #1454), so under FSDP the host's per-layer time adds to the GPU's instead of hiding under it
      (``fsdp_cpu_floor_s(synced=True)``).
    - ``param_offload``: ``none``; ``per_call`` (verl ``fsdp_config.param_offload`` of an actor or
      critic: the shard is loaded to the GPU before each call and offloaded after it); or
      ``per_micro_batch`` (PyTorch FSDP ``CPUOffload(offload_params=True)``, which verl uses for a
      reference model with ``param_offload``: the shard is copied host -> GPU for every forward).
    - ``optimizer_offload``: the Adam state lives on the host and moves to the GPU and back
      around each optimizer update call (verl ``fsdp_config.optimizer_offload``).
    - ``fp8_linear``: training runs the decoder layers' linear GEMMs in FP8 (Transformer Engine,
      torchao float8): see ``fp8_linear_s``. Memory is unchanged (weights, gradients, optimizer
      state and saved activations stay in bf16 / fp32).
    - ``grad_sync``: when data-parallel gradients are reduced in training: ``step`` (once per
      optimizer step, after the last micro-batch: Megatron, Nereus's executor, verl with
      ``use_no_sync_for_gradient_accumulation=True``) or ``micro_batch`` (every backward: PyTorch
      FSDP / DDP accumulating gradients without ``no_sync``, verl's FSDP default).
    - ``grad_reduce_bytes``: bytes per gradient element on the wire (0: the model's dtype; verl's
      FSDP ``mixed_precision.reduce_dtype`` defaults to fp32, 4).
    - ``controller_width``: > 0 when a single controller moves every worker call's batch through its
      driver process (verl's ``RayWorkerGroup``), each sequence padded to this many tokens (verl:
      ``max_prompt_length + max_response_length``): adds ``controller_transfer_s``. 0 (default): no
      driver in the data path (SPMD launchers: Megatron, NeMo RL's workers, Nereus's executor).
    """

    pad_to: int = 0
    param_offload: str = "none"
    optimizer_offload: bool = False
    fp8_linear: bool = False
    grad_sync: str = "step"
    grad_reduce_bytes: int = 0
    controller_width: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.pad_to, bool) or not isinstance(self.pad_to, int) or self.pad_to < 0:
            raise SpecError(f"stage options: pad_to must be an integer >= 0, got {self.pad_to!r}")
        if self.param_offload not in ("none", "per_call", "per_micro_batch"):
            raise SpecError(f"stage options: param_offload must be none, per_call or per_micro_batch, "
                            f"got {self.param_offload!r}")
        if not isinstance(self.optimizer_offload, bool):
            raise SpecError(f"stage options: optimizer_offload must be true or false, got {self.optimizer_offload!r}")
        if not isinstance(self.fp8_linear, bool):
            raise SpecError(f"stage options: fp8_linear must be true or false, got {self.fp8_linear!r}")
        if self.grad_sync not in ("step", "micro_batch"):
            raise SpecError(f"stage options: grad_sync must be step or micro_batch, got {self.grad_sync!r}")
        if isinstance(self.grad_reduce_bytes, bool) or self.grad_reduce_bytes not in (0, 1, 2, 4):
            raise SpecError(f"stage options: grad_reduce_bytes must be 0 (the model's dtype), 1, 2 or 4, "
                            f"got {self.grad_reduce_bytes!r}")
        if isinstance(self.controller_width, bool) or not isinstance(self.controller_width, int) \
                or self.controller_width < 0:
            raise SpecError(f"stage options: controller_width must be an integer >= 0, got {self.controller_width!r}")


NO_OPTIONS = StageOptions()


# ---- sizes -------------------------------------------------------------------------------------
def params_per_gpu(model: ModelSpec, tp: int, pp: int, head: str = "lm") -> float:
    """Parameters held by one GPU of the most loaded pipeline stage (KV projections replicate
    when tp exceeds kv_heads; the embedding sits on the first stage, the LM head on the last)."""
    h, d = model.hidden, model.head_dim
    kv_split = min(tp, model.kv_heads)
    per_layer = (2 * h * model.q_dim) / tp + (2 * h * model.kv_dim) / kv_split + 3 * h * model.ffn / tp + 2 * h
    if model.qkv_bias:
        per_layer += model.q_dim / tp + 2 * model.kv_dim / kv_split
    if model.qk_norm:
        per_layer += 2 * d
    layers = math.ceil(model.layers / pp)
    embed = model.vocab * h / tp
    last = h + (h if head == "value" else (0 if model.tie_embeddings else embed))
    if pp == 1:
        return layers * per_layer + embed + last
    return layers * per_layer + max(embed, last)


def model_state_bytes(psi: float, dp: int, zero: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Mixed-precision Adam: bf16 weights (2) + bf16 grads (2) + fp32 master, m, v (12) per param,
    sharded along DP by the ZeRO stage (Rajbhandari et al. 2019). In fp32 (dtype_bytes 4, no
    master copy): 4 + 4 + 8, the same 16 bytes split differently."""
    if dtype_bytes == 4:
        w, g, o = 4 * psi, 4 * psi, 8 * psi
    else:
        w, g, o = 2 * psi, 2 * psi, 12 * psi
    if zero >= 1:
        o /= dp
    if zero >= 2:
        g /= dp
    if zero >= 3:
        w /= dp
    return {"weights": w, "grads": g, "optimizer": o}


def _links(cluster: ClusterSpec, p: CostParams) -> tuple[float, float]:
    g = cluster.gpu
    return g.intra_node_gbps * 1e9 * p.intra_link_eff, g.inter_node_gbps * 1e9 * p.inter_link_eff


def _group_bw(cluster: ClusterSpec, span_gpus: int, p: CostParams) -> float:
    """Bandwidth of a group whose members lie within ``span_gpus`` consecutive GPUs."""
    intra, inter = _links(cluster, p)
    return intra if span_gpus <= cluster.gpus_per_node else inter


def _nodes(cluster: ClusterSpec, n: int, stride: int) -> int:
    """Nodes a group of n ranks spaced ``stride`` GPUs apart spans."""
    return max(1, -(-(n * stride) // cluster.gpus_per_node))


def ar_s(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int = 1) -> float:
    """All-reduce over a group of n ranks spaced ``stride`` GPUs apart (TP: 1; DP: tp * pp),
    hierarchical when the group spans nodes (``allreduce_s``)."""
    intra, inter = _links(cluster, p)
    return allreduce_s(nbytes, n, intra, p.allreduce_latency_s, nodes=_nodes(cluster, n, stride),
                       alpha_inter=p.inter_latency_s, bw_inter=inter)


def ag_s(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int = 1) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` in total over n ranks spaced ``stride`` apart."""
    intra, inter = _links(cluster, p)
    return allgather_s(nbytes, n, intra, p.allreduce_latency_s, nodes=_nodes(cluster, n, stride),
                       alpha_inter=p.inter_latency_s, bw_inter=inter)


def validate_config(job: JobSpec, cluster: ClusterSpec, model_stage: str, cfg: ParallelConfig) -> ModelSpec:
    role, _, stage = model_stage.partition("/")
    if model_stage not in job.model_stages():
        raise SpecError(f"job has no model-stage {model_stage!r}; it has {list(job.model_stages())}")
    model = job.model(role)
    check_tp(model, cfg.tp)
    if cfg.tp > cluster.gpus_per_node:
        raise SpecError(f"tp({cfg.tp}) > gpus_per_node({cluster.gpus_per_node}): TP stays inside a node")
    if cfg.pp > model.layers:
        raise SpecError(f"pp({cfg.pp}) > layers({model.layers}) of {model.name}")
    if cfg.gpus > cluster.num_gpus:
        raise SpecError(
            f"tp({cfg.tp}) * pp({cfg.pp}) * dp({cfg.dp}) = {cfg.gpus} GPUs > cluster's {cluster.num_gpus}"
        )
    return model


def estimate(job: JobSpec, cluster: ClusterSpec, model_stage: str, cfg: ParallelConfig,
             workload: Workload | None = None, params: CostParams | None = None,
             kv_budget_bytes: float | None = None, options: StageOptions | None = None) -> StageEstimate:
    """Time and memory of ``model_stage`` under ``cfg``. ``kv_budget_bytes`` caps the KV cache of
    generation per GPU (default: what the inference engine may take of an otherwise empty GPU);
    ``options``: padding and offload settings of the framework (``StageOptions``)."""
    model = validate_config(job, cluster, model_stage, cfg)
    w = workload or job.workload()
    p = params or CostParams()
    role, _, stage = model_stage.partition("/")
    head = "value" if role in ("critic", "reward") else "lm"
    if cfg.sp > 1 and model.heads % (cfg.sp * cfg.tp):
        raise SpecError(f"sp({cfg.sp}) * tp({cfg.tp}) must divide the {model.heads} attention heads of {model.name} "
                        f"(Ulysses splits heads across the sequence-parallel ranks)")
    o = options or NO_OPTIONS
    if stage == "training":
        e = _training(job, cluster, model_stage, model, cfg, w, p, head, o)
    elif stage == "inference":
        e = _inference(cluster, model_stage, model, cfg, w, p, head, job.sequence.padded, o)
    else:
        e = _generation(job, cluster, model_stage, model, cfg, w, p, kv_budget_bytes)
    if o.controller_width:
        if o.controller_width < w.response_len_max:
            raise SpecError(f"stage options: controller_width({o.controller_width}) must hold the response cap "
                            f"({w.response_len_max}) and the prompt")
        c = controller_transfer_s(stage, w.sequences, o.controller_width, w.response_len_max, p)
        e = replace(e, time_s=e.time_s + c, time_breakdown={**e.time_breakdown, "controller_transfer": c})
    return e


CONTROLLER_TRAIN_TENSORS = 6
"""fp32 per-response-token tensors a verl update call carries besides the token tensors: old and
reference log-probs, token-level scores and rewards, advantages, returns (verl's batch at
``update_actor`` / ``update_critic``; the worker selects its keys only after the dispatch)."""


def controller_transfer_s(stage: str, sequences: float, width: int, response_cap: int, p: CostParams) -> float:
    """One worker call of a single-controller framework (verl's ``RayWorkerGroup``,
    ``Dispatch.DP_COMPUTE_PROTO``): the driver sends the step's batch out in one chunk per worker and
    gets the results back, serialised both ways; host work at ``p.controller_gbps`` GB/s of bytes
    sent plus returned, plus ``p.controller_call_s``. Bytes per sequence, padded to ``width`` tokens
    (``response_cap`` of them the response), as verl's batch holds them (int64 token tensors):

    - generation: sends the prompts' input_ids, attention_mask and position_ids (3 x 8 bytes per
      prompt token); gets back prompts, responses, input_ids, attention_mask, position_ids
      (4 x width x 8 bytes);
    - inference (log-probs, values): sends those five and the response mask (8 bytes per response
      token); gets one fp32 per response token;
    - training: sends the same plus ``CONTROLLER_TRAIN_TENSORS`` fp32 tensors per response token;
      gets back metrics (nothing to count)."""
    prompt = width - response_cap
    batch = 4 * width * 8
    if stage == "generation":
        per_seq = 3 * prompt * 8 + batch
    elif stage == "inference":
        per_seq = batch + 8 * response_cap + 4 * response_cap
    else:
        per_seq = batch + 8 * response_cap + CONTROLLER_TRAIN_TENSORS * 4 * response_cap
    return p.controller_call_s + sequences * per_seq / (p.controller_gbps * 1e9)


def _finish(ms: str, cfg: ParallelConfig, t: dict[str, float], stage: str, p: CostParams,
            resident: dict[str, float], transient: dict[str, float], cluster: ClusterSpec,
            waves: int = 1, notes: tuple[str, ...] = ()) -> StageEstimate:
    f = p.factor(stage)
    t = {k: v * f for k, v in t.items()}
    return StageEstimate(ms, cfg, sum(t.values()), t, sum(resident.values()), sum(transient.values()),
                         {**resident, **transient}, cluster.gpu.usable_bytes, waves, notes)


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
    return m, b * s_mean, (b - 1) * s_mean + longest


def _computed(w: Workload, cfg: ParallelConfig, mb_tokens: float, s_sq: float, padded: bool) -> tuple[float, float]:
    """(tokens computed, E[s^2]) of the batch: a padded batch computes every row to the batch's
    expected longest (``mb_tokens`` / micro-batch sequences), not to its own length."""
    if not padded:
        return w.tokens, s_sq
    longest = mb_tokens / max(1, cfg.micro_batch)
    return w.sequences * longest, longest * longest


def _training(job: JobSpec, cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig,
              w: Workload, p: CostParams, head: str, o: StageOptions = NO_OPTIONS) -> StageEstimate:
    tp, pp, dp, sp, split = cfg.tp, cfg.pp, cfg.dp, cfg.sp, cfg.seq_split
    E, M = job.batch.ppo_epochs, job.batch.mini_batches
    h, L = model.hidden, model.layers
    _, s_sq = seq_moments(w)
    gpu = cluster.gpu
    # compute: 6N (8N with full recompute) per token, attention from E[s^2] of the batch
    n_factor = 8 if cfg.recompute else 6
    m, mb_tokens, mb_worst = _micro_batches(w, cfg, M, job.sequence.padded, o.pad_to)
    # a padded batch computes every row to its longest; pad_to: every row to a fixed width (attention
    # stays at the real lengths there: padded_tokens)
    tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq, True) if job.sequence.padded else (padded_tokens(w, o.pad_to), s_sq)
    attn = 6 * L * model.heads * model.head_dim * w.sequences * s_sq * (4 / 3 if cfg.recompute else 1) * E
    flops = n_factor * model.matmul_params() * tokens * E
    eff = p.matmul_eff(p.mfu_train, 2 * mb_tokens / split * h * model.ffn / tp)
    if o.fp8_linear:  # the layers' GEMMs in FP8, the LM head's in bf16
        layer_flops = n_factor * L * model.layer_params() * tokens * E
        compute = ((flops - layer_flops) / (cfg.gpus * gpu.peak_flops * eff)
                   + fp8_linear_s(model, layer_flops, tokens * E, cfg, mb_tokens, gpu, p))
    else:
        compute = flops / (cfg.gpus * gpu.peak_flops * eff)
    attn_s = attn / (cfg.gpus * gpu.peak_flops * p.mfu_attn)
    compute += attn_s
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m}
    # communication
    n_micro = E * M * m
    act_bytes = mb_tokens / split * h * 2
    n_ar = 6 if cfg.recompute else 4
    t["tp_comm"] = n_micro * math.ceil(L / pp) * n_ar * ar_s(act_bytes, tp, cluster, p)
    t["sp_comm"] = n_micro * math.ceil(L / pp) * (12 if cfg.recompute else 8) * _a2a(act_bytes / tp, sp, cluster, p, tp)
    if cfg.cp > 1:  # forward, backward (keys/values again and their gradients back), forward again when recomputing
        t["cp_comm"] = ring_kv_exposed_s(model, cfg, mb_tokens, n_micro, 4 if cfg.recompute else 3, attn_s, cluster, p)
    t["pp_p2p"] = 0.0 if pp == 1 else n_micro * 2 * p2p_s(act_bytes / tp, _group_bw(cluster, tp * pp, p), p.p2p_latency_s)
    psi = params_per_gpu(model, tp, pp, head)
    # gradients reduced once per optimizer step, or after every micro-batch's backward (o.grad_sync)
    syncs = n_micro if o.grad_sync == "micro_batch" else E * M
    grad_bytes = psi * (o.grad_reduce_bytes or model.dtype_bytes)
    if cfg.zero >= 3:  # FSDP: params gathered for forward and backward of every micro-batch, grads reduce-scattered
        t["fsdp_gather"] = n_micro * 2 * ag_s(psi * 2, dp, cluster, p, tp * pp)
        t["dp_grad_sync"] = syncs * ag_s(grad_bytes, dp, cluster, p, tp * pp)
    else:
        t["dp_grad_sync"] = syncs * ar_s(grad_bytes, dp, cluster, p, tp * pp)
    opt_share = psi / dp if cfg.zero >= 1 else psi
    t["optimizer"] = E * M * opt_share * p.optimizer_bytes_per_param / (p.hbm_eff * gpu.hbm_bytes_per_s)
    if head == "lm":
        t["logprob_vocab"] = logprob_vocab_s(tokens * E, model.vocab, cfg, cluster, p, training=True)
    if o.param_offload != "none":
        t["param_offload"] = param_offload_s(psi / dp if cfg.zero >= 3 else psi, o.param_offload, n_micro, p,
                                             bytes_per_param=4.0, passes_per_micro_batch=2)
    if o.optimizer_offload:
        t["optimizer_offload"] = optimizer_offload_s(opt_share, p)
    if cfg.zero >= 3:
        t["fsdp_cpu_bound"] = fsdp_cpu_floor_s(n_micro, math.ceil(L / pp), 3 if cfg.recompute else 2, sum(t.values()), p,
                                               synced=o.pad_to > 0)
    if p.micro_batch_overhead_s or p.optimizer_step_overhead_s:  # host overheads (0 on the GPU presets)
        passes = 4 if cfg.recompute else 3  # forward, backward (2x), and the forward again when recomputing
        t["overhead"] = (n_micro * passes * p.micro_batch_overhead_s * math.ceil(L / pp) / L
                         + E * M * p.optimizer_step_overhead_s)
    # memory: activations of the largest micro-batch actually formed, not s_max for every sequence
    resident = model_state_bytes(psi, dp, cfg.zero, model.dtype_bytes)
    act_tok_layer = p.act_bytes_per_token(h, model.ffn, model.kv_dim, tp, model.dtype_bytes)
    in_flight = min(pp, m)
    layers_here = math.ceil(L / pp)
    tok = mb_worst / split
    if cfg.recompute:
        # the kept block inputs: split over TP with sequence parallelism, replicated where the
        # measured activations say the executor replicates the residual (no SP)
        kept_tp = 1 if p.act_bytes_replicated else tp
        act = in_flight * layers_here * tok * model.dtype_bytes * h / kept_tp + tok * act_tok_layer
    else:
        act = in_flight * layers_here * tok * act_tok_layer
    vocab_out = model.vocab / tp if head == "lm" else 1
    transient = {"activations": act,
                 "logits": tok * vocab_out * p.logits_bytes * p.logits_copies_train,
                 "workspace": p.workspace_gib * GiB}
    return _finish(ms, cfg, t, "training", p, resident, transient, cluster)


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


def ring_kv_exposed_s(model: ModelSpec, cfg: ParallelConfig, mb_tokens: float, n_micro: float, passes: int,
                      attn_s: float, cluster: ClusterSpec, p: CostParams) -> float:
    """Context parallelism's ring attention (Megatron ``context_parallel_size``): in every pass over
    a layer each of the cp ranks hands its key/value chunk (``2 * kv_dim / tp`` values per token of
    its ``mb_tokens / cp``) to the next rank cp - 1 times, point to point inside the cp x tp group.
    Megatron overlaps each transfer with the attention block of the chunk already there, so what
    shows is the ring time beyond the attention compute (``attn_s``, the stage's attention seconds).
    ``passes``: 1 for a forward, 3 for forward + backward (keys/values again, their gradients back),
    4 with recomputation."""
    chunk = 2 * model.kv_dim / cfg.tp * (mb_tokens / cfg.cp) * model.dtype_bytes
    per_layer = (cfg.cp - 1) * p2p_s(chunk, _group_bw(cluster, cfg.cp * cfg.tp, p), p.p2p_latency_s)
    ring = n_micro * math.ceil(model.layers / cfg.pp) * passes * per_layer
    return max(0.0, ring - attn_s)


def _a2a(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int) -> float:
    """Ulysses all-to-all of ``nbytes`` per rank over the n sequence-parallel ranks."""
    return alltoall_s(nbytes, n, _group_bw(cluster, n * stride, p), p.allreduce_latency_s)


TP_EDGE_COLLECTIVES = 2
"""Collectives of a tensor-parallel forward outside the layers, per micro-batch: the vocab-parallel
embedding's all-reduce and the vocab-parallel head's (Megatron's log-prob/cross-entropy reduces
max and sum over the vocabulary shards; Nereus's executor gathers the logits). Counted for
inference passes; a pass of many layers hardly notices them, a latency-bound one of few does."""


def _inference(cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
               p: CostParams, head: str, padded: bool = False, o: StageOptions = NO_OPTIONS) -> StageEstimate:
    tp, pp, sp, split = cfg.tp, cfg.pp, cfg.sp, cfg.seq_split
    h, L = model.hidden, model.layers
    _, s_sq = seq_moments(w)
    m, mb_tokens, mb_worst = _micro_batches(w, cfg, 1, padded, o.pad_to)
    tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq, True) if padded else (padded_tokens(w, o.pad_to), s_sq)
    attn = 2 * L * model.heads * model.head_dim * w.sequences * s_sq
    flops = 2 * model.matmul_params() * tokens
    eff = p.matmul_eff(p.mfu_prefill, 2 * mb_tokens / split * h * model.ffn / tp)
    peak = cfg.gpus * cluster.gpu.peak_flops
    attn_s = attn / (peak * p.mfu_attn)
    compute = flops / (peak * eff) + attn_s
    act_bytes = mb_tokens / split * h * 2
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m,
         "tp_comm": m * (math.ceil(L / pp) * 2 + TP_EDGE_COLLECTIVES) * ar_s(act_bytes, tp, cluster, p),
         "sp_comm": m * math.ceil(L / pp) * 4 * _a2a(act_bytes / tp, sp, cluster, p, tp),
         "pp_p2p": 0.0 if pp == 1 else m * p2p_s(act_bytes / tp, _group_bw(cluster, tp * pp, p), p.p2p_latency_s)}
    if cfg.cp > 1:
        t["cp_comm"] = ring_kv_exposed_s(model, cfg, mb_tokens, m, 1, attn_s, cluster, p)
    if head == "lm":
        t["logprob_vocab"] = logprob_vocab_s(tokens, model.vocab, cfg, cluster, p, training=False)
    psi = params_per_gpu(model, tp, pp, head)
    if cfg.zero >= 3:  # FSDP: every micro-batch's forward all-gathers the parameters again (resharded after it)
        t["fsdp_gather"] = m * ag_s(psi * 2, cfg.dp, cluster, p, tp * pp)
    if o.param_offload != "none":
        t["param_offload"] = param_offload_s(psi / cfg.dp, o.param_offload, m, p,
                                             bytes_per_param=4.0 if trainable(ms.partition("/")[0]) else model.dtype_bytes)
    if cfg.zero >= 3:
        t["fsdp_cpu_bound"] = fsdp_cpu_floor_s(m, math.ceil(L / pp), 1, sum(t.values()), p, training=False,
                                               synced=o.pad_to > 0)
    if p.infer_pass_overhead_s or p.infer_call_overhead_s:  # host overheads (0 on the GPU presets)
        t["overhead"] = m * p.infer_pass_overhead_s * math.ceil(L / pp) / L + p.infer_call_overhead_s
    resident = {"weights": model.dtype_bytes * psi}
    vocab_out = model.vocab / tp if head == "lm" else 1
    act_tok_layer = p.act_bytes_per_token(h, model.ffn, model.kv_dim, tp, model.dtype_bytes)
    tok = mb_worst / split
    transient = {"activations": tok * act_tok_layer, "logits": tok * vocab_out * p.logits_bytes,
                 "workspace": p.workspace_gib * GiB}
    return _finish(ms, cfg, t, "inference", p, resident, transient, cluster)


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


def param_offload_s(shard_params: float, mode: str, micro_batches: float, p: CostParams,
                    bytes_per_param: float = 2.0, passes_per_micro_batch: int = 1) -> float:
    """Host <-> GPU traffic of a parameter shard kept in host memory (``StageOptions.param_offload``)
    over the host link (``p.host_link_gbps``):

    - ``per_call``: verl's own offload of an actor / critic (``load_fsdp_model_to_gpu`` before the
      call, ``offload_fsdp_model_to_cpu`` after): the shard crosses twice per call;
    - ``per_micro_batch``: PyTorch FSDP ``CPUOffload(offload_params=True)`` (verl's reference model
      with ``param_offload``): the shard is copied to the GPU before every forward (and backward in
      training) of every micro-batch; the copy back is a pointer swap to the pinned host shard.

    ``bytes_per_param``: 4 for a trained model under verl's FSDP (fp32 flat parameters, bf16
    compute), the dtype's size for a frozen one."""
    nbytes = shard_params * bytes_per_param
    if mode == "per_call":
        return 2 * host_copy_s(nbytes, p)
    if mode == "per_micro_batch":
        return micro_batches * passes_per_micro_batch * host_copy_s(nbytes, p)
    return 0.0


def host_copy_s(nbytes: float, p: CostParams) -> float:
    """``nbytes`` one way over the GPU <-> host link (``p.host_link_gbps``)."""
    return nbytes / (p.host_link_gbps * 1e9)


def optimizer_offload_s(opt_share_params: float, p: CostParams) -> float:
    """Adam moments (fp32 m and v: 8 bytes per parameter of the optimizer's shard) loaded to the GPU
    before an update call and offloaded after it (verl ``optimizer_offload``)."""
    return 2 * host_copy_s(opt_share_params * 8.0, p)


def fsdp_cpu_floor_s(micro_batches: float, layers: int, passes: int, gpu_s: float, p: CostParams,
                     training: bool = True, synced: bool = False) -> float:
    """Time a stage run under PyTorch FSDP waits on the CPU beyond its GPU work. FSDP wraps every
    decoder layer as a unit whose pre-forward / pre-backward hooks (unshard, all-gather launch,
    stream waits, then the layer's eager kernel launches) run on the CPU once per pass per micro-
    batch: ``passes`` = 1 for a forward-only stage, 2 for forward + backward, 3 with activation
    recomputation. Per unit and pass the CPU spends FSDP's hooks (``p.fsdp_unit_cpu_s`` = 1 ms, as
    published for FSDP2's pre-forward on a server Xeon, pytorch/pytorch#173680) plus the layer's own
    eager dispatch (``p.layer_cpu_train_s`` averaged over a training micro-batch's passes, or
    ``p.layer_cpu_fwd_s`` for a no-grad forward, ``training=False``), both from the corpus's
    ``host`` rows. CPU and GPU overlap, so only the excess of the CPU time over the GPU time
    ``gpu_s`` is added; large micro-batches of large models hide it, small models with small
    micro-batches (RL on 0.5-1B models, a few sequences per micro-batch) are CPU-bound.
    ``synced``: every layer synchronises host and device (a padded batch in Hugging Face's flash-
    attention path, ``StageOptions.pad_to``), so the host never runs ahead: all of it is added."""
    layer = p.layer_cpu_train_s if training else p.layer_cpu_fwd_s
    cpu = micro_batches * layers * passes * (p.fsdp_unit_cpu_s + layer)
    return cpu if synced else max(0.0, cpu - gpu_s)


def engine_wake_s(weights_bytes: float, kv_bytes: float, p: CostParams) -> float:
    """A colocated engine's wake-up from a level-1 sleep (vLLM ``wake_up``, SGLang
    ``resume_memory_occupation``): its weights come back from pinned host memory over the host link,
    and its KV cache pool, released at sleep, is created and mapped again in GPU memory
    (``p.kv_remap_s_per_gib`` per GiB: 3.9 ms, vLLM 0.26 re-creating 69 GiB in 0.27 s, corpus row
    ``srtslurm-001``). The vLLM sleep-mode blog's wake-ups on A100 (corpus ``vllmsleep-*``) check it."""
    return host_copy_s(weights_bytes, p) + max(0.0, kv_bytes) / GiB * p.kv_remap_s_per_gib


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int, pp: int) -> float:
    """2 * (L/pp) * g * d * bytes / min(tp, g): KV heads replicate when tp > g."""
    return 2 * math.ceil(model.layers / pp) * model.kv_dim * model.dtype_bytes / min(tp, model.kv_heads)


def engine_memory_util(job: JobSpec, p: CostParams) -> float:
    """Fraction of usable GPU memory the rollout engine takes: the job's setting, else the profile's."""
    u = job.rollout.gpu_memory_utilization
    return p.kv_mem_util if u is None else u


def kv_budget_full(job: JobSpec, cluster: ClusterSpec, weights: float, p: CostParams) -> float:
    """KV bytes per GPU an engine gets on an otherwise empty GPU."""
    return cluster.gpu.usable_bytes * engine_memory_util(job, p) - weights - p.workspace_gib * GiB


def _generation(job: JobSpec, cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
                p: CostParams, kv_budget_bytes: float | None) -> StageEstimate:
    """Prefill, then continuous-batching decode. At most ``concurrency`` sequences run at once
    (the engine's max_num_seqs, and as many as the KV budget holds at their peak); the rest wait
    for a free slot, so the engine runs full until the queue drains. The step ends with the
    longest response (order statistics of the replica's sample, clipped at the cap)."""
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    workspace = p.workspace_gib * GiB
    if kv_budget_bytes is None:
        kv_budget_bytes = kv_budget_full(job, cluster, weights, p)
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    n = math.ceil(w.sequences / dp)
    P, cap, mean, p90 = w.prompt_len, w.response_len_max, w.response_len_mean, w.response_len_p90
    one_seq = P + cap
    if kv_budget_bytes < one_seq * kvg:
        need = weights + workspace + one_seq * kvg
        return StageEstimate(ms, cfg, math.inf, {"decode": math.inf}, 0.0, need,
                             {"weights": weights, "kv_cache": one_seq * kvg, "workspace": workspace},
                             gpu.usable_bytes, 0, (f"one {one_seq}-token sequence needs {one_seq * kvg / GiB:.2f} GiB "
                                                   f"of KV cache; {max(kv_budget_bytes, 0) / GiB:.2f} GiB left",))
    # KV a sequence holds over its life, in expectation at its worst moment: max_x P(len > x) (P + x);
    # a static batch holds every row's slot and KV until its longest ends (the cap, at worst)
    if job.rollout.engine == "static":
        per_seq_peak = P + cap
    else:
        per_seq_peak = peak_context_per_seq(n, mean, p90, cap, P, total=w.sequences)
    concurrency = max(1, min(n, job.rollout.max_num_seqs, int(kv_budget_bytes // (kvg * per_seq_peak))))
    t_prefill, acc = _decode_phase(model, tp, pp, cluster, p, job.rollout.engine, n, P, mean, p90, cap, w.sequences,
                                   concurrency, job.rollout.enforce_eager)
    t = {"prefill": t_prefill, **dict(acc)}
    if job.rollout.sleep:  # weights back from host at wake-up, out again at sleep; KV pool re-created
        # sleep: the weights out to host memory, the KV pool released without a copy
        t["engine_wake_sleep"] = engine_wake_s(weights, kv_budget_bytes, p) + host_copy_s(weights, p)
    kv_used = min(concurrency * per_seq_peak * kvg, kv_budget_bytes)
    transient = {"weights": weights, "kv_cache": kv_used, "workspace": workspace}
    waves = math.ceil(n / concurrency)
    notes = (f"at most {concurrency} of {n} sequences per replica run at once (KV budget "
             f"{kv_budget_bytes / GiB:.1f} GiB, max_num_seqs {job.rollout.max_num_seqs}); the rest wait",) \
        if waves > 1 else ()
    return _finish(ms, cfg, t, "generation", p, {}, transient, cluster, waves, notes)


@lru_cache(maxsize=8192)
def _decode_phase(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec, p: CostParams, engine: str, n: int,
                  P: int, mean: float, p90: float | None, cap: int, total: int,
                  concurrency: int, eager: bool = False) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Prefill seconds and the decode components of one replica's ``n`` sequences (of ``total``
    in the step), at most ``concurrency`` at a time, over the decode grid (points (x, sequences
    still running)). Cached: plans that differ elsewhere, or only in how much KV room they leave
    when as many sequences run at once, share it. ``eager``: no CUDA graphs, so each iteration
    lasts at least its kernel launches (``eager_launch_s``); the excess is ``eager_launch``."""
    grid = decode_grid(n, mean, p90, cap, total=total)
    static = engine == "static"
    if static:  # every row holds its slot until the longest of the batch ends
        grid = ((0.0, float(n)), (grid[-1][0], 0.0))
    t_prefill = prefill_s(model, tp, pp, P, n, min(n, concurrency), cluster, p)
    acc = {"decode_memory": 0.0, "decode_compute": 0.0, "tp_comm": 0.0, "step_overhead": 0.0}
    step_terms = decode_terms(model, tp, pp, cluster, p)
    o0, o1 = p.engine_overhead_terms(engine)
    launch = eager_launch_s(model, p) if eager else 0.0
    if eager:
        acc["eager_launch"] = 0.0

    def run(steps: float, active: float, ctx: float) -> None:
        mem, cmp_, comm = step_terms(active, ctx)
        acc["decode_memory" if mem >= cmp_ else "decode_compute"] += steps * max(mem, cmp_)
        acc["tp_comm"] += steps * comm
        acc["step_overhead"] += steps * (o0 + o1 * active)
        if launch:
            acc["eager_launch"] += steps * max(0.0, launch - max(mem, cmp_) - comm)

    if n > concurrency and static:  # sequential batches, each decoding to its longest
        run((math.ceil(n / concurrency) - 1) * grid[-1][0], concurrency, P + grid[-1][0] / 2)
    elif n > concurrency:  # queue phase: the engine stays full while waiting sequences take freed slots
        run((n - concurrency) * mean / concurrency, concurrency, P + mean)
    prev_x, prev_a = grid[0]
    for x, a in grid[1:]:
        run(x - prev_x, min(concurrency, max(prev_a, 1.0)), P + (prev_x + x) / 2)
        prev_x, prev_a = x, a
    return t_prefill, tuple(acc.items())


def prefill_s(model: ModelSpec, tp: int, pp: int, prompt_len: float, seqs: float, per_forward: float,
              cluster: ClusterSpec, p: CostParams) -> float:
    """Prefill of ``seqs`` prompts of ``prompt_len`` tokens on one replica, ``per_forward`` prompts
    per forward pass: each forward takes the longer of its compute (at the per-rank GEMM size's
    efficiency) and reading the rank's weights once (short prompts are memory-bound), plus 2 TP
    all-reduces per layer."""
    tokens = per_forward * prompt_len
    eff = p.matmul_eff(p.mfu_prefill, 2 * tokens * model.hidden * model.ffn / tp)
    flops = 2 * model.matmul_params() * prompt_len * seqs
    attn = 2 * model.layers * model.heads * model.head_dim * prompt_len ** 2 * seqs
    forwards = math.ceil(seqs / max(1.0, per_forward))
    peak = tp * pp * cluster.gpu.peak_flops
    compute = flops / (peak * eff) + attn / (peak * p.mfu_attn)
    weights = forwards * pp * model.dtype_bytes * params_per_gpu(model, tp, pp) / (p.hbm_eff * cluster.gpu.hbm_bytes_per_s)
    return max(compute, weights) + forwards * 2 * model.layers * ar_s(tokens * model.hidden * 2, tp, cluster, p)


def decode_iteration_s(model: ModelSpec, tp: int, pp: int, active: float, ctx: float, cluster: ClusterSpec,
                       p: CostParams, engine: str = "vllm", eager: bool = False) -> float:
    """Wall time of one engine iteration decoding ``active`` sequences at context ``ctx``: the
    larger of the memory- and compute-bound times, the TP collectives, the engine's overhead.
    ``eager`` (no CUDA graphs): the GPU part lasts at least the iteration's kernel launches."""
    mem, cmp_, comm = decode_step_s(model, tp, pp, active, ctx, cluster, p)
    gpu = max(mem, cmp_) + comm
    if eager:
        gpu = max(gpu, eager_launch_s(model, p))
    return gpu + p.iteration_overhead_s(engine, active)


def eager_launch_s(model: ModelSpec, p: CostParams) -> float:
    """Host time to launch one decode iteration's kernels without CUDA graphs: every decoder layer's
    (``p.eager_layer_cpu_s``). Each rank of a TP group launches its own in parallel; the pipeline
    stages of a replica together launch every layer once per iteration."""
    return model.layers * p.eager_layer_cpu_s


def decode_step_s(model: ModelSpec, tp: int, pp: int, active: float, ctx: float, cluster: ClusterSpec,
                  p: CostParams) -> tuple[float, float, float]:
    """One decode step of ``active`` sequences at mean context ``ctx`` on one replica:
    (memory-bound time, compute-bound time, communication). With pp stages the batch is split
    into pp pipelined micro-batches, so every stage reads its weights pp times per token. The
    compute-bound part uses the per-rank GEMM size (smaller under TP, so less efficient)."""
    return decode_terms(model, tp, pp, cluster, p)(active, ctx)


def decode_terms(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec,
                 p: CostParams) -> Callable[[float, float], tuple[float, float, float]]:
    """``decode_step_s`` of one replica as a function of (active, ctx), with everything that
    depends only on the model, the layout and the parameters computed once (generation calls it
    at every point of its decode grid)."""
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    hbm = p.hbm_eff * gpu.hbm_bytes_per_s
    n_mat, n_attn = 2 * model.matmul_params(), 4 * model.layers * model.heads * model.head_dim
    h, ffn, peak, shards = model.hidden, model.ffn, gpu.peak_flops, tp * pp
    intra, inter = _links(cluster, p)
    nodes = _nodes(cluster, tp, 1)
    bw_pp = _group_bw(cluster, tp * pp, p)
    n_ar = 2 * model.layers
    one_node = nodes == 1 and tp > 1
    lat = 2 * (latency_steps(tp) * p.allreduce_latency_s + latency_steps(1) * max(p.inter_latency_s, p.allreduce_latency_s))
    ring = 2 * (tp - 1) / tp

    def terms(active: float, ctx: float) -> tuple[float, float, float]:
        mem = (pp * weights + active * ctx * kvg) / hbm
        eff = p.matmul_eff(p.mfu_decode, 2 * active / pp * h * ffn / tp)
        cmp_ = active * (n_mat + n_attn * ctx) / shards / (eff * peak)
        act = active / pp * h * 2
        if tp == 1 or act <= 0:
            comm = 0.0
        elif one_node:  # allreduce_s inside one node, its terms computed once
            comm = n_ar * (lat + ring * act / intra)
        else:
            comm = n_ar * allreduce_s(act, tp, intra, p.allreduce_latency_s, nodes=nodes,
                                      alpha_inter=p.inter_latency_s, bw_inter=inter)
        if pp > 1:
            comm += pp * p2p_s(act, bw_pp, p.p2p_latency_s)
        return mem, cmp_, comm

    return terms


def weight_sync_s(model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, cluster: ClusterSpec,
                  colocated: bool, params: CostParams | None = None) -> float:
    """Per-step actor weight sync from the training layout to the generation layout: every
    generation GPU receives its 2N/(tp*pp) bytes; every training GPU sends its share of the
    dp_gen copies. Intra-node bandwidth when the pools are colocated, scale-out otherwise."""
    p = params or CostParams()
    intra, inter = _links(cluster, p)
    bw = intra if colocated and gen.tp * gen.pp <= cluster.gpus_per_node else inter
    full = model.dtype_bytes * model.num_params()
    recv = full / (gen.tp * gen.pp)
    send = full * gen.dp / train.gpus
    return p.p2p_latency_s * gen.tp * gen.pp + max(recv, send) / bw


def offload_s(nbytes: float, params: CostParams | None = None) -> float:
    """Moving a resident state to host memory and back once per step."""
    return 2 * host_copy_s(nbytes, params or CostParams())


def trainable(role: str) -> bool:
    return role in TRAINABLE
