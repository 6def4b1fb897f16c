"""Cost and memory of mixture-of-experts models with expert parallelism (issue 30, item 2), and
dense estimates unchanged by it."""
from __future__ import annotations

import hashlib
import json
import math
import re

import pytest

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec, from_hf_dict, preset
from nereus.planner.cost import moe
from nereus.planner.cost.estimates import StageOptions
from nereus.planner.cost.generation import decode_terms
from nereus.planner.cost.memory import GiB, kv_bytes_per_token_per_gpu, params_per_gpu
from nereus.planner.cost.model import estimate
from nereus.planner.cost.params import CostParams
from nereus.planner.plan import StagePlacement
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

from test_models_moe import QWEN3_30B_A3B

C1, C4 = "examples/cluster-h100-1n.yaml", "examples/cluster-h100-4n.yaml"
JOB = "examples/grpo-qwen3-30b-a3b.yaml"

# time_s, mem_bytes and a hash of the whole estimate JSON of dense model-stages. Captured before expert
# parallelism existed (7b98795; still exact at a6bf255, which added it), re-pinned at ebc4e38 after two
# deliberate dense changes: 9269c20's per-response host cost in generation (each generation time grew by
# exactly 0.185 ms x responses per replica, e.g. +0.02368 s = 128 x 0.185 ms) and ebc4e38's memory terms
# (Megatron fp32 main grads, logits_copies_train 1.62, mem_fragmentation; training/inference mem_bytes
# only), and again when the allocator's slack left the plan (reserved-memory rows only; training/inference
# mem_bytes only). Every other time is the pre-EP capture to the last bit. A change here must be deliberate.
DENSE_CASES = [
    ("ppo-8b", C1, "actor/generation", {"tp": 1, "dp": 8}, 100.81686631091118, 44931176060.09477, "14823a22d584f56e"),
    ("ppo-8b", C1, "actor/generation", {"tp": 4, "pp": 2, "dp": 1}, 161.81098619215598, 10030738847.023693, "5262f7db88a5f958"),
    ("ppo-8b", C1, "actor/training", {"tp": 2, "dp": 4, "micro_batch": 2}, 45.75826158000778, 81943504697.7536, "4d5af7e27ffd4209"),
    ("ppo-8b", C1, "actor/training", {"tp": 1, "dp": 8, "zero": 3, "recompute": True, "sp": 2}, 79.59157099497968,
     26988353832.755203, "4a7aa8951e22c69f"),
    ("ppo-8b", C1, "critic/inference", {"tp": 2, "pp": 2, "dp": 2}, 12.245218240200881, 6550414663.68, "142f87fd931ba81f"),
    # ZeRO-3 inference re-pinned (mem_bytes only, time to the bit) when its weights were sharded over dp as
    # FSDP holds them (24.50 -> 10.76 GiB: 14.96 GiB of whole bf16 weights -> 1.87 + 0.93 gathered)
    ("ppo-8b", C1, "ref/inference", {"tp": 1, "dp": 8, "zero": 3}, 16.161756272338273, 11558427130.88, "9df00f0cd96ea2f4"),
    ("ppo-70b", C4, "actor/training", {"tp": 8, "pp": 4, "dp": 1, "recompute": True}, 323.0785033013246, 50583392308.4288,
     "4085b77dc3b8d392"),
    ("ppo-70b", C4, "actor/generation", {"tp": 8, "pp": 1, "dp": 4}, 231.39824469742047, 36087546381.559235,
     "6ab36940fa09499e"),
    ("grpo-32b", C4, "actor/training", {"tp": 4, "pp": 2, "dp": 4, "cp": 2, "token_budget": 8192}, 104.40966665585171,
     83518850864.3328, "b0ee17987ca83273"),
    ("grpo-7b", C1, "actor/inference", {"tp": 1, "dp": 8, "micro_batch": 4}, 3.3974528714309407, 27973360957.44,
     "be9f98bc52fb630c"),
    ("grpo-7b", C1, "actor/generation", {"tp": 2, "dp": 4}, 27.660979028776882, 12522560974.085579, "f5a1edf237a44072"),
]


