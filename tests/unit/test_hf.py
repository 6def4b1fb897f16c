"""Hugging Face models on one process: configs -> ModelSpec, names <-> inventory (fused QKV and
gate/up included), regions read from safetensors in any layout, the executor's forward against
``transformers`` (fp32 and bf16), the critic's value head, and one mixed-precision AdamW step.
Tiny models built from configs, no downloads."""
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from nereus.errors import SpecError  # noqa: E402
from nereus.executor.engine import Engine  # noqa: E402
from nereus.executor.hf.arch import ARCHS, TINY, hf_config, spec_of  # noqa: E402
from nereus.executor.hf.checkpoint import Checkpoint, gather_state, load_regions, write_checkpoint  # noqa: E402
from nereus.executor.hf.names import NameMap  # noqa: E402
from nereus.executor.layout import rank_regions  # noqa: E402
from nereus.executor.store import ShardStore  # noqa: E402
from nereus.executor.scenario import make_plan  # noqa: E402
from nereus.models.inventory import tensor_inventory  # noqa: E402
from nereus.models.spec import from_hf_config  # noqa: E402

IDS = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter random (HF initialises biases to 0 and norms to 1, which would hide them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 / p.shape[-1] ** 0.5
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * scale)
    return model.eval()


def causal_lm(arch: str, dtype=torch.float32, **overrides):
    cfg = hf_config(arch, **overrides)
    hf = randomize(transformers.AutoModelForCausalLM.from_config(cfg))
    return cfg, hf.to(dtype), spec_of(cfg)


def saved_state(hf, spec) -> dict:
    """The state dict ``save_pretrained`` writes: a tied model has no lm_head.weight."""
    return {k: v for k, v in hf.state_dict().items() if not (spec.tie_embeddings and k == "lm_head.weight")}


