"""Collectives and point-to-point transfers of a model-stage: all-reduce and all-gather over TP/DP
groups (hierarchical across nodes), Ulysses all-to-all, context parallelism's ring, and the
actor's per-step weight sync. The alpha-beta primitives themselves are in ``params``."""
from __future__ import annotations

import math
from functools import lru_cache

from nereus.models.spec import ModelSpec
from nereus.planner.cost.params import CostParams, allgather_s, allreduce_s, alltoall_s, p2p_s
from nereus.planner.specs import ClusterSpec, ParallelConfig


def links(cluster: ClusterSpec, p: CostParams) -> tuple[float, float]:
    g = cluster.gpu
    return g.intra_node_gbps * 1e9 * p.intra_link_eff, g.inter_node_gbps * 1e9 * p.inter_link_eff


def group_bw(cluster: ClusterSpec, span_gpus: int, p: CostParams) -> float:
    """Bandwidth of a group whose members lie within ``span_gpus`` consecutive GPUs."""
    intra, inter = links(cluster, p)
    return intra if span_gpus <= cluster.gpus_per_node else inter


def nodes_spanned(cluster: ClusterSpec, n: int, stride: int) -> int:
    """Nodes a group of n ranks spaced ``stride`` GPUs apart spans."""
    return max(1, -(-(n * stride) // cluster.gpus_per_node))


def ar_s(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int = 1) -> float:
    """All-reduce over a group of n ranks spaced ``stride`` GPUs apart (TP: 1; DP: tp * pp),
    hierarchical when the group spans nodes (``allreduce_s``)."""
    intra, inter = links(cluster, p)
    return allreduce_s(nbytes, n, intra, p.allreduce_latency_s, nodes=nodes_spanned(cluster, n, stride),
                       alpha_inter=p.inter_latency_s, bw_inter=inter)


def ag_s(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int = 1) -> float:
    """All-gather (or reduce-scatter) of ``nbytes`` in total over n ranks spaced ``stride`` apart."""
    intra, inter = links(cluster, p)
    return allgather_s(nbytes, n, intra, p.allreduce_latency_s, nodes=nodes_spanned(cluster, n, stride),
                       alpha_inter=p.inter_latency_s, bw_inter=inter)


def a2a_s(nbytes: float, n: int, cluster: ClusterSpec, p: CostParams, stride: int) -> float:
    """Ulysses all-to-all of ``nbytes`` per rank over the n sequence-parallel ranks."""
    return alltoall_s(nbytes, n, group_bw(cluster, n * stride, p), p.allreduce_latency_s)


TP_EDGE_COLLECTIVES = 2
"""Collectives of a tensor-parallel forward outside the layers, per micro-batch: the vocab-parallel
embedding's all-reduce and the vocab-parallel head's (Megatron's log-prob/cross-entropy reduces
max and sum over the vocabulary shards; Nereus's executor gathers the logits). Counted for
inference passes; a pass of many layers hardly notices them, a latency-bound one of few does."""


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
    per_layer = (cfg.cp - 1) * p2p_s(chunk, group_bw(cluster, cfg.cp * cfg.tp, p), p.p2p_latency_s)
    ring = n_micro * math.ceil(model.layers / cfg.pp) * passes * per_layer
    return max(0.0, ring - attn_s)


SYNC_METHODS = ("bucketed", "per_tensor")
"""How a sync between disjoint pools moves the weights (``weight_sync_s``): ``bucketed``, a
checkpoint engine's (verl ``checkpoint_engine.backend=nccl``, MoonshotAI checkpoint-engine:
tensors packed into buffers, one broadcast per buffer; what the planner's verl launch uses), or
``per_tensor``, one NCCL broadcast per tensor (verl with the checkpoint engine off)."""
SYNC_BUCKET_BYTES = 1024 * 2**20
"""Bytes of one bucket of a bucketed sync: verl's starting NCCL bucket (``BaseDetachNcclSync.
_bucket_size_mb = 1024``, verl/experimental/fully_async_policy/base_detach_sync.py)."""


def broadcast_latency_s(ranks: int, cluster: ClusterSpec, p: CostParams) -> float:
    """Latency of one NCCL broadcast over ``ranks`` consecutive GPUs, whatever its size: NCCL
    broadcasts along a ring (it has no tree broadcast), so the message's head passes ranks - 1 hops,
    those inside a node at ``p2p_latency_s``, the nodes - 1 between nodes at ``inter_latency_s``.
    32 ranks on 4 nodes: 28 * 8 us + 3 * 52 us = 0.38 ms (the fitted H100 / H20 latencies)."""
    if ranks <= 1:
        return 0.0
    nodes = nodes_spanned(cluster, ranks, 1)
    return (ranks - nodes) * p.p2p_latency_s + (nodes - 1) * max(p.p2p_latency_s, p.inter_latency_s)


def weight_sync_s(model: ModelSpec, train: ParallelConfig, gen: ParallelConfig, cluster: ClusterSpec,
                  colocated: bool, params: CostParams | None = None, method: str = "bucketed",
                  group: int | None = None) -> float:
    """Per-step actor weight sync from the training layout to the generation layout.

    Colocated pools: every generation GPU receives its 2N/(tp*pp) bytes and every training GPU
    sends its share of the dp_gen copies, over NVLink (CUDA IPC inside each GPU's node).

    Disjoint pools: the trainer gathers each tensor (TP / EP / FSDP shards to the full Hugging Face
    tensor, ``ModelSpec.weight_tensors``) and broadcasts it to the sync group (every trainer and
    rollout rank, verl's ``collective.broadcast`` from rank 0), each rollout rank loading what it
    holds. Three terms:

    - bytes: one pipelined broadcast of the 2N bytes: every rank receives every byte once, the root
      sends once (relays forward), at the scale-out rate (NVLink on a one-node cluster);
    - ``weight_tensors() * weight_sync_tensor_s``: the per-tensor work both methods do (the
      trainer's gather and name conversion, the buffer copy, the engine's ``load_weights`` call),
      fitted on bucketed syncs of the corpus's fit split (``nereus.fidelity.fit.weight_sync_tensor_s``);
    - the broadcasts' latency (``broadcast_latency_s`` over train.gpus + gen.gpus ranks): once per
      tensor for ``per_tensor``, once per ``SYNC_BUCKET_BYTES`` for ``bucketed``.

    ``group`` overrides the broadcast group's ranks (default train.gpus + gen.gpus): a checkpoint
    engine that stages the weights in the rollout hosts' memory broadcasts among gen.gpus only.

    Worked example, Qwen3-30B-A3B (30.5B parameters, 18,867 tensors) from 16 trainer to 16 rollout
    H20s on 4 nodes (fitted H20 profile: 36 GB/s scale-out, ``broadcast_latency_s`` 0.381 ms over
    the 32 ranks; ``weight_sync_tensor_s`` 0.281 ms): bytes 61.06 GB / 36 GB/s = 1.70 s; tensors
    18,867 * 0.281 ms = 5.30 s; per-tensor broadcasts 18,867 * 0.381 ms = 7.19 s, or for a bucketed
    sync 57 buckets * 0.381 ms = 0.02 s. Per-tensor 14.19 s, bucketed 7.02 s (verl's published
    ablation on H20: 15.76 / 4.38 s, held out). A dense 7B's 339 tensors cost 0.1 s of either term;
    an MoE's experts multiply the tensors 56-fold.
    """
    p = params or CostParams()
    if method not in SYNC_METHODS:
        raise ValueError(f"weight sync method must be one of {SYNC_METHODS}, got {method!r}")
    intra, inter = links(cluster, p)
    one_node = cluster.nodes == 1
    full = model.dtype_bytes * model.num_params()
    if colocated:
        bw = intra if gen.tp * gen.pp <= cluster.gpus_per_node else inter
        recv = full / (gen.tp * gen.pp)
        send = full * gen.dp / train.gpus
        return p.p2p_latency_s * gen.tp * gen.pp + max(recv, send) / bw
    ranks = group or train.gpus + gen.gpus
    bw = intra if one_node else inter
    tensors = model.weight_tensors()
    calls = tensors if method == "per_tensor" else math.ceil(full / SYNC_BUCKET_BYTES)
    return full / bw + tensors * p.weight_sync_tensor_s + calls * broadcast_latency_s(ranks, cluster, p)


def pp_hops_s(nbytes: float, tp: int, pp: int, cluster: ClusterSpec, p: CostParams) -> float:
    """One round of a rollout replica's pipeline: ``pp`` activation sends of ``nbytes`` (stage to
    stage, and the last stage's result back to the first). The replica's tp * pp GPUs are
    consecutive, stage s on GPUs [s * tp, (s + 1) * tp): a hop whose two stages lie on different
    nodes goes over the scale-out link and pays the inter-node latency (``inter_latency_s``, fitted
    on the profile's cross-node collective rows), the others stay on NVLink at ``p2p_latency_s``.
    vLLM's multi-node layout (TP inside a node, PP across nodes) crosses once per node boundary."""
    if pp <= 1 or nbytes <= 0:
        return 0.0
    intra, inter = links(cluster, p)
    cross = _node_crossings(tp, pp, cluster.gpus_per_node)
    far = p2p_s(nbytes, inter, max(p.p2p_latency_s, p.inter_latency_s))
    return cross * far + (pp - cross) * p2p_s(nbytes, intra, p.p2p_latency_s)


@lru_cache(maxsize=1024)
def _node_crossings(tp: int, pp: int, g: int) -> int:
    """Hops of ``pp_hops_s``'s round whose two stages lie on different nodes of ``g`` GPUs."""
    cross = sum(1 for s in range(1, pp) if (s * tp) // g != (s * tp - 1) // g)
    if -(-(tp * pp) // g) > 1:  # the replica spans nodes (``nodes_spanned``)
        cross += 1  # the wrap-around hop, last stage back to the first
    return min(cross, pp)
