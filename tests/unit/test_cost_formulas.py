"""The cost model's terms, each against what its docstring says it computes: how memory adds up,
how each time term scales with the config (GPUs, layers per stage, micro-batch, context), the
closed forms of offload, weight sync, decode and the KV budget. Mutation testing found these
relations unchecked (a sign or an operator could flip and every other test still passed)."""
import math
from dataclasses import replace

import pytest

from nereus.models import preset
from nereus.planner.cost import model as cm
from nereus.planner.cost.model import (decode_step_s, estimate, kv_budget_full, kv_bytes_per_token_per_gpu,
                                       model_state_bytes, offload_s, params_per_gpu, weight_sync_s)
from nereus.planner.cost.params import CostParams, p2p_s
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig

GiB = 1024**3
H100 = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 1})
H100x2 = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 2})
M8B = preset("llama-3.1-8b")


def job(mean=1024, mx=4096, prompt=512, prompts=64, spp=4, mb=4, fixed_lengths=False):
    """PPO on Llama-3.1-8B; ``fixed_lengths``: every response at the cap (mean == max), so a
    micro-batch of b sequences holds exactly b * (prompt + cap) tokens."""
    seq = {"prompt_len": prompt, "response_len_mean": mx if fixed_lengths else mean, "response_len_max": mx}
    return JobSpec.from_dict({
        "algorithm": "ppo", "models": {"actor": "llama-3.1-8b", "critic": "llama-3.1-8b", "ref": "llama-3.1-8b"},
        "batch": {"prompts": prompts, "samples_per_prompt": spp, "ppo_epochs": 1, "mini_batches": mb},
        "sequence": seq})


@pytest.mark.parametrize("stage, cfg, kw", [
    ("actor/training", ParallelConfig(tp=2, pp=2, dp=2, zero=1, micro_batch=2), {}),
    ("critic/training", ParallelConfig(tp=1, pp=1, dp=8, zero=3, recompute=True), {}),
    ("actor/inference", ParallelConfig(tp=2, dp=4), {}),
    ("actor/generation", ParallelConfig(tp=1, dp=8), {}),
    ("actor/generation", ParallelConfig(tp=1, dp=1), {"mx": 1_000_000, "mean": 100_000}),  # KV cannot hold one
])
def test_memory_is_the_sum_of_its_breakdown_and_time_the_sum_of_its_terms(stage, cfg, kw):
    e = estimate(job(**kw), H100, stage, cfg)
    assert e.mem_bytes == pytest.approx(sum(e.mem_breakdown.values()), rel=1e-12)
    assert e.resident_bytes + e.transient_bytes == pytest.approx(e.mem_bytes, rel=1e-12)
    assert e.time_s == pytest.approx(sum(e.time_breakdown.values()), rel=1e-12)
    assert all(v >= 0 for v in e.mem_breakdown.values()) and all(v >= 0 for v in e.time_breakdown.values())


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_training_state_is_the_frameworks_bytes_a_parameter_split_by_the_zero_stage(zero):
    """Megatron (ZeRO 0-2) keeps fp32 main gradients: 2 + 4 + 12 bytes; FSDP (ZeRO-3) 16 / dp; the
    plan holds the held-out memory error's reserve on top (``CostParams.mem_reserve_frac``)."""
    e = estimate(job(), H100, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, zero=zero))
    psi = params_per_gpu(M8B, 1, 1)
    want = model_state_bytes(psi, 8, zero)
    assert {k: e.mem_breakdown[k] for k in want} == pytest.approx(want, rel=1e-12)
    reserve = CostParams().mem_reserve_frac
    assert e.resident_bytes == pytest.approx(sum(want.values()) * (1 + reserve), rel=1e-12)
    assert sum(want.values()) == pytest.approx({0: 18, 1: 6 + 12 / 8, 2: 2 + 16 / 8, 3: 16 / 8}[zero] * psi)


@pytest.mark.parametrize("stage", ["actor/inference", "actor/training"])
def test_compute_time_halves_when_data_parallel_gpus_double(stage):
    """Same micro-batches per GPU, twice the GPUs: the FLOPs are spread over twice the peak."""
    j = job(prompts=128)
    one = estimate(j, H100, stage, ParallelConfig(tp=1, dp=4, zero=1))
    two = estimate(j, H100, stage, ParallelConfig(tp=1, dp=8, zero=1))
    assert two.time_breakdown["compute"] == pytest.approx(one.time_breakdown["compute"] / 2, rel=1e-9)