def _digest(e) -> str:
    return hashlib.sha256(json.dumps(e.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("job,cluster,ms,cfg,time_s,mem,digest", DENSE_CASES)
def test_dense_estimates_identical_to_before_expert_parallelism(job, cluster, ms, cfg, time_s, mem, digest):
    e = estimate(load_job(f"examples/{job}.yaml"), load_cluster(cluster), ms, ParallelConfig(**cfg))
    assert (e.time_s, e.mem_bytes, _digest(e)) == (time_s, mem, digest)


def test_dense_estimate_with_framework_options_identical():
    e = estimate(load_job("examples/ppo-8b.yaml"), load_cluster(C1), "actor/training", ParallelConfig(tp=2, dp=4),
                 options=StageOptions(fp8_linear=True, pad_to=4096, param_offload="per_call", optimizer_offload=True))
    assert (e.time_s, e.mem_bytes, _digest(e)) == (52.78973318248092, 55346875257.6512, "4a50fef5b895542f")


# ---- ParallelConfig --------------------------------------------------------------------------
def test_parallel_config_expert_fields_default_and_json():
    c = ParallelConfig(tp=2, dp=4)
    assert "ep" not in c.to_dict() and "etp" not in c.to_dict() and c.label() == "tp2pp1dp4"
    e = ParallelConfig(tp=2, dp=4, ep=8)
    assert e.to_dict()["ep"] == 8 and e.to_dict()["etp"] == 1 and e.label() == "tp2pp1dp4ep8"
    assert ParallelConfig.from_dict(e.to_dict()) == e
    assert ParallelConfig(tp=4, dp=2, ep=2, etp=4).label() == "tp4pp1dp2ep2etp4"


@pytest.mark.parametrize("kw", [dict(tp=2, dp=2, ep=8), dict(tp=4, dp=2, ep=4, etp=4), dict(tp=1, dp=6, ep=4)])
def test_parallel_config_refuses_ep_etp_not_dividing_tp_dp(kw):
    with pytest.raises(SpecError, match=r"ep\(\d+\) \* etp\(\d+\) must divide tp"):
        ParallelConfig(**kw)


def test_plan_row_carries_ep_etp_and_round_trips():
    s = StagePlacement(name="actor/training", config=ParallelConfig(tp=2, pp=2, dp=8, ep=8), pool=0, first_gpu=0,
                       gpus=32)
    d = s.to_dict()
    assert (d["ep"], d["etp"]) == (8, 1)
    assert StagePlacement.from_dict(d).config == s.config
    dense = StagePlacement(name="actor/training", config=ParallelConfig(tp=2, dp=4), pool=0, first_gpu=0, gpus=8)
    assert "ep" not in dense.to_dict() and "etp" not in dense.to_dict()


def test_dense_model_refuses_expert_parallelism():
    job = load_job("examples/ppo-8b.yaml")
    for ms in ("actor/training", "ref/inference", "actor/generation"):
        with pytest.raises(SpecError, match="dense model"):
            estimate(job, load_cluster(C1), ms, ParallelConfig(tp=2, dp=4, ep=2))


def test_moe_layout_rules():
    job, c = load_job(JOB), load_cluster(C4)
    with pytest.raises(SpecError, match="ep\\(3\\) must divide the 128 experts"):
        estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=6, ep=3))
    with pytest.raises(SpecError, match="ZeRO-3"):
        estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32, ep=8, zero=3))
    with pytest.raises(SpecError, match="ep is 1 or tp"):
        estimate(job, c, "actor/generation", ParallelConfig(tp=2, dp=16, ep=8))


# ---- memory: every expert counted -------------------------------------------------------------
def test_qwen3_30b_a3b_from_hf_config_weights_of_a_tp1_replica():
    m = from_hf_dict(QWEN3_30B_A3B, "qwen3-30b-a3b")
    assert m.num_params() / 1e9 == pytest.approx(30.5, rel=0.02)
    assert m.active_params() / 1e9 == pytest.approx(3.3, rel=0.02)
    assert params_per_gpu(m, 1, 1) == m.num_params()  # all experts, not a 3B dense model (6.2 GiB)
    e = estimate(load_job(JOB), load_cluster(C4), "actor/generation", ParallelConfig(tp=1, dp=32))
    assert e.mem_breakdown["weights"] == 2 * m.num_params()
    assert e.mem_breakdown["weights"] / GiB == pytest.approx(56.87, abs=0.01)


