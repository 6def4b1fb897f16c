"""Tensor inventory: every parameter's name, shape and the dim tensor parallelism splits.

The same names are used by the planner's EMUs and by the executor's reference transformer, so a
region the planner describes is exactly a slice of a tensor the executor holds.

Megatron convention: column-parallel linears (q/k/v, gate/up, vocab-parallel embedding and LM head)
split dim 0 of the ``[out, in]`` weight; row-parallel linears (o_proj, down_proj) split dim 1.
Head-structured dims split on head boundaries; when tp exceeds the number of KV heads the KV
projections are replicated in groups of ``tp // kv_heads`` ranks (``tp_max`` below).

Worked example (Llama-3.1-8B, tp=4): ``layers.0.attn.k_proj.weight`` is [1024, 4096] with
kv_heads=8, so rank 1 holds rows [256, 512). With tp=16 (> 8 heads) ranks 2 and 3 both hold
rows [128, 256) (head 1).

Mixture of experts: an MoE block's MLP is ``mlp.router.weight`` [E, h] (replicated), per routed
expert ``e`` ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (``TensorInfo.expert`` = e, so expert
parallelism can hand whole experts to ranks; inside an expert TP splits like a dense MLP), and the
shared expert ``mlp.shared_expert.*`` (+ ``mlp.shared_expert_gate.weight``). Latent attention (MLA)
replaces q/k/v by ``q_a_proj`` / ``q_b_proj`` (or ``q_proj``) and ``kv_a_proj`` / ``kv_b_proj``:
the down-projections and their norms are replicated, the per-head up-projections split by head.
A dense model's inventory is exactly what it was before experts existed.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Literal, Mapping

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec

Part = Literal["embed", "layer", "head"]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    """Tensor dim that TP splits; None means replicated across the TP group."""
    tp_max: int | None
    """At most this many distinct TP shards (head count); beyond it shards are replicated."""
    layer: int | None
    part: Part
    expert: int | None = None
    """Routed expert this tensor belongs to (expert parallelism shards by it); None otherwise."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` when ``n`` is split into ``parts`` near-equal chunks."""
    lo, hi = index * n // parts, (index + 1) * n // parts
    return lo, hi - lo


