"""Decoder-only transformer (Llama, Qwen2, Qwen3, Qwen3-MoE), written over the shard store's tensors.

RMSNorm, rotary positions, GQA attention with optional q/k/v bias (Qwen2) and per-head q/k
RMSNorm (Qwen3), SwiGLU MLP, LM head untied or tied to the embedding, or a value head (critic).
Every op follows the Hugging Face definition (``LlamaForCausalLM`` and the Qwen2/Qwen3 classes):
``F.linear``; RMSNorm computed in fp32 and cast back before the weight; rotary tables computed in
fp32 from ``ModelSpec.rope_theta`` and cast to the activations' dtype; so the same weights give
HF's logits (fp32) or its bf16 rounding (bf16 weights run in bf16). Parameter names and shapes
come from ``nereus.models.inventory``; each function takes this rank's TP shard of the weights
(``w`` maps inventory name -> local tensor) and the TP group, so the same code runs at TP=1 and
TP=k (Megatron: q/k/v with their biases, gate/up and the LM head column-parallel; o_proj and
down_proj row-parallel; vocab-parallel embedding; q/k norms replicated, applied per local head).

Mixture-of-experts blocks (``ModelSpec.moe_layers``) run ``moe_mlp`` instead of the SwiGLU MLP
(router, top-k, experts sharded by EP and expert TP; see "Mixture of experts" below).

``init_full`` builds every full tensor from a seed, independently of any layout, which is what
makes a never-resharded reference rebuildable bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nereus.executor.parallel import copy_to_tp, gather_from_tp, reduce_from_tp
from nereus.executor.store import TORCH_DTYPES
from nereus.models.inventory import TensorInfo, tensor_inventory
from nereus.models.spec import ModelSpec
from nereus.planner.plan import StagePlacement
from nereus.planner.transition.emu import expert_coords, expert_layout
from nereus.planner.transition.types import Region

EPS = 1e-5
ROPE_BASE = 10000.0


def init_tensor(t: TensorInfo, index: int, seed: int, kind: str = "param") -> torch.Tensor:
    """Full tensor ``t`` from ``seed``; depends only on (seed, tensor index, kind)."""
    salt = {"param": 0, "exp_avg": 1, "exp_avg_sq": 2, "master": 3}[kind]
    g = torch.Generator().manual_seed(seed * 1_000_003 + index * 7 + salt)
    if kind == "exp_avg":
        return torch.randn(t.shape, generator=g) * 1e-3
    if kind == "exp_avg_sq":
        return torch.rand(t.shape, generator=g) * 1e-6
    if t.name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(t.shape, generator=g)
    return torch.randn(t.shape, generator=g) * (0.5 / math.sqrt(t.shape[-1]))


def init_full(model: ModelSpec, seed: int, kinds: tuple[str, ...] = ("param",),
              value_head: bool = False) -> dict[tuple[str, str], torch.Tensor]:
    """(tensor name, kind) -> full tensor, for every tensor of the inventory (with the value head
    instead of the LM head for a critic)."""
    inv = tensor_inventory(model, "value" if value_head else "lm")
    return {(t.name, k): init_tensor(t, i, seed, k) for i, t in enumerate(inv) for k in kinds}


def initial_region(full: dict[tuple[str, str], torch.Tensor], r: Region) -> torch.Tensor:
    """Region ``r``'s step-0 value from ``init_full``'s fp32 tensors: a param in the region's
    dtype (bf16 under mixed precision: the fp32 value rounded once), a ``master`` copy the fp32
    param itself, a moment its seeded value, or zeros where ``full`` has no such kind."""
    src = full.get((r.tensor, "param" if r.kind == "master" else r.kind))
    t = torch.zeros(r.lengths) if src is None else src[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))]
    return t.to(TORCH_DTYPES[r.dtype])


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """HF's RMSNorm: normalised in fp32, cast back to x's dtype, then times the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, pos0: int, theta: float = ROPE_BASE) -> torch.Tensor:
    """Rotary embedding of x [B, T, H, d] at positions pos0 .. pos0+T-1 (half-split convention,
    HF's ``rotate_half``); the cos/sin tables are fp32, cast to x's dtype as HF does."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = torch.arange(pos0, pos0 + x.shape[1], dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :].to(x.dtype), ang.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass
class KVCache:
    """Per-layer keys and values of this rank's KV heads, [B, T, H_kv_local, d]."""

    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)

    def length(self, layer: int) -> int:
        return self.k[layer].shape[1] if layer in self.k else 0


