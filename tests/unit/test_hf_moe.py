"""Qwen3-MoE on one process: the EMU rule for expert tensors (EP by whole experts, expert TP inside
them, ZeRO over expert-dp, vLLM's rule in generation; the docstring's worked example), dense EMUs
and transitions byte-identical to before experts were placed, transition pieces tiling every MoE
destination region, Hugging Face names (fused 3-D and per-expert) <-> inventory, regions read from a
``save_pretrained`` directory, and the executor's forward against ``transformers`` (fp32 and bf16).
Tiny models built from configs, no downloads."""
import hashlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from nereus.errors import SpecError  # noqa: E402
from nereus.executor.engine import Engine  # noqa: E402
from nereus.executor.hf.arch import TINY, hf_config, spec_of  # noqa: E402
from nereus.executor.hf.checkpoint import Checkpoint, gather_state, load_regions  # noqa: E402
from nereus.executor.hf.names import NameMap  # noqa: E402
from nereus.executor.hf.scenarios import moe_plan  # noqa: E402
from nereus.executor.scenario import local_cluster, make_plan, tiny_job  # noqa: E402
from nereus.executor.store import ShardStore, cover_error  # noqa: E402
from nereus.models.inventory import tensor_inventory  # noqa: E402
from nereus.models.spec import preset  # noqa: E402
from nereus.planner.plan import StagePlacement  # noqa: E402
from nereus.planner.specs import ParallelConfig  # noqa: E402
from nereus.planner.transition.build import plan_transition  # noqa: E402
from nereus.planner.transition.emu import build_emus, gpu_regions, holdings, kinds_of  # noqa: E402

IDS = torch.randint(0, 256, (3, 10), generator=torch.Generator().manual_seed(1))
SPEC = spec_of(TINY["qwen3_moe"], name="tiny-qwen3_moe")
F = SPEC.expert_ffn  # 32


def _held(plan, gpu, tensor, kind="param", stage="actor/training"):
    p = plan.stage(stage)
    c = p.config
    local = gpu - p.first_gpu
    rs = gpu_regions(SPEC, stage.split("/")[0], p, local % c.tp, local // (c.tp * c.dp), (local // c.tp) % c.dp,
                     kinds_of("actor"))
    return [(r.offsets, r.lengths) for r in rs if r.tensor == tensor and r.kind == kind]


