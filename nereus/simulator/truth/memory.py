"""The ground truth's memory model: what one GPU holds, counted from the model shapes.

Its own accounting (not the planner's: nothing here imports ``nereus.planner.cost``), with the
conventions that published measurements support (issue 32 item 2: the truth's independence is in its
code, not in ignoring a published fact). Each convention names its source: row ids of
``nereus/calibration/published/memory.csv`` or the report they come from; ``docs/fidelity.md``
("Peak memory against published measurements") has the corpus, and
``tests/unit/test_truth_memory.py`` ties each constant to its source value.

- **What is counted: allocated memory.** A step's peak is what ``torch.cuda.max_memory_allocated``
  reports (model states + the live transients of its worst micro-batch), and a step runs out of
  memory when that exceeds what the GPU holds after its non-torch memory. No allocator slack
  (``FRAGMENTATION`` 1.0): Megatron's allocated peaks (``memmegtool-001..004``) need none, and
  torchtitan's reserved peaks (``memtitan-*``, 1.84x allocated in the planner's fit) are the caching
  allocator growing towards the GPU's capacity (83.9-84.5 GiB of 95 for sequences of 32k-262k,
  ``memtitan-004..007``): cache that PyTorch frees and retries before it raises an out-of-memory error.
- **Trainable models, ZeRO-3 / FSDP** (verl's default): fp32 parameters, fp32 gradients and two fp32
  Adam moments, all sharded over DP: 16 bytes per parameter / dp (torchtitan FSDP2's mixed
  precision, ``memtitan-*`` notes), plus two gathered bf16 layers (prefetch) while computing.
- **Trainable models, ZeRO 0-2** (Megatron-style): bf16 parameters (2), fp32 main gradients (4,
  sharded from ZeRO-2), fp32 master copy and Adam moments (12, sharded from ZeRO-1): Megatron's own
  account (NVIDIA/Megatron-LM#654, 18 bytes per parameter before the distributed optimizer), and
  what its measured allocated peaks show (``memmegtool-001..004``; with bf16 gradients they would be
  6-9 GiB lower).
- **Frozen models** (reference, reward): bf16 weights, sharded over DP under ZeRO-3.
- **Activations** of a Llama/Qwen block kept for backward (FlashAttention, no sequence parallelism):
  the residual stream and both norm inputs/outputs are replicated across TP (8h bytes per token),
  Q, K, V, the attention output and the four SwiGLU tensors are split (4q + 4kv + 8f bytes / tp);
  full recomputation keeps only each layer's input (2h) plus one layer being recomputed. (The
  truth's own count; it comes out at 0.91-0.97 of Megatron's measured allocated peaks, the residual
  reported, not fitted away.)
- **Logits**: ``LOGITS_BYTES_TRAIN`` = 6.5 bytes per vocabulary entry per token / tp in training:
  1.62 fp32 copies, the figure the fit split's torchtitan full-recompute rows give (``memtitan-004..007,
  011-018``; docs/fidelity.md), between the tensor counts 6 (bf16 logits + an fp32 gradient, the fp32
  upcast freed by a fused loss) and 10 (all three alive at once, this module's figure before); a
  log-prob pass keeps bf16 logits and an fp32 log-softmax, ``LOGITS_BYTES_INFER`` = 6 (no
  measurement).
- **Non-torch memory** (outside torch's counters: CUDA context, cuBLAS workspaces, NCCL buffers),
  TP-dependent, not a flat figure: 1.79 GiB on a GPU with no collective group (vLLM 0.6.5's whole
  non-torch figure at TP 1, context included, ``memvllm10511-002``) plus about 1.8 GiB of NCCL
  buffers once the GPU is in a collective group (vLLM TP 1 -> 2: 1.79 -> 3.58 GiB,
  ``memvllm10511-004``; llm-d's vLLM 0.19 sweep, non-torch increase TP 1 -> 2/4: 0.25 -> 2.07/2.13
  GiB for Llama-3.1-8B, 0.24 -> 2.06/2.13 for Qwen2.5-7B, ``memllmd`` source, accuracy report's TP
  table). A trainer's GPU always is (DP gradient sync or FSDP gathers): ``capacity_bytes``.
- **Total memory**: what the driver reports, not the catalog size: 79.19 GiB of an "80 GB" H100
  (``memllmd-*`` total_gib; 79.22 in ``memvllm10511-*``), the same fraction taken of every GPU's
  catalog size (only the H100 is measured).
- **Engine KV pool** (vLLM V1, as verl runs it): ``util`` x the TOTAL memory, minus the weights, the
  activation peak of a profile run and the non-torch memory vLLM measures (its increase over the
  engine's start: 0.25 GiB at TP 1, ~2.1 GiB at TP >= 2, 0.07 GiB with PP >= 2 at TP 1; llm-d
  accuracy report, TP and PP tables), and minus the states resident on the pool while it generates.
  CUDA graphs are captured after the pool is sized and come out of the rest, not the pool (llm-d
  report, "CUDA Graph Memory"). Checked against ``memllmd-012`` / ``memllmd-013`` (58.11 / 58.53 GiB).
"""
from __future__ import annotations