def megatron_fused(state: dict, spec) -> dict:
    """Megatron's layout written out independently of NameMap: per KV group [q heads, k, v];
    gate_up = [gate; up]."""
    out = {k: v for k, v in state.items() if not any(s in k for s in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                       "up_proj"))}
    per, d = spec.heads // spec.kv_heads, spec.head_dim
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            q, k, v = (state[f"{p}self_attn.{n}_proj.{kind}"] for n in "qkv")
            groups = [torch.cat([q[j * per * d:(j + 1) * per * d], k[j * d:(j + 1) * d], v[j * d:(j + 1) * d]])
                      for j in range(spec.kv_heads)]
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(groups)
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([state[f"{p}mlp.gate_proj.weight"],
                                                       state[f"{p}mlp.up_proj.weight"]])
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_names_and_counts_match_the_hf_model(arch, tmp_path):
    cfg, hf, spec = causal_lm(arch)
    want = {"llama": (False, False, False, 500000.0, 1e-5), "qwen2": (True, False, True, 1e6, 1e-6),
            "qwen3": (False, True, False, 1e6, 1e-6)}[arch]
    assert (spec.qkv_bias, spec.qk_norm, spec.tie_embeddings, spec.rope_theta, spec.norm_eps) == want
    assert spec.head_dim == (32 if arch == "qwen3" else spec.hidden // spec.heads)
    # the planner's memory model counts exactly the HF parameters (a tied matrix once)
    assert spec.num_params() == sum(p.numel() for p in hf.parameters())
    # the inventory is exactly the checkpoint's tensors, one to one
    names = NameMap(model=spec)
    assert set(names.shapes) == set(saved_state(hf, spec))
    assert sorted(b.source for blocks in names.blocks.values() for b in blocks) == sorted(names.shapes)
    # config.json as transformers writes it gives the same spec
    cfg.save_pretrained(tmp_path)
    assert from_hf_config(tmp_path / "config.json", name=spec.name) == spec


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_round_trips_plain_and_fused(arch):
    _, hf, spec = causal_lm(arch)
    state = saved_state(hf, spec)
    inv = NameMap.for_keys(spec, state).to_inventory(hf.state_dict())  # lm_head listed when tied: accepted
    back = NameMap(model=spec).to_hf(inv)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    fused = megatron_fused(state, spec)
    fmap = NameMap.for_keys(spec, fused)
    assert fmap.fused_qkv and fmap.fused_gate_up
    inv_f = fmap.to_inventory(fused)
    assert all(torch.equal(inv_f[k], inv[k]) for k in inv)
    again = fmap.to_hf(inv)
    assert again.keys() == fused.keys() and all(torch.equal(again[k], fused[k]) for k in fused)


def test_checkpoint_mismatches_are_named():
    _, hf, spec = causal_lm("qwen2")
    state = saved_state(hf, spec)
    names = NameMap(model=spec)
    with pytest.raises(SpecError, match=r"missing \['model.layers.0.self_attn.q_proj.bias'\]"):
        names.to_inventory({k: v for k, v in state.items() if k != "model.layers.0.self_attn.q_proj.bias"})
    with pytest.raises(SpecError, match=r"model.norm.weight has shape \(63,\), the model needs \(64,\)"):
        names.to_inventory({**state, "model.norm.weight": torch.ones(63)})
    with pytest.raises(SpecError, match="lm_head.weight differs"):
        names.to_inventory({**state, "lm_head.weight": torch.zeros(256, 64)})
    with pytest.raises(SpecError, match=r"unexpected \['extra.weight'\]"):
        names.to_inventory({**state, "extra.weight": torch.ones(1)})


@pytest.mark.parametrize("config,match", [
    ({**TINY["llama"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type 'llama3'"),
    ({**TINY["llama"], "attention_bias": True}, "attention_bias on o_proj"),
    ({**TINY["qwen2"], "use_sliding_window": True}, "use_sliding_window"),
    ({**TINY["llama"], "hidden_act": "gelu"}, "hidden_act"),
    ({**TINY["llama"], "model_type": "mistral"}, "model_type must be one of llama, qwen2, qwen3, got 'mistral'"),
])
def test_unsupported_settings_are_refused_by_name(config, match):
    with pytest.raises(SpecError, match=match):
        spec_of(config)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_every_layout_loads_exact_slices_from_safetensors(fused, tmp_path):
    """Each rank of tp/pp/dp layouts (ZeRO shares, row-parallel weights stored transposed, bf16
    params and fp32 masters) reads exactly its slice of each full tensor from the file."""
    cfg, hf, spec = causal_lm("llama")
    state = saved_state(hf, spec)
    write_checkpoint(tmp_path, megatron_fused(state, spec) if fused else state, cfg)
    ckpt = Checkpoint(tmp_path)
    full = NameMap(model=spec).to_inventory(state)
    for plan in (make_plan(tp=4), make_plan(tp=2, pp=2), make_plan(tp=2, dp=2, zero=1)):
        for precision in ("fp32", "bf16-mixed"):
            for rank in range(4):
                store = ShardStore()
                load_regions(store, spec, "actor", plan.home("actor"), rank, ckpt, precision=precision)
                assert sorted(store) == sorted(rank_regions(spec, plan.home("actor"), rank, "actor", True, precision))
                for r, t in store.items():
                    want = full[r.tensor][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))]
                    want = torch.zeros_like(want) if r.kind.startswith("exp_avg") else want
                    assert torch.equal(t, want.to(t.dtype)), (r, precision)


def test_a_sharded_save_pretrained_directory_loads_like_the_state_dict(tmp_path):
    cfg, hf, spec = causal_lm("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    plan = make_plan(tp=2, pp=2)
    for rank in range(4):
        stores = [ShardStore(), ShardStore()]
        for store, source in zip(stores, (tmp_path, saved_state(hf, spec))):
            load_regions(store, spec, "actor", plan.home("actor"), rank, source)
        assert list(stores[0]) == list(stores[1]) and all(
            torch.equal(stores[0].get(r), stores[1].get(r)) for r in stores[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_one_rank_forward_is_the_hf_forward_in_fp32_and_bf16(arch, tmp_path):
    cfg, hf, spec = causal_lm(arch)
    write_checkpoint(tmp_path, saved_state(hf, spec), cfg)
    plan = make_plan()
    # built in bf16 (``hf.to(bf16)`` would also round the rotary inv_freq buffer, which HF keeps fp32)
    hf16 = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    hf16.load_state_dict({k: v.bfloat16() for k, v in hf.state_dict().items()})
    with torch.no_grad():
        ref32 = hf(IDS).logits
        ref16 = hf16(IDS).logits.float()
    got = {}
    for precision in ("fp32", "bf16-mixed"):
        store = ShardStore()
        load_regions(store, spec, "actor", plan.home("actor"), 0, tmp_path, precision=precision)
        got[precision] = Engine(0, 1, spec, plan.home("actor"), store, precision=precision).logits(IDS)
    assert (got["fp32"] - ref32).abs().max() <= 1e-5
    # same bf16 roundings as transformers' own bf16 forward (measured: identical here)
    assert (got["bf16-mixed"] - ref16).abs().max() <= 1e-3 * ref16.abs().max()
    assert (got["bf16-mixed"] - ref32).abs().max() > 1e-4  # it did run in bf16


def test_gathered_state_loads_with_from_pretrained(tmp_path):
    """One rank holds everything: gather -> config.json + model.safetensors -> from_pretrained."""
    cfg, hf, spec = causal_lm("qwen2")
    plan = make_plan()
    store = ShardStore()
    load_regions(store, spec, "actor", plan.home("actor"), 0, saved_state(hf, spec))
    state = gather_state(store, spec, "actor", plan.home("actor"), 0)
    assert "lm_head.weight" not in state  # tied, as save_pretrained writes it
    write_checkpoint(tmp_path, state, cfg)
    again, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), hf.state_dict().values()))
    with torch.no_grad():
        assert torch.equal(again.eval()(IDS).logits, hf(IDS).logits)


def test_value_head_is_token_classification_score(tmp_path):
    cfg = hf_config("qwen3", num_labels=1, token_classification_bias=False)
    critic = randomize(transformers.AutoModelForTokenClassification.from_config(cfg))
    spec = spec_of(cfg)
    assert [t.name for t in tensor_inventory(spec, "value")][-1] == "value_head.weight"
    write_checkpoint(tmp_path, critic.state_dict(), cfg)
    plan = make_plan(pp=1)
    store = ShardStore()
    load_regions(store, spec, "critic", plan.home("actor"), 0, tmp_path)
    eng = Engine(0, 1, spec, plan.home("actor"), store, role="critic")
    with torch.no_grad():
        want = critic(IDS).logits[..., 0]
    assert (eng.values(IDS) - want).abs().max() <= 1e-5
    with pytest.raises(SpecError, match="critic model ends in a value head"):
        eng.logits(IDS)
    gathered = gather_state(store, spec, "critic", plan.home("actor"), 0)
    assert gathered.keys() == critic.state_dict().keys() and torch.equal(gathered["score.weight"],
                                                                         critic.score.weight)
    with pytest.raises(SpecError, match="needs returns"):
        eng.train_step(IDS)
    # value regression, 3 AdamW steps: the same trajectory as transformers + torch.optim.AdamW
    returns = torch.linspace(-1, 1, IDS.numel()).view(IDS.shape)
    losses = [eng.train_step(IDS, returns=returns) for _ in range(3)]
    opt = torch.optim.AdamW(critic.parameters(), lr=eng.optim.lr, weight_decay=eng.optim.weight_decay)
    for step in range(3):
        loss = (critic(IDS).logits[..., 0] - returns).pow(2).sum() / (2 * IDS.numel())
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert losses[step] == pytest.approx(loss.item(), rel=1e-5)


def test_a_mixed_precision_step_is_adamw_on_the_fp32_master_rounded_into_bf16():
    _, hf, spec = causal_lm("qwen3")
    plan = make_plan()
    store = ShardStore()
    load_regions(store, spec, "actor", plan.home("actor"), 0, saved_state(hf, spec), precision="bf16-mixed")
    eng = Engine(0, 1, spec, plan.home("actor"), store, precision="bf16-mixed")
    master = {r.tensor: t.clone() for r, t in store.items() if r.kind == "master"}
    grads = {}

    def capture() -> bool:
        grads.update({name: t.grad.clone() for name, t in eng.w.items()})
        return True

    eng.train_step(IDS, before_update=capture)
    assert {g.dtype for g in grads.values()} == {torch.bfloat16}
    ref = {name: torch.nn.Parameter(t.clone()) for name, t in master.items()}
    opt = torch.optim.AdamW(ref.values(), lr=eng.optim.lr, betas=(eng.optim.beta1, eng.optim.beta2),
                            eps=eng.optim.eps, weight_decay=eng.optim.weight_decay, foreach=False)
    for name, p in ref.items():
        p.grad = grads[name].float()
    opt.step()
    for r, t in store.items():
        if r.kind == "master":
            assert t.dtype == torch.float32 and not torch.equal(t, master[r.tensor])
            torch.testing.assert_close(t, ref[r.tensor].detach(), rtol=1e-6, atol=1e-7)
        elif r.kind == "param":  # one rounding of the fp32 master, not an update in bf16
            assert t.dtype == torch.bfloat16 and torch.equal(t, store.find("actor", r.tensor, "master")[1].bfloat16())
    assert store.step["actor"] == 1


def test_the_executor_imports_neither_transformers_nor_safetensors():
    code = ("import sys, pkgutil, importlib, nereus.executor as E; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(E.__path__, 'nereus.executor.')]; "
            "bad = [m for m in ('transformers', 'safetensors') if m in sys.modules]; print(bad); "
            "sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
