"""Mixture-of-experts and latent-attention model specs: parameter counts against the model cards and
against transformers, the refusal of model types and keys that are not modelled (one line, exit 2
on the CLI), JSON round trips, expert tensors in the inventory, and dense models left exactly as
they were."""
import hashlib
import json
import subprocess
import sys

import pytest

from nereus.errors import SpecError
from nereus.models import ModelSpec, check_tp, from_hf_dict, preset, preset_names, stage_tensors, tensor_inventory
from nereus.models.inventory import storage_dims

# Model cards (billions): total, activated per token.
#   Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B on huggingface.co ("30.5B in total and 3.3B activated",
#   "235B in total and 22B activated"); mistralai/Mixtral-8x7B-v0.1 (Mixtral paper, arXiv 2401.04088:
#   46.7B total, 12.9B per token); DeepSeek-V3 technical report (arXiv 2412.19437: 671B total, 37B
#   activated; README_WEIGHTS.md says 36.7B, the MTP module excluded from both).
CARDS = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235.0, 22.0), "mixtral-8x7b": (46.7, 12.9),
         "deepseek-v3": (671.0, 37.0)}

# Qwen/Qwen3-30B-A3B config.json as published on the hub (transformers 4.51.0).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
# deepseek-ai/DeepSeek-V3 config.json (the fields that shape the model; quantization_config as shipped)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "aux_loss_alpha": 0.001, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "v_head_dim": 128, "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]}}

# Captured on main before models had experts: num_params, matmul_params, layer_params,
# kv_bytes_per_token, sha256[:16] of to_dict() and of the inventories (lm and value head) + storage dims.
DENSE_BEFORE = {
    'llama-3.1-8b': (8030261248, 7504920576, 218112000, 131072, 'cdcc83ae52f27fbd', '699b6a40fa2e83f8'),
    'llama-3.1-70b': (70553706496, 69503025152, 855654400, 327680, '2c4aff77df6a6010', 'f7c65d680a1c7fb1'),
    'qwen2.5-7b': (7615616512, 7070615552, 233057792, 57344, '1bbc41b47c8aea20', 'f0f33901f93c6f89'),
    'qwen2.5-32b': (32763876352, 31985303552, 487605248, 262144, '6f9b9bf81d07ddce', 'a08923d723e0c3fd'),
    'qwen2.5-72b': (72706203648, 71460487168, 877684736, 327680, '3fd6fa9f19af6941', '47f237a08e3768bc'),
    'qwen3-8b': (8190735360, 7568401408, 192946432, 147456, '441072dc556ca124', '67316f7906e63bea'),
    'qwen3-14b': (14768307200, 13990389760, 330311936, 163840, '0f6d454f73336edc', 'f0c601702c38f1cf'),
    'deepseek-r1-distill-qwen-1.5b': (1777088000, 1543712768, 46797824, 28672, 'bf596cdbacf986a8', 'fb42e951d011d4c0'),
    'qwen2.5-0.5b': (494032768, 494031872, 14912384, 12288, '7112109bc6bf637a', '40e56a06b42c9275'),
    'qwen2.5-1.5b': (1543714304, 1543712768, 46797824, 28672, 'c217b49b99b8d561', '83b89414f53c9f02'),
    'qwen2.5-3b': (3085938688, 3085936640, 77076992, 36864, 'f3de0f2b1e7c2fd6', 'cacc241e2fdb99ef'),
    'llama-3.2-1b': (1235814400, 1235812352, 60821504, 32768, '3315f00046379cc8', 'a1bb4b580fd2c200'),
    'llama-3.2-3b': (3212749824, 3212746752, 100669440, 114688, '4ae925c7fae02997', '764d408e8b8859e8'),
    'qwen3-0.6b': (596049920, 596048896, 15730944, 114688, '6dbd548fdfe2f348', '3dcf61ddd942b2ba'),
    'qwen3-4b': (4022468096, 4022465536, 100930816, 147456, '3d55106b5352a129', '3f4912a80f8f5257'),
    'tiny-4l-128h': (607360, 599040, 147712, 1024, 'abc40a3d3c0a1822', '6f9f01bafd260e8b'),
}


