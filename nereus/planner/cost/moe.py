"""Mixture-of-experts terms of the cost model: which ranks hold which experts, the all-to-all
dispatch and combine of expert parallelism, the busiest rank's extra load, and the experts a decode
step actually reads. ``passes``, ``generation`` and ``memory`` call these only for a model with
experts (``ModelSpec.is_moe``); a dense model's estimate never reaches this module.

Notes (the COST_MODEL.md of this module)
-----------------------------------------
Layouts.
- Training and inference passes (Megatron): inside a pipeline stage the tp * dp ranks are regrouped
  as etp x ep x expert-dp (Megatron-core ``parallel_state``: world_size % (etp * ep * pp) == 0;
  ``ParallelConfig`` checks ep * etp | tp * dp, and here ep | experts, the MoE layer's own assert).
  Attention, norms, router, shared expert, embedding and head are split by tp as in a dense model;
  the routed experts of a stage by ep * etp (``expert_shards``), so ep = etp = 1 with tp > 1 keeps
  every expert on every rank, as Megatron does. Expert order is etp fastest, then ep (Megatron's
  ``tp-ep-dp-pp`` expert order) and a stage's tp * dp ranks are consecutive GPUs
  (``StagePlacement.gpu_of``), so an EP group spans ep * etp consecutive GPUs: inside a node while
  that fits in one, across nodes otherwise.
- Model states: the dense share is sharded over dp by the ZeRO stage as before; the experts'
  gradients and optimizer states over the expert-data-parallel group, tp * dp / (ep * etp) ranks
  (Megatron's distributed optimizer shards expert params over expert-dp). Expert parallelism with
  ZeRO-3 / FSDP is refused: Megatron's EP runs with its distributed optimizer, and verl's FSDP
  backend has no expert parallelism (verl#6879).
- Generation (vLLM): experts are tensor-parallel over the replica's tp ranks by default (ep = 1);
  ``--enable-expert-parallel`` places whole experts, E / tp per rank (ep = tp; vLLM's EP size is
  TP x DP of one engine and a Nereus replica is one engine at DP 1). Either way a rank holds 1/tp
  of the expert bytes; etp is a Megatron knob and must be 1 there.

Time.
- FLOPs: 6N / 2N of ``ModelSpec.matmul_params()``, the active parameters (top-k experts, shared
  expert, router), as for a dense model.
- GEMM size for the efficiency curve (``expert_gemm_flops``): the routed experts' FLOPs run at the
  efficiency of one expert's GEMM, tokens_rank * ep * etp * k / E tokens (the all-to-all gathers
  them from the EP x ETP group) by h by f_e / etp; the rest of the pass (attention, router, shared
  expert, head) at that of an h-wide GEMM over the rank's tokens. The efficiency curve is the
  profile's fitted one (``CostParams.matmul_eff``); nothing MoE-specific is fitted.
- All-to-all (``ep_a2a_s``): per MoE layer of the stage, a dispatch and a combine in the forward
  and again in the backward (+2 with full recompute; 2 in an inference pass), each moving
  tokens_rank * k * h * bytes per rank (each token goes to k experts; ``alltoall_s``: (n-1)/n of it
  leaves the rank) over the EP group, at the intra-node link inside a node; across nodes the
  share bound for the rank's own node's peers over NVLink while the remote share leaves over the
  scale-out link, concurrently (the slower sets the time; the profile's fitted link efficiencies; DeepEP's published H800 numbers, about
  153-158 GB/s NVLink inside a node and 43-58 GB/s RDMA across 2-8 nodes against about 50 GB/s
  per NIC, show an optimised all-to-all near those links' rates). With tp > 1 Megatron requires
  sequence parallelism for MoE, so a rank dispatches its 1/tp of the micro-batch's tokens.
- TP collectives: with whole experts (etp = 1) a MoE block's MLP needs no TP all-gather /
  reduce-scatter (each rank dispatches its sequence-parallel share of the tokens straight to the
  all-to-all), so half of that block's TP collectives go; with etp > 1 they stay (Megatron's
  dispatcher gathers the tokens over the expert-TP group as a dense MLP does).
- Imbalance (``CAPACITY_FACTOR``): with ep > 1 the busiest EP rank sets the time of the expert
  GEMMs and of the all-to-all. Its load is taken as capacity factor 1.25 times the mean: the
  capacity factor of Switch Transformer's experiments (Fedus, Zoph, Shazeer 2022, JMLR 23(120),
  "Switch Transformers", Table 1 and sec. 2.2: capacity factors 1.0-1.25 hold nearly all tokens
  with the load-balancing loss; GShard, Lepikhin et al. 2020, uses 2.0 for top-2), the value
  Megatron's ``moe_expert_capacity_factor`` is set to for token-dropping runs. Dropless runs (verl's
  default) have no cap, so 1.25 is a typical busiest-rank ratio under an auxiliary balancing loss,
  not a bound. ep = 1: every rank runs every expert, so no rank waits on another.
- Decode (``decode_expert_fraction``): a decode step of B tokens per pipeline micro-batch reads the
  dense weights and only the experts some token routed to. With top-k of E routed uniformly, each
  expert of a layer is missed by one token with probability 1 - k/E, so the expected share of a
  layer's experts hit is 1 - (1 - k/E)^B (E * that experts): all of them at large B, k of E at
  B = 1. A mechanism, no fitted constant.
- KV: ``ModelSpec.kv_bytes_per_token()``; MLA caches the latent, the same on every TP rank
  (``memory.kv_bytes_per_token_per_gpu``).
"""
from __future__ import annotations

