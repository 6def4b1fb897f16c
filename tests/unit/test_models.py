import json

import pytest

from nereus.errors import SpecError
from nereus.models import from_hf_config, preset, preset_names, stage_tensors, tensor_inventory, tp_shard

# N from shared/reference/COST_MODEL.md (billions)
PUBLISHED_N = {
    "llama-3.1-8b": 8.03, "llama-3.1-70b": 70.6, "qwen2.5-7b": 7.62, "qwen2.5-32b": 32.8, "qwen2.5-72b": 72.7,
    "qwen3-8b": 8.19, "qwen3-14b": 14.8, "deepseek-r1-distill-qwen-1.5b": 1.78,
}
PUBLISHED_KV_KIB = {
    "llama-3.1-8b": 128, "llama-3.1-70b": 320, "qwen2.5-7b": 56, "qwen2.5-32b": 256, "qwen2.5-72b": 320,
    "qwen3-8b": 144, "qwen3-14b": 160, "deepseek-r1-distill-qwen-1.5b": 28,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_N))
def test_param_counts_match_published_within_1pct(name):
    n = preset(name).num_params() / 1e9
    assert abs(n - PUBLISHED_N[name]) / PUBLISHED_N[name] < 0.01, n


@pytest.mark.parametrize("name", sorted(PUBLISHED_KV_KIB))
def test_kv_bytes_per_token(name):
    assert preset(name).kv_bytes_per_token() == PUBLISHED_KV_KIB[name] * 1024


def test_inventory_sums_to_num_params():
    for name in preset_names():
        m = preset(name)
        assert sum(t.numel for t in tensor_inventory(m)) == m.num_params()


def test_stage_tensors_partition_the_model():
    m = preset("tiny-4l-128h")
    for pp in (1, 2, 4):
        names = [t.name for s in range(pp) for t in stage_tensors(m, pp, s)]
        assert sorted(names) == sorted(t.name for t in tensor_inventory(m))


def test_tp_shard_head_boundaries_and_kv_replication():
    m = preset("llama-3.1-8b")
    k = next(t for t in tensor_inventory(m) if t.name == "layers.0.attn.k_proj.weight")
    assert tp_shard(k, 4, 1) == (0, 256, 256)
    # tp=16 > 8 kv heads: ranks 2 and 3 both hold head 1
    assert tp_shard(k, 16, 2) == tp_shard(k, 16, 3) == (0, 128, 128)
    o = next(t for t in tensor_inventory(m) if t.name == "layers.0.attn.o_proj.weight")
    assert tp_shard(o, 8, 7) == (1, 3584, 512)


def test_hf_config_roundtrip(tmp_path):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = from_hf_config(p, name="q")
    assert m.num_params() == preset("qwen2.5-7b").num_params()
    assert m.qkv_bias


def test_hf_config_errors(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        from_hf_config(p)
    p.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SpecError, match="missing key"):
        from_hf_config(p)


def test_unknown_preset_lists_known():
    with pytest.raises(SpecError, match="llama-3.1-8b"):
        preset("llama-9")


@pytest.mark.parametrize("name, billions", [
    ("qwen2.5-0.5b", 0.49), ("qwen2.5-1.5b", 1.54), ("qwen2.5-3b", 3.09), ("llama-3.2-1b", 1.24),
    ("llama-3.2-3b", 3.21), ("qwen3-0.6b", 0.6), ("qwen3-4b", 4.0)])
def test_small_presets_have_their_published_parameter_counts(name, billions):
    """The small models' presets (tied embeddings counted once) match their model cards' sizes."""
    assert preset(name).num_params() / 1e9 == pytest.approx(billions, rel=0.02)
