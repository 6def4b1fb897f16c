"""Hugging Face parameter names <-> Nereus's tensor inventory, as blocks of rows.

Every inventory tensor (``nereus.models.inventory``) is made of row blocks (dim 0) of Hugging
Face tensors; a plain name is one block, a fused tensor gives each of its parts a few blocks:

- ``model.embed_tokens.weight`` -> ``embed.weight``; ``model.norm.weight`` -> ``final_norm.weight``;
  ``lm_head.weight`` -> ``lm_head.weight`` (absent when the model ties it to the embedding);
  ``score.weight`` -> ``value_head.weight`` (a critic: ``*ForTokenClassification``, one label,
  ``token_classification_bias=False``);
- ``model.layers.{i}.input_layernorm`` / ``post_attention_layernorm`` -> ``layers.{i}.attn_norm`` /
  ``mlp_norm``; ``model.layers.{i}.self_attn.{q,k,v,o}_proj`` (weights; q/k/v biases for Qwen2)
  and ``self_attn.{q,k}_norm`` (Qwen3) -> ``layers.{i}.attn.*``; ``model.layers.{i}.mlp.*`` -> ``layers.{i}.mlp.*``;
- Megatron-style fused QKV ``self_attn.qkv_proj.{weight,bias}``, per KV group: group j holds its
  ``a/g`` query heads, then its key head, then its value head (``d`` rows per head). Worked
  example: a = 4 query heads, g = 2 KV heads, d = 16: rows [0, 32) are q heads 0-1, [32, 48) k
  head 0, [48, 64) v head 0, [64, 96) q heads 2-3, [96, 112) k head 1, [112, 128) v head 1; so
  ``q_proj`` rows [32, 64) (heads 2-3) are fused rows [64, 96). A TP rank's share is whole groups,
  hence one contiguous run of fused rows, as in Megatron;
- fused gate/up ``mlp.gate_up_proj.weight`` = [gate; up] stacked on dim 0 (Megatron's
  ``linear_fc1`` saved at tp 1, Phi-3's ``gate_up_proj``): ``up_proj`` row r is fused row f + r.
- Mixture of experts (Qwen3-MoE): the router ``mlp.gate.weight`` -> ``layers.{i}.mlp.router.weight``;
  routed expert e, two spellings, both read (``for_keys`` tells them apart):
  the hub's and ``save_pretrained``'s per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
  (plain names, the default when writing), or the fused 3-D tensors ``transformers`` 5.x keeps
  in memory (``model.state_dict()``): ``mlp.experts.gate_up_proj`` [E, 2 f_e, h] with expert e's
  gate rows [0, f_e) and up rows [f_e, 2 f_e) of ``gate_up_proj[e]``, and ``mlp.experts.down_proj``
  [E, h, f_e] (``down_proj[e]`` is expert e's down_proj). A block holds ``RowBlock.index`` = e for
  these: rows of the 2-D matrix at index e of dim 0. Worked example (f_e = 32): expert 5's
  ``up_proj`` rows [16, 32) are ``gate_up_proj[5, 48:64]``.

Torch is the only import; transformers is never needed here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch

from nereus.errors import SpecError
from nereus.models.inventory import TensorInfo, tensor_inventory
from nereus.models.spec import ModelSpec

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some checkpoints carry that are not parameters."""

Fetch = Callable[[str, tuple[slice, ...]], torch.Tensor]
"""``fetch(hf_name, index)``: the part of one Hugging Face tensor at ``index`` (a slice per dim)."""


@dataclass(frozen=True, slots=True)
class RowBlock:
    """Rows [row, row + rows) of an inventory tensor are rows [source_row, source_row + rows) of
    the Hugging Face tensor ``source``."""

    source: str
    source_row: int
    row: int
    rows: int
    index: int | None = None
    """A 3-D source (fused experts): the rows are of ``source[index]``; None: of ``source`` itself."""


def _plain(name: str) -> str:
    """The unfused Hugging Face name of an inventory tensor."""
    fixed = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight", "value_head.weight": "score.weight"}
    if name in fixed:
        return fixed[name]
    _, i, rest = name.split(".", 2)
    rest = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
            "mlp.router.weight": "mlp.gate.weight"}.get(rest, rest.replace("attn.", "self_attn.", 1))
    return f"model.layers.{i}.{rest}"


