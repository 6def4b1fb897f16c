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
from dataclasses import dataclass, field
from typing import Mapping

from nereus.errors import SpecError
from nereus.models.inventory import check_tp
from nereus.models.spec import ModelSpec
from nereus.planner.cost.params import CostParams, allreduce_s, p2p_s
from nereus.planner.cost.lengths import response_quantiles
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
             kv_budget_bytes: float | None = None) -> StageEstimate:
    """Time and memory of ``model_stage`` under ``cfg``. ``kv_budget_bytes`` caps the KV cache of
    generation per GPU (default: what the inference engine may take of an otherwise empty GPU)."""
    model = validate_config(job, cluster, model_stage, cfg)
    w = workload or job.workload()
    p = params or CostParams()
    role, _, stage = model_stage.partition("/")
    head = "value" if role in ("critic", "reward") else "lm"
    if stage == "training":
        return _training(job, cluster, model_stage, model, cfg, w, p, head)
    if stage == "inference":
        return _inference(cluster, model_stage, model, cfg, w, p, head)
    return _generation(cluster, model_stage, model, cfg, w, p, kv_budget_bytes)


def _finish(ms: str, cfg: ParallelConfig, t: dict[str, float], stage: str, p: CostParams,
            resident: dict[str, float], transient: dict[str, float], cluster: ClusterSpec,
            waves: int = 1, notes: tuple[str, ...] = ()) -> StageEstimate:
    f = p.factor(stage)
    t = {k: v * f for k, v in t.items()}
    return StageEstimate(ms, cfg, sum(t.values()), t, sum(resident.values()), sum(transient.values()),
                         {**resident, **transient}, cluster.gpu.usable_bytes, waves, notes)


def _training(job: JobSpec, cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig,
              w: Workload, p: CostParams, head: str) -> StageEstimate:
    tp, pp, dp, b = cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch
    E, M = job.batch.ppo_epochs, job.batch.mini_batches
    h, L = model.hidden, model.layers
    s_mean = w.prompt_len + w.response_len_mean
    s_max = w.seq_len_max
    gpu = cluster.gpu
    # compute
    n_factor = 8 if cfg.recompute else 6
    attn = 6 * L * model.heads * model.head_dim * s_mean * (4 / 3 if cfg.recompute else 1)
    flops = (n_factor * model.matmul_params() + attn) * w.tokens * E
    m = max(1, math.ceil(w.sequences / (M * dp * b)))  # micro-batches per DP rank per mini-batch
    eff = p.matmul_eff(p.mfu_train, 2 * b * s_mean * h * model.ffn / tp)
    compute = flops / (cfg.gpus * gpu.peak_flops * eff)
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m}
    # communication
    n_micro = E * M * m
    n_ar = 6 if cfg.recompute else 4
    t["tp_comm"] = n_micro * math.ceil(L / pp) * n_ar * allreduce_s(
        b * s_mean * h * 2, tp, _group_bw(cluster, tp, p), p.allreduce_latency_s)
    t["pp_p2p"] = 0.0 if pp == 1 else n_micro * 2 * p2p_s(
        b * s_mean * h * 2 / tp, _group_bw(cluster, tp * pp, p), p.p2p_latency_s)
    psi = params_per_gpu(model, tp, pp, head)
    grad_bytes = psi * 2 * (1.5 if cfg.zero >= 3 else 1.0)
    t["dp_allreduce"] = E * M * allreduce_s(grad_bytes, dp, _group_bw(cluster, cfg.gpus, p), p.allreduce_latency_s)
    # memory
    resident = model_state_bytes(psi, dp, cfg.zero, model.dtype_bytes)
    act_tok_layer = p.act_bytes_per_token(h, model.ffn, model.kv_dim, tp, model.dtype_bytes)
    in_flight = min(pp, m)
    layers_here = math.ceil(L / pp)
    if cfg.recompute:
        act = in_flight * layers_here * b * s_max * 2 * h / tp + b * s_max * act_tok_layer
    else:
        act = in_flight * layers_here * b * s_max * act_tok_layer
    vocab_out = model.vocab / tp if head == "lm" else 1
    transient = {"activations": act,
                 "logits": b * s_max * vocab_out * p.logits_bytes * p.logits_copies_train,
                 "workspace": p.workspace_gib * GiB}
    return _finish(ms, cfg, t, "training", p, resident, transient, cluster)