def attention(x: torch.Tensor, w: dict, layer: int, model: ModelSpec, tp_group, cache: KVCache | None) -> torch.Tensor:
    p = f"layers.{layer}.attn."
    d = model.head_dim
    B, T, _ = x.shape
    xin = copy_to_tp(x, tp_group)
    q, k, v = (F.linear(xin, w[p + n + "_proj.weight"], w.get(p + n + "_proj.bias")).view(B, T, -1, d)
               for n in "qkv")
    if model.qk_norm:  # Qwen3: per-head RMSNorm before the rotary embedding
        q, k = rms_norm(q, w[p + "q_norm.weight"], model.norm_eps), rms_norm(k, w[p + "k_norm.weight"], model.norm_eps)
    pos0 = cache.length(layer) if cache is not None else 0
    q, k = rope(q, pos0, model.rope_theta), rope(k, pos0, model.rope_theta)
    if cache is not None:
        if layer in cache.k:
            k, v = torch.cat([cache.k[layer], k], 1), torch.cat([cache.v[layer], v], 1)
        cache.k[layer], cache.v[layer] = k.detach(), v.detach()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    S = k.shape[1]
    mask = torch.arange(S, device=x.device)[None, :] <= (pos0 + torch.arange(T, device=x.device))[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    o = o.transpose(1, 2).reshape(B, T, -1)
    return reduce_from_tp(F.linear(o, w[p + "o_proj.weight"]), tp_group)


def mlp(x: torch.Tensor, w: dict, layer: int, tp_group) -> torch.Tensor:
    p = f"layers.{layer}.mlp."
    xin = copy_to_tp(x, tp_group)
    h = F.silu(F.linear(xin, w[p + "gate_proj.weight"])) * F.linear(xin, w[p + "up_proj.weight"])
    return reduce_from_tp(F.linear(h, w[p + "down_proj.weight"]), tp_group)


def block(x: torch.Tensor, w: dict, layer: int, model: ModelSpec, tp_group, cache: KVCache | None,
          moe=None) -> torch.Tensor:
    """One decoder block; a block in ``model.moe_layers`` runs the mixture-of-experts MLP
    (``moe_mlp``, ``moe``: this rank's ``ExpertShard``, None with every expert in ``w``)."""
    p, eps = f"layers.{layer}.", model.norm_eps
    x = x + attention(rms_norm(x, w[p + "attn_norm.weight"], eps), w, layer, model, tp_group, cache)
    if layer in model.moe_layers:
        return x + moe_mlp(rms_norm(x, w[p + "mlp_norm.weight"], eps), w, layer, model, moe)
    return x + mlp(rms_norm(x, w[p + "mlp_norm.weight"], eps), w, layer, tp_group)


def embed(ids: torch.Tensor, w: dict, vocab_lo: int, tp_group) -> torch.Tensor:
    """Vocab-parallel embedding: rows outside this rank's vocab slice contribute zeros."""
    table = w["embed.weight"]
    local = ids - vocab_lo
    inside = (local >= 0) & (local < table.shape[0])
    out = table[local.clamp(0, table.shape[0] - 1)] * inside[..., None].to(table.dtype)
    return reduce_from_tp(out, tp_group)


def head(x: torch.Tensor, w: dict, tp_group, eps: float = EPS) -> torch.Tensor:
    """Final norm and vocab-parallel LM head (``embed.weight`` when the model ties them: the same
    vocab split), logits gathered over TP: [B, T, vocab]."""
    h = copy_to_tp(rms_norm(x, w["final_norm.weight"], eps), tp_group)
    return gather_from_tp(F.linear(h, w["lm_head.weight"] if "lm_head.weight" in w else w["embed.weight"]), tp_group)


def value_head(x: torch.Tensor, w: dict, eps: float = EPS) -> torch.Tensor:
    """Final norm and the critic's value head: one value per token, [B, T]. The head is
    replicated over TP and every TP rank computes the same values, so no TP communication (HF:
    ``*ForTokenClassification`` with one label and no bias, ``score.weight``)."""
    return F.linear(rms_norm(x, w["final_norm.weight"], eps), w["value_head.weight"])[..., 0]


# ---- mixture of experts -------------------------------------------------------------------
MOE_NOTES = """Mixture-of-experts MLP of the executor's transformer (Qwen3-MoE), sharded by expert (EP) and
inside experts (expert TP), as ``nereus.planner.transition.emu`` places the expert tensors.

Op for op ``transformers``' ``Qwen3MoeSparseMoeBlock`` (5.x): router logits ``F.linear(x,
router)`` in the activations' dtype, softmax in fp32, top-k, the k probabilities renormalised to
sum 1 (``norm_topk_prob``; Mixtral's rule too), cast back to the activations' dtype; each expert e
runs SwiGLU on the tokens routed to it, ``down(silu(gate x) * up x) * p``, added into a zero
output with ``index_add_`` in increasing expert order.

Sharded (``ExpertShard``): the ranks of one expert group (the ep * etp ranks of a pipeline stage
that share an expert-dp index, ``emu.expert_coords``) hold every expert slice exactly once
between them. Each rank all-gathers the group's tokens (sizes first: DP ranks may hold different
token counts), routes all of them with its replicated router (same bits on every rank of the
group, so all agree on the routing), runs its own experts' slices (whole experts under EP, the
etp rank's gate/up rows and down columns: a partial sum of the down projection), and one
all-reduce over the group sums every expert's (partial) output per token; each rank keeps its
own tokens. Forward only (no autograd through the collectives): ``Engine.train_step`` refuses
MoE models. Every rank of a group must run the same number of MoE calls: ``Engine`` checks that
the batch splits evenly over DP when a group spans DP ranks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertShard:
    """This rank's experts and its expert group under one placement."""

    experts: tuple[int, ...]
    """Routed experts (whole or this etp rank's slice) this rank holds."""
    group: object
    """Process group of the ep * etp ranks that hold every expert slice once (None: one rank)."""
    ranks: tuple[int, ...]
    """Global ranks of that group, in group-rank order."""
    spans_dp: bool
    """The group holds ranks of several DP replicas (ep * etp > tp), which run different rows."""


def expert_groups(placement: StagePlacement) -> list[tuple[int, ...]]:
    """Every expert group of ``placement`` (global ranks), pipeline stage by stage, then expert-dp
    index: the ep * etp consecutive GPUs of a stage that share an expert-dp rank."""
    c = placement.config
    ep, etp = expert_layout(placement)
    n = ep * etp
    out = []
    for s in range(c.pp):
        base = placement.first_gpu + s * c.tp * c.dp
        for e in range(c.tp * c.dp // n):
            out.append(tuple(base + e * n + j for j in range(n)))
    return out


def build_shard(model: ModelSpec, placement: StagePlacement, rank: int) -> ExpertShard | None:
    """Collective over the world (makes every expert group, in a fixed order, on every rank):
    this rank's ``ExpertShard``; None outside the placement's pool."""
    from nereus.executor.layout import Coords
    from nereus.executor.parallel import group_of

    mine = None
    for ranks in expert_groups(placement):
        g = group_of(ranks)
        if rank in ranks:
            mine = (ranks, g)
    co = Coords.of(placement, rank)
    if co is None or mine is None:
        return None
    ep, etp = expert_layout(placement)
    _, ep_rank, _, _ = expert_coords(placement, co.tp_rank, co.dp_rank)
    per = model.experts // ep
    return ExpertShard(experts=tuple(range(ep_rank * per, (ep_rank + 1) * per)), group=mine[1], ranks=mine[0],
                       spans_dp=ep * etp > placement.config.tp)


def _gather_tokens(flat: torch.Tensor, group) -> tuple[torch.Tensor, int, int]:
    """(every group rank's tokens, concatenated in group-rank order; this rank's first row; its rows)."""
    n = torch.tensor([flat.shape[0]], dtype=torch.int64, device=flat.device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    sizes = [int(s) for s in sizes]
    most = max(sizes)
    padded = torch.zeros((most,) + flat.shape[1:], dtype=flat.dtype, device=flat.device)
    padded[:flat.shape[0]] = flat
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    me = dist.get_rank(group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)]), sum(sizes[:me]), flat.shape[0]


def moe_mlp(x: torch.Tensor, w: dict, layer: int, model: ModelSpec, shard: ExpertShard | None) -> torch.Tensor:
    """The MoE block's MLP on x [B, T, h]; ``shard`` None: every expert is in ``w`` (one rank)."""
    p = f"layers.{layer}.mlp."
    B, T, h = x.shape
    flat = x.reshape(-1, h)
    group = shard.group if shard is not None else None
    lo, n = 0, flat.shape[0]
    if group is not None:
        flat, lo, n = _gather_tokens(flat.contiguous(), group)
    logits = F.linear(flat, w[p + "router.weight"])
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, model.experts_per_token, dim=-1)
    top = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
    out = torch.zeros_like(flat)
    for e in (shard.experts if shard is not None else range(model.experts)):
        pos, tok = torch.where(idx.t() == e)  # slot-major, as transformers orders them
        if tok.numel() == 0:
            continue
        q = f"{p}experts.{e}."
        xs = flat[tok]
        hidden = F.silu(F.linear(xs, w[q + "gate_proj.weight"])) * F.linear(xs, w[q + "up_proj.weight"])
        y = F.linear(hidden, w[q + "down_proj.weight"]) * top[tok, pos, None]
        out.index_add_(0, tok, y.to(out.dtype))
    if group is not None:
        dist.all_reduce(out, group=group)
    return out[lo:lo + n].view(B, T, h)
