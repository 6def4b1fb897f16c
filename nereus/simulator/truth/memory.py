"""The ground truth's memory model: what one GPU holds, counted from the model shapes.

Its own accounting (not the planner's), with the conventions of the frameworks it imitates:

- trainable models, ZeRO-3 / FSDP (verl's default): fp32 parameters, fp32 gradients and two fp32
  Adam moments, all sharded over DP: 16 bytes per parameter / dp, plus two gathered bf16 layers
  (prefetch) while computing;
- trainable models, ZeRO 0-2 (Megatron-style): bf16 parameters (2), fp32 main gradients (4, sharded
  from ZeRO-2), fp32 master copy and Adam moments (12, sharded from ZeRO-1);
- frozen models (reference, reward): bf16 weights, sharded over DP under ZeRO-3;
- activations of a Llama/Qwen block kept for backward (FlashAttention, no sequence parallelism):
  the residual stream and both norm inputs/outputs are replicated across TP (8h bytes per token),
  Q, K, V, the attention output and the four SwiGLU tensors are split (4q + 4kv + 8f bytes / tp);
  full recomputation keeps only each layer's input (2h) plus one layer being recomputed;
- logits: bf16 logits, their fp32 copy and (training) fp32 gradient: 10 bytes per vocabulary
  entry per token / tp in training, 6 in a log-prob pass;
- a fixed ``CONTEXT_GIB`` per GPU (CUDA context, NCCL buffers) and ``FRAGMENTATION`` on every
  transient allocation (the caching allocator's slack).
"""
from __future__ import annotations

import math

from nereus.models.spec import ModelSpec

GiB = 1024**3
CONTEXT_GIB = 2.5
FRAGMENTATION = 1.10
ENGINE_MEMORY_UTILIZATION = 0.9
"""vLLM's gpu_memory_utilization default: the engine may take this fraction of the GPU (a job's
``rollout.gpu_memory_utilization`` replaces it)."""
MAX_BATCHED_TOKENS = 8192
"""verl's rollout default (``max_num_batched_tokens``): tokens per prefill chunk."""
KV_BLOCK = 16
"""vLLM's KV block size in tokens."""


def layer_params_per_gpu(m: ModelSpec, tp: int) -> float:
    kv_split = min(tp, m.kv_heads)
    n = 2 * m.hidden * m.q_dim / tp + 2 * m.hidden * m.kv_dim / kv_split + 3 * m.hidden * m.ffn / tp + 2 * m.hidden
    if m.qkv_bias:
        n += m.q_dim / tp + 2 * m.kv_dim / kv_split
    if m.qk_norm:
        n += 2 * m.head_dim
    return n


def params_per_gpu(m: ModelSpec, tp: int, pp: int, value_head: bool = False) -> float:
    """Parameters on one GPU of the most loaded pipeline stage (embedding on the first stage,
    LM head or value head on the last)."""
    layers = math.ceil(m.layers / pp) * layer_params_per_gpu(m, tp)
    embed = m.vocab * m.hidden / tp
    head = m.hidden if value_head else (0 if m.tie_embeddings else embed)
    return layers + (embed + head if pp == 1 else max(embed, head))


def state_bytes(psi: float, dp: int, zero: int, trainable: bool) -> float:
    """Bytes per GPU of a model's persistent state in this layout (see module docstring)."""
    if not trainable:
        return 2 * psi / (dp if zero >= 3 else 1)
    if zero >= 3:
        return 16 * psi / dp
    grads = 4 * psi / (dp if zero >= 2 else 1)
    return 2 * psi + grads + 12 * psi / (dp if zero >= 1 else 1)


def act_bytes_per_token_layer(m: ModelSpec, tp: int) -> float:
    return 8 * m.hidden + (4 * m.q_dim + 4 * m.kv_dim + 8 * m.ffn) / tp


def kv_bytes_per_token(m: ModelSpec, tp: int, pp: int) -> float:
    """KV cache bytes per token on one GPU (bf16; KV heads replicate when tp > kv_heads)."""
    return 2 * math.ceil(m.layers / pp) * m.kv_dim * m.dtype_bytes / min(tp, m.kv_heads)


def capacity_bytes(memory_gib: float) -> float:
    return (memory_gib - CONTEXT_GIB) * GiB


def engine_fixed_bytes(m: ModelSpec, tp: int, pp: int, max_seqs: int) -> float:
    """A generation engine's non-KV memory per GPU: bf16 weights, the activation peak of a prefill
    chunk of MAX_BATCHED_TOKENS, the sampler's fp32 logits of ``max_seqs`` rows, CUDA graphs."""
    weights = 2 * params_per_gpu(m, tp, pp)
    act = MAX_BATCHED_TOKENS * (4 * m.hidden + 6 * m.ffn / tp) * 2
    sampler = max_seqs * m.vocab / tp * 4
    return weights + act + sampler + 0.5 * GiB


def kv_budget_tokens(m: ModelSpec, tp: int, pp: int, memory_gib: float, resident_bytes: float, *,
                     util: float = ENGINE_MEMORY_UTILIZATION, max_seqs: int = 256) -> float:
    """KV-cache tokens an engine replica can hold: ``util`` of the GPU, minus the context, the states
    resident on the pool while it generates, and the engine's fixed memory."""
    free = util * memory_gib * GiB - CONTEXT_GIB * GiB - resident_bytes - engine_fixed_bytes(m, tp, pp, max_seqs)
    tokens = max(0.0, free) / kv_bytes_per_token(m, tp, pp)
    return math.floor(tokens / KV_BLOCK) * KV_BLOCK