def _digest(x) -> str:
    return hashlib.sha256(json.dumps(x, sort_keys=True).encode()).hexdigest()[:16]


def _rows(m, head="lm"):
    return [[t.name, list(t.shape), t.tp_dim, t.tp_max, t.layer, t.part] for t in tensor_inventory(m, head)]


@pytest.mark.parametrize("name", sorted(DENSE_BEFORE))
def test_dense_presets_are_exactly_what_they_were(name):
    m = preset(name)
    inv = _digest([_rows(m), _rows(m, "value"), dict(storage_dims(m))])
    now = (m.num_params(), m.matmul_params(), m.layer_params(), m.kv_bytes_per_token(), _digest(m.to_dict()), inv)
    assert now == DENSE_BEFORE[name]
    assert m.active_params() == m.num_params() and m.expert_params() == 0 and not m.is_moe and not m.is_mla
    assert all(t.expert is None for t in tensor_inventory(m))


@pytest.mark.parametrize("name", sorted(CARDS))
def test_total_and_active_parameters_match_the_model_cards_within_2pct(name):
    m = preset(name)
    total, active = CARDS[name]
    assert m.num_params() / 1e9 == pytest.approx(total, rel=0.02)
    assert m.active_params() / 1e9 == pytest.approx(active, rel=0.02)
    # the arithmetic pieces add up: the blocks, embedding and head; experts are what EP shards
    assert m.layers * m.layer_params() + m.embedding_params() + m.head_params() == pytest.approx(m.num_params())
    assert m.num_params() - m.active_params() == \
        len(m.moe_layers) * (m.experts - m.experts_per_token) * m.one_expert_params()
    # FLOPs: the active blocks and the LM head, not the embedding lookup or the final norm
    assert m.matmul_params() == m.active_params() - m.embedding_params() - m.hidden


def test_the_worked_example_of_qwen3_30b_a3b():
    m = preset("qwen3-30b-a3b")
    assert m.one_expert_params() == 3 * 2048 * 768
    assert m.expert_params() == 48 * 128 * 3 * 2048 * 768
    assert m.layer_params(0) - m.active_layer_params(0) == 120 * 3 * 2048 * 768
    assert m.kv_bytes_per_token() == 2 * 48 * 4 * 128 * 2


def test_deepseek_v3_latent_attention_sizes():
    m = preset("deepseek-v3")
    assert m.is_mla and m.qk_nope_head_dim == 128 and m.kv_latent_dim == 576
    # the cache holds the 512-wide latent and the 64-wide rotary key: 70,272 bytes a token (DeepSeek-V2
    # paper: (d_c + d_h^R) * l elements per token)
    assert m.kv_bytes_per_token() == 61 * 576 * 2
    assert m.dense_layers == (0, 1, 2) and m.moe_layers == tuple(range(3, 61))
    assert m.layer_params(0) == m.attn_params() + 3 * 7168 * 18432 + 2 * 7168
    assert m.layer_params(3) - m.layer_params(0) == (256 * 3 * 7168 * 2048 + 256 * 7168 + 256
                                                     + 3 * 7168 * 2048 - 3 * 7168 * 18432)


@pytest.mark.parametrize("cfg,name", [(QWEN3_30B_A3B, "qwen3-30b-a3b"), (DEEPSEEK_V3, "deepseek-v3")])
def test_the_published_config_json_reads_as_the_preset(cfg, name):
    m = from_hf_dict(cfg, name)
    assert m == preset(name)


def test_qwen2_moe_shared_expert_and_gate():
    cfg = {k: v for k, v in QWEN3_30B_A3B.items() if k != "attention_bias"}  # Qwen1.5-MoE has none
    cfg = {**cfg, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632, "mlp_only_layers": [0],
           "decoder_sparse_step": 2}
    m = from_hf_dict(cfg)
    assert m.moe_layers == tuple(range(1, 48, 2)) and m.shared_expert_ffn == 5632 and m.shared_expert_gate
    assert m.qkv_bias and not m.qk_norm
    names = {t.name for t in tensor_inventory(m) if t.layer == 1}
    assert {"layers.1.mlp.shared_expert.up_proj.weight", "layers.1.mlp.shared_expert_gate.weight",
            "layers.1.mlp.router.weight", "layers.1.mlp.experts.127.down_proj.weight"} <= names
    assert "layers.0.mlp.gate_proj.weight" in {t.name for t in tensor_inventory(m)}


