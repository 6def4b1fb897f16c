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
    if model.ffn % tp:
        raise SpecError(f"tp({tp}) does not divide ffn({model.ffn}) of {model.name}")


@lru_cache(maxsize=256)
def tensor_inventory(model: ModelSpec, head: Literal["lm", "value"] = "lm") -> tuple[TensorInfo, ...]:
    """Every parameter of ``model`` in a fixed order. ``head='value'`` gives a critic's value head."""
    h, f, d = model.hidden, model.ffn, model.head_dim
    a, g = model.heads, model.kv_heads
    out: list[TensorInfo] = [TensorInfo("embed.weight", (model.vocab, h), 0, None, None, "embed")]
    for i in range(model.layers):
        p = f"layers.{i}."
        out.append(TensorInfo(p + "attn_norm.weight", (h,), None, None, i, "layer"))
        out.append(TensorInfo(p + "attn.q_proj.weight", (a * d, h), 0, a, i, "layer"))
        out.append(TensorInfo(p + "attn.k_proj.weight", (g * d, h), 0, g, i, "layer"))
        out.append(TensorInfo(p + "attn.v_proj.weight", (g * d, h), 0, g, i, "layer"))
        if model.qkv_bias:
            out.append(TensorInfo(p + "attn.q_proj.bias", (a * d,), 0, a, i, "layer"))
            out.append(TensorInfo(p + "attn.k_proj.bias", (g * d,), 0, g, i, "layer"))
            out.append(TensorInfo(p + "attn.v_proj.bias", (g * d,), 0, g, i, "layer"))
        if model.qk_norm:
            out.append(TensorInfo(p + "attn.q_norm.weight", (d,), None, None, i, "layer"))
            out.append(TensorInfo(p + "attn.k_norm.weight", (d,), None, None, i, "layer"))
        out.append(TensorInfo(p + "attn.o_proj.weight", (h, a * d), 1, a, i, "layer"))
        out.append(TensorInfo(p + "mlp_norm.weight", (h,), None, None, i, "layer"))
        out.append(TensorInfo(p + "mlp.gate_proj.weight", (f, h), 0, None, i, "layer"))
        out.append(TensorInfo(p + "mlp.up_proj.weight", (f, h), 0, None, i, "layer"))
        out.append(TensorInfo(p + "mlp.down_proj.weight", (h, f), 1, None, i, "layer"))
    out.append(TensorInfo("final_norm.weight", (h,), None, None, None, "head"))
    if head == "value":
        out.append(TensorInfo("value_head.weight", (1, h), None, None, None, "head"))
    elif not model.tie_embeddings:
        out.append(TensorInfo("lm_head.weight", (model.vocab, h), 0, None, None, "head"))
    return tuple(out)


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
