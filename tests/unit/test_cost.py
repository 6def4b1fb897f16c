import math

import pytest

from nereus.models import preset
from nereus.planner.cost.model import decode_step_s, estimate, model_state_bytes, params_per_gpu, weight_sync_s
from nereus.planner.cost.params import CostParams, allreduce_s, p2p_s
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig

GiB = 1024**3
H100 = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 1})
H100x4 = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 4})


def job(model="llama-3.1-8b", mean=512, mx=2048, prompt=1024, prompts=64, spp=4, mb=4):
    return JobSpec.from_dict({
        "algorithm": "ppo", "models": {"actor": model, "critic": model, "ref": model},
        "batch": {"prompts": prompts, "samples_per_prompt": spp, "ppo_epochs": 1, "mini_batches": mb},
        "sequence": {"prompt_len": prompt, "response_len_mean": mean, "response_len_max": mx}})


def test_model_states_16_bytes_and_zero_variants():
    psi, dp = 1e9, 8
    # ZeRO 0-2: Megatron's fp32 main gradients (2 + 4 + 12 = 18 bytes before sharding, Megatron-LM#654)
    assert sum(model_state_bytes(psi, dp, 0).values()) == 18e9
    assert sum(model_state_bytes(psi, dp, 1).values()) == pytest.approx(6e9 + 12e9 / 8)
    assert sum(model_state_bytes(psi, dp, 2).values()) == pytest.approx(2e9 + 16e9 / 8)
    assert sum(model_state_bytes(psi, dp, 3).values()) == pytest.approx(16e9 / 8)


def test_allreduce_is_a_whole_operation_latency_plus_ring_bandwidth_and_p2p():
    assert allreduce_s(1e9, 8, 100e9, 0.0) == pytest.approx(2 * 7 / 8 * 1e9 / 100e9)
    # latency: 2 * ceil(log2 8) = 6 steps, not 2(n-1) = 14 ring hops
    assert allreduce_s(1e9, 8, 100e9, 1e-5) == pytest.approx(6 * 1e-5 + 0.0175)
    assert allreduce_s(8, 8, 100e9, 3e-6) == pytest.approx(18e-6, rel=1e-3)  # the published 10-40 us on 8 GPUs
    # 16 ranks on 2 nodes: 3 intra-node steps and 1 inter-node step, each twice
    assert allreduce_s(8, 16, 100e9, 3e-6, nodes=2, alpha_inter=12e-6) == pytest.approx(2 * (3 * 3e-6 + 12e-6), rel=1e-3)
    assert allreduce_s(1e9, 1, 100e9, 1e-5) == 0.0
    assert p2p_s(1e6, 1e9, 5e-6) == pytest.approx(5e-6 + 1e-3)