import math

from nereus.models.spec import ModelSpec

GiB = 1024**3
FRAGMENTATION = 1.0
"""Allocator slack on transients: none. The truth counts allocated memory (see the module docstring:
Megatron's allocated peaks ``memmegtool-001..004`` need none; torchtitan's reserved peaks are
capacity-bound cache). Was 1.10, an assumption."""
LOGITS_BYTES_TRAIN = 6.5
"""Bytes per vocabulary entry per token (/ tp) of a training micro-batch's logits: 1.62 fp32 copies
(1.62 x 4 = 6.48), fitted on the fit split's torchtitan rows (docs/fidelity.md, memory section).
Was 10 (bf16 logits + fp32 copy + fp32 gradient, all alive)."""
LOGITS_BYTES_INFER = 6.0
"""The same in a log-prob pass: bf16 logits + an fp32 log-softmax (a tensor count; no measurement)."""
NON_TORCH_BASE_GIB = 1.79
"""Non-torch memory of a GPU with no collective group, CUDA context included: vLLM 0.6.5's
``non_torch`` at TP 1 (``memvllm10511-002``: 'non_torch 1.79 GiB'). Was part of a flat 2.5 GiB."""
NCCL_GROUP_GIB = 1.8
"""Non-torch memory a collective group adds (NCCL buffers): vLLM TP 1 -> 2 adds 1.79 GiB
(``memvllm10511-004``: non_torch 3.58 GiB); llm-d's vLLM 0.19 sweep +1.82 / +1.88 GiB at TP 2 / 4
(Llama-3.1-8B 0.25 -> 2.07 / 2.13; Qwen2.5-7B 0.24 -> 2.06 / 2.13)."""
ENGINE_NON_TORCH_GIB = {"tp1": 0.25, "tp2+": 2.1, "pp2+": 0.07}
"""The non-torch memory vLLM V1 subtracts from its budget (its increase over the engine's start,
the CUDA context before it excluded): llm-d accuracy report, vLLM 0.19, H100: TP 1 0.25 GiB
(Llama-3.1-8B; Qwen2.5-7B 0.24), TP 2-4 2.06-2.13 GiB (mean 2.08-2.17), PP 2-4 at TP 1 0.07 GiB."""
PHYSICAL_FRACTION = 79.19 / 80
"""Memory the driver reports over the catalog size: 79.19 GiB of an H100-80GB (``memllmd-*``
total_gib; ``memvllm10511-*`` 79.22). Only the H100 is measured; applied to every GPU."""
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


FSDP_STATE_BYTES = 16
"""ZeRO-3 / FSDP bytes per parameter, all sharded: fp32 parameters, gradients, Adam m and v."""
MAIN_GRAD_BYTES = 4
"""ZeRO 0-2 (Megatron) gradient bytes per parameter: fp32 main gradients (NVIDIA/Megatron-LM#654;
``memmegtool-001..004``)."""
OPTIMIZER_BYTES = 12
"""fp32 master parameters + Adam m and v, sharded from ZeRO-1 (Megatron's distributed optimizer)."""


def state_bytes(psi: float, dp: int, zero: int, trainable: bool) -> float:
    """Bytes per GPU of a model's persistent state in this layout (see module docstring)."""
    if not trainable:
        return 2 * psi / (dp if zero >= 3 else 1)
    if zero >= 3:
        return FSDP_STATE_BYTES * psi / dp
    grads = MAIN_GRAD_BYTES * psi / (dp if zero >= 2 else 1)
    return 2 * psi + grads + OPTIMIZER_BYTES * psi / (dp if zero >= 1 else 1)


HOST_D2H_GBPS = 3.22
HOST_H2D_GBPS = 7.55
"""Host copy rates per GPU, every GPU of a node copying at once, of a ZeRO-3 engine's states moved to
pinned host memory and back (``offload_states`` / ``offload_states_back``, non-blocking):
DeepSpeedExamples ``training/offload_states`` README, 4 x A100, a 4.29B-parameter model (4 layers
of hidden 32,768): 18.18 GB per GPU offloaded in 5.64 s (3.22 GB/s) and loaded back in 2.41 s
(7.55 GB/s). Only that A100 host is measured; applied to every GPU."""