import math

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec
from nereus.planner.cost.comm import group_bw, links
from nereus.planner.cost.params import CostParams, alltoall_s, latency_steps
from nereus.planner.specs import ClusterSpec, ParallelConfig

CAPACITY_FACTOR = 1.25
"""Busiest expert-parallel rank's tokens over the mean (Switch Transformer's capacity factor 1.25,
Fedus et al. 2022, Table 1; Megatron ``moe_expert_capacity_factor``). Applies when ep > 1."""


def check(model: ModelSpec, cfg: ParallelConfig, stage: str) -> None:
    """Refuse an expert layout the model or the stage's engine cannot run (one line, naming it)."""
    if not model.is_moe:
        if cfg.ep != 1 or cfg.etp != 1:
            raise SpecError(f"ep({cfg.ep}) / etp({cfg.etp}) set for {model.name}, a dense model (no experts): "
                            "expert parallelism needs a mixture-of-experts model")
        return
    if model.experts % cfg.ep:
        raise SpecError(f"ep({cfg.ep}) must divide the {model.experts} experts of {model.name}")
    if model.expert_ffn % cfg.etp:
        raise SpecError(f"etp({cfg.etp}) must divide the expert FFN size {model.expert_ffn} of {model.name}")
    if stage == "generation":
        if cfg.etp != 1 or cfg.ep not in (1, cfg.tp):
            raise SpecError(f"generation: ep({cfg.ep}) etp({cfg.etp}): a rollout engine (vLLM "
                            f"--enable-expert-parallel) spreads experts over the replica's tp({cfg.tp}) ranks, "
                            f"so ep is 1 or tp and etp is 1")
    elif cfg.zero >= 3 and cfg.ep * cfg.etp > 1:
        raise SpecError(f"ep({cfg.ep}) etp({cfg.etp}) with ZeRO-3: expert parallelism runs with Megatron's "
                        "distributed optimizer (zero <= 2); FSDP shards experts without it (ep = etp = 1)")


def expert_shards(cfg: ParallelConfig, stage: str) -> int:
    """Ranks one expert's bytes are spread over: ep * etp (Megatron), tp in generation (vLLM: TP
    slices every expert, EP places whole ones; 1/tp of the bytes per rank either way)."""
    return cfg.tp if stage == "generation" else cfg.ep * cfg.etp