def test_1f1b_bubble_fraction():
    j = job()
    for pp, b in ((2, 1), (4, 2)):
        e = estimate(j, H100, "actor/training", ParallelConfig(tp=1, pp=pp, dp=8 // pp, micro_batch=b), params=CostParams())
        m = math.ceil(256 / (4 * (8 // pp) * b))
        tb = e.time_breakdown
        # bubble share of (compute + bubble) is (p-1)/(m+p-1)
        assert tb["pp_bubble"] / (tb["compute"] + tb["pp_bubble"]) == pytest.approx((pp - 1) / (m + pp - 1))


def test_decode_switches_from_memory_to_compute_bound_at_ridge_batch():
    m = preset("llama-3.1-8b")
    p = CostParams(hbm_eff=1.0, mfu_decode=1.0)
    ridge = 989e12 / 3.35e12  # about 295 on H100 (weights only)
    mem, cmp_, _ = decode_step_s(m, 1, 1, ridge * 0.9, 1e-6, H100, p)
    assert mem > cmp_
    mem, cmp_, _ = decode_step_s(m, 1, 1, ridge * 1.1, 1e-6, H100, p)
    assert cmp_ > mem
    # weights-only memory time is 2N bytes / HBM bandwidth
    mem, _, _ = decode_step_s(m, 1, 1, 1, 1e-6, H100, p)
    assert mem == pytest.approx(2 * params_per_gpu(m, 1, 1) / 3.35e12, rel=1e-6)


def test_8b_adam_does_not_fit_one_gpu_but_fits_zero3_over_8():
    j = job()
    one = estimate(j, H100, "actor/training", ParallelConfig(zero=0))
    # Megatron's 2 + 4 + 12 bytes a parameter (fp32 main grads), ~145 GB, and the plan's reserve on top
    reserve = 1 + CostParams().mem_reserve_frac
    assert one.resident_bytes == pytest.approx(18 * preset("llama-3.1-8b").num_params() * reserve)
    assert not one.fits
    z3 = estimate(j, H100, "actor/training", ParallelConfig(dp=8, zero=3))
    assert z3.fits


def test_70b_generation_weights_need_tp4():
    j = job("llama-3.1-70b")
    assert not estimate(j, H100, "actor/generation", ParallelConfig(tp=1, dp=8)).fits
    assert estimate(j, H100, "actor/generation", ParallelConfig(tp=4, dp=2)).fits


def test_generation_memory_and_waves_grow_with_response_length():
    short = estimate(job(mean=512, mx=2048), H100, "actor/generation", ParallelConfig(tp=1, dp=8))
    long = estimate(job(mean=8192, mx=32768), H100, "actor/generation", ParallelConfig(tp=1, dp=8))
    assert long.mem_bytes > short.mem_bytes
    assert long.waves >= short.waves
    assert long.time_s > 4 * short.time_s


def test_tp_spanning_nodes_uses_inter_node_bandwidth_for_dp():
    j = job()
    one_node = estimate(j, H100x4, "actor/training", ParallelConfig(tp=1, dp=8))
    four_nodes = estimate(j, H100x4, "actor/training", ParallelConfig(tp=4, dp=8))
    # same per-GPU gradient volume ratio aside, 32-GPU DP crosses nodes: per-byte slower
    psi1 = params_per_gpu(preset("llama-3.1-8b"), 1, 1)
    psi4 = params_per_gpu(preset("llama-3.1-8b"), 4, 1)
    per_byte_1 = one_node.time_breakdown["dp_grad_sync"] / psi1
    per_byte_4 = four_nodes.time_breakdown["dp_grad_sync"] / psi4
    # hierarchical: 8 DP ranks of stride 4 on 4 nodes = 2 per node, so each node's 2 NICs carry the
    # inter-node ring (2(k-1)/k * S / (2 * B_inter)) against 2(n-1)/n * S / B_intra on one node
    p = CostParams()
    intra = H100x4.gpu.intra_node_gbps * 1e9 * p.intra_link_eff
    inter = H100x4.gpu.inter_node_gbps * 1e9 * p.inter_link_eff
    expected = (2 * 3 / 4 / (2 * inter)) / (2 * 7 / 8 / intra)
    assert per_byte_4 / per_byte_1 == pytest.approx(expected, rel=0.05)
    assert per_byte_4 > 3 * per_byte_1


def test_weight_sync_colocated_is_faster():
    m = preset("llama-3.1-8b")
    tr, gen = ParallelConfig(tp=2, dp=16), ParallelConfig(tp=1, dp=32)
    assert weight_sync_s(m, tr, gen, H100x4, True) < weight_sync_s(m, tr, gen, H100x4, False)


def test_stage_factor_scales_time():
    j = job()
    cfg = ParallelConfig(tp=1, dp=8)
    base = estimate(j, H100, "ref/inference", cfg).time_s
    p = CostParams().with_stage_factors(inference=1.5)
    assert estimate(j, H100, "ref/inference", cfg, params=p).time_s == pytest.approx(1.5 * base)
    assert CostParams.from_dict(p.to_dict()) == p