@pytest.mark.parametrize("cfg,match", [
    ({**QWEN3_30B_A3B, "model_type": "qwen3_next"}, r"model_type 'qwen3_next' is not modelled \(known: llama"),
    ({k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"}, "no model_type"),
    ({**QWEN3_30B_A3B, "model_type": "deepseek_v2"}, "model_type 'deepseek_v2' is not modelled"),
    ({**QWEN3_30B_A3B, "moe_shared_expert_overlap": True},
     "key 'moe_shared_expert_overlap' is not modelled for an MoE model_type 'qwen3_moe'"),
    ({**QWEN3_30B_A3B, "n_shared_experts": 1}, "key 'n_shared_experts' is not modelled for an MoE model_type"),
    ({**QWEN3_30B_A3B, "model_type": "qwen3"}, "key 'decoder_sparse_step' is not modelled for a dense model_type"),
    ({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "vocab_size": 256, "num_local_experts": 8}, "key 'num_local_experts'"),
    ({"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
      "num_attention_heads": 4, "vocab_size": 256, "kv_lora_rank": 8}, "key 'kv_lora_rank'"),
    ({**DEEPSEEK_V3, "moe_layer_freq": 2}, r"moe_layer_freq 2 is not modelled"),
    ({**DEEPSEEK_V3, "attention_bias": True}, r"multi-head latent attention \(MLA\)"),
    ({**DEEPSEEK_V3, "qk_head_dim": 128}, r"qk_head_dim 128 != qk_nope_head_dim\(128\) \+ qk_rope_head_dim\(64\)"),
    ({**QWEN3_30B_A3B, "num_experts_per_tok": 200}, r"experts_per_token\(200\) must be between 1 and experts\(128\)"),
    ({**QWEN3_30B_A3B, "num_local_experts": 64}, "expert counts disagree"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": [48]}, r"mlp_only_layers \[48\] names a layer outside 0..47"),
])
def test_what_is_not_modelled_is_refused_by_name_in_one_line(cfg, match):
    with pytest.raises(SpecError, match=match) as e:
        from_hf_dict(cfg)
    assert "\n" not in str(e.value)


def test_keys_irrelevant_to_cost_are_not_refused():
    harmless = {"torch_dtype": "float16", "dtype": "bfloat16", "bos_token_id": 1, "top_k": 50, "use_cache": False,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "quantization_config": {"quant_method": "fp8"},
                "architectures": ["X"], "layer_types": ["full_attention"] * 48, "some_new_flag": 1}
    assert from_hf_dict({**QWEN3_30B_A3B, **harmless}, "q") == from_hf_dict(QWEN3_30B_A3B, "q")
    dense = {"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}
    assert from_hf_dict({**dense, **harmless}).num_params() == preset("qwen2.5-7b").num_params()


@pytest.mark.parametrize("name", sorted(CARDS))
def test_moe_specs_round_trip_through_json(name):
    m = preset(name)
    d = json.loads(json.dumps(m.to_dict()))
    assert ModelSpec.from_dict(d) == m and hash(ModelSpec.from_dict(d)) == hash(m)
    assert isinstance(ModelSpec.from_dict(d).moe_layers, tuple)


@pytest.mark.parametrize("fields,match", [
    ({"experts": 8, "experts_per_token": 2, "expert_ffn": 64, "moe_layers": [0, 4]},
     r"moe_layers must be increasing block indices in 0..3, got \[0, 4\]"),
    ({"experts": 8, "experts_per_token": 9, "expert_ffn": 64, "moe_layers": [0]}, r"experts_per_token\(9\)"),
    ({"experts": 8, "experts_per_token": 2, "moe_layers": [0]}, r"expert_ffn must be a positive integer"),
    ({"expert_ffn": 64}, r"\['expert_ffn'\] set on a dense model"),
    ({"v_head_dim": 64}, r"\['v_head_dim'\] set without multi-head latent attention"),
    ({"kv_lora_rank": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}, r"MLA has kv_heads == heads\(4\) \(got 2\)"),
])
def test_invalid_expert_fields_name_their_numbers(fields, match):
    with pytest.raises(SpecError, match=match):
        ModelSpec.from_dict({**preset("tiny-4l-128h").to_dict(), **fields})


@pytest.mark.parametrize("name", sorted(CARDS))
def test_the_inventory_lists_every_expert(name):
    m = preset(name)
    inv = tensor_inventory(m)
    assert sum(t.numel for t in inv) == m.num_params()
    experts = [t for t in inv if t.expert is not None]
    assert sum(t.numel for t in experts) == m.expert_params()
    assert {t.expert for t in experts} == set(range(m.experts))
    assert {t.layer for t in experts} == set(m.moe_layers)
    down = next(t for t in experts if t.name.endswith("experts.1.down_proj.weight"))
    assert down.shape == (m.hidden, m.expert_ffn) and down.tp_dim == 1 and down.expert == 1
    router = next(t for t in inv if t.name == f"layers.{m.moe_layers[0]}.mlp.router.weight")
    assert router.shape == (m.experts, m.hidden) and router.tp_dim is None
    for tp in (1, 2, 4, 8):
        check_tp(m, tp)


def test_stage_tensors_partition_an_moe_model():
    m = ModelSpec.from_dict({**preset("tiny-4l-128h").to_dict(), "name": "tiny-moe", "experts": 4,
                             "experts_per_token": 2, "expert_ffn": 64, "shared_expert_ffn": 32, "moe_layers": [1, 3]})
    assert sum(t.numel for t in tensor_inventory(m)) == m.num_params()
    for pp in (1, 2, 4):
        names = [t.name for s in range(pp) for t in stage_tensors(m, pp, s)]
        assert sorted(names) == sorted(t.name for t in tensor_inventory(m))
    with pytest.raises(SpecError, match=r"tp\(3\) does not divide expert_ffn\(64\)"):
        check_tp(ModelSpec.from_dict({**m.to_dict(), "heads": 6, "kv_heads": 3, "ffn": 258, "shared_expert_ffn": 33}), 3)


def test_only_the_new_presets_have_experts():
    assert {n for n in preset_names() if preset(n).is_moe} == set(CARDS)


ARCHS = {  # tiny configs of each MoE model type, built by transformers from the config alone
    "qwen3_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=2, mlp_only_layers=[3], head_dim=32),
    "qwen2_moe": dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    "mixtral": dict(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=2,
                        topk_group=1),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_parameter_counts_equal_transformers_models(arch, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    kw = {**dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                 max_position_embeddings=128), **ARCHS[arch]}
    cfg = transformers.AutoConfig.for_model(arch, **kw)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = from_hf_dict(cfg.to_dict(), "tiny")  # to_dict() of this transformers version is accepted
    # DeepSeek-V3's e_score_correction_bias is a buffer in transformers, a tensor in the checkpoint
    bias = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias"))
    assert spec.num_params() == sum(p.numel() for p in hf.parameters()) + bias
    cfg.save_pretrained(tmp_path)  # and so is the config.json it writes
    assert from_hf_dict(json.loads((tmp_path / "config.json").read_text()), "tiny") == spec


def test_the_cli_refuses_an_unknown_model_type_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "model_type": "qwen3_next"}))
    (tmp_path / "job.yaml").write_text(
        "algorithm: grpo\nmodels: {actor: {hf_config: config.json}, ref: {hf_config: config.json}}\n"
        "batch: {prompts: 64, samples_per_prompt: 8, ppo_epochs: 1, mini_batches: 2}\n"
        "sequence: {prompt_len: 512, response_len_mean: 1536, response_len_max: 4096}\n")
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "plan", "--job", str(tmp_path / "job.yaml"),
                        "--cluster", "examples/cluster-h100-4n.yaml", "--time-limit", "5"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "model_type 'qwen3_next' is not modelled" in r.stderr
    assert "model-stage" not in r.stdout
