"""Sizes per GPU: parameters held by the most loaded pipeline stage, model states by precision and
ZeRO stage, KV bytes per token, and the KV budget a rollout engine gets."""
from __future__ import annotations

import math

from nereus.models.spec import ModelSpec, derived
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import ClusterSpec, JobSpec

GiB = 1024**3


# ---- sizes -------------------------------------------------------------------------------------
def params_per_gpu(model: ModelSpec, tp: int, pp: int, head: str = "lm", expert_shards: int | None = None) -> float:
    """Parameters held by one GPU of the most loaded pipeline stage (KV projections replicate
    when tp exceeds kv_heads; the embedding sits on the first stage, the LM head on the last).
    A mixture-of-experts (or latent-attention) model is counted block by block, every expert
    included, its routed experts spread over ``expert_shards`` ranks (default tp: a rollout
    engine's layout; training passes ep * etp): ``moe.stage_params``. Remembered per model (the
    option tables ask it thousands of times)."""
    return derived(model, ("params_per_gpu", tp, pp, head, expert_shards),
                   lambda: _params_per_gpu(model, tp, pp, head, expert_shards))


def _params_per_gpu(model: ModelSpec, tp: int, pp: int, head: str, expert_shards: int | None) -> float:
    if model.is_moe or model.is_mla:
        from nereus.planner.cost.moe import stage_params

        return sum(stage_params(model, tp, pp, tp if expert_shards is None else expert_shards, head))
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


MAIN_GRAD_BYTES = 4
"""Bytes per gradient element a Megatron-style layout (ZeRO 0-2) keeps: fp32 main gradients
(``--accumulate-allreduce-grads-in-fp32``, on for bf16), not bf16 ones. Megatron's own account: 2
bytes of bf16 parameters, 4 of fp32 main parameters, 4 of gradients, 8 of Adam states, 18 per
parameter before the distributed optimizer shards the 12 (NVIDIA/Megatron-LM#654;
``megatron/training/theoretical_memory_usage.py``). The corpus's held-out Megatron rows
(``memory.csv``, ``memmegtool``) are predicted with it."""


def model_state_bytes(psi: float, dp: int, zero: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Mixed-precision Adam as the frameworks keep it, sharded along DP by the ZeRO stage
    (Rajbhandari et al. 2019). ZeRO 0-2 (Megatron): bf16 weights (2), fp32 main gradients
    (``MAIN_GRAD_BYTES``, sharded from ZeRO-2), fp32 master, m, v (12, sharded from ZeRO-1).
    ZeRO-3 / FSDP (verl's FSDP workers, torchtitan's FSDP2 with bf16 compute): fp32 sharded
    parameters, fp32 gradients and the two Adam moments, 16 bytes / dp in all, written here as
    2 + 2 + 12 (the optimizer share is what optimizer offload moves). In fp32 (dtype_bytes 4, no
    master copy): 4 + 4 + 8."""
    if dtype_bytes == 4:
        w, g, o = 4 * psi, 4 * psi, 8 * psi
    elif zero >= 3:
        w, g, o = 2 * psi, 2 * psi, 12 * psi
    else:
        w, g, o = 2 * psi, MAIN_GRAD_BYTES * psi, 12 * psi
    if zero >= 1:
        o /= dp
    if zero >= 2:
        g /= dp
    if zero >= 3:
        w /= dp
    return {"weights": w, "grads": g, "optimizer": o}


def kv_bytes_per_token_per_gpu(model: ModelSpec, tp: int, pp: int) -> float:
    """2 * (L/pp) * g * d * bytes / min(tp, g): KV heads replicate when tp > g. Multi-head latent
    attention caches (L/pp) * (kv_lora_rank + qk_rope_head_dim) * bytes, the same on every TP rank
    (``ModelSpec.kv_bytes_per_token``)."""
    if model.is_mla:
        return math.ceil(model.layers / pp) * model.kv_latent_dim * model.dtype_bytes
    return 2 * math.ceil(model.layers / pp) * model.kv_dim * model.dtype_bytes / min(tp, model.kv_heads)


def engine_memory_util(job: JobSpec, p: CostParams) -> float:
    """Fraction of usable GPU memory the rollout engine takes: the job's setting, else the profile's."""
    u = job.rollout.gpu_memory_utilization
    return p.kv_mem_util if u is None else u


def kv_budget_full(job: JobSpec, cluster: ClusterSpec, weights: float, p: CostParams) -> float:
    """KV bytes per GPU an engine gets on an otherwise empty GPU."""
    return cluster.gpu.usable_bytes * engine_memory_util(job, p) - weights - p.workspace_gib * GiB


def split_model_state_bytes(dense: float, expert: float, dp: int, expert_dp: int, zero: int,
                            dtype_bytes: int = 2) -> dict[str, float]:
    """Model states of a trainable MoE model: the dense share sharded over ``dp``, the experts' over
    the expert-data-parallel group (``moe.expert_dp``), each by the ZeRO stage (``model_state_bytes``)."""
    a = model_state_bytes(dense, dp, zero, dtype_bytes)
    b = model_state_bytes(expert, expert_dp, zero, dtype_bytes)
    return {k: a[k] + b[k] for k in a}
