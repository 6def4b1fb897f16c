"""ModelSpec: the architecture of one decoder-only network, as pure data.

Torch-free. Presets live in ``presets/presets.json``; any Hugging Face ``config.json`` of a model
type this package models can be read with :func:`from_hf_config` (config parsing only, no
weights); ``hf.py`` holds which types and keys are modelled, and refuses the rest by name.

Mixture of experts: a block listed in ``moe_layers`` replaces its SwiGLU MLP by a router and
``experts`` SwiGLU experts of width ``expert_ffn`` (``experts_per_token`` of them run per token),
plus an optional always-on shared expert. Memory follows every parameter (``num_params``), FLOPs
the parameters one token runs through (``active_params``, ``matmul_params``); ``expert_params``
is the part expert parallelism shards. Worked example (Qwen3-30B-A3B, 48 blocks, h=2048,
128 experts of width 768, top 8): one expert is 3*2048*768 = 4.72M parameters; a block holds 128
of them (604M) but a token uses 8 (37.7M), so the model is 30.5B total and 3.35B active.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, naming, number, read_json
from nereus.models.hf import DENSE_TYPES, check_model_keys, moe_fields

_MOE_FIELDS = ("experts", "experts_per_token", "expert_ffn", "shared_expert_ffn", "shared_expert_gate",
               "router_score_bias", "moe_layers")
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Shape of a Llama/Qwen-style decoder (RMSNorm, GQA attention, SwiGLU MLP), optionally with
    mixture-of-experts blocks and DeepSeek's multi-head latent attention (MLA)."""

    name: str
    """Preset name or a free label."""
    layers: int
    """Number of transformer blocks (L)."""
    hidden: int
    """Model width (h)."""
    ffn: int
    """SwiGLU intermediate size (f) of the dense blocks (those not in ``moe_layers``)."""
    heads: int
    """Query heads (a)."""
    kv_heads: int
    """Key/value heads (g); g < a is grouped-query attention. MLA: g = a."""
    vocab: int
    """Vocabulary size (V)."""
    head_dim: int = 128
    """Per-head width (d) of q and k. MLA: qk_nope_head_dim + qk_rope_head_dim."""
    tie_embeddings: bool = False
    """LM head shares the embedding matrix."""
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm on per-head q and k (Qwen3)."""
    dtype_bytes: int = 2
    """Bytes per parameter / activation element in the compute dtype (bf16 = 2)."""
    rope_theta: float = 10000.0
    """Rotary base (Hugging Face ``rope_theta``); used by the executor, not by the cost model."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (Hugging Face ``rms_norm_eps``); used by the executor, not by the cost model."""
    experts: int = 0
    """Routed experts in each MoE block (E); 0 is a dense model."""
    experts_per_token: int = 0
    """Routed experts each token runs through (top-k)."""
    expert_ffn: int = 0
    """SwiGLU intermediate size of one routed expert (HF ``moe_intermediate_size``; Mixtral's
    ``intermediate_size``)."""
    shared_expert_ffn: int = 0
    """Intermediate size of the always-on shared expert MLP of each MoE block, all shared experts
    together (DeepSeek: n_shared_experts * moe_intermediate_size; Qwen2-MoE:
    shared_expert_intermediate_size); 0: none."""
    shared_expert_gate: bool = False
    """A sigmoid gate (Linear h -> 1) scales the shared expert's output (Qwen2-MoE)."""
    router_score_bias: bool = False
    """The router holds a per-expert score-correction bias (DeepSeek-V3's e_score_correction_bias)."""
    moe_layers: tuple[int, ...] = ()
    """Blocks whose MLP is a mixture of experts, increasing; the others are dense with ``ffn``."""
    q_lora_rank: int = 0
    """MLA: rank of the low-rank query (q_a_proj -> q_b_proj); 0: a full q_proj."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed KV latent that the KV cache holds; 0: not MLA."""
    qk_rope_head_dim: int = 0
    """MLA: rotary part of each q/k head, and of the shared rotary key in the cache."""
    v_head_dim: int = 0
    """MLA: per-head value width."""

    def __post_init__(self) -> None:
        owner = f"model {self.name!r}"
        for f in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "head_dim", "dtype_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"{owner}: {f} must be a positive integer, got {v!r}")
            number(owner, f, v, whole=True)  # and at most MAX_WHOLE
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise SpecError(f"{owner}: {f} must be a positive number, got {v!r}")
            number(owner, f, v)  # and finite
        if self.heads % self.kv_heads:
            raise SpecError(f"{owner}: heads({self.heads}) is not a multiple of kv_heads({self.kv_heads})")
        for f in ("experts", "experts_per_token", "expert_ffn", "shared_expert_ffn") + _MLA_FIELDS:
            number(owner, f, getattr(self, f), whole=True)
        for f in ("shared_expert_gate", "router_score_bias"):
            if not isinstance(getattr(self, f), bool):
                raise SpecError(f"{owner}: {f} must be true or false, got {getattr(self, f)!r}")
        self._check_moe(owner)
        self._check_mla(owner)

    def _check_moe(self, owner: str) -> None:
        if isinstance(self.moe_layers, list):  # JSON gives a list; the spec stays hashable
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        ml = self.moe_layers
        if not isinstance(ml, tuple) or any(isinstance(i, bool) or not isinstance(i, int) for i in ml):
            raise SpecError(f"{owner}: moe_layers must be a list of block indices, got {ml!r}")
        if self.experts == 0:
            stray = [f for f in _MOE_FIELDS[1:] if getattr(self, f)]
            if stray:
                raise SpecError(f"{owner}: {stray} set on a dense model (experts is 0)")
            return
        if not 1 <= self.experts_per_token <= self.experts:
            raise SpecError(f"{owner}: experts_per_token({self.experts_per_token}) must be between 1 and "
                            f"experts({self.experts})")
        if self.expert_ffn <= 0:
            raise SpecError(f"{owner}: expert_ffn must be a positive integer with experts({self.experts}), "
                            f"got {self.expert_ffn}")
        if not ml or list(ml) != sorted(set(ml)) or not 0 <= ml[0] <= ml[-1] < self.layers:
            raise SpecError(f"{owner}: moe_layers must be increasing block indices in 0..{self.layers - 1}, "
                            f"got {list(ml)}")
        if self.shared_expert_gate and not self.shared_expert_ffn:
            raise SpecError(f"{owner}: shared_expert_gate without a shared expert (shared_expert_ffn is 0)")

    def _check_mla(self, owner: str) -> None:
        if not self.kv_lora_rank:
            stray = [f for f in _MLA_FIELDS if getattr(self, f)]
            if stray:
                raise SpecError(f"{owner}: {stray} set without multi-head latent attention (kv_lora_rank is 0)")
            return
        if not 0 < self.qk_rope_head_dim < self.head_dim or self.v_head_dim <= 0:
            raise SpecError(f"{owner}: MLA needs 0 < qk_rope_head_dim({self.qk_rope_head_dim}) < "
                            f"head_dim({self.head_dim}) and v_head_dim({self.v_head_dim}) > 0")
        if self.kv_heads != self.heads or self.qkv_bias or self.qk_norm:
            raise SpecError(f"{owner}: MLA has kv_heads == heads({self.heads}) (got {self.kv_heads}) and no "
                            "qkv_bias or qk_norm")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Blocks with a dense SwiGLU MLP of width ``ffn``."""
        return _dense_layers(self.layers, self.moe_layers)

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the non-rotary part of each q/k head (0 without MLA)."""
        return self.head_dim - self.qk_rope_head_dim if self.is_mla else 0

    @property
    def kv_latent_dim(self) -> int:
        """MLA: elements one block caches per token (the KV latent plus the shared rotary key)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def attn_params(self) -> int:
        """Parameters of one block's attention (projections, their biases, q/k or latent norms)."""
        h, a = self.hidden, self.heads
        if self.is_mla:  # q: down, norm, up (or one q_proj); kv: down to the latent + rotary key, norm, up; o
            r, c = self.q_lora_rank, self.kv_lora_rank
            q = h * r + r + r * self.q_dim if r else h * self.q_dim
            kv = h * self.kv_latent_dim + c + c * a * (self.qk_nope_head_dim + self.v_head_dim)
            return q + kv + a * self.v_head_dim * h
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn

    def one_expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden * self.expert_ffn

    def router_params(self) -> int:
        """Parameters of one MoE block's router (and its score-correction bias)."""
        return self.experts * self.hidden + (self.experts if self.router_score_bias else 0)

    def shared_expert_params(self) -> int:
        """Parameters of one MoE block's shared expert (and its gate)."""
        return 3 * self.hidden * self.shared_expert_ffn + (self.hidden if self.shared_expert_gate else 0)

    def _moe_mlp(self, routed: int) -> int:
        return routed * self.one_expert_params() + self.router_params() + self.shared_expert_params()

    def _blocks(self, moe_mlp: int) -> int:
        """All blocks' parameters when an MoE block's MLP holds ``moe_mlp``."""
        base = self.attn_params() + 2 * self.hidden  # + two RMSNorm weights
        n_moe = len(self.moe_layers)
        return (self.layers - n_moe) * (base + 3 * self.hidden * self.ffn) + n_moe * (base + moe_mlp)

    def _block(self, routed: int, layer: int | None) -> int | float:
        if layer is None:  # the mean block: exact (an int) whenever it is whole, as for a dense model
            total = self._blocks(self._moe_mlp(routed))
            return total // self.layers if total % self.layers == 0 else total / self.layers
        mlp = self._moe_mlp(routed) if layer in self.moe_layers else 3 * self.hidden * self.ffn
        return self.attn_params() + mlp + 2 * self.hidden

    def layer_params(self, layer: int | None = None) -> int | float:
        """Parameters of block ``layer`` (every expert counted); without ``layer``, the mean over the
        blocks, so ``layers * layer_params()`` is all blocks (one block's count for a dense model)."""
        return self._block(self.experts, layer)

    def active_layer_params(self, layer: int | None = None) -> int | float:
        """As ``layer_params`` with only the ``experts_per_token`` routed experts a token runs through."""
        return self._block(self.experts_per_token, layer)

    def weight_tensors(self) -> int:
        """Named tensors of the model's Hugging Face checkpoint: what a per-tensor weight sync sends
        one call at a time (the trainer converts its shards to these names, the engine loads them).

        Per block: attention q, k, v, o (MLA: q_proj, or q_a_proj + q_a_layernorm + q_b_proj;
        kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), q/k/v biases (Qwen2.5), q/k norms
        (Qwen3), two RMSNorms; the MLP's gate, up and down, or in an MoE block 3 per routed expert,
        the router (and its score bias), the shared expert's 3 (and its gate). Plus the embedding,
        the final norm and an untied LM head. Qwen3-30B-A3B: 48 * (4 + 2 + 2 + 128 * 3 + 1) + 3 =
        18,867 tensors, 98% of them expert matrices; Qwen2.5-7B: 28 * (4 + 3 + 2 + 3) + 3 = 339."""
        if self.is_mla:
            attn = (3 if self.q_lora_rank else 1) + 3 + 1
        else:
            attn = 4 + (3 if self.qkv_bias else 0) + (2 if self.qk_norm else 0)
        moe = (3 * self.experts + 1 + (1 if self.router_score_bias else 0)
               + (3 if self.shared_expert_ffn else 0) + (1 if self.shared_expert_gate else 0))
        n_moe = len(self.moe_layers)
        blocks = self.layers * (attn + 2) + (self.layers - n_moe) * 3 + n_moe * moe
        return blocks + 2 + (0 if self.tie_embeddings else 1)

    def expert_params(self) -> int:
        """Routed experts' parameters over all blocks: what expert parallelism shards."""
        return len(self.moe_layers) * self.experts * self.one_expert_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """LM-head parameters (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_embeddings else self.vocab * self.hidden) + self.hidden

    def num_params(self) -> int:
        """Total parameters N (embedding, LM head and every expert included): what memory holds."""
        return self._blocks(self._moe_mlp(self.experts)) + self.embedding_params() + self.head_params()

    def active_params(self) -> int:
        """Parameters one token runs through, embedding and head included (a model card's
        "activated" count); ``num_params()`` for a dense model."""
        return self._blocks(self._moe_mlp(self.experts_per_token)) + self.embedding_params() + self.head_params()

    def matmul_params(self) -> int:
        """Parameters one token multiplies with (excludes the embedding lookup; only the active
        experts): the 2N of FLOPs."""
        return _matmul_params(self)

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers: 2 * L * g * d * bytes; MLA caches the latent,
        L * (kv_lora_rank + qk_rope_head_dim) * bytes, the same on every TP rank."""
        if self.is_mla:
            return self.layers * self.kv_latent_dim * self.dtype_bytes
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, except the expert and MLA ones at their dense defaults (a dense model's
        dict is what it was before models had experts)."""
        d = asdict(self)
        for f in _MOE_FIELDS + _MLA_FIELDS:
            if not d[f]:
                del d[f]
        if "moe_layers" in d:
            d["moe_layers"] = list(d["moe_layers"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        check_keys("model spec", d, {f.name for f in fields(cls)})
        missing = [f for f in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab") if f not in d]
        if missing:
            raise SpecError(f"model spec {d.get('name', '?')!r}: missing field(s) {missing}")
        return cls(**{"name": "custom", **dict(d)})


def _preset_table() -> dict[str, dict[str, Any]]:
    text = resources.files("nereus.models").joinpath("presets/presets.json").read_text()
    return json.loads(text)


def preset_names() -> tuple[str, ...]:
    return tuple(_preset_table())


def preset(name: str) -> ModelSpec:
    table = _preset_table()
    if not isinstance(name, str):
        raise SpecError(f"model preset must be a name, got {name!r}")
    key = name.lower()
    if key not in table:
        raise SpecError(f"unknown model preset {name!r}; known presets: {', '.join(table)}")
    return ModelSpec(name=key, **{k: v for k, v in table[key].items() if not k.startswith("_")})


def from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (``hf.DENSE_TYPES`` and ``hf.MOE_TYPES``). No weights."""
    p = Path(path)
    with naming(p):
        return from_hf_dict(read_json(p, "hf_config"), name, where=f"hf_config {p}",
                            default_name=p.parent.name or "hf-model")


