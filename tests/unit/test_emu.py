"""EMUs and holdings: worked example, byte totals against the model's parameter count, exact
tiling of every tensor kind, EMU grouping."""
from hypothesis import given, settings, strategies as st

from nereus.models.inventory import tensor_inventory
from nereus.models.spec import ModelSpec, preset
from nereus.planner.transition.emu import build_emus, head_of, holdings
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.transition.regions import covers_exactly
from nereus.planner.specs import BatchSpec, JobSpec, ParallelConfig, SequenceSpec
from nereus.planner.transition.types import Region

ROLES_STAGES = {"actor": "actor/training", "critic": "critic/training", "ref": "ref/inference", "reward": "reward/inference"}


def make_job(model: ModelSpec) -> JobSpec:
    return JobSpec(algorithm="ppo", models=tuple((r, model) for r in ROLES_STAGES), batch=BatchSpec(prompts=8),
                   sequence=SequenceSpec(prompt_len=16, response_len_mean=16, response_len_max=32))


def make_plan(cfgs: dict[str, tuple], first: int = 0) -> Plan:
    stages = []
    for pool, (role, (tp, pp, dp, zero)) in enumerate(cfgs.items()):
        stages.append(StagePlacement(name=ROLES_STAGES[role], config=ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero),
                                     pool=pool, first_gpu=first, gpus=tp * pp * dp))
        first += tp * pp * dp
    return Plan(stages=tuple(stages))


def test_worked_example_llama8b_gpu5():
    job = make_job(preset("llama-3.1-8b"))
    plan = make_plan({"actor": (4, 1, 2, 1), "critic": (8, 1, 1, 1), "ref": (8, 1, 1, 1), "reward": (8, 1, 1, 1)})
    hs = {(h.region.kind): h.region for h in holdings(job, plan) if h.gpu == 5
          and h.region.model == "actor" and h.region.tensor == "layers.0.attn.k_proj.weight"}
    assert hs["param"] == Region("actor", "layers.0.attn.k_proj.weight", "param", (256, 0), (256, 4096), "bf16")
    assert hs["master"].offsets == (384, 0) and hs["master"].lengths == (128, 4096) and hs["master"].dtype == "fp32"
    assert hs["exp_avg"].lengths == hs["exp_avg_sq"].lengths == (128, 4096)


tiny = st.builds(lambda L, h, kv, g, f, v: ModelSpec(name="tiny", layers=L, hidden=h * 8, ffn=f * 8, heads=kv * g,
                                                    kv_heads=kv, vocab=v * 8, head_dim=8),
                 st.integers(1, 5), st.integers(1, 4), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]),
                 st.integers(1, 4), st.integers(1, 4))


@settings(max_examples=30, deadline=None)
@given(tiny, st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 3), st.sampled_from([0, 1, 3]),
       st.booleans())
def test_holdings_tile_each_tensor_and_match_param_count(model, tp, pp, dp, zero, mixed):
    tp = min(tp, model.kv_heads) if model.ffn % tp == 0 else 1
    pp = min(pp, model.layers)
    job = make_job(model)
    plan = make_plan({"actor": (tp, pp, dp, zero), "critic": (1, 1, 1, 1), "ref": (tp, 1, 1, 0), "reward": (1, 1, dp, 0)})
    hs = holdings(job, plan, mixed_precision=mixed)
    assert list(hs) == sorted(hs) and len(set(hs)) == len(hs)
    by_key: dict[tuple, set] = {}
    per_kind_bytes: dict[tuple[str, str], int] = {}
    for h in hs:
        by_key.setdefault(h.region.key, set()).add((h.region.offsets, h.region.lengths))
        k = (h.region.model, h.region.kind)
        per_kind_bytes[k] = per_kind_bytes.get(k, 0) + h.region.nbytes
    for role in ROLES_STAGES:
        inv = {t.name: t for t in tensor_inventory(model, head_of(role))}
        tp_role = plan.home(role).config.tp
        # TP-replicated tensors (norms, value head) are held whole by every TP rank
        n = sum(t.numel * (tp_role if t.tp_dim is None else 1) for t in inv.values())
        for (r, tensor, kind), boxes in by_key.items():
            if r == role:  # distinct boxes of every tensor kind tile the whole tensor exactly once
                assert covers_exactly((0,) * len(inv[tensor].shape), inv[tensor].shape, boxes)
        pbytes = 2 if mixed else 4
        dp_role = plan.home(role).config.dp
        param_copies = 1 if role == "actor" and zero == 3 else dp_role  # ZeRO-3 shards params of training stages
        assert per_kind_bytes[(role, "param")] == n * pbytes * param_copies
        if role == "actor":
            opt_copies = dp if zero == 0 else 1
            assert per_kind_bytes[(role, "exp_avg")] == 4 * n * opt_copies
            assert ((role, "master") in per_kind_bytes) == mixed
        if role in ("ref", "reward"):
            assert {k for (r, k) in per_kind_bytes if r == role} == {"param"}
    emus = build_emus(job, plan, mixed_precision=mixed)
    assert len(emus) == sum(s.config.dp for s in plan.stages)
    assert sorted(h for e in emus for h in e.holdings) == list(hs)
    assert emus[0].to_dict() == type(emus[0]).from_dict(emus[0].to_dict()).to_dict()
