"""Hugging Face ``config.json`` -> ModelSpec fields: which model types and keys are modelled, which
are known to be harmless, and the refusal of the rest.

A config is read only when its ``model_type`` is one this package models (``DENSE_TYPES``,
``MOE_TYPES``). Every key that shapes mixture-of-experts or latent attention (``is_moe_key``: a
name with ``expert``, ``moe``, ``router``, ``lora_rank``, ...) must be read for that model type
(``MOE_KEYS``) or be listed as harmless for it (``HARMLESS_MOE_KEYS``); any other such key is
refused by name, so a model is never planned as something else. ``HARMLESS`` lists the keys every
``PretrainedConfig`` carries (generation defaults, token ids, dtype, dropout, ...) that never
change a size or a FLOP; they are never refused. Other keys are read as before (dense configs keep
loading as they did).

Pure: returns keyword arguments for ``ModelSpec``; ``spec.from_hf_dict`` builds the spec.
"""
from __future__ import annotations

from typing import Any, Mapping

from nereus.errors import SpecError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Llama-shaped decoders (RMSNorm, RoPE, GQA, SwiGLU): exactly what ModelSpec's dense block is."""
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3")

# Keys of ModelSpec's mixture-of-experts and multi-head latent attention that each type reads.
MOE_KEYS: Mapping[str, frozenset[str]] = {
    "qwen2_moe": frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                            "mlp_only_layers", "shared_expert_intermediate_size"}),
    "qwen3_moe": frozenset({"num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "decoder_sparse_step", "mlp_only_layers"}),
    "mixtral": frozenset({"num_local_experts", "num_experts", "num_experts_per_tok"}),
    "deepseek_v3": frozenset({"n_routed_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                              "first_k_dense_replace", "moe_layer_freq", "q_lora_rank", "kv_lora_rank",
                              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim"}),
}
# Routing and loss settings that change neither a parameter count nor the FLOPs of a token.
HARMLESS_MOE_KEYS: Mapping[str, frozenset[str]] = {
    "qwen2_moe": frozenset({"norm_topk_prob", "output_router_logits", "router_aux_loss_coef"}),
    "qwen3_moe": frozenset({"norm_topk_prob", "output_router_logits", "router_aux_loss_coef"}),
    "mixtral": frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}),
    # num_nextn_predict_layers: the multi-token-prediction module is not part of transformers'
    # DeepseekV3ForCausalLM (its layer-61 weights are dropped at load), so an RL job does not hold it
    "deepseek_v3": frozenset({"norm_topk_prob", "n_group", "topk_group", "topk_method", "routed_scaling_factor",
                              "scoring_func", "aux_loss_alpha", "seq_aux", "ep_size", "num_nextn_predict_layers",
                              "num_mtp_layers", "output_router_logits"}),
}
HARMLESS = frozenset({
    # PretrainedConfig's own fields (transformers 4.x and 5.x to_dict())
    "_name_or_path", "_attn_implementation_autoset", "architectures", "auto_map", "transformers_version",
    "model_type", "torch_dtype", "dtype", "use_bfloat16", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix",
    "task_specific_params", "problem_type", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
    "decoder_start_token_id",
    # generation defaults some versions keep in the model config (top_k is sampling, not routing)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # training-time and runtime settings of the architectures above
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "max_position_embeddings",
    "pretraining_tp", "hidden_act", "mlp_bias", "rope_scaling", "rope_interleave", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types", "use_mrope",
    # storage quantization of a checkpoint: the job plans weights in its compute dtype (dtype_bytes)
    "quantization_config",
})
_MOE_WORDS = ("expert", "moe", "router", "routed", "topk", "sparse", "dense", "mlp_only", "lora_rank", "nope",
              "rope_head_dim", "v_head_dim", "qk_head_dim", "n_group", "scoring_func", "aux_loss", "capacity",
              "ep_size", "nextn", "mtp")
# The expert count's names: the hub's config.json name first, then the alias transformers 5.x
# writes in to_dict() (its attribute_map)
EXPERT_COUNT_KEYS: Mapping[str, tuple[str, ...]] = {
    "qwen2_moe": ("num_experts", "num_local_experts"), "qwen3_moe": ("num_experts", "num_local_experts"),
    "mixtral": ("num_local_experts", "num_experts"), "deepseek_v3": ("n_routed_experts", "num_local_experts"),
}


def is_moe_key(key: str) -> bool:
    """A key that shapes experts, routing or latent attention (and so must be modelled or refused)."""
    k = key.lower()
    return any(w in k for w in _MOE_WORDS)


def check_model_keys(cfg: Mapping[str, Any], model_type: str, where: str) -> None:
    """SpecError naming the first key of ``cfg`` that shapes experts or latent attention and that
    ``model_type`` does not model; ``model_type`` must be one of DENSE_TYPES + MOE_TYPES."""
    if model_type not in DENSE_TYPES + MOE_TYPES:
        what = f"model_type {model_type!r} is not modelled" if model_type else "no model_type"
        raise SpecError(f"{where}: {what} (known: {', '.join(DENSE_TYPES + MOE_TYPES)})")
    known = MOE_KEYS.get(model_type, frozenset()) | HARMLESS_MOE_KEYS.get(model_type, frozenset()) | HARMLESS
    bad = sorted(str(k) for k in cfg if is_moe_key(str(k)) and k not in known)
    if bad:
        kind = "a dense" if model_type in DENSE_TYPES else "an MoE"
        raise SpecError(f"{where}: key {bad[0]!r} is not modelled for {kind} model_type {model_type!r}"
                        + (f" (also {bad[1:]})" if len(bad) > 1 else ""))


def _whole(cfg: Mapping[str, Any], key: str, where: str, *, default: Any = None, minimum: int = 0) -> int:
    v = cfg.get(key)
    if v is None:
        if default is None:
            raise SpecError(f"{where}: missing key {key!r}")
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(f"{where}: {key} must be a whole number >= {minimum}, got {v!r}")
    return v


def expert_count(cfg: Mapping[str, Any], model_type: str, where: str) -> int:
    """The routed-expert count under whichever of its names ``cfg`` uses (all that appear must agree)."""
    names = [k for k in EXPERT_COUNT_KEYS[model_type] if cfg.get(k) is not None]
    if not names:
        raise SpecError(f"{where}: missing key {EXPERT_COUNT_KEYS[model_type][0]!r}")
    values = {k: _whole(cfg, k, where) for k in names}
    if len(set(values.values())) > 1:
        raise SpecError(f"{where}: expert counts disagree: {values}")
    return values[names[0]]


def moe_fields(cfg: Mapping[str, Any], model_type: str, layers: int, where: str) -> dict[str, Any]:
    """ModelSpec's expert fields (and DeepSeek-V3's latent attention) from a config of MOE_TYPES."""
    if model_type == "mixtral":
        experts = expert_count(cfg, model_type, where)
        out = {"experts": experts, "expert_ffn": cfg["intermediate_size"], "moe_layers": tuple(range(layers))}
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        experts = expert_count(cfg, model_type, where)
        step = _whole(cfg, "decoder_sparse_step", where, default=1, minimum=1)
        dense = cfg.get("mlp_only_layers") or []
        if not isinstance(dense, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in dense):
            raise SpecError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense!r}")
        if any(not 0 <= i < layers for i in dense):
            raise SpecError(f"{where}: mlp_only_layers {list(dense)} names a layer outside 0..{layers - 1}")
        # transformers: a block is sparse when it is not in mlp_only_layers and (i + 1) % step == 0
        sparse = tuple(i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0)
        out = {"experts": experts if sparse else 0, "expert_ffn": 0, "moe_layers": sparse}
        if sparse:
            out["expert_ffn"] = _whole(cfg, "moe_intermediate_size", where, minimum=1)
            if model_type == "qwen2_moe":  # one shared SwiGLU expert behind a sigmoid gate (Linear h -> 1)
                out["shared_expert_ffn"] = _whole(cfg, "shared_expert_intermediate_size", where, minimum=1)
                out["shared_expert_gate"] = True
    else:  # deepseek_v3
        experts = expert_count(cfg, model_type, where)
        first = _whole(cfg, "first_k_dense_replace", where, default=0)
        if _whole(cfg, "moe_layer_freq", where, default=1, minimum=1) != 1:
            # DeepSeek's reference code skips layers by it, transformers ignores it: not guessed
            raise SpecError(f"{where}: moe_layer_freq {cfg['moe_layer_freq']} is not modelled (only 1)")
        ffn = _whole(cfg, "moe_intermediate_size", where, minimum=1)
        out = {"experts": experts, "expert_ffn": ffn, "moe_layers": tuple(range(first, layers)),
               "shared_expert_ffn": _whole(cfg, "n_shared_experts", where, default=0) * ffn,
               "router_score_bias": True, **mla_fields(cfg, where)}
    if out["experts"]:
        top = _whole(cfg, "num_experts_per_tok", where, minimum=1)
        out["experts_per_token"] = top
    return out


def mla_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and a shared KV latent."""
    if cfg.get("attention_bias"):
        raise SpecError(f"{where}: attention_bias with multi-head latent attention (MLA) is not modelled")
    rope = _whole(cfg, "qk_rope_head_dim", where, minimum=1)
    nope = _whole(cfg, "qk_nope_head_dim", where, minimum=1)
    if cfg.get("qk_head_dim") not in (None, rope + nope):
        raise SpecError(f"{where}: qk_head_dim {cfg['qk_head_dim']!r} != qk_nope_head_dim({nope}) + "
                        f"qk_rope_head_dim({rope})")
    return {"q_lora_rank": _whole(cfg, "q_lora_rank", where, default=0),  # null: a full q_proj
            "kv_lora_rank": _whole(cfg, "kv_lora_rank", where, minimum=1), "qk_rope_head_dim": rope,
            "v_head_dim": _whole(cfg, "v_head_dim", where, minimum=1), "head_dim": rope + nope,
            "kv_heads": cfg["num_attention_heads"]}
