"""Reference decoder-only transformer, written over the shard store's tensors.

RMSNorm, rotary positions, GQA attention, SwiGLU MLP, untied LM head. Parameter names and shapes
come from ``nereus.models.inventory``; each function takes this rank's TP shard of the weights
(``w`` maps inventory name -> local tensor) and the TP group, so the same code runs at TP=1 and
TP=k (Megatron: q/k/v, gate/up and the LM head column-parallel; o_proj and down_proj
row-parallel; vocab-parallel embedding).

``init_full`` builds every full tensor from a seed, independently of any layout, which is what
makes a never-resharded reference rebuildable bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nereus.executor.parallel import copy_to_tp, gather_from_tp, reduce_from_tp
from nereus.models.inventory import TensorInfo, tensor_inventory
from nereus.models.spec import ModelSpec

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


def init_full(model: ModelSpec, seed: int, kinds: tuple[str, ...] = ("param",)) -> dict[tuple[str, str], torch.Tensor]:
    """(tensor name, kind) -> full tensor, for every tensor of the inventory."""
    return {(t.name, k): init_tensor(t, i, seed, k) for i, t in enumerate(tensor_inventory(model)) for k in kinds}


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x: torch.Tensor, pos0: int) -> torch.Tensor:
    """Rotary embedding of x [B, T, H, d] at positions pos0 .. pos0+T-1 (half-split convention)."""
    d = x.shape[-1]
    inv = 1.0 / ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = torch.arange(pos0, pos0 + x.shape[1], dtype=torch.float32, device=x.device)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
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
    q = (xin @ w[p + "q_proj.weight"].t()).view(B, T, -1, d)
    k = (xin @ w[p + "k_proj.weight"].t()).view(B, T, -1, d)
    v = (xin @ w[p + "v_proj.weight"].t()).view(B, T, -1, d)
    pos0 = cache.length(layer) if cache is not None else 0
    q, k = rope(q, pos0), rope(k, pos0)
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
    return reduce_from_tp(o @ w[p + "o_proj.weight"].t(), tp_group)


def mlp(x: torch.Tensor, w: dict, layer: int, tp_group) -> torch.Tensor:
    p = f"layers.{layer}.mlp."
    xin = copy_to_tp(x, tp_group)
    h = F.silu(xin @ w[p + "gate_proj.weight"].t()) * (xin @ w[p + "up_proj.weight"].t())
    return reduce_from_tp(h @ w[p + "down_proj.weight"].t(), tp_group)


def block(x: torch.Tensor, w: dict, layer: int, model: ModelSpec, tp_group, cache: KVCache | None) -> torch.Tensor:
    p = f"layers.{layer}."
    x = x + attention(rms_norm(x, w[p + "attn_norm.weight"]), w, layer, model, tp_group, cache)
    return x + mlp(rms_norm(x, w[p + "mlp_norm.weight"]), w, layer, tp_group)


def embed(ids: torch.Tensor, w: dict, vocab_lo: int, tp_group) -> torch.Tensor:
    """Vocab-parallel embedding: rows outside this rank's vocab slice contribute zeros."""
    table = w["embed.weight"]
    local = ids - vocab_lo
    inside = (local >= 0) & (local < table.shape[0])
    out = table[local.clamp(0, table.shape[0] - 1)] * inside[..., None].to(table.dtype)
    return reduce_from_tp(out, tp_group)


def head(x: torch.Tensor, w: dict, tp_group) -> torch.Tensor:
    """Final norm and vocab-parallel LM head, logits gathered over TP: [B, T, vocab]."""
    h = copy_to_tp(rms_norm(x, w["final_norm.weight"]), tp_group)
    return gather_from_tp(h @ w["lm_head.weight"].t(), tp_group)