def _inference(cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
               p: CostParams, head: str) -> StageEstimate:
    tp, pp, dp, b = cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch
    h, L = model.hidden, model.layers
    s_mean, s_max = w.prompt_len + w.response_len_mean, w.seq_len_max
    attn = 2 * L * model.heads * model.head_dim * s_mean
    flops = (2 * model.matmul_params() + attn) * w.tokens
    m = max(1, math.ceil(w.sequences / (dp * b)))
    eff = p.matmul_eff(p.mfu_prefill, 2 * b * s_mean * h * model.ffn / tp)
    compute = flops / (cfg.gpus * cluster.gpu.peak_flops * eff)
    t = {"compute": compute, "pp_bubble": compute * (pp - 1) / m,
         "tp_comm": m * math.ceil(L / pp) * 2 * allreduce_s(b * s_mean * h * 2, tp, _group_bw(cluster, tp, p),
                                                            p.allreduce_latency_s),
         "pp_p2p": 0.0 if pp == 1 else m * p2p_s(b * s_mean * h * 2 / tp, _group_bw(cluster, tp * pp, p),
                                                  p.p2p_latency_s)}
    resident = {"weights": model.dtype_bytes * params_per_gpu(model, tp, pp, head)}
    vocab_out = model.vocab / tp if head == "lm" else 1
    act_tok_layer = p.act_bytes_per_token(h, model.ffn, model.kv_dim, tp, model.dtype_bytes)
    transient = {"activations": b * s_max * act_tok_layer, "logits": b * s_max * vocab_out * p.logits_bytes,
                 "workspace": p.workspace_gib * GiB}
    return _finish(ms, cfg, t, "inference", p, resident, transient, cluster)


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int, pp: int) -> float:
    """2 * (L/pp) * g * d * bytes / min(tp, g): KV heads replicate when tp > g."""
    return 2 * math.ceil(model.layers / pp) * model.kv_dim * model.dtype_bytes / min(tp, model.kv_heads)


def _generation(cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
                p: CostParams, kv_budget_bytes: float | None) -> StageEstimate:
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    workspace = p.workspace_gib * GiB
    if kv_budget_bytes is None:
        kv_budget_bytes = gpu.usable_bytes * p.kv_mem_util - weights - workspace
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    lengths = response_quantiles(w.response_len_mean, w.response_len_p90, w.response_len_max)
    k = len(lengths)
    seqs = math.ceil(w.sequences / dp)
    P = w.prompt_len
    # Peak KV tokens if every sequence of this replica ran at once: max over decode positions x of
    # (sequences still running at x) * (prompt + x); running at x means length > x.
    peak_tokens = max((seqs * (k - i) / k) * (P + lengths[i]) for i in range(k))
    one_seq = P + w.response_len_max
    if kv_budget_bytes < one_seq * kvg:
        need = weights + workspace + one_seq * kvg
        return StageEstimate(ms, cfg, math.inf, {"decode": math.inf}, 0.0, need,
                             {"weights": weights, "kv_cache": one_seq * kvg, "workspace": workspace},
                             gpu.usable_bytes, 0, (f"one {one_seq}-token sequence needs {one_seq * kvg / GiB:.2f} GiB "
                                                   f"of KV cache; {max(kv_budget_bytes, 0) / GiB:.2f} GiB left",))
    waves = max(1, math.ceil(peak_tokens * kvg / kv_budget_bytes))
    per_wave = seqs / waves
    # prefill (compute-bound)
    pre_flops = (2 * model.matmul_params() + 2 * model.layers * model.heads * model.head_dim * P) * P * seqs
    t_prefill = pre_flops / (tp * pp * gpu.peak_flops * p.mfu_prefill)
    # decode: sum over length buckets of steps * t_step(active sequences, mean context)
    t_mem = t_cmp = t_comm = t_over = 0.0
    prev = 0.0
    for i, length in enumerate(lengths):
        steps = length - prev
        if steps <= 0:
            continue
        mem, cmp_, comm = decode_step_s(model, tp, pp, per_wave * (k - i) / k, P + (prev + length) / 2, cluster, p)
        if mem >= cmp_:
            t_mem += steps * mem
        else:
            t_cmp += steps * cmp_
        t_comm += steps * comm
        t_over += steps * p.decode_step_overhead_s
        prev = length
    t = {"prefill": t_prefill, "decode_memory": waves * t_mem, "decode_compute": waves * t_cmp,
         "tp_comm": waves * t_comm, "step_overhead": waves * t_over}
    kv_used = min(peak_tokens * kvg, kv_budget_bytes)
    transient = {"weights": weights, "kv_cache": kv_used, "workspace": workspace}
    notes = (f"{waves} waves: peak KV demand {peak_tokens * kvg / GiB:.1f} GiB > budget {kv_budget_bytes / GiB:.1f} GiB",) \
        if waves > 1 else ()
    return _finish(ms, cfg, t, "generation", p, {}, transient, cluster, waves, notes)


def decode_step_s(model: ModelSpec, tp: int, pp: int, active: float, ctx: float, cluster: ClusterSpec,
                  p: CostParams) -> tuple[float, float, float]:
    """One decode step of ``active`` sequences at mean context ``ctx`` on one replica:
    (memory-bound time, compute-bound time, communication). With pp stages the batch is split
    into pp pipelined micro-batches, so every stage reads its weights pp times per token."""
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    mem = (pp * weights + active * ctx * kvg) / (p.hbm_eff * gpu.hbm_bytes_per_s)
    flops = active * (2 * model.matmul_params() + 4 * model.layers * model.heads * model.head_dim * ctx)
    cmp_ = flops / (tp * pp) / (p.mfu_decode * gpu.peak_flops)
    comm = 2 * model.layers * allreduce_s(active / pp * model.hidden * 2, tp, _group_bw(cluster, tp, p),
                                          p.allreduce_latency_s)
    if pp > 1:
        comm += pp * p2p_s(active / pp * model.hidden * 2, _group_bw(cluster, tp * pp, p), p.p2p_latency_s)
    return mem, cmp_, comm


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
    p = params or CostParams()
    return 2 * nbytes / (p.host_link_gbps * 1e9)


def trainable(role: str) -> bool:
    return role in TRAINABLE
