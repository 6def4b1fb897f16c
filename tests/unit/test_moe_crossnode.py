"""Generation layouts that span nodes (issue 30 leftovers): a rollout engine's TP group across whole
nodes (vLLM multi-node TP, as NeMo RL runs Qwen3-235B at TP 16 and DeepSeek-V3 at TP 32) and PP
stages across nodes, priced with the inter-node link; Megatron's TP still refused across nodes."""
from __future__ import annotations

import pytest

from nereus.errors import SpecError
from nereus.models.spec import preset
from nereus.planner.cost.comm import links, pp_hops_s
from nereus.planner.cost.generation import decode_terms
from nereus.planner.cost.model import estimate
from nereus.planner.cost.params import CostParams, allreduce_s, p2p_s
from nereus.planner.specs import (BatchSpec, ClusterSpec, GPU_PRESETS, JobSpec, ParallelConfig, SequenceSpec)

H100 = GPU_PRESETS["h100-80gb"]
TWO = ClusterSpec(gpu=H100, nodes=2, gpus_per_node=8)
P = CostParams(inter_latency_s=50e-6, p2p_latency_s=8e-6)


def _job(model_name: str = "qwen3-235b-a22b") -> JobSpec:
    m = preset(model_name)
    return JobSpec(algorithm="grpo", models=(("actor", m), ("ref", m)),
                   batch=BatchSpec(prompts=8, samples_per_prompt=8),
                   sequence=SequenceSpec(prompt_len=256, response_len_mean=512, response_len_max=1024))


def test_generation_tp_may_span_whole_nodes_megatron_tp_may_not():
    job = _job()
    e = estimate(job, TWO, "actor/generation", ParallelConfig(tp=16, dp=1), params=P)
    assert e.fits and e.time_s > 0
    with pytest.raises(SpecError, match=r"tp\(16\) > gpus_per_node\(8\): training TP stays inside a node"):
        estimate(job, TWO, "actor/training", ParallelConfig(tp=16, dp=1), params=P)
    with pytest.raises(SpecError, match=r"inference TP stays inside a node"):
        estimate(job, TWO, "ref/inference", ParallelConfig(tp=16, dp=1), params=P)
    six = ClusterSpec(gpu=H100, nodes=4, gpus_per_node=6)  # tp 8 would take a node and a third
    with pytest.raises(SpecError, match=r"tp\(8\) spans nodes but is not a multiple of gpus_per_node\(6\)"):
        estimate(_job("qwen3-30b-a3b"), six, "actor/generation", ParallelConfig(tp=8, dp=3), params=P)


@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "llama-3.1-70b"])
def test_cross_node_tp_decode_pays_the_hierarchical_all_reduce_on_the_inter_node_link(name):
    """TP 16 over two nodes: every layer's two all-reduces are hierarchical (3 NVLink steps and 1
    inter-node step each way, the remote ring over the NIC), and the inter-node latency shows."""
    m = preset(name)
    intra, inter = links(TWO, P)
    for active in (1.0, 64.0):
        _, _, comm = decode_terms(m, 16, 1, TWO, P)(active, 1000.0)
        act = active * m.hidden * 2
        want = 2 * m.layers * allreduce_s(act, 16, intra, P.allreduce_latency_s, nodes=2,
                                          alpha_inter=P.inter_latency_s, bw_inter=inter)
        assert comm == pytest.approx(want, rel=1e-12)
        # one node's TP 8 pays no inter-node step; the cross-node group's latency alone exceeds it
        _, _, comm8 = decode_terms(m, 8, 1, TWO, P)(active, 1000.0)
        assert comm > comm8 + 2 * m.layers * 2 * (P.inter_latency_s - P.allreduce_latency_s) * 0.99
    slow = CostParams(inter_latency_s=2 * P.inter_latency_s, p2p_latency_s=8e-6)
    assert decode_terms(m, 16, 1, TWO, slow)(8.0, 1000.0)[2] > decode_terms(m, 16, 1, TWO, P)(8.0, 1000.0)[2]