def pp_layer_range(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """[first, last) transformer blocks held by pipeline stage ``stage``."""
    if not 0 < pp <= layers:
        raise SpecError(f"pp({pp}) must be between 1 and layers({layers})")
    off, n = split_range(layers, pp, stage)
    return off, off + n


def tp_shard(t: TensorInfo, tp: int, tp_rank: int) -> tuple[int, int, int]:
    """(dim, offset, length) of the slice TP rank ``tp_rank`` holds; dim -1 means whole tensor."""
    if t.tp_dim is None or tp == 1:
        return -1, 0, 0
    shards, index = tp, tp_rank
    if t.tp_max is not None and tp > t.tp_max:
        if tp % t.tp_max:
            raise SpecError(f"{t.name}: tp({tp}) is not a multiple of its {t.tp_max} heads")
        shards, index = t.tp_max, tp_rank // (tp // t.tp_max)
    size = t.shape[t.tp_dim]
    if size % shards:
        raise SpecError(f"{t.name}: dim {t.tp_dim} of size {size} does not split into tp({shards}) shards")
    off, n = split_range(size, shards, index)
    return t.tp_dim, off, n


def check_tp(model: ModelSpec, tp: int) -> None:
    """Raise SpecError unless ``tp`` splits this model on head boundaries."""
    if tp < 1:
        raise SpecError(f"tp must be >= 1, got {tp}")
    if model.heads % tp:
        raise SpecError(f"tp({tp}) does not divide heads({model.heads}) of {model.name}")
    if tp <= model.kv_heads and model.kv_heads % tp:
        raise SpecError(f"tp({tp}) does not divide kv_heads({model.kv_heads}) of {model.name}")
    if tp > model.kv_heads and tp % model.kv_heads:
        raise SpecError(f"tp({tp}) is not a multiple of kv_heads({model.kv_heads}) of {model.name}")
    if model.dense_layers and model.ffn % tp:
        raise SpecError(f"tp({tp}) does not divide ffn({model.ffn}) of {model.name}")
    for f in ("expert_ffn", "shared_expert_ffn"):
        if getattr(model, f) % tp:
            raise SpecError(f"tp({tp}) does not divide {f}({getattr(model, f)}) of {model.name}")


@lru_cache(maxsize=256)
def tensor_inventory(model: ModelSpec, head: Literal["lm", "value"] = "lm") -> tuple[TensorInfo, ...]:
    """Every parameter of ``model`` in a fixed order. ``head='value'`` gives a critic's value head."""
    h = model.hidden
    out: list[TensorInfo] = [TensorInfo("embed.weight", (model.vocab, h), 0, None, None, "embed")]
    sparse = set(model.moe_layers)
    for i in range(model.layers):
        p = f"layers.{i}."
        out.append(TensorInfo(p + "attn_norm.weight", (h,), None, None, i, "layer"))
        out.extend(_mla_tensors(model, i) if model.is_mla else _attn_tensors(model, i))
        out.append(TensorInfo(p + "mlp_norm.weight", (h,), None, None, i, "layer"))
        out.extend(_moe_tensors(model, i) if i in sparse else _mlp_tensors(p + "mlp.", h, model.ffn, i))
    out.append(TensorInfo("final_norm.weight", (h,), None, None, None, "head"))
    if head == "value":
        out.append(TensorInfo("value_head.weight", (1, h), None, None, None, "head"))
    elif not model.tie_embeddings:
        out.append(TensorInfo("lm_head.weight", (model.vocab, h), 0, None, None, "head"))
    return tuple(out)


def _attn_tensors(model: ModelSpec, i: int) -> list[TensorInfo]:
    h, d, a, g, p = model.hidden, model.head_dim, model.heads, model.kv_heads, f"layers.{i}.attn."
    out = [TensorInfo(p + "q_proj.weight", (a * d, h), 0, a, i, "layer"),
           TensorInfo(p + "k_proj.weight", (g * d, h), 0, g, i, "layer"),
           TensorInfo(p + "v_proj.weight", (g * d, h), 0, g, i, "layer")]
    if model.qkv_bias:
        out += [TensorInfo(p + "q_proj.bias", (a * d,), 0, a, i, "layer"),
                TensorInfo(p + "k_proj.bias", (g * d,), 0, g, i, "layer"),
                TensorInfo(p + "v_proj.bias", (g * d,), 0, g, i, "layer")]
    if model.qk_norm:
        out += [TensorInfo(p + "q_norm.weight", (d,), None, None, i, "layer"),
                TensorInfo(p + "k_norm.weight", (d,), None, None, i, "layer")]
    return out + [TensorInfo(p + "o_proj.weight", (h, a * d), 1, a, i, "layer")]


def _mla_tensors(model: ModelSpec, i: int) -> list[TensorInfo]:
    """DeepSeek's latent attention: replicated down-projections, up-projections split by head."""
    h, a, p, r, c = model.hidden, model.heads, f"layers.{i}.attn.", model.q_lora_rank, model.kv_lora_rank
    if r:
        out = [TensorInfo(p + "q_a_proj.weight", (r, h), None, None, i, "layer"),
               TensorInfo(p + "q_a_norm.weight", (r,), None, None, i, "layer"),
               TensorInfo(p + "q_b_proj.weight", (model.q_dim, r), 0, a, i, "layer")]
    else:
        out = [TensorInfo(p + "q_proj.weight", (model.q_dim, h), 0, a, i, "layer")]
    return out + [
        TensorInfo(p + "kv_a_proj.weight", (model.kv_latent_dim, h), None, None, i, "layer"),
        TensorInfo(p + "kv_a_norm.weight", (c,), None, None, i, "layer"),
        TensorInfo(p + "kv_b_proj.weight", (a * (model.qk_nope_head_dim + model.v_head_dim), c), 0, a, i, "layer"),
        TensorInfo(p + "o_proj.weight", (h, a * model.v_head_dim), 1, a, i, "layer")]


def _mlp_tensors(p: str, h: int, f: int, i: int, expert: int | None = None) -> list[TensorInfo]:
    return [TensorInfo(p + "gate_proj.weight", (f, h), 0, None, i, "layer", expert),
            TensorInfo(p + "up_proj.weight", (f, h), 0, None, i, "layer", expert),
            TensorInfo(p + "down_proj.weight", (h, f), 1, None, i, "layer", expert)]


def _moe_tensors(model: ModelSpec, i: int) -> list[TensorInfo]:
    h, p = model.hidden, f"layers.{i}.mlp."
    out = [TensorInfo(p + "router.weight", (model.experts, h), None, None, i, "layer")]
    if model.router_score_bias:
        out.append(TensorInfo(p + "router.score_bias", (model.experts,), None, None, i, "layer"))
    for e in range(model.experts):
        out += _mlp_tensors(f"{p}experts.{e}.", h, model.expert_ffn, i, e)
    if model.shared_expert_ffn:
        out += _mlp_tensors(p + "shared_expert.", h, model.shared_expert_ffn, i)
    if model.shared_expert_gate:
        out.append(TensorInfo(p + "shared_expert_gate.weight", (1, h), None, None, i, "layer"))
    return out


def stage_tensors(model: ModelSpec, pp: int, stage: int, head: Literal["lm", "value"] = "lm") -> tuple[TensorInfo, ...]:
    """Tensors held by pipeline stage ``stage``: its blocks, the embedding on the first stage,
    the final norm and head on the last (a tied embedding also lives on the last stage)."""
    first, last = pp_layer_range(model.layers, pp, stage)
    out = []
    for t in tensor_inventory(model, head):
        if t.part == "layer" and first <= t.layer < last:
            out.append(t)
        elif t.part == "embed" and (stage == 0 or (model.tie_embeddings and head == "lm" and stage == pp - 1)):
            out.append(t)
        elif t.part == "head" and stage == pp - 1:
            out.append(t)
    return tuple(out)


def storage_dim(t: TensorInfo) -> int:
    """The dim of ``t`` stored outermost in memory: its TP split dim, else 0 (see ``storage_dims``)."""
    return t.tp_dim or 0


@lru_cache(maxsize=256)
def storage_dims(model: ModelSpec) -> Mapping[str, int]:
    """Tensors whose shards are stored with a dim other than 0 outermost in memory: name -> dim.

    The convention shared by the planner (it writes it into every TransitionPlan) and the
    executor (it allocates and sends by it): a tensor is stored with its TP split dim outermost,
    so that any TP shard, and any piece of one cut along that dim, is one dense block of memory;
    resharding then moves bytes without packing or staging copies. Only row-parallel weights
    (split on dim 1) differ from plain row-major; their ``.t()`` is a contiguous matrix.
    """
    return MappingProxyType({t.name: storage_dim(t) for t in tensor_inventory(model) if storage_dim(t)})