def offloaded_bytes(psi: float, dp: int, zero: int) -> float:
    """Bytes per GPU of a trained model's optimizer state kept in host memory between optimizer steps
    (verl ``optimizer_offload``; OpenRLHF ``--adam_offload``): Adam m and v (8 B/param) of an FSDP /
    ZeRO-3 shard, the fp32 master parameters with them (``OPTIMIZER_BYTES``) under ZeRO 0-2."""
    if zero >= 3:
        return 8 * psi / dp
    return OPTIMIZER_BYTES * psi / (dp if zero >= 1 else 1)


def offload_copy_s(nbytes: float) -> float:
    """Seconds per step to load an offloaded state before the optimizer step and offload it after."""
    return nbytes / (HOST_H2D_GBPS * 1e9) + nbytes / (HOST_D2H_GBPS * 1e9)


def act_bytes_per_token_layer(m: ModelSpec, tp: int) -> float:
    return 8 * m.hidden + (4 * m.q_dim + 4 * m.kv_dim + 8 * m.ffn) / tp


def kv_bytes_per_token(m: ModelSpec, tp: int, pp: int) -> float:
    """KV cache bytes per token on one GPU (bf16; KV heads replicate when tp > kv_heads)."""
    return 2 * math.ceil(m.layers / pp) * m.kv_dim * m.dtype_bytes / min(tp, m.kv_heads)


def total_bytes(memory_gib: float) -> float:
    """The GPU's memory as the driver reports it (``PHYSICAL_FRACTION`` of the catalog size)."""
    return PHYSICAL_FRACTION * memory_gib * GiB


def non_torch_bytes(collective: bool = True) -> float:
    """Memory outside torch's counters on a GPU: CUDA context etc., plus NCCL buffers when the GPU is
    in a collective group (``collective``)."""
    return (NON_TORCH_BASE_GIB + (NCCL_GROUP_GIB if collective else 0.0)) * GiB


def capacity_bytes(memory_gib: float, collective: bool = True) -> float:
    """What torch may allocate on one GPU: its total memory minus the non-torch memory. An allocated
    peak above it is an out-of-memory error. A trainer's GPU is always in a collective group (DP
    gradient sync, FSDP gathers, the weight sync to the engine): ``collective`` defaults to True."""
    return total_bytes(memory_gib) - non_torch_bytes(collective)


def engine_non_torch_bytes(tp: int, pp: int = 1) -> float:
    """The non-torch memory vLLM subtracts from an engine's budget (``ENGINE_NON_TORCH_GIB``)."""
    if tp >= 2:
        return ENGINE_NON_TORCH_GIB["tp2+"] * GiB
    return ENGINE_NON_TORCH_GIB["pp2+" if pp >= 2 else "tp1"] * GiB


def engine_activation_bytes(m: ModelSpec, tp: int, max_seqs: int) -> float:
    """The activation peak of vLLM's profile run per GPU (the truth's own count): a prefill chunk of
    MAX_BATCHED_TOKENS (residual + norm, 4h, and the SwiGLU tensors, 6f / tp, in bf16) and the
    sampler's fp32 logits of ``max_seqs`` rows. Llama-3.1-8B at TP 1: 1.68 GiB (measured 1.89, llm-d)."""
    act = MAX_BATCHED_TOKENS * (4 * m.hidden + 6 * m.ffn / tp) * 2
    sampler = max_seqs * m.vocab / tp * 4
    return act + sampler


def engine_fixed_bytes(m: ModelSpec, tp: int, pp: int, max_seqs: int) -> float:
    """A generation engine's non-KV memory inside its budget, per GPU: bf16 weights, the activation
    peak, the non-torch memory vLLM measures. (CUDA graphs come after the pool is sized, outside it.)"""
    return 2 * params_per_gpu(m, tp, pp) + engine_activation_bytes(m, tp, max_seqs) + engine_non_torch_bytes(tp, pp)


def kv_pool_bytes(m: ModelSpec, tp: int, pp: int, memory_gib: float, resident_bytes: float = 0.0, *,
                  util: float = ENGINE_MEMORY_UTILIZATION, max_seqs: int = 256) -> float:
    """KV-cache bytes per GPU of an engine: ``util`` x the GPU's total memory, minus its fixed memory
    and the states resident on the pool while it generates (vLLM V1's profile, module docstring)."""
    return max(0.0, util * total_bytes(memory_gib) - engine_fixed_bytes(m, tp, pp, max_seqs) - resident_bytes)


def kv_budget_tokens(m: ModelSpec, tp: int, pp: int, memory_gib: float, resident_bytes: float, *,
                     util: float = ENGINE_MEMORY_UTILIZATION, max_seqs: int = 256) -> float:
    """KV-cache tokens an engine replica can hold (``kv_pool_bytes`` in whole KV blocks)."""
    tokens = kv_pool_bytes(m, tp, pp, memory_gib, resident_bytes, util=util, max_seqs=max_seqs) / kv_bytes_per_token(m, tp, pp)
    return math.floor(tokens / KV_BLOCK) * KV_BLOCK