def test_training_memory_shards_experts_by_ep_etp_and_dense_by_tp():
    m, job, c = preset("qwen3-30b-a3b"), load_job(JOB), load_cluster(C4)
    expert = m.expert_params()
    dense = m.num_params() - expert
    for kw, shards in ((dict(tp=1, dp=32), 1), (dict(tp=1, dp=32, ep=8), 8), (dict(tp=2, dp=16, ep=4, etp=2), 8),
                       (dict(tp=2, dp=16, ep=1, etp=2), 2)):
        cfg = ParallelConfig(**kw)
        e = estimate(job, c, "actor/training", cfg)
        d, x = moe.stage_params(m, cfg.tp, 1, shards)
        assert x == pytest.approx(expert / shards)
        assert d == pytest.approx(dense / cfg.tp, rel=0.01)  # KV projections replicate a little at tp 2 > ...
        assert e.mem_breakdown["weights"] == pytest.approx(2 * (d + x))
        edp = cfg.tp * cfg.dp // (cfg.ep * cfg.etp)
        assert e.mem_breakdown["optimizer"] == pytest.approx(12 * (d / cfg.dp + x / edp))
    # ep = etp = 1 keeps every expert on every rank: 30.5B of bf16 weights and grads do not fit
    e = estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32))
    assert e.mem_breakdown["weights"] == 2 * m.num_params() and not e.fits


def test_pipeline_stage_holds_its_blocks_experts():
    m = preset("deepseek-v3")  # blocks 0-2 dense, the rest MoE
    d1, x1 = moe.stage_params(m, 1, 1, 1)
    assert d1 + x1 == pytest.approx(m.num_params())
    d, x = moe.stage_params(m, 1, 61, 1)  # one block per stage: the busiest is a MoE block
    assert x == m.experts * m.one_expert_params()


def test_mla_kv_cache_not_divided_by_tp():
    m = preset("deepseek-v3")
    assert kv_bytes_per_token_per_gpu(m, 8, 1) == kv_bytes_per_token_per_gpu(m, 1, 1) == m.kv_bytes_per_token()
    q = preset("qwen3-30b-a3b")
    assert kv_bytes_per_token_per_gpu(q, 4, 1) == q.kv_bytes_per_token() / 4


# ---- time ----------------------------------------------------------------------------------------
def test_flops_follow_active_parameters():
    job, c = load_job(JOB), load_cluster(C4)
    e = estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32, ep=8))
    m = preset("qwen3-30b-a3b")
    assert m.matmul_params() < 0.12 * m.num_params()
    assert e.time_breakdown["compute"] < 30  # a 30B dense model's 6N would take ~9x longer


def test_all_to_all_per_moe_layer_only_with_ep_and_across_nodes_costlier():
    job, c, p = load_job(JOB), load_cluster(C4), CostParams()
    base = estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32, ep=1, etp=1), params=p)
    ep8 = estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32, ep=8), params=p)
    ep16 = estimate(job, c, "actor/training", ParallelConfig(tp=1, dp=32, ep=16), params=p)
    assert base.time_breakdown["ep_comm"] == 0 and base.time_breakdown["moe_imbalance"] == 0
    assert ep8.time_breakdown["ep_comm"] > 0
    assert ep8.time_breakdown["moe_imbalance"] > 0
    assert ep16.time_breakdown["ep_comm"] > 3 * ep8.time_breakdown["ep_comm"]  # 16 ranks span two nodes
    # one dispatch: tokens x k x h x bytes, the busiest rank's share, over the EP group
    m, cfg = preset("qwen3-30b-a3b"), ParallelConfig(tp=1, dp=8, ep=8)
    from nereus.planner.cost.params import alltoall_s
    from nereus.planner.cost.comm import group_bw
    want = alltoall_s(1000 * 8 * 2048 * 2 * moe.CAPACITY_FACTOR, 8, group_bw(c, 8, p), p.allreduce_latency_s)
    assert moe.ep_a2a_s(m, cfg, 1000, c, p) == want


def test_decode_reads_only_the_experts_its_tokens_hit():
    m = preset("qwen3-30b-a3b")
    assert moe.expected_distinct_experts(m, 1) == pytest.approx(8)
    assert moe.expected_distinct_experts(m, 10**6) == pytest.approx(128)
    assert moe.expected_distinct_experts(m, 4) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 4))
    c, p = load_cluster(C1), CostParams()
    terms = decode_terms(m, 1, 1, c, p)
    mem1, _, _ = terms(1, 0)
    mem256, _, _ = terms(256, 0)
    hbm = p.hbm_eff * c.gpu.hbm_bytes_per_s
    d, x = moe.stage_params(m, 1, 1, 1)
    assert mem1 == pytest.approx(2 * (d + x * 8 / 128) / hbm)
    assert mem256 == pytest.approx(2 * (d + x * (1 - (1 - 1 / 16) ** 256)) / hbm)
    # vLLM expert parallelism: the busiest rank reads and computes more
    e1 = estimate(load_job(JOB), load_cluster(C4), "actor/generation", ParallelConfig(tp=4, dp=8))
    e4 = estimate(load_job(JOB), load_cluster(C4), "actor/generation", ParallelConfig(tp=4, dp=8, ep=4))
    assert e1.mem_breakdown["weights"] == e4.mem_breakdown["weights"]
    assert e1.time_s != e4.time_s