def expert_dp(cfg: ParallelConfig) -> int:
    """Expert-data-parallel ranks: replicas of one expert shard inside a pipeline stage."""
    return cfg.tp * cfg.dp // (cfg.ep * cfg.etp)


def _attn_per_gpu(model: ModelSpec, tp: int) -> float:
    """One block's attention parameters on one TP rank (norms included)."""
    h = model.hidden
    if model.is_mla:  # Megatron MLA: the down-projections and their norms replicate, the up-projections split
        r, c = model.q_lora_rank, model.kv_lora_rank
        a = model.heads
        rep = (h * r + r if r else 0) + h * model.kv_latent_dim + c
        split = (r * model.q_dim if r else h * model.q_dim) + c * a * (model.qk_nope_head_dim + model.v_head_dim) \
            + a * model.v_head_dim * h
        return rep + split / tp + 2 * h
    kv_split = min(tp, model.kv_heads)
    attn = (2 * h * model.q_dim) / tp + (2 * h * model.kv_dim) / kv_split + 2 * h
    if model.qkv_bias:
        attn += model.q_dim / tp + 2 * model.kv_dim / kv_split
    if model.qk_norm:
        attn += 2 * model.head_dim
    return attn


def stage_params(model: ModelSpec, tp: int, pp: int, shards: int, head: str = "lm") -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of the most loaded pipeline stage, block by block
    (``ModelSpec.moe_layers``): attention, norms, dense MLPs, router and shared expert split by tp
    (the router and the shared expert's gate replicate), routed experts by ``shards``; the
    embedding on the first stage, the final norm and LM head (or value head) on the last."""
    h = model.hidden
    attn = _attn_per_gpu(model, tp)
    dense_mlp = 3 * h * model.ffn / tp
    moe_dense = model.router_params() + 3 * h * model.shared_expert_ffn / tp + (h if model.shared_expert_gate else 0)
    experts = model.experts * model.one_expert_params() / shards
    sparse = set(model.moe_layers)
    per = math.ceil(model.layers / pp)
    embed = model.vocab * h / tp
    last = h + (h if head == "value" else (0 if model.tie_embeddings else embed))
    best = (-1.0, 0.0, 0.0)
    for s in range(pp):
        layers = range(s * per, min((s + 1) * per, model.layers))
        n_moe = sum(1 for i in layers if i in sparse)
        dense = len(layers) * attn + (len(layers) - n_moe) * dense_mlp + n_moe * moe_dense
        dense += (embed if s == 0 else 0.0) + (last if s == pp - 1 else 0.0)
        expert = n_moe * experts
        if dense + expert > best[0]:
            best = (dense + expert, dense, expert)
    return best[1], best[2]


def moe_layers_per_stage(model: ModelSpec, pp: int) -> int:
    """MoE blocks of the pipeline stage with the most of them."""
    per = math.ceil(model.layers / pp)
    return max(sum(1 for i in model.moe_layers if s * per <= i < (s + 1) * per) for s in range(pp))


def routed_active_params(model: ModelSpec) -> int:
    """Routed-expert parameters one token runs through, over all blocks (k experts per MoE block)."""
    return len(model.moe_layers) * model.experts_per_token * model.one_expert_params()


def expert_gemm_flops(model: ModelSpec, tokens_rank: float, gather: int, width_split: int) -> float:
    """FLOPs of one routed expert's GEMM, the efficiency curve's size argument (``matmul_eff``): the
    ``tokens_rank`` tokens of each of ``gather`` ranks (the EP x ETP group in training; 1 in a rollout
    engine, whose ranks all hold every token) send k / E of their tokens to it, and its width is
    split over ``width_split`` ranks (etp; tp for a rollout engine's tensor-parallel experts):
    2 * tokens_rank * gather * k / E * h * f_e / width_split. Fine-grained experts see few tokens
    each, so they run far below a dense GEMM's efficiency; EP gathers more tokens per expert (and
    keeps experts whole), which is why Megatron recommends EP over expert-TP for such models."""
    return 2 * tokens_rank * gather * model.experts_per_token / model.experts * model.hidden * model.expert_ffn \
        / width_split


def split_compute_s(model: ModelSpec, flops: float, routed_flops: float, gpus: int, peak: float,
                    eff_dense: float, eff_expert: float) -> tuple[float, float]:
    """(seconds of the whole pass at the balanced load, of which the routed experts'), the dense part
    at ``eff_dense`` and the routed experts at ``eff_expert``."""
    expert_s = routed_flops / (gpus * peak * eff_expert)
    return (flops - routed_flops) / (gpus * peak * eff_dense) + expert_s, expert_s


def act_ffn(model: ModelSpec, load: float = 1.0) -> float:
    """FFN width whose activations a token leaves in an average block: dense blocks ``ffn``, MoE
    blocks the k routed experts it went through (``load``: the busiest rank's share, ``imbalance``)
    plus the shared expert."""
    n_moe = len(model.moe_layers)
    moe = model.experts_per_token * model.expert_ffn * load + model.shared_expert_ffn
    return ((model.layers - n_moe) * model.ffn + n_moe * moe) / model.layers


def imbalance(cfg: ParallelConfig) -> float:
    """Busiest EP rank's load over the mean: ``CAPACITY_FACTOR`` with ep > 1, else 1."""
    return CAPACITY_FACTOR if cfg.ep > 1 else 1.0


def ep_span(cfg: ParallelConfig) -> int:
    """Consecutive GPUs one EP group covers (etp fastest, then ep, inside a stage's tp * dp ranks)."""
    return cfg.ep * cfg.etp


def ep_a2a_s(model: ModelSpec, cfg: ParallelConfig, tokens_rank: float, cluster: ClusterSpec, p: CostParams) -> float:
    """One all-to-all (dispatch or combine) of ``tokens_rank`` tokens per rank over the EP group:
    k copies of each token's hidden state, the busiest rank's share (``imbalance``)."""
    if cfg.ep <= 1:
        return 0.0
    nbytes = tokens_rank * model.experts_per_token * model.hidden * model.dtype_bytes * imbalance(cfg)
    span = ep_span(cfg)
    if span <= cluster.gpus_per_node:
        return alltoall_s(nbytes, cfg.ep, group_bw(cluster, span, p), p.allreduce_latency_s)
    # Across nodes a rank's peers on its own node still take their share over NVLink, at the same
    # time as the remote peers' share leaves over the scale-out link: an all-to-all is per-peer
    # sends and receives (NCCL's ncclSend/ncclRecv group, P2P over NVLink inside a node, the network
    # across), and DeepEP's internode kernels likewise forward over NVLink while RDMA carries the
    # remote share (its README reports internode dispatch/combine by the RDMA bytes alone). Before,
    # all (n-1)/n of the bytes were priced at the scale-out link (1.9x too much at ep 16 on 2 nodes).
    intra, inter = links(cluster, p)
    n, local = cfg.ep, max(1, cluster.gpus_per_node // cfg.etp)
    return (latency_steps(n) * p.allreduce_latency_s
            + max((local - 1) / n * nbytes / intra, (n - local) / n * nbytes / inter))


def decode_expert_fraction(model: ModelSpec, tokens: float) -> float:
    """Expected share of a block's experts that ``tokens`` tokens route to, top-k of E uniformly:
    1 - (1 - k/E)^tokens (so E * that distinct experts are read)."""
    if tokens <= 0:
        return 0.0
    return 1.0 - (1.0 - model.experts_per_token / model.experts) ** tokens


def expected_distinct_experts(model: ModelSpec, tokens: float) -> float:
    """E * (1 - (1 - k/E)^tokens): distinct experts of one block a batch of ``tokens`` reaches."""
    return model.experts * decode_expert_fraction(model, tokens)
