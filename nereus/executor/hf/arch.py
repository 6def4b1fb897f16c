"""Which Hugging Face architectures the executor runs, and their ModelSpec.

``spec_of(config)`` reads a ``transformers`` config object or a ``config.json`` dict (Llama,
Qwen2, Qwen3, Qwen3-MoE) through ``nereus.models.spec.from_hf_dict`` and refuses, naming the setting, what
the executor's model (``nereus.executor.model``) does not compute: rotary scaling other than the
default (``rope_theta`` only: no ``llama3``/``yarn``/``linear``, no partial rotary), an activation
other than SiLU, biases on ``o_proj`` or the MLP, sliding-window attention, Llama's
``pretraining_tp``; for Qwen3-MoE ``norm_topk_prob`` false (the executor renormalises the top-k
router probabilities, as Qwen3-30B-A3B / 235B-A22B and Mixtral do). ``TINY`` holds the small configs the tests and ``nereus reshard-check --arch``
use; ``hf_config`` builds the ``transformers`` config object from one (the only import of
transformers here, done when called).
"""
from __future__ import annotations

from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec, from_hf_dict

ARCHS = ("llama", "qwen2", "qwen3")
"""Dense architectures."""
MOE_ARCHS = ("qwen3_moe",)
"""Mixture-of-experts architectures (``nereus.executor.model.moe_mlp``): experts sharded by EP and expert TP."""

_BASE = {"num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
TINY: Mapping[str, Mapping[str, Any]] = {
    # GQA 8/4, rope_theta of Llama 3, untied head
    "llama": {**_BASE, "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8,
              "num_key_value_heads": 4, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # QKV bias, tied embeddings
    "qwen2": {**_BASE, "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    # q/k norm, head_dim 32 != hidden / heads = 16
    "qwen3": {**_BASE, "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 1000000.0, "tie_word_embeddings": False},
    # 8 routed experts of width 32, top 2 renormalised, every block sparse; q/k norm as Qwen3
    "qwen3_moe": {**_BASE, "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 1000000.0,
                  "tie_word_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": []},
}
"""config.json contents of tiny models (2 layers, hidden 64-128, vocab 256), one per architecture."""


def config_dict(config: Any) -> dict[str, Any]:
    """A ``transformers`` config object (``to_dict``) or a mapping, as a plain dict."""
    return dict(config) if isinstance(config, Mapping) else config.to_dict()


def spec_of(config: Any, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a supported Hugging Face config; SpecError naming what is not supported."""
    d = config_dict(config)
    arch = str(d.get("model_type", ""))
    where = f"Hugging Face config ({arch or 'no model_type'})"
    if arch not in ARCHS + MOE_ARCHS:
        raise SpecError(f"{where}: model_type must be one of {', '.join(ARCHS)}, got {arch!r} "
                        f"(mixture of experts: {', '.join(MOE_ARCHS)})")
    if arch in MOE_ARCHS:
        stray = [k for k in ("shared_expert_intermediate_size", "n_shared_experts") if d.get(k)]
        if stray:
            raise SpecError(f"{where}: not supported by the executor: shared experts ({stray[0]})")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise SpecError(f"{where}: rope_type {kind!r} is not supported (the executor computes the default "
                        "rotary embedding from rope_theta only)")
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    refuse = {"hidden_act": d.get("hidden_act", "silu") != "silu", "mlp_bias": bool(d.get("mlp_bias")),
              "attention_bias on o_proj (Llama)": arch == "llama" and bool(d.get("attention_bias")),
              "use_sliding_window": bool(d.get("use_sliding_window")),
              "pretraining_tp": (d.get("pretraining_tp") or 1) != 1, "partial_rotary_factor": partial != 1.0,
              "norm_topk_prob false": arch == "qwen3_moe" and not d.get("norm_topk_prob", False)}
    bad = [k for k, v in refuse.items() if v]
    if bad:
        raise SpecError(f"{where}: not supported by the executor: {', '.join(bad)}")
    return from_hf_dict(d, name or d.get("_name_or_path") or f"hf-{arch}", where=where)


def hf_config(arch: str, **overrides: Any):
    """The ``transformers`` config object of ``TINY[arch]`` (imports transformers)."""
    from transformers import AutoConfig

    if arch not in TINY:
        raise SpecError(f"arch must be one of {', '.join(TINY)}, got {arch!r}")
    kw = {k: v for k, v in {**TINY[arch], **overrides}.items() if k != "model_type"}
    return AutoConfig.for_model(arch, **kw)