@pytest.mark.parametrize("stage, recompute", [("actor/inference", False), ("actor/training", False),
                                               ("actor/training", True), ("critic/training", True)])
def test_activation_and_logits_memory_grow_in_proportion_to_the_micro_batch(stage, recompute):
    j = job(fixed_lengths=True)
    one = estimate(j, H100, stage, ParallelConfig(tp=2, dp=4, zero=1, micro_batch=1, recompute=recompute))
    two = estimate(j, H100, stage, ParallelConfig(tp=2, dp=4, zero=1, micro_batch=2, recompute=recompute))
    for part in ("activations", "logits"):
        assert two.mem_breakdown[part] == pytest.approx(2 * one.mem_breakdown[part], rel=1e-9), part


def test_lm_logits_hold_the_vocabulary_a_value_head_one_number_per_token():
    j = job(fixed_lengths=True)
    cfg = ParallelConfig(tp=2, dp=4, zero=1)
    for stage in ("inference", "training"):
        lm = estimate(j, H100, f"actor/{stage}", cfg).mem_breakdown["logits"]
        value = estimate(j, H100, f"critic/{stage}", cfg).mem_breakdown["logits"]
        assert lm / value == pytest.approx(M8B.vocab / 2, rel=1e-12), stage
    # and in proportion to the bytes of a logit
    p = CostParams()
    wide = estimate(j, H100, "actor/inference", cfg, params=replace(p, logits_bytes=2 * p.logits_bytes))
    assert wide.mem_breakdown["logits"] == pytest.approx(
        2 * estimate(j, H100, "actor/inference", cfg, params=p).mem_breakdown["logits"], rel=1e-12)


def test_sequence_parallel_exchange_covers_only_the_layers_of_a_pipeline_stage():
    j = job(fixed_lengths=True)
    flat = estimate(j, H100x2, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, sp=2, zero=1))
    staged = estimate(j, H100x2, "actor/training", ParallelConfig(tp=1, pp=2, dp=8, sp=2, zero=1))
    assert flat.time_breakdown["sp_comm"] > 0
    assert staged.time_breakdown["sp_comm"] == pytest.approx(flat.time_breakdown["sp_comm"] / 2, rel=1e-9)


def test_decode_step_reads_weights_once_per_stage_micro_batch_and_kv_of_every_context_token():
    p = CostParams()
    hbm = p.hbm_eff * H100.gpu.hbm_bytes_per_s
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        w = M8B.dtype_bytes * params_per_gpu(M8B, tp, pp)
        kvg = kv_bytes_per_token_per_gpu(M8B, tp, pp)
        mem, _, _ = decode_step_s(M8B, tp, pp, 64, 3000.0, H100, p)
        assert mem == pytest.approx((pp * w + 64 * 3000.0 * kvg) / hbm, rel=1e-12)


def test_pipelined_decode_passes_each_micro_batchs_activations_between_stages():
    p = CostParams()
    _, _, flat = decode_step_s(M8B, 1, 1, 64, 1000.0, H100, p)
    _, _, staged = decode_step_s(M8B, 1, 2, 64, 1000.0, H100, p)
    assert flat == 0.0  # tp 1, pp 1: no communication
    bw = H100.gpu.intra_node_gbps * 1e9 * p.intra_link_eff
    assert staged == pytest.approx(2 * p2p_s(64 / 2 * M8B.hidden * 2, bw, p.p2p_latency_s), rel=1e-12)


def test_kv_budget_is_what_the_engine_may_take_less_weights_and_workspace():
    j, p = job(), CostParams()
    w = 15 * GiB
    b = kv_budget_full(j, H100, w, p)
    assert b == pytest.approx(H100.gpu.usable_bytes * cm.engine_memory_util(j, p) - w - p.workspace_gib * GiB,
                              rel=1e-12)
    assert kv_budget_full(j, H100, 2 * w, p) == pytest.approx(b - w, rel=1e-12)


def test_a_sequence_the_kv_budget_cannot_hold_needs_weights_workspace_and_its_kv():
    j = job(mx=1_000_000, mean=100_000)
    e = estimate(j, H100, "actor/generation", ParallelConfig(tp=1, dp=1))
    assert not e.fits and math.isinf(e.time_s)
    b = e.mem_breakdown
    kv = (j.sequence.prompt_len + 1_000_000) * kv_bytes_per_token_per_gpu(M8B, 1, 1)
    assert b["kv_cache"] == pytest.approx(kv) and b["workspace"] == pytest.approx(CostParams().workspace_gib * GiB)
    assert e.mem_bytes == pytest.approx(b["weights"] + b["workspace"] + kv, rel=1e-12)