def test_pipeline_hops_cross_nodes_only_at_node_boundaries():
    intra, inter = links(TWO, P)
    nb = 64 * 8192 * 2
    near, far = p2p_s(nb, intra, P.p2p_latency_s), p2p_s(nb, inter, P.inter_latency_s)
    one = ClusterSpec(gpu=H100, nodes=1, gpus_per_node=8)
    assert pp_hops_s(nb, 4, 2, one, P) == pytest.approx(2 * near)  # one node: as before, all on NVLink
    assert pp_hops_s(nb, 8, 2, TWO, P) == pytest.approx(2 * far)  # TP 8 per node, PP 2: both hops cross
    assert pp_hops_s(nb, 4, 4, TWO, P) == pytest.approx(2 * far + 2 * near)  # stage 1 -> 2 and the wrap cross
    assert pp_hops_s(nb, 2, 2, TWO, P) == pytest.approx(2 * near)  # 4 GPUs in node 0
    assert pp_hops_s(nb, 8, 1, TWO, P) == 0.0
    m = preset("llama-3.1-70b")
    _, _, c = decode_terms(m, 8, 2, TWO, P)(16.0, 500.0)
    act = 16.0 / 2 * m.hidden * 2
    tp_part = 2 * m.layers * allreduce_s(act, 8, intra, P.allreduce_latency_s)
    assert c == pytest.approx(tp_part + 2 * p2p_s(act, inter, P.inter_latency_s), rel=1e-9)


def test_moe_rows_spanning_nodes_are_predicted_with_their_stated_layouts():
    from nereus.fidelity.corpus import load_corpus
    from nereus.fidelity.predict import moe_stage_configs
    from nereus.fidelity.report import evaluate, fitted_params

    rows = {r.id: r for r in load_corpus() if r.category == "moe"}
    layouts = {i: moe_stage_configs(rows[i], rows[i].gpus)[1] for i in ("moe-nemorl-002", "moe-nemorl-003")}
    assert {i: (g.tp, g.dp, g.ep) for i, g in layouts.items()} == {"moe-nemorl-002": (16, 8, 1),
                                                                   "moe-nemorl-003": (32, 8, 1)}
    preds = evaluate(list(rows.values()), fitted_params)
    assert all(p.predicted and p.predicted > 0 for p in preds), [(p.row.id, p.reason) for p in preds]


def test_one_step_off_moe_rows_overlap_rollout_and_trainer_pools():
    """NeMo RL's 1-step-off MoE rows: generation alone on the rollout GPUs, the rest on the trainer
    GPUs; the step is the slower pool plus what of the sync cannot overlap, not the sum."""
    from dataclasses import replace

    from nereus.fidelity.corpus import load_corpus
    from nereus.fidelity.predict import moe_one_step_off_s, moe_stage_configs
    from nereus.fidelity.report import fitted_params
    from nereus.fidelity.rl_rows import rl_job

    p = fitted_params("h100-80gb")
    rows = {r.id: r for r in load_corpus() if r.category == "moe"}
    r = rows["moe-nemorl-006"]  # DeepSeek-V3, 256 : 256, vLLM TP 32 over 4 nodes
    step = moe_one_step_off_s(r, H100, p)
    job, w = rl_job(r, preset("deepseek-v3"))
    cluster = ClusterSpec(gpu=H100, nodes=64, gpus_per_node=8)
    train, gen = moe_stage_configs(r, 256)  # 256 : 256, so one call gives both pools' layouts
    assert (gen.tp, gen.dp, train.pp, train.ep, train.dp) == (32, 8, 16, 16, 16)
    q = replace(p, mem_reserve_frac=0.0, mem_fragmentation=1.0)
    rollout = estimate(job, cluster, "actor/generation", gen, w, q).time_s
    rollout = rollout - estimate(job, cluster, "actor/generation", gen, w, q).time_breakdown.get("engine_wake_sleep", 0)
    trainer = sum(estimate(job, cluster, ms, train, w, q).time_s for ms in job.model_stages() if ms != "actor/generation")
    from nereus.planner.cost.comm import weight_sync_s

    sync = weight_sync_s(preset("deepseek-v3"), train, gen, cluster, False, q)
    assert max(rollout, trainer) * 0.999 <= step < rollout + trainer + sync
    assert step == pytest.approx(max(rollout, trainer) + sync, rel=0.01)  # the sync does not overlap (staleness 1)
    fewer = replace(r, config={**r.config, "rollout_gpus": "128"})  # half the rollout GPUs: twice the sequences
    from nereus.fidelity.predict import moe_one_step_off

    # per replica, a (slightly) slower rollout (the smaller sync group's cheaper broadcasts aside)
    assert moe_one_step_off(fewer, H100, p)["rollout_s"] > moe_one_step_off(r, H100, p)["rollout_s"] * (1 + 1e-6)