@dataclass(frozen=True, slots=True, kw_only=True)
class NameMap:
    """How one model's Hugging Face tensors make up its inventory tensors."""

    model: ModelSpec
    head: str = "lm"
    """``lm`` (causal LM) or ``value`` (critic: ``score.weight``)."""
    fused_qkv: bool = False
    fused_gate_up: bool = False
    fused_experts: bool = False
    """Routed experts as transformers 5.x's 3-D ``mlp.experts.gate_up_proj`` / ``down_proj``
    instead of the per-expert names (see the module docstring)."""
    blocks: Mapping[str, tuple[RowBlock, ...]] = field(init=False, repr=False, compare=False)
    """Inventory name -> its row blocks, in row order."""
    shapes: Mapping[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    """Hugging Face name -> shape, every tensor this model's checkpoint holds."""

    def __post_init__(self) -> None:
        if self.head not in ("lm", "value"):
            raise SpecError(f"head must be 'lm' or 'value', got {self.head!r}")
        blocks, shapes = {}, {}
        for t in tensor_inventory(self.model, self.head):
            blocks[t.name] = self._blocks_of(t)
            for b in blocks[t.name]:
                if b.index is not None:  # [E, rows, cols]
                    rows = shapes.get(b.source, (0, 0))[1]
                    shapes[b.source] = (self.model.experts, max(rows, b.source_row + b.rows)) + t.shape[1:]
                    continue
                rows = shapes.get(b.source, (0,))[0]
                shapes[b.source] = (max(rows, b.source_row + b.rows),) + t.shape[1:]
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "shapes", shapes)

    @classmethod
    def for_keys(cls, model: ModelSpec, keys: Iterable[str], head: str = "lm") -> "NameMap":
        """The map matching a checkpoint's names: fused QKV / gate-up where its names say so."""
        keys = set(keys)
        return cls(model=model, head=head, fused_qkv=any(k.endswith("self_attn.qkv_proj.weight") for k in keys),
                   fused_gate_up=any(k.endswith("mlp.gate_up_proj.weight") for k in keys),
                   fused_experts=any(k.endswith("mlp.experts.gate_up_proj") for k in keys))

    def _blocks_of(self, t: TensorInfo) -> tuple[RowBlock, ...]:
        rows = t.shape[0]
        part = t.name.rsplit(".", 2)[-2] if t.layer is not None else ""
        if t.expert is not None:  # a routed expert: per-expert plain names, or the fused 3-D tensors
            if not self.fused_experts:
                return (RowBlock(_plain(t.name), 0, 0, rows),)
            src = f"model.layers.{t.layer}.mlp.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
            return (RowBlock(src, rows if part == "up_proj" else 0, 0, rows, t.expert),)
        if self.fused_qkv and part in ("q_proj", "k_proj", "v_proj"):
            m = self.model
            per, d = m.heads // m.kv_heads, m.head_dim
            src = f"model.layers.{t.layer}.self_attn.qkv_proj.{t.name.rsplit('.', 1)[-1]}"
            group = (per + 2) * d
            at, n = {"q_proj": (0, per * d), "k_proj": (per * d, d), "v_proj": ((per + 1) * d, d)}[part]
            return tuple(RowBlock(src, j * group + at, j * n, n) for j in range(m.kv_heads))
        if self.fused_gate_up and part in ("gate_proj", "up_proj"):
            src = f"model.layers.{t.layer}.mlp.gate_up_proj.weight"
            return (RowBlock(src, 0 if part == "gate_proj" else self.model.ffn, 0, rows),)
        return (RowBlock(_plain(t.name), 0, 0, rows),)

    # ---- reading ---------------------------------------------------------------------------
    def read(self, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...], fetch: Fetch) -> torch.Tensor:
        """The region ``offsets + lengths`` of inventory tensor ``name``, fetched row block by
        row block (only the rows and columns it covers are read)."""
        lo, hi = offsets[0], offsets[0] + lengths[0]
        rest = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
        parts = []
        for b in self.blocks[name]:
            a, z = max(lo, b.row), min(hi, b.row + b.rows)
            if a < z:
                rows = (slice(b.source_row + a - b.row, b.source_row + z - b.row),) + rest
                if b.index is None:
                    parts.append(fetch(b.source, rows))
                else:  # a slice (not an int) on dim 0: safetensors' get_slice takes slices
                    parts.append(fetch(b.source, (slice(b.index, b.index + 1),) + rows)[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts, 0)

    def check(self, shapes: Mapping[str, tuple[int, ...]], equal_tied=None) -> None:
        """SpecError unless a checkpoint with these tensor shapes holds exactly this model's
        tensors. A tied model's ``lm_head.weight`` may be present (``state_dict()`` lists it)
        if ``equal_tied()`` says it equals the embedding."""
        missing = sorted(set(self.shapes) - set(shapes))
        extra = sorted(k for k in set(shapes) - set(self.shapes) if not k.endswith(IGNORED_SUFFIXES))
        if extra == ["lm_head.weight"] and self.head == "lm" and self.model.tie_embeddings:
            if equal_tied is not None and not equal_tied():
                raise SpecError(f"{self.model.name}: ties its LM head to the embedding, but the checkpoint's "
                                "lm_head.weight differs from model.embed_tokens.weight")
            extra = []
        if missing or extra:
            raise SpecError(f"{self.model.name}: checkpoint does not match the model: missing {missing[:4]}"
                            f"{' ...' if len(missing) > 4 else ''} ({len(missing)}), unexpected {extra[:4]}"
                            f"{' ...' if len(extra) > 4 else ''} ({len(extra)})")
        for k, want in self.shapes.items():
            if tuple(shapes[k]) != want:
                raise SpecError(f"{self.model.name}: {k} has shape {tuple(shapes[k])}, the model needs {want}")

    # ---- whole state dicts -------------------------------------------------------------------
    def to_inventory(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict as full inventory tensors (fresh memory)."""
        self.check({k: tuple(v.shape) for k, v in state.items()},
                   lambda: torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]))
        fetch = lambda name, index: state[name][index]  # noqa: E731
        return {t.name: self.read(t.name, (0,) * len(t.shape), t.shape, fetch).clone()
                for t in tensor_inventory(self.model, self.head)}

    def to_hf(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full inventory tensors as a Hugging Face state dict with this map's names (a tied
        model has no ``lm_head.weight``, as ``save_pretrained`` writes it)."""
        out: dict[str, torch.Tensor] = {}
        for name, blocks in self.blocks.items():
            t = full[name]
            for b in blocks:
                dst = out.get(b.source)
                if dst is None:
                    dst = out[b.source] = torch.empty(self.shapes[b.source], dtype=t.dtype)
                if b.index is None:
                    dst[b.source_row:b.source_row + b.rows] = t[b.row:b.row + b.rows]
                else:
                    dst[b.index, b.source_row:b.source_row + b.rows] = t[b.row:b.row + b.rows]
        return out