def test_offload_moves_the_state_out_and_back_once_per_step():
    p = CostParams()
    assert offload_s(1e9, p) == pytest.approx(2 * 1e9 / (p.host_link_gbps * 1e9), rel=1e-12)


def test_weight_sync_pays_one_latency_per_generation_shard_and_the_busier_end_of_the_transfer():
    p = CostParams()
    full = M8B.dtype_bytes * M8B.num_params()
    bw = H100.gpu.intra_node_gbps * 1e9 * p.intra_link_eff
    for train, gen in ((ParallelConfig(tp=2, dp=4), ParallelConfig(tp=2, pp=2, dp=2)),
                       (ParallelConfig(tp=8, dp=1), ParallelConfig(tp=1, dp=8)),
                       (ParallelConfig(tp=2, dp=1), ParallelConfig(tp=1, dp=8))):  # sending 4 copies dominates
        want = p.p2p_latency_s * gen.tp * gen.pp + max(full / (gen.tp * gen.pp), full * gen.dp / train.gpus) / bw
        assert weight_sync_s(M8B, train, gen, H100, True, p) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b", "qwen3-8b", "deepseek-r1-distill-qwen-1.5b"])
def test_one_gpu_without_model_parallelism_holds_every_parameter(name):
    """Llama, Qwen2 (q/k/v biases, tied embeddings at 1.5B), Qwen3 (q/k norms): params_per_gpu at
    TP1 x PP1 is the model's parameter count, and TP/PP only divide it up."""
    m = preset(name)
    assert params_per_gpu(m, 1, 1) == m.num_params()
    assert params_per_gpu(m, 2, 1) < m.num_params() < 2 * params_per_gpu(m, 2, 1)


def test_each_stage_names_itself_and_its_memory_parts():
    j = job()
    reserve = {"reserve_resident", "reserve_transient"}  # the held-out memory error, kept free
    parts = {"actor/training": {"weights", "grads", "optimizer", "activations", "logits", "workspace",
                                "fsdp_unsharded"} | reserve,
             "actor/inference": {"weights", "activations", "logits", "workspace"} | reserve,
             "actor/generation": {"weights", "kv_cache", "workspace"}}
    for stage, want in parts.items():
        e = estimate(j, H100, stage, ParallelConfig(tp=2, dp=4))
        assert e.model_stage == stage and set(e.mem_breakdown) == want, (stage, sorted(e.mem_breakdown))


def test_an_estimate_as_json_carries_every_field_of_the_estimate():
    """``nereus estimate --json``: the breakdowns, the notes and the verdict, under their names."""
    e = estimate(job(), H100, "actor/generation", ParallelConfig(tp=1, dp=2), kv_budget_bytes=8 * GiB)
    d = e.to_dict()
    assert {"model_stage", "tp", "pp", "dp", "time_s", "time_breakdown", "mem_bytes", "resident_bytes",
            "transient_bytes", "mem_breakdown", "capacity_bytes", "fits", "waves", "notes"} <= set(d)
    assert d["time_breakdown"] == dict(e.time_breakdown) and d["mem_breakdown"] == dict(e.mem_breakdown)
    assert d["notes"] == list(e.notes) and e.notes and d["waves"] == e.waves > 1
    assert d["mem_bytes"] == e.mem_bytes and d["fits"] == e.fits and d["model_stage"] == "actor/generation"


# ---- pinned by the mutation run of this round (each fails on a mutant that survived it) -----------
def test_fp32_state_is_4_4_8_bytes_per_parameter_unsharded():
    s = cm.model_state_bytes(1000.0, 4, 0, dtype_bytes=4)
    assert (s["weights"], s["grads"], s["optimizer"]) == (4000.0, 4000.0, 8000.0), s


def test_a_decode_iteration_pays_the_engines_overhead_on_top_of_its_kernels():
    p = CostParams()
    mem, cmp_, comm = decode_step_s(M8B, 2, 1, 64, 2048, H100, p)
    want = max(mem, cmp_) + comm + p.iteration_overhead_s("vllm", 64)
    assert cm.decode_iteration_s(M8B, 2, 1, 64, 2048, H100, p) == pytest.approx(want, rel=1e-12)
    assert p.iteration_overhead_s("vllm", 64) > 0


