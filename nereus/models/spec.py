"""ModelSpec: the architecture of one decoder-only network, as pure data.

Torch-free. Presets live in ``presets/presets.json``; any Hugging Face ``config.json`` can be
read with :func:`from_hf_config` (config parsing only, no weights).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, naming, number, read_json


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Shape of a Llama/Qwen-style decoder (RMSNorm, GQA attention, SwiGLU MLP)."""

    name: str
    """Preset name or a free label."""
    layers: int
    """Number of transformer blocks (L)."""
    hidden: int
    """Model width (h)."""
    ffn: int
    """SwiGLU intermediate size (f)."""
    heads: int
    """Query heads (a)."""
    kv_heads: int
    """Key/value heads (g); g < a is grouped-query attention."""
    vocab: int
    """Vocabulary size (V)."""
    head_dim: int = 128
    """Per-head width (d)."""
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

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "head_dim", "dtype_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise SpecError(f"model {self.name!r}: {f} must be a positive integer, got {v!r}")
            number(f"model {self.name!r}", f, v, whole=True)  # and at most MAX_WHOLE
        for f in ("rope_theta", "norm_eps"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise SpecError(f"model {self.name!r}: {f} must be a positive number, got {v!r}")
            number(f"model {self.name!r}", f, v)  # and finite
        if self.heads % self.kv_heads:
            raise SpecError(
                f"model {self.name!r}: heads({self.heads}) is not a multiple of kv_heads({self.kv_heads})"
            )

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f = self.hidden, self.ffn
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        return attn + 3 * h * f + 2 * h  # + two RMSNorm weights

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def head_params(self) -> int:
        """LM-head parameters (0 when tied to the embedding) plus the final norm."""
        return (0 if self.tie_embeddings else self.vocab * self.hidden) + self.hidden

    def num_params(self) -> int:
        """Total parameters N (embedding and LM head included)."""
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()

    def matmul_params(self) -> int:
        """Parameters that take part in matmuls (excludes the embedding lookup): the 2N of FLOPs."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers: 2 * L * g * d * bytes."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
    return ModelSpec(name=key, **table[key])


def from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (Llama, Qwen2, Qwen3 families). No weights."""
    p = Path(path)
    with naming(p):
        return from_hf_dict(read_json(p, "hf_config"), name, where=f"hf_config {p}",
                            default_name=p.parent.name or "hf-model")


def from_hf_dict(cfg: Mapping[str, Any], name: str | None = None, *, where: str = "hf_config",
                 default_name: str = "hf-model") -> ModelSpec:
    """A ``config.json``'s contents (or ``PretrainedConfig.to_dict()``) as a ModelSpec.

    ``rope_theta`` is read at the top level (transformers 4.x) or under ``rope_parameters``
    (5.x); a missing ``rms_norm_eps`` is 1e-6, the Llama/Qwen default."""
    if not isinstance(cfg, Mapping):
        raise SpecError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    need = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise SpecError(f"{where}: missing key(s) {missing}")
    heads = cfg["num_attention_heads"]
    if not cfg.get("head_dim"):  # head_dim = hidden_size // heads: both must be positive whole numbers
        for k in ("num_attention_heads", "hidden_size"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or cfg[k] <= 0:
                raise SpecError(f"{where}: {k} must be a positive integer, got {cfg[k]!r}")
    model_type = str(cfg.get("model_type", "")).lower()
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise SpecError(f"{where}: rope_parameters must be a mapping, got {type(rope).__name__}")
    for key in ("tie_word_embeddings", "attention_bias"):
        if cfg.get(key) is not None and not isinstance(cfg[key], bool):
            raise SpecError(f"{where}: {key} must be true or false, got {cfg[key]!r}")
    floats = {}
    for key, value in (("rope_theta", cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                       ("rms_norm_eps", cfg.get("rms_norm_eps") or 1e-6)):
        try:
            floats[key] = float(value)
        except (TypeError, ValueError, OverflowError):
            raise SpecError(f"{where}: {key} must be a number, got {value!r}") from None
    return ModelSpec(
        name=str(name or cfg.get("_name_or_path") or default_name),
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        ffn=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        vocab=cfg["vocab_size"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        rope_theta=floats["rope_theta"],
        norm_eps=floats["rms_norm_eps"],
    )


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