def test_whole_experts_drop_the_moe_blocks_mlp_tp_collectives():
    job, c = load_job(JOB), load_cluster(C4)
    etp = estimate(job, c, "actor/training", ParallelConfig(tp=2, dp=16, ep=1, etp=2))
    whole = estimate(job, c, "actor/training", ParallelConfig(tp=2, dp=16, ep=8))
    assert whole.time_breakdown["tp_comm"] == pytest.approx(etp.time_breakdown["tp_comm"] / 2)


def test_all_to_all_across_nodes_sends_the_local_peers_share_over_nvlink():
    """ep 16 on two 8-GPU nodes: 7/16 of a rank's bytes go to peers on its node (NVLink), 8/16 to the
    other node (scale-out), concurrently; not all 15/16 over the scale-out link."""
    from nereus.planner.cost.comm import links
    from nereus.planner.cost.params import latency_steps

    c, p, m = load_cluster(C4), CostParams(), preset("qwen3-30b-a3b")
    intra, inter = links(c, p)
    for cfg, local in ((ParallelConfig(tp=1, dp=32, ep=16), 8), (ParallelConfig(tp=2, dp=16, ep=8, etp=2), 4)):
        nbytes = 1000 * 8 * 2048 * 2 * moe.CAPACITY_FACTOR
        n = cfg.ep
        want = latency_steps(n) * p.allreduce_latency_s + max((local - 1) / n * nbytes / intra,
                                                               (n - local) / n * nbytes / inter)
        assert moe.ep_a2a_s(m, cfg, 1000, c, p) == pytest.approx(want)
        old = (n - 1) / n * nbytes / inter  # everything over the scale-out link, as before
        assert moe.ep_a2a_s(m, cfg, 1000, c, p) < 0.6 * old + latency_steps(n) * p.allreduce_latency_s


# ---- fidelity: the corpus's MoE rows, held out --------------------------------------------------------
def test_moe_fidelity_rows_held_out_and_predicted_at_their_stated_layout(tmp_path):
    from nereus.fidelity.corpus import HELDOUT_ONLY, load_corpus, load_file
    from nereus.fidelity.predict import moe_stage_configs
    from nereus.fidelity.report import evaluate, fitted_params, summarize

    rows = [r for r in load_corpus() if r.category == "moe"]
    assert len(rows) >= 3 and "moe" in HELDOUT_ONLY and all(r.split == "heldout" for r in rows)
    bad = tmp_path / "moe.csv"
    text = (load_corpus.__globals__["DEFAULT_DIR"] / "moe.csv").read_text().splitlines()
    bad.write_text("\n".join([text[0], text[1].replace(",heldout,", ",fit,")]) + "\n")
    with pytest.raises(SpecError, match="held out from every fit"):
        load_file(bad, "moe")
    r30 = next(r for r in rows if r.id == "moe-nemorl-001")
    train, gen = moe_stage_configs(r30, r30.gpus)
    assert (train.tp, train.dp, train.ep, train.etp, gen.tp, gen.ep) == (2, 16, 8, 1, 4, 1)  # NeMo RL's [TP2 EP8], vLLM TP4
    preds = {p.row.id: p for p in evaluate(rows, fitted_params)}
    assert 0.5 <= preds["moe-nemorl-001"].ratio <= 2
    assert all(preds[i].predicted for i in ("moe-nemorl-002", "moe-nemorl-003"))  # vLLM TP 16 / 32 across nodes
    s = next(x for x in summarize(list(preds.values())) if x["category"] == "moe")
    assert s["split"] == "heldout" and s["rows"] == len(rows) and s["predicted"] >= 1 and "median_error" in s


def test_nereus_fidelity_reports_the_moe_category():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import sys; from nereus.cli import main; sys.exit(main())", "fidelity",
                          "--split", "heldout"], capture_output=True, text=True, timeout=600, env={
        **__import__("os").environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r"moe \(heldout\): \d+ rows, \d+ predicted, within 2x \d+%, median error [\d.]+x", out.stdout)
