"""Qwen3-MoE on 4 gloo processes (``launch``: file:// rendezvous in a temp dir, per-rank result
queue, join with a deadline): a transformers checkpoint (built from a config, random weights, no
downloads) loads into expert-parallel layouts, reshards through chains that change ep, etp, tp,
dp and pp with every region bit-exact (fp32, and bf16 params with fp32 masters and moments), gives
transformers' logits in every layout, and gathers back into the same state dict, which
from_pretrained loads; and random MoE layout pairs (``reshard-check``'s rule) reshard bit-exactly
in bf16-mixed."""
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from nereus.commands.reshard_check import _make_cases, _moe_rounding_moves, _verdict  # noqa: E402
from nereus.executor.checks import reshard_cases  # noqa: E402
from nereus.executor.hf.arch import TINY, hf_config, spec_of  # noqa: E402
from nereus.executor.hf.checkpoint import write_checkpoint  # noqa: E402
from nereus.executor.hf.names import NameMap  # noqa: E402
from nereus.executor.hf.scenarios import HFCase, hf_chain, moe_plan  # noqa: E402
from nereus.executor.launch import launch  # noqa: E402
from nereus.executor.scenario import local_cluster, tiny_job  # noqa: E402
from nereus.planner.transition.build import plan_transition  # noqa: E402

pytestmark = pytest.mark.dist
WORLD = 4
IDS = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(2))

# fp32: EP across DP replicas -> EP x expert-TP -> expert-TP only with PP -> EP on two GPUs
FP32 = (moe_plan(tp=1, dp=4, ep=4, zero=1), moe_plan(tp=2, dp=2, ep=2, etp=2, zero=1),
        moe_plan(tp=2, pp=2, etp=2), moe_plan(tp=1, dp=2, ep=2, first_gpu=2))
# bf16-mixed: EP4 over tp2 x dp2 (expert moments ZeRO'd over expert-dp 1) -> EP2 with PP2 x DP2 ->
# ep 1 etp 1 (every expert whole on each rank, expert moments over expert-dp 4) -> one GPU
BF16 = (moe_plan(tp=2, dp=2, ep=4, zero=1), moe_plan(tp=1, pp=2, dp=2, ep=2, zero=1),
        moe_plan(tp=1, dp=4, zero=1), moe_plan(first_gpu=3))


def _hf(dtype=torch.float32, state=None):
    cfg = hf_config("qwen3_moe")
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    if state is None:
        g = torch.Generator().manual_seed(1)
        state = {n: (1 + 0.1 * torch.randn(p.shape, generator=g)) if n.endswith("norm.weight")
                 else torch.randn(p.shape, generator=g) * (0.5 / p.shape[-1] ** 0.5) for n, p in hf.named_parameters()}
    hf.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return cfg, hf, state


def test_moe_checkpoint_loads_reshards_across_ep_and_gathers_back(tmp_path):
    cfg, hf, state = _hf()
    spec = spec_of(cfg)
    fused = {k: v.clone() for k, v in state.items()}  # transformers 5.x's in-memory names (3-D experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    per_expert = NameMap(model=spec).to_hf(NameMap.for_keys(spec, fused).to_inventory(fused))
    with torch.no_grad():
        ref32 = hf(IDS).logits
        ref16 = _hf(torch.bfloat16, state)[1](IDS).logits.float()
    cases = []
    for precision, plans, on_disk, as_fused in (("fp32", FP32, fused, True), ("bf16-mixed", BF16, per_expert, False)):
        path = write_checkpoint(tmp_path / precision, on_disk, cfg)
        tplans = tuple(plan_transition(tiny_job(spec), local_cluster(WORLD), a, b, scheduler="greedy",
                                       mixed_precision=precision == "bf16-mixed") for a, b in zip(plans, plans[1:]))
        cases.append(HFCase(model=spec, checkpoint=str(path), precision=precision, plans=plans, tplans=tplans,
                            ids=IDS, fused_experts=as_fused))
    out = launch(hf_chain, WORLD, cases, timeout_s=400)
    bf16_err = float((ref16 - ref32).abs().max())
    for i, (case, on_disk) in enumerate(zip(cases, (fused, per_expert))):
        results = [o[i] for o in out]
        assert all(r["mismatches"] == [] for r in results), [r["mismatches"][:3] for r in results]
        assert sum(r["regions"] for r in results) == len(case.tplans[-1].dst)
        logits = [lg for r in results for lg in r["logits"] if lg is not None]
        assert len(logits) >= 2
        if case.precision == "fp32":  # (reshard-check --arch qwen3_moe fp32: at most 8.3e-7)
            assert max(float((lg - ref32).abs().max()) for lg in logits) <= 1e-5
        else:  # TP2 moves bf16 roundings (no router tie flips here): within 2x transformers' own bf16 error
            assert max(float((lg - ref16).abs().max()) for lg in logits) <= 2 * bf16_err
            assert max(float((lg - ref32).abs().max()) for lg in logits) <= 2 * bf16_err
            assert float((logits[-1] - ref16).abs().max()) == 0.0  # one GPU: transformers' own bf16 bits
        for kind, got in results[0]["gathered"].items():  # params (bf16: rounded once) and fp32 masters
            dtype = torch.bfloat16 if kind == "param" and case.precision == "bf16-mixed" else torch.float32
            assert got.keys() == on_disk.keys(), kind
            assert all(torch.equal(got[k], on_disk[k].to(dtype)) for k in got), kind
    # what from_pretrained reads: the fp32 chain's gathered params with the hub's per-expert names
    gathered = out[0][0]["gathered"]["param"]
    names = NameMap(model=spec).to_hf(NameMap.for_keys(spec, gathered).to_inventory(gathered))
    again, info = transformers.AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path / "back", names, cfg),
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(again.eval()(IDS).logits, ref32)


class _Args:
    world, cases, seed, precision = WORLD, 4, 3, "bf16-mixed"


def test_random_moe_layout_pairs_reshard_bit_exactly_in_bf16_mixed():
    job = tiny_job(spec_of(TINY["qwen3_moe"], name="tiny-qwen3_moe"))
    _, cases = _make_cases(_Args, job)
    changes = [(a.home("actor").config.ep, a.home("actor").config.etp) != (b.home("actor").config.ep,
                                                                            b.home("actor").config.etp)
               for a, b, _ in cases]
    assert any(changes), "no case changes ep or etp"
    out = launch(reshard_cases, WORLD, job, cases, _Args.seed, 20.0, "bf16-mixed", timeout_s=400)
    for i, case in enumerate(cases):
        results = [o[i] for o in out]
        assert all(not r["rolled_back"] and r["mismatches"] == [] for r in results), i
        ok, why = _verdict(results, False, "bf16-mixed", _moe_rounding_moves(case))
        assert ok, (i, why)
        if not _moe_rounding_moves(case):  # neither layout splits attention or experts: bf16 logits held tight
            assert "reported only" not in why, (i, why)