def test_training_pays_pipeline_p2p_only_with_pipeline_stages():
    j = job()
    one = estimate(j, H100, "actor/training", ParallelConfig(tp=2, pp=1, dp=4, zero=1, micro_batch=2))
    two = estimate(j, H100, "actor/training", ParallelConfig(tp=2, pp=2, dp=2, zero=1, micro_batch=2))
    assert one.time_breakdown["pp_p2p"] == 0.0 < two.time_breakdown["pp_p2p"]


def test_without_zero_every_rank_steps_the_whole_optimizer():
    j = job()
    z0 = estimate(j, H100, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, zero=0, micro_batch=2))
    z1 = estimate(j, H100, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, zero=1, micro_batch=2))
    assert z0.time_breakdown["optimizer"] == pytest.approx(8 * z1.time_breakdown["optimizer"], rel=1e-9)


def test_host_overhead_counts_three_passes_per_micro_batch_and_four_with_recompute():
    p = replace(CostParams(), micro_batch_overhead_s=0.01)
    j = job()
    plain = estimate(j, H100, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, zero=1, micro_batch=2), params=p)
    rc = estimate(j, H100, "actor/training", ParallelConfig(tp=1, pp=1, dp=8, zero=1, micro_batch=2, recompute=True),
                  params=p)
    assert rc.time_breakdown["overhead"] == pytest.approx(plain.time_breakdown["overhead"] * 4 / 3, rel=1e-12)


def test_weight_sync_stays_on_nvlink_when_a_generation_replica_fills_exactly_one_node():
    train, gen = ParallelConfig(tp=8, dp=1), ParallelConfig(tp=8, dp=1)
    p = CostParams()
    two_nodes = H100.with_gpus(16)  # pools apart on one node share its NVLink; on two, scale-out
    inside = cm.weight_sync_s(M8B, train, gen, two_nodes, colocated=True, params=p)
    across = cm.weight_sync_s(M8B, train, gen, two_nodes, colocated=False, params=p)
    assert inside < across


@pytest.mark.parametrize("bad", [-1, "3", True, 2.5])
def test_stage_options_refuse_a_bad_pad_width(bad):
    from nereus.errors import SpecError

    with pytest.raises(SpecError, match="pad_to"):
        cm.StageOptions(pad_to=bad)


def test_inference_pays_its_own_host_overheads_per_micro_batch_and_per_call():
    """A no-grad pass has its own measured overhead (no autograd graph): the training figure does
    not move inference, and the per-call cost (gathering the result) is paid once, not per micro-batch."""
    j = job()
    cfg = ParallelConfig(tp=1, pp=1, dp=8, micro_batch=2)
    train_only = replace(CostParams(), micro_batch_overhead_s=0.01)
    assert "overhead" not in estimate(j, H100, "ref/inference", cfg, params=train_only).time_breakdown
    p = replace(CostParams(), infer_pass_overhead_s=0.01, infer_call_overhead_s=0.5)
    o1 = estimate(j, H100, "ref/inference", replace(cfg, micro_batch=1), params=p).time_breakdown["overhead"]
    o2 = estimate(j, H100, "ref/inference", cfg, params=p).time_breakdown["overhead"]
    seqs = j.workload().sequences / 8
    assert o1 == pytest.approx(seqs * 0.01 + 0.5, rel=1e-12)
    assert o2 == pytest.approx(seqs / 2 * 0.01 + 0.5, rel=1e-12)


def test_tensor_parallel_inference_pays_the_embedding_and_head_collectives_per_micro_batch():
    """2 all-reduces per layer plus the vocab-parallel embedding's and head's, per micro-batch (the
    executor's TP forward makes exactly these: tests/dist/test_tp_collectives_dist.py counts them)."""
    j = job()
    m8b = j.model("ref")
    cfg = ParallelConfig(tp=4, pp=1, dp=2, micro_batch=4)
    est = estimate(j, H100, "ref/inference", cfg)
    m = math.ceil(j.workload().sequences / 2 / 4)
    one = cm.ar_s(4 * (j.workload().prompt_len + j.workload().response_len_mean) * m8b.hidden * 2, 4, H100,
                  CostParams())
    assert est.time_breakdown["tp_comm"] == pytest.approx(m * (2 * m8b.layers + cm.TP_EDGE_COLLECTIVES) * one, rel=1e-9)