def test_the_docstring_example_ep2_on_tp2_dp2():
    plan = moe_plan(tp=2, dp=2, ep=2, zero=1)
    e0, e4 = "layers.0.mlp.experts.0.gate_proj.weight", "layers.0.mlp.experts.4.gate_proj.weight"
    assert [bool(_held(plan, g, e0)) for g in range(4)] == [True, False, True, False]
    assert [bool(_held(plan, g, e4)) for g in range(4)] == [False, True, False, True]
    assert _held(plan, 0, e0) == [((0, 0), (F, 64))]  # whole expert
    assert _held(plan, 0, e0, "master") == [((0, 0), (F // 2, 64))]  # ZeRO-1 over expert-dp (GPUs 0, 2)
    assert _held(plan, 2, e0, "master") == [((F // 2, 0), (F // 2, 64))]
    # the router is replicated, attention split by tp as in a dense model
    assert all(_held(plan, g, "layers.0.mlp.router.weight") == [((0, 0), (8, 64))] for g in range(4))
    assert _held(plan, 1, "layers.0.attn.q_proj.weight") == [((64, 0), (64, 64))]


def test_expert_tp_slices_inside_experts_and_ep1_keeps_every_expert_whole():
    etp = moe_plan(tp=2, dp=2, etp=2)
    down = "layers.1.mlp.experts.5.down_proj.weight"
    assert _held(etp, 0, "layers.1.mlp.experts.5.up_proj.weight") == [((0, 0), (F // 2, 64))]
    assert _held(etp, 3, "layers.1.mlp.experts.5.up_proj.weight") == [((F // 2, 0), (F // 2, 64))]
    assert _held(etp, 1, down) == [((0, F // 2), (64, F // 2))]  # down_proj by its input dim
    whole = moe_plan(tp=2, dp=1)  # Megatron: ep = etp = 1 keeps experts whole on every TP rank
    assert _held(whole, 1, down) == [((0, 0), (64, F))]
    # ep spanning DP replicas: ep4 on tp2 x dp2 gives GPU g experts [2g, 2g + 2)
    ep4 = moe_plan(tp=2, dp=2, ep=4)
    assert [[e for e in range(8) if _held(ep4, g, f"layers.0.mlp.experts.{e}.gate_proj.weight")]
            for g in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_generation_follows_vllm():
    cfg = ParallelConfig(tp=2)
    p = StagePlacement(name="actor/generation", config=cfg, pool=0, first_gpu=0, gpus=2)
    rs = gpu_regions(SPEC, "actor", p, 1, 0, 0, kinds_of("ref"))
    got = {r.tensor: (r.offsets, r.lengths) for r in rs}
    assert got["layers.0.mlp.experts.3.gate_proj.weight"] == ((F // 2, 0), (F // 2, 64))  # ep 1: sliced by tp
    p = StagePlacement(name="actor/generation", config=ParallelConfig(tp=2, ep=2), pool=0, first_gpu=0, gpus=2)
    names = {r.tensor for r in gpu_regions(SPEC, "actor", p, 1, 0, 0, kinds_of("ref"))}
    assert "layers.0.mlp.experts.4.gate_proj.weight" in names and "layers.0.mlp.experts.3.gate_proj.weight" not in names


@pytest.mark.parametrize("cfg", [dict(tp=2, dp=2, ep=2, zero=1), dict(tp=1, dp=4, ep=4, zero=1),
                                 dict(tp=2, dp=2, etp=2, ep=2, zero=1), dict(tp=2, pp=2, ep=2, zero=0),
                                 dict(tp=2, dp=1, zero=1)])  # expert-dp 2 at dp 1: expert moments split
def test_every_expert_tensor_is_covered_once_per_expert_dp_replica(cfg):
    plan = moe_plan(**cfg)
    c = plan.home("actor").config
    edp = c.tp * c.dp // (c.ep * c.etp)
    hs = [h for h in holdings(tiny_job(SPEC), plan) if h.region.model == "actor"]
    for t in tensor_inventory(SPEC):
        for kind in ("param", "master", "exp_avg"):
            regions = [h.region for h in hs if h.region.tensor == t.name and h.region.kind == kind]
            sharded = kind != "param" and c.zero >= 1 and (edp if t.expert is not None else c.dp) > 1
            copies = 1 if sharded else (edp if t.expert is not None else c.dp)
            if t.tp_dim is None or t.expert is not None:
                copies *= 1 if t.expert is not None else c.tp
            # split the regions into exact covers: every element held `copies` times in all
            whole = regions[0].__class__("actor", t.name, kind, (0,) * len(t.shape), t.shape, regions[0].dtype)
            numel = sum(r.numel for r in regions)
            assert numel == copies * whole.numel, (t.name, kind)
            if copies == 1:
                assert cover_error(whole, regions) is None, (t.name, kind)


def test_moe_transitions_tile_every_destination_region():
    job = tiny_job(SPEC)
    pairs = [(moe_plan(tp=2, dp=2, ep=2, zero=1), moe_plan(tp=1, dp=4, ep=4, zero=1)),
             (moe_plan(tp=1, dp=4, ep=4, zero=1), moe_plan(tp=2, dp=2, ep=1, etp=2, zero=1)),
             (moe_plan(tp=2, dp=2, ep=1, etp=2, zero=1), moe_plan(tp=2, dp=2, ep=2, etp=2, zero=0)),
             (moe_plan(tp=2, pp=2, ep=2), moe_plan(tp=1, dp=2, ep=2, first_gpu=2))]
    for a, b in pairs:
        tp = plan_transition(job, local_cluster(4), a, b, scheduler="greedy")
        assert set(tp.dst) == set(holdings(job, b))
        src = {(h.gpu, h.region) for h in tp.src}
        kept = {(h.gpu, h.region) for h in tp.kept}
        for h in tp.dst:
            pieces = [op.region for op in tp.ops if op.dst_gpu == h.gpu and op.region.model == h.region.model
                      and op.region.tensor == h.region.tensor and op.region.kind == h.region.kind] + ([h.region] if (h.gpu, h.region) in kept else [])
            inside = [r for r in pieces if all(o >= ho and o + n <= ho + hn for o, n, ho, hn in
                                               zip(r.offsets, r.lengths, h.region.offsets, h.region.lengths))]
            assert cover_error(h.region, inside) is None, h
        for op in tp.ops:  # every source named holds the piece
            assert any(g == op.src_gpu and r.model == op.region.model and r.tensor == op.region.tensor and
                       r.kind == op.region.kind and
                       all(o >= ro and o + n <= ro + rn for o, n, ro, rn in zip(op.region.offsets, op.region.lengths,
                                                                                 r.offsets, r.lengths))
                       for g, r in src), op


# sha256 of the EMUs (both precisions) and transitions of dense models over seven layouts,
# captured before expert placement was added to emu.py and pieces.py (/tmp script, same code).
# Re-pinned at 5fcedc2 (source choice in integer bytes per link class, so float ties break
# another way): tiny-4l-128h, qwen2 and qwen3 changed only in which replica sends a piece (5 of
# their 15 transitions; bytes moved, kept holdings and lower bounds identical, makespans within
# 4%, compared transition by transition against 2dfbf4d); llama did not change.
DENSE_DIGESTS = {
    "tiny-4l-128h": "d3071a39753a3db4cafc1ac8d7185ed36fa07896b92a347d2904954dc80df669",
    "llama": "633aa128a1f52cb486ea045d254f971809fa01606da87fc1f3af9c5750489405",
    "qwen2": "68b3396c7bfd96f4f720d2cf80f0b9b45f8207cd6333c53826ad79adb55b2bfa",
    "qwen3": "953c9424c46121ca689aa01bda722c7c7c787cfa61a75aced080c620125a627c",
}


def _dense_digest(job) -> str:
    h = hashlib.sha256()
    plans = [make_plan(tp=tp, pp=pp, dp=dp, zero=z, first_gpu=0)
             for tp, pp, dp, z in [(1, 1, 1, 0), (2, 1, 2, 1), (4, 1, 1, 1), (1, 2, 2, 1), (2, 2, 1, 0), (1, 1, 4, 1),
                                   (2, 1, 4, 1)] if tp <= job.model("actor").kv_heads]
    for p in plans:
        for mp in (True, False):
            h.update(repr([e.to_dict() for e in build_emus(job, p, mixed_precision=mp)]).encode())
    for a, b in zip(plans, plans[1:]):
        t = plan_transition(job, local_cluster(8), a, b, mixed_precision=True, scheduler="greedy")
        h.update(repr((t.src, t.dst, t.kept, t.ops, t.bytes_moved)).encode())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(DENSE_DIGESTS))
def test_dense_emus_and_transitions_are_unchanged(name):
    model = preset(name) if name.startswith("tiny") else spec_of(TINY[name], name=f"tiny-{name}")
    assert _dense_digest(tiny_job(model)) == DENSE_DIGESTS[name]


def _hf(dtype=torch.float32, **overrides):
    cfg = hf_config("qwen3_moe", **overrides)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_((1 + 0.1 * torch.randn(p.shape, generator=g)) if n.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5))
    return cfg, hf


def test_names_fused_and_per_expert_round_trip(tmp_path):
    cfg, hf = _hf(mlp_only_layers=[1])  # block 1 dense: both kinds of MLP in one model
    spec = spec_of(cfg)
    assert spec.moe_layers == (0,)
    state = hf.state_dict()
    fused = NameMap.for_keys(spec, state)
    assert fused.fused_experts and "model.layers.0.mlp.experts.gate_up_proj" in fused.shapes
    full = fused.to_inventory(state)
    gu = state["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(full["layers.0.mlp.experts.5.up_proj.weight"], gu[5, F:])
    assert torch.equal(full["layers.0.mlp.experts.5.gate_proj.weight"], gu[5, :F])
    assert torch.equal(full["layers.0.mlp.experts.2.down_proj.weight"], state["model.layers.0.mlp.experts.down_proj"][2])
    assert torch.equal(full["layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])
    assert torch.equal(full["layers.1.mlp.up_proj.weight"], state["model.layers.1.mlp.up_proj.weight"])
    back = fused.to_hf(full)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    # save_pretrained writes per-expert names (the hub's); they read to the same inventory
    hf.save_pretrained(tmp_path)
    ckpt = Checkpoint(tmp_path)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ckpt.shapes
    names = ckpt.names_for(spec, "lm")
    assert not names.fused_experts
    per = NameMap(model=spec).to_hf(full)
    assert per.keys() == ckpt.shapes.keys()
    plan = moe_plan(tp=2, dp=2, ep=2, etp=2, zero=1)
    for rank in range(4):  # every region of a sharded layout read from the directory is that slice
        store = ShardStore()
        load_regions(store, spec, "actor", plan.home("actor"), rank, ckpt, precision="bf16-mixed")
        for r, t in store.items():
            if r.kind in ("param", "master"):
                want = full[r.tensor][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))]
                assert torch.equal(t.float() if r.kind == "master" else t, want.to(t.dtype)), r


def test_unsupported_moe_settings_are_refused_by_name():
    with pytest.raises(SpecError, match="norm_topk_prob false"):
        spec_of({**TINY["qwen3_moe"], "norm_topk_prob": False})
    with pytest.raises(SpecError, match="ep\\(3\\) must divide the 8 experts"):
        gpu_regions(SPEC, "actor", moe_plan(tp=1, dp=3, ep=3).home("actor"), 0, 0, 0, kinds_of("actor"))


@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [0]}])
def test_one_rank_forward_is_the_hf_forward_in_fp32_and_bf16(overrides, tmp_path):
    cfg, hf = _hf(**overrides)
    spec = spec_of(cfg)
    hf16 = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    hf16.load_state_dict({k: v.bfloat16() for k, v in hf.state_dict().items()})
    with torch.no_grad():
        ref32, ref16 = hf(IDS).logits, hf16(IDS).logits.float()
    plan = moe_plan()
    got = {}
    for precision in ("fp32", "bf16-mixed"):
        store = ShardStore()
        load_regions(store, spec, "actor", plan.home("actor"), 0, hf.state_dict(), precision=precision)
        got[precision] = Engine(0, 1, spec, plan.home("actor"), store, precision=precision).logits(IDS)
    assert (got["fp32"] - ref32).abs().max() <= 1e-5  # measured: 0.0
    assert (got["bf16-mixed"] - ref16).abs().max() <= 1e-3 * ref16.abs().max()  # measured: 0.0
    assert (got["bf16-mixed"] - ref32).abs().max() > 1e-4
    # and gathered back on one rank, it is the state dict (fused, as in memory) bit for bit
    store = ShardStore()
    load_regions(store, spec, "actor", plan.home("actor"), 0, hf.state_dict())
    back = gather_state(store, spec, "actor", plan.home("actor"), 0, fused_experts=True)
    assert back.keys() == hf.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())


def test_training_an_moe_model_is_refused():
    store = ShardStore()
    plan = moe_plan()
    eng = Engine(0, 1, SPEC, plan.home("actor"), store)
    eng.init_state(0)
    with pytest.raises(SpecError, match="mixture-of-experts"):
        eng.train_step(IDS)