def from_hf_dict(cfg: Mapping[str, Any], name: str | None = None, *, where: str = "hf_config",
                 default_name: str = "hf-model") -> ModelSpec:
    """A ``config.json``'s contents (or ``PretrainedConfig.to_dict()``) as a ModelSpec.

    Refuses (SpecError naming it) a ``model_type`` this package does not model and any expert or
    latent-attention key it does not model for that type (``hf.check_model_keys``).
    ``rope_theta`` is read at the top level (transformers 4.x) or under ``rope_parameters``
    (5.x); a missing ``rms_norm_eps`` is 1e-6, the Llama/Qwen default."""
    if not isinstance(cfg, Mapping):
        raise SpecError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise SpecError(f"{where}: missing key(s) {missing}")
    model_type = cfg.get("model_type")
    model_type = model_type.lower() if isinstance(model_type, str) else model_type
    check_model_keys(cfg, model_type, where)
    heads = cfg["num_attention_heads"]
    if not cfg.get("head_dim"):  # head_dim = hidden_size // heads: both must be positive whole numbers
        for k in ("num_attention_heads", "hidden_size"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] <= 0:
                raise SpecError(f"{where}: {k} must be a positive integer, got {cfg[k]!r}")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise SpecError(f"{where}: rope_parameters must be a mapping, got {type(rope).__name__}")
    for key in ("tie_word_embeddings", "attention_bias") + (("qkv_bias",) if model_type == "qwen2_moe" else ()):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise SpecError(f"{where}: {key} must be true or false, got {cfg[key]!r}")
    floats = {}
    for key, value in (("rope_theta", cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                       ("rms_norm_eps", cfg.get("rms_norm_eps") or 1e-6)):
        try:
            floats[key] = float(value)
        except (TypeError, ValueError, OverflowError):
            raise SpecError(f"{where}: {key} must be a number, got {value!r}") from None
    # qwen2 and qwen2_moe put a bias on q/k/v unless told otherwise (qwen2_moe's own key: qkv_bias)
    default_bias = cfg.get("qkv_bias", True) if model_type == "qwen2_moe" else model_type == "qwen2"
    qkv_bias = cfg.get("attention_bias", default_bias)
    spec: dict[str, Any] = dict(
        name=str(name or cfg.get("_name_or_path") or default_name),
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        ffn=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(qkv_bias),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_theta=floats["rope_theta"],
        norm_eps=floats["rms_norm_eps"],
    )
    if model_type not in DENSE_TYPES:
        if not isinstance(spec["layers"], int) or isinstance(spec["layers"], bool) or spec["layers"] <= 0:
            raise SpecError(f"{where}: num_hidden_layers must be a positive integer, got {spec['layers']!r}")
        spec.update(moe_fields(cfg, model_type, spec["layers"], where))
        if spec.get("kv_lora_rank"):
            spec["qkv_bias"] = False
    return ModelSpec(**spec)


def load_model(ref: str | Mapping[str, Any], base_dir: Path | None = None) -> ModelSpec:
    """A model reference from a job file: a preset name, ``{hf_config: path}`` or a full dict."""
    if isinstance(ref, str):
        return preset(ref)
    if isinstance(ref, Mapping):
        if "hf_config" in ref:
            if not isinstance(ref["hf_config"], str) or not ref["hf_config"]:
                raise SpecError(f"model reference: hf_config must be a path, got {ref['hf_config']!r}")
            path = Path(ref["hf_config"])
            if base_dir is not None and not path.is_absolute():
                path = base_dir / path
            return from_hf_config(path, ref.get("name"))
        if "preset" in ref:
            return preset(ref["preset"])
        return ModelSpec.from_dict(ref)
    raise SpecError(f"model reference must be a preset name or a mapping, got {type(ref).__name__}")


@lru_cache(maxsize=256)
def _dense_layers(layers: int, moe_layers: tuple[int, ...]) -> tuple[int, ...]:
    sparse = set(moe_layers)
    return tuple(i for i in range(layers) if i not in sparse)


_DERIVED: dict[tuple, tuple] = {}


def derived(model: "ModelSpec", key: tuple, fn):
    """``fn()``, remembered per model instance and ``key``: a ModelSpec is frozen (its fields never
    change), so a size derived from it is too. Keyed by identity (hashing a spec with a long
    ``moe_layers`` costs more than most sizes); the entry holds the model, so its id is not reused."""
    k = (id(model), *key)
    hit = _DERIVED.get(k)
    if hit is not None and hit[0] is model:
        return hit[1]
    if len(_DERIVED) > 16384:
        _DERIVED.clear()
    v = fn()
    _DERIVED[k] = (model, v)
    return v


def _matmul_params(model: "ModelSpec") -> int:
    return derived(model, ("matmul_params",),
                   lambda: model._blocks(model._moe_mlp(model.experts_per_token)) + model.vocab * model.hidden)
