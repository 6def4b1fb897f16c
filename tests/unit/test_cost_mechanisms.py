"""Each mechanism of the cost model, tied to the published measurements it explains
(nereus/calibration/published). Predictions use the shipped profiles fitted on the fit split
(``nereus fit-profiles``); where a test reads held-out rows, no fit has read them."""
import math
from dataclasses import replace
import statistics

import pytest

from nereus.fidelity.corpus import load_corpus
from nereus.fidelity.fit import fit_profile_params
from nereus.fidelity.predict import predict
from nereus.fidelity.report import fitted_params
from nereus.planner.cost.lengths import expected_max, survival
from nereus.planner.cost.model import decode_iteration_s, estimate
from nereus.planner.cost.params import CostParams, allreduce_s
from nereus.planner.specs import (BatchSpec, ClusterSpec, GPU_PRESETS, JobSpec, ParallelConfig, RolloutSpec,
                                  SequenceSpec, Workload, load_cluster, load_job)
from nereus.models.spec import preset
from nereus.errors import SpecError

ROWS = load_corpus()
H100 = load_cluster("examples/cluster-h100-1n.yaml")


def rows(category, **cfg):
    out = [r for r in ROWS if r.category == category]
    for k, v in cfg.items():
        out = [r for r in out if (getattr(r, k, None) if k in ("metric", "split") else r.get(k)) == v]
    return out


def ratios(rs):
    preds = [predict(r, fitted_params) for r in rs]
    return [p.ratio for p in preds if p.ratio is not None]


def test_small_allreduce_is_a_whole_operation_latency_not_a_per_hop_one():
    """nccl-tests / rccl-tests latency of all-reduces <= 64 KiB on one node of 8 GPUs: the
    log2-step latency reproduces them; charging alpha per ring hop (2(n-1) = 14 hops) with the
    same fitted alpha would be 14/6 = 2.3x too slow."""
    small = [r for r in rows("collectives", metric="latency_us", op="all_reduce", nodes="1", gpus="8")
             if r.num("msg_bytes") <= 65536]
    assert len(small) >= 5
    rs = ratios(small)
    assert statistics.median(rs) == pytest.approx(1.0, abs=0.35)
    p = fitted_params("h100-80gb")
    assert allreduce_s(8, 8, 1e12, p.allreduce_latency_s) == pytest.approx(6 * p.allreduce_latency_s)


def test_multi_node_allreduce_bus_bandwidth_exceeds_one_nic_hierarchically():
    """2-node all-reduce in the bandwidth regime (>= 512 MiB) on H100/H200 reaches 260-480 GB/s
    bus bandwidth, several times one 400 Gb/s NIC: NCCL's hierarchical algorithm spreads the
    inter-node ring over the 8 NICs. The model's hierarchical term predicts those rows within 35%
    (a flat ring over the NIC would be 7-13x low)."""
    big = [r for r in rows("collectives", metric="busbw_gbs", op="all_reduce", nodes="2") if r.num("msg_bytes") >= 2**29]
    assert len(big) >= 5
    rs = ratios(big)
    # every row within 1.6x (GCP A3 Mega's NICs are 200 Gb/s per GPU, half the preset's), the median within 25%
    assert all(0.6 <= x <= 1.6 for x in rs) and abs(statistics.median(rs) - 1) <= 0.25, rs
    one_nic = GPU_PRESETS["h100-80gb"].inter_node_gbps
    assert min(r.value for r in big) > 2 * one_nic


def test_tensor_parallel_decode_latency_falls_with_tp_for_llama_8b_on_h100():
    """Published vLLM / TensorRT-LLM per-token latency of an 8B model at batch 1-2 falls from about
    6-7 ms at TP1 to 3-4 ms at TP4 (COST_MODEL.md); with whole-operation all-reduce latency the
    fitted model agrees (TP4 <= 0.7 x TP1), and it predicts the published batch-1 decode rows of
    the corpus (tpot at small batch) within 25% at the median."""
    p = fitted_params("h100-80gb")
    m = preset("llama-3.1-8b")
    t = {tp: decode_iteration_s(m, tp, 1, 2, 1024, H100, p) for tp in (1, 2, 4, 8)}
    assert t[4] <= 0.7 * t[1] and t[2] < t[1]
    assert 4e-3 <= t[1] <= 10e-3 and t[4] <= 5e-3
    lowbatch = [r for r in rows("decode") if r.metric.endswith("tpot_ms") and r.get("batch") in ("1", "2", "4", "8")]
    assert len(lowbatch) >= 5
    assert statistics.median(abs(x - 1) for x in ratios(lowbatch)) <= 0.25


def _gen(n_seqs, mean, cap, tp, p, gpus=8):
    job = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
                  batch=BatchSpec(prompts=max(1, n_seqs // 2), samples_per_prompt=2),
                  sequence=SequenceSpec(prompt_len=256, response_len_mean=mean, response_len_max=cap))
    w = Workload(sequences=n_seqs, prompt_len=256, response_len_mean=mean, response_len_max=cap)
    return estimate(job, H100, "actor/generation", ParallelConfig(tp=tp, dp=gpus // tp), w, p)


def test_many_short_responses_favour_tp1_dp8_and_few_long_ones_tp8():
    """Throughput regime vs latency regime on one 8 x H100 node (fitted profile): 4,096 short
    responses finish first as eight TP1 replicas; 8 long responses finish first at TP8, since the
    step waits for the longest and TP cuts per-token latency."""
    p = fitted_params("h100-80gb")
    assert _gen(4096, 256, 512, 1, p).time_s < _gen(4096, 256, 512, 8, p).time_s
    assert _gen(8, 8192, 16384, 8, p).time_s < _gen(8, 8192, 16384, 1, p).time_s


def test_the_longest_of_n_responses_follows_order_statistics_and_the_cap():
    """The longest of 1,024 responses of mean 2,048 is about 5-6x the mean (not the top of 32
    quantiles, about 3x), and the cap matters: 8,192 and 32,768 give different generation times."""
    assert 5 * 2048 <= expected_max(1024, 2048, None, 32768) <= 6.5 * 2048
    assert expected_max(1024, 2048, None, 8192) == 8192
    assert expected_max(8, 2048, None, 32768) < expected_max(64, 2048, None, 32768) < expected_max(1024, 2048, None, 32768)
    assert survival(8192, 2048, None, 8192) == 0.0 and 0 < survival(4096, 2048, None, 8192) < 0.2
    p = fitted_params("h100-80gb")
    assert _gen(1024, 2048, 32768, 1, p).time_s > 1.2 * _gen(1024, 2048, 8192, 1, p).time_s


def test_kv_overflow_queues_sequences_instead_of_multiplying_the_decode():
    """Continuous batching: with fewer KV blocks than sequences, concurrency drops and the rest
    wait, so halving the KV budget costs less than the 2x of sequential waves."""
    p = fitted_params("h100-80gb")
    job = load_job("examples/ppo-8b.yaml")
    w = job.workload()
    cfg = ParallelConfig(tp=1, dp=8)
    full = estimate(job, H100, "actor/generation", cfg, w, p)
    kv = full.mem_breakdown["kv_cache"]
    half = estimate(job, H100, "actor/generation", cfg, w, p, kv_budget_bytes=kv / 2)
    assert half.waves > full.waves or half.time_s > full.time_s
    assert full.time_s < half.time_s < 2 * full.time_s


def test_engine_overhead_grows_with_batch_and_is_fitted_per_engine():
    """Per-iteration engine overhead (scheduler, sampling, launch) fitted per engine on the
    corpus's decode rows; its growth with batch is what the large-batch rows need."""
    for gpu in ("h100-80gb", "mi300x"):
        p = fitted_params(gpu)
        assert p.engine_overhead, f"{gpu}: no engine fitted"
        for e, o0, o1 in p.engine_overhead:
            assert p.iteration_overhead_s(e, 256) > p.iteration_overhead_s(e, 1) > 0


def test_tp_prefill_pays_smaller_gemms_and_collectives():
    """TTFT of Llama-2-70B at TP4-8 on H100 (TensorRT-LLM tables): predicted within 40% (a
    128-token prompt reads the weights once: memory-bound, not compute-bound); and per token, TP4
    prefill is less efficient than the TP1 GEMM size would give (matmul_eff on the per-rank shape)."""
    r70 = [r for r in rows("prefill", metric="ttft_ms") if r.model == "Llama-2-70B" and r.hardware == "h100-80gb"]
    assert r70
    assert all(abs(x - 1) <= 0.40 for x in ratios(r70)), ratios(r70)
    p = fitted_params("h100-80gb")
    assert p.matmul_eff(1.0, 1e9 / 4) < p.matmul_eff(1.0, 1e9)


def test_long_sequences_pay_attention_from_the_square_of_their_length():
    """MPT training throughput falls as the sequence grows at fixed tokens per step (llm-foundry
    tables); attention FLOPs from E[s^2] at their own efficiency track that fall within 25%."""
    mpt = [r for r in rows("training", metric="tok_s_per_gpu") if r.model == "MPT-7B" and r.hardware == "a100-80gb"]
    by_len = sorted((r.num("seq_len"), r) for r in mpt)
    assert len(by_len) >= 4 and by_len[0][0] < by_len[-1][0]
    rs = ratios([r for _, r in by_len])
    assert statistics.median(abs(x - 1) for x in rs) <= 0.25
    assert by_len[-1][1].value < by_len[0][1].value


def test_jobs_without_a_reference_model_or_reward_model_are_valid():
    job = JobSpec(algorithm="ppo", models=(("actor", preset("llama-3.1-8b")), ("critic", preset("llama-3.1-8b"))),
                  batch=BatchSpec(prompts=64, samples_per_prompt=2), sequence=SequenceSpec(
                      prompt_len=512, response_len_mean=512, response_len_max=2048))
    assert "ref/inference" not in job.model_stages() and "critic/inference" in job.model_stages()
    from nereus.planner.solver import PlanProblem, solve
    sol = solve(PlanProblem(job=job, cluster=H100, workload=job.workload()), time_limit_s=10, workers=1, seed=0)
    assert sol.status == "OPTIMAL" and sol.plan is not None


def test_token_budget_bounds_activation_memory_and_sequence_parallel_splits_it():
    job = load_job("examples/ppo-8b.yaml")
    p = CostParams()
    fixed = estimate(job, H100, "actor/training", ParallelConfig(tp=1, dp=8, micro_batch=4), params=p)
    budget = estimate(job, H100, "actor/training", ParallelConfig(tp=1, dp=8, token_budget=8192), params=p)
    sp2 = estimate(job, H100, "actor/training", ParallelConfig(tp=1, dp=8, sp=2, token_budget=8192), params=p)
    # the token budget packs sequences to 8,192 tokens (a longer one gets its own micro-batch)
    assert budget.mem_breakdown["activations"] < fixed.mem_breakdown["activations"]
    assert sp2.mem_breakdown["activations"] < budget.mem_breakdown["activations"]
    assert sp2.time_breakdown["sp_comm"] > 0 == budget.time_breakdown["sp_comm"]


def test_fitting_never_reads_a_held_out_row():
    """Poison every held-out row's value: the fitted coefficients do not move."""
    from dataclasses import replace

    clean, _ = fit_profile_params(ROWS, "h200")
    poisoned = [replace(r, value=r.value * 1000) if r.split == "heldout" else r for r in ROWS]
    dirty, rec = fit_profile_params(poisoned, "h200")
    assert clean == dirty
    held = {r.id for r in ROWS if r.split == "heldout"}
    assert not held & set(rec["rows"])


def test_plan_json_round_trips_sequence_parallel_and_token_budget():
    from nereus.planner.plan import Plan, StagePlacement

    cfg = ParallelConfig(tp=1, dp=4, sp=2, token_budget=4096)
    plan = Plan(stages=(StagePlacement(name="actor/training", config=cfg, pool=0, first_gpu=0, gpus=4),))
    back = Plan.from_dict(plan.to_dict())
    assert back.stages[0].config == cfg
    plain = Plan(stages=(StagePlacement(name="actor/training", config=ParallelConfig(dp=4), pool=0, first_gpu=0, gpus=4),))
    assert "sp" not in plain.to_dict()["model_stages"][0]  # old readers see the fields they know


# ---- RL framework mechanisms (verl FSDP workers), checked on held-out RL rows; no constant below is
# fitted to them: padding has none, offload uses the host-link bandwidth of the reference sheet, the
# vocabulary pass the profile's HBM efficiency (fitted on decode rows), the FSDP floor a published
# per-unit CPU time (pytorch/pytorch#173680).
import nereus.fidelity.predict as fidelity_predict  # noqa: E402
import nereus.fidelity.rl_rows as fidelity_rl_rows  # noqa: E402
from nereus.planner.cost.model import (StageOptions, fsdp_cpu_floor_s, logprob_vocab_s,  # noqa: E402
                                       padded_tokens, param_offload_s)


def _rl_rows(prefix, *stages, **cfg):
    return [r for r in rows("rl_stages", **cfg) if r.id.startswith(prefix) and r.get("stage") in stages]


def _without(monkeypatch, **drop):
    """Predict with ``stage_settings`` stripped of the named options (the mechanism removed)."""
    real = fidelity_predict.stage_settings

    def stripped(*a, **k):
        cfg, o = real(*a, **k)
        return cfg, StageOptions(**{"pad_to": o.pad_to, "param_offload": o.param_offload,
                                    "optimizer_offload": o.optimizer_offload, **drop})
    monkeypatch.setattr(fidelity_rl_rows, "stage_settings", stripped)  # where the RL rows look it up


def test_unremoved_padding_runs_every_sequence_at_max_prompt_plus_max_response(monkeypatch):
    """verl runs with ``use_remove_padding=False`` (the critic of play-verl's Qwen2-7B PPO runs:
    prompts padded to 512, responses to 1,024, ~290 real tokens) compute every sequence at 1,536
    tokens: values and critic updates take 5x what the real tokens would. With the padding the
    predictions of those held-out rows are within 2x (0.65-1.05); without it, 0.15-0.26."""
    w = Workload(sequences=10, prompt_len=100, response_len_mean=190, response_len_max=1024)
    assert padded_tokens(w, 0) == w.tokens and padded_tokens(w, 1536) == 10 * 1536
    critic = _rl_rows("playverl", "values", "update_critic", critic_remove_padding="0")
    critic = [r for r in critic if "7B" in r.model]
    assert len(critic) == 8
    with_pad = ratios(critic)
    assert all(0.5 <= x <= 2 for x in with_pad), with_pad
    _without(monkeypatch, pad_to=0)
    without = ratios(critic)
    assert max(without) < 0.3 and statistics.median(with_pad) > 3 * statistics.median(without)


def test_offloaded_parameters_and_optimizer_cross_the_host_link(monkeypatch):
    """verl's ``param_offload`` / ``optimizer_offload``: an actor or critic shard (fp32 under verl's
    FSDP) crosses the host link twice per call, Adam's moments twice per update; a reference model
    offloaded with FSDP CPUOffload is copied in for every micro-batch. The held-out rows of the
    offloaded Qwen2-7B run (play-verl 'min' config) come closer to measured with it."""
    p = CostParams()
    assert param_offload_s(1e9, "per_call", 10, p, bytes_per_param=4) == pytest.approx(2 * 4e9 / 25e9)
    assert param_offload_s(1e9, "per_micro_batch", 10, p) == pytest.approx(10 * 2e9 / 25e9)
    assert param_offload_s(1e9, "none", 10, p) == 0.0
    off = _rl_rows("playverl", "ref", "update_actor", "update_critic", actor_param_offload="1")
    assert len(off) == 6
    with_off = ratios(off)
    _without(monkeypatch, param_offload="none", optimizer_offload=False)
    without = ratios(off)
    assert all(a > b for a, b in zip(with_off, without))
    assert statistics.median(abs(math.log(x)) for x in with_off) < statistics.median(abs(math.log(x)) for x in without)


def test_log_probabilities_pay_a_memory_bound_pass_over_the_vocabulary():
    """After the LM head, log-softmax in fp32 reads and writes every logit: for Qwen's 152k
    vocabulary about 2.4 GB per 1,000 tokens, a share of the old-log-prob pass that GEMM FLOPs do
    not count; the value head (critic) does not pay it. Held-out play-verl Qwen2-7B log-prob rows
    (remove-padding on, no offload) are within 2x with it."""
    p = fitted_params("h100-80gb")
    cfg = ParallelConfig(dp=8, tp=1)
    t = logprob_vocab_s(8000, 152064, cfg, H100, p, training=False)  # 1,000 tokens per GPU
    assert t == pytest.approx(1000 * 152064 * 16 / (p.hbm_eff * H100.gpu.hbm_bytes_per_s))
    assert logprob_vocab_s(8000, 152064, ParallelConfig(dp=8, tp=2), H100, p, False) == pytest.approx(
        logprob_vocab_s(8000, 152064, cfg, H100, p, False) / 2)
    job = load_job("examples/ppo-8b.yaml")
    actor = estimate(job, H100, "actor/inference", ParallelConfig(dp=8), params=p)
    critic = estimate(job, H100, "critic/inference", ParallelConfig(dp=8), params=p)
    # a few % of an 8B log-prob pass at long sequences (ppo-8b example), none for the value head
    assert actor.time_breakdown["logprob_vocab"] > 0.02 * actor.time_s and "logprob_vocab" not in critic.time_breakdown
    lp = _rl_rows("playverl", "old_log_prob", "ref", actor_param_offload="0", remove_padding="1")
    lp = [r for r in lp if "7B" in r.model]
    assert len(lp) == 4 and all(0.5 <= x <= 2 for x in ratios(lp))


def test_small_models_under_fsdp_are_cpu_bound_per_layer_and_micro_batch(monkeypatch):
    """FSDP runs each decoder layer's hooks (1 ms per unit, pytorch/pytorch#173680) and the layer's
    eager dispatch (about 1 ms per pass in training, 0.39 ms in a no-grad forward) on the CPU once
    per pass and micro-batch; overlapped with the GPU, it only shows when the GPU work per micro-
    batch is smaller, as for 0.5-1B models with 4-8 sequences per micro-batch (held-out play-verl
    Qwen2.5-0.5B PPO and verl Llama-3.2-1B rows), hardly for the 7B rows."""
    p = CostParams()
    train, fwd = p.fsdp_unit_cpu_s + p.layer_cpu_train_s, p.fsdp_unit_cpu_s + p.layer_cpu_fwd_s
    assert fsdp_cpu_floor_s(10, 24, 3, 0.1, p) == pytest.approx(10 * 24 * 3 * train - 0.1)
    assert fsdp_cpu_floor_s(10, 24, 1, 0.1, p, training=False) == pytest.approx(10 * 24 * fwd - 0.1)
    assert fwd < train
    assert fsdp_cpu_floor_s(10, 24, 1, 5.0, p) == 0.0
    small = [r for r in ROWS if r.category == "rl_stages" and r.id.startswith(("playverl", "verlbm1b"))
             and r.get("stage") in ("old_log_prob", "values", "update_actor", "update_critic")
             and ("0.5B" in r.model and r.get("algo") == "ppo" or "1B" in r.model)]
    big = _rl_rows("playverl", "values", "update_critic", critic_remove_padding="0")
    big = [r for r in big if "7B" in r.model and r.get("actor_param_offload") == "0"]
    assert len(small) == 10 and len(big) == 4
    with_floor, big_with = ratios(small), ratios(big)
    import nereus.planner.cost.passes as cost_model  # where the passes look it up
    monkeypatch.setattr(cost_model, "fsdp_cpu_floor_s", lambda *a, **k: 0.0)
    without, big_without = ratios(small), ratios(big)
    assert statistics.median(with_floor) > 1.5 * statistics.median(without)
    # the 7B critics pad their batches, so their floor is synchronised (added whole), yet small
    assert all(1 <= a / b < 1.05 for a, b in zip(big_with, big_without))


def test_eager_launch_time_is_the_corpus_pairs_median_and_binds_small_models_only():
    """enforce_eager: CostParams.eager_layer_cpu_s is what the fit split's launch-bound eager /
    CUDA-graph pairs give (nereus.fidelity.fit.eager_layer_cpu_s); with it a 124M model's decode is
    launch-bound, as the H200 GPT-2 pairs measured (eager 3.7-4.7x graph), while an 8B model's GPU
    time hides most launches, as the 8B pairs of the fit split measured (1.11-1.31x)."""
    from nereus.fidelity.catalog import resolve_model
    from nereus.fidelity.fit import eager_layer_cpu_s, eager_pairs

    rows = load_corpus()
    c, used = eager_layer_cpu_s(rows)
    assert len(used) >= 4 and len({u["eager"].split("-")[0] for u in used}) >= 3
    assert c == pytest.approx(CostParams().eager_layer_cpu_s, rel=0.05)
    big = [p for p in eager_pairs(rows) if p["layers"] >= 32]
    assert big and max(p["ratio"] for p in big) < 1.35
    p = CostParams()
    h200, h100 = ClusterSpec(gpu=GPU_PRESETS["h200"], nodes=1, gpus_per_node=1), H100
    gpt2, _ = resolve_model("gpt2")
    small = decode_iteration_s(gpt2, 1, 1, 1, 144, h200, p, eager=True) / decode_iteration_s(gpt2, 1, 1, 1, 144, h200, p)
    assert small >= 1.5  # launch-bound
    llama = preset("llama-3.1-8b")
    for batch in (1, 8):
        r = decode_iteration_s(llama, 1, 1, batch, 100, h100, p, eager=True) / decode_iteration_s(llama, 1, 1, batch, 100, h100, p)
        assert 1.0 <= r <= max(q["ratio"] for q in big)
    # the rows themselves: the eager GPT-2 batches are predicted within 2x, and slower than the graph ones
    by_id = {r.id: r for r in rows}
    for pair in used:
        e, g = by_id[pair["eager"]], by_id[pair["graph"]]
        pe, pg = predict(e, lambda _: p), predict(g, lambda _: p)
        if pe.predicted is None:
            continue  # hardware not stated
        assert 0.5 <= pe.predicted / e.value <= 2.0
        assert pe.predicted / pg.predicted >= 1.5


def test_verl_fsdp_reduces_gradients_after_every_micro_batch_in_fp32():
    """verl's FSDP workers call backward per micro-batch without no_sync (its engine's
    use_no_sync_for_gradient_accumulation defaults to false), with reduce_dtype fp32: one fp32
    reduce-scatter per micro-batch, not one bf16 one per optimizer step. The held-out verl FSDP
    rows are predicted so; Megatron rows keep one reduction per step."""
    m = preset("llama-3.1-8b")
    job = JobSpec(algorithm="grpo", models=(("actor", m), ("ref", m)), batch=BatchSpec(prompts=64, samples_per_prompt=8),
                  sequence=SequenceSpec(prompt_len=256, response_len_mean=512, response_len_max=1024))
    cfg = ParallelConfig(tp=1, dp=8, zero=3, micro_batch=2, recompute=True)
    step = estimate(job, H100, "actor/training", cfg, options=StageOptions())
    per_mb = estimate(job, H100, "actor/training", cfg, options=StageOptions(grad_sync="micro_batch", grad_reduce_bytes=4))
    micro = 64 * 8 / 8 / 2  # micro-batches per GPU per step (one mini-batch)
    sync_step, sync_mb = step.time_breakdown["dp_grad_sync"], per_mb.time_breakdown["dp_grad_sync"]
    assert sync_mb / sync_step == pytest.approx(micro * 2, rel=0.05)  # every micro-batch, twice the bytes
    verl = [r for r in rows("rl_stages") if r.engine.lower().startswith("verl") and r.get("stage") == "update_actor"
            and "fsdp" in (r.get("actor_backend") or "fsdp")]
    mega = [r for r in rows("rl_stages") if r.get("actor_backend") == "megatron" and r.get("stage") == "update_actor"]
    assert verl and mega
    for r in verl[:3]:
        _, o = fidelity_predict.stage_settings(r, "actor/training", 1, 1, 8, True)
        assert (o.grad_sync, o.grad_reduce_bytes) == ("micro_batch", 4)
    _, o = fidelity_predict.stage_settings(mega[0], "actor/training", 1, 1, 8, False)
    assert o.grad_sync == "step"


def test_fp8_training_and_the_power_cap_of_the_rows_it_is_fitted_on():
    """FP8 training (fp8_linear) is fitted on torchtitan's FP8 rows, taken on Meta's 500 W H100s;
    the cap is a fitted compute scale of that variant (power_cap_flops_scale), pinned by its bf16
    rows against the 700 W rows' mfu_train. Fitted, the scale sits near the power ratio 500/700
    and the held-out FP8 rows of another source on 700 W H100s (NeMo 24.07) come out right; without
    the scale the capped bf16 rows are predicted too fast."""
    p = fitted_params("h100-80gb")
    assert 0.55 <= p.power_cap_flops_scale <= 0.9
    assert p.mfu_train_fp8 > p.mfu_train / 2  # an FP8 GEMM at least as fast as a bf16 one
    capped_bf16 = [r for r in rows("training", split="fit") if r.hardware.endswith("500w")
                   and not (r.get("dtype") or "").startswith("fp8")]
    nemo_fp8 = [r for r in rows("training", split="heldout") if r.id.startswith("nemo2407")]
    assert len(capped_bf16) >= 4 and len(nemo_fp8) >= 30
    with_cap = ratios(capped_bf16)
    assert all(0.8 <= x <= 1.25 for x in with_cap), with_cap
    uncapped = [predict(r, lambda _: replace(p, power_cap_flops_scale=1.0)).ratio for r in capped_bf16]
    assert statistics.median(uncapped) > 1.25
    assert 0.8 <= statistics.median(ratios(nemo_fp8)) <= 1.25
    # the FP8 option itself: GEMMs at twice the peak make the same step faster than bf16
    m = preset("llama-3.1-8b")
    job = JobSpec(algorithm="grpo", models=(("actor", m),), batch=BatchSpec(prompts=32, samples_per_prompt=2),
                  sequence=SequenceSpec(prompt_len=1, response_len_mean=1, response_len_max=1))
    w = Workload(sequences=64, prompt_len=4095, response_len_mean=1, response_len_max=1)
    cfg = ParallelConfig(tp=1, dp=8, zero=3, micro_batch=2, recompute=True)
    bf16 = estimate(job, H100, "actor/training", cfg, w, p).time_s
    fp8 = estimate(job, H100, "actor/training", cfg, w, p, options=StageOptions(fp8_linear=True)).time_s
    assert 0.4 < fp8 / bf16 < 0.95


def test_context_parallel_ring_attention_on_torchtitans_long_sequence_rows():
    """torchtitan's Llama-3.1-8B rows at 64k-256k tokens on 8 H100s (cp = 2, 4, 8; same tokens per
    GPU as the 32k cp=1 row): throughput falls with the sequence length (attention grows with s^2,
    split over the cp ranks), the ring's key/value passes hide behind attention at these lengths,
    and the model predicts every row within 25%. Context parallelism splits activations like sp."""
    cp_rows = [r for r in rows("training", metric="tok_s_per_gpu") if r.id.startswith("titan2412")
               and r.num("cp") and r.num("cp") > 1]
    assert {int(r.num("cp")) for r in cp_rows} == {2, 4, 8}
    rs = ratios(cp_rows)
    assert len(rs) == len(cp_rows) >= 3 and all(0.75 <= x <= 1.25 for x in rs), rs
    by_cp = sorted((r for r in cp_rows if r.id in ("titan2412-005", "titan2412-006", "titan2412-007")),
                   key=lambda r: r.num("cp"))
    assert len(by_cp) == 3
    preds = [predict(r, fitted_params).predicted for r in by_cp]
    assert preds[0] > preds[1] > preds[2]  # longer sequences: fewer tokens per second per GPU
    # the mechanism: tokens (and activations) per rank divided by cp; the ring exposed only past attention
    p = fitted_params("h100-80gb")
    m = preset("llama-3.1-8b")
    job = JobSpec(algorithm="grpo", models=(("actor", m),), batch=BatchSpec(prompts=1, samples_per_prompt=2),
                  sequence=SequenceSpec(prompt_len=1, response_len_mean=1, response_len_max=1))
    long_w = Workload(sequences=2, prompt_len=131071, response_len_mean=1, response_len_max=1)
    base = ParallelConfig(tp=1, dp=8, micro_batch=1, zero=3, recompute=True)
    one, four = (estimate(job, H100, "actor/training", replace(base, cp=c), long_w, p) for c in (1, 4))
    assert four.mem_breakdown["activations"] == pytest.approx(one.mem_breakdown["activations"] / 4, rel=0.01)
    assert four.time_breakdown.get("cp_comm", 0.0) == 0.0  # 128k tokens: attention hides the ring
    short_w = Workload(sequences=64, prompt_len=1023, response_len_mean=1, response_len_max=1)
    short = estimate(job, H100, "actor/training", replace(base, cp=8), short_w, p)
    assert short.time_breakdown["cp_comm"] > 0  # 1k tokens split 8 ways: the ring shows
    with pytest.raises(SpecError, match="both split sequences"):
        ParallelConfig(tp=1, dp=8, sp=2, cp=2)
    with pytest.raises(SpecError, match="cp\\(3\\) must divide dp\\(8\\)"):
        ParallelConfig(tp=1, dp=8, cp=3)


def test_the_solver_may_choose_context_parallelism_and_plans_round_trip_it():
    from nereus.planner.plan import Plan
    from nereus.planner.solver import PlanProblem, solve
    from nereus.planner.solver.problem import CandidateSettings

    job = load_job("examples/ppo-8b.yaml")
    w = job.workload().with_lengths(mean=30000, max_=65536)
    cluster = load_cluster("examples/cluster-h100-4n.yaml")
    off = solve(PlanProblem(job=job, cluster=cluster, workload=w), time_limit_s=20)
    on = solve(PlanProblem(job=job, cluster=cluster, workload=w, candidates=CandidateSettings(cps=(1, 2, 4))),
               time_limit_s=20)
    assert off.status == on.status == "OPTIMAL"
    assert on.objective <= off.objective * (1 + 1e-9)  # a superset of the options
    assert all(s.config.cp == 1 for s in off.plan.stages)
    back = Plan.from_dict(on.plan.to_dict())
    assert back.stages == on.plan.stages


@pytest.mark.parametrize("text, key, engine", [
    ("vLLM V0 (Nov 2024, ~v0.6.3)", None, "vllm-v0"),
    ("vLLM V1 (Nov 2024, ~v0.6.3)", None, "vllm"),
    ("vllm 0.6.6 (rocm)", None, "vllm-v0"),
    ("vLLM-Omni on vLLM 0.29.0", None, "vllm"),
    ("NeMo RL v0.5 (vllm + megatron-core)", None, "vllm"),  # v0.5 is NeMo RL's release, not vLLM's
    ("verl (vllm 0.8.3 + fsdp)", None, "vllm"),  # V1 by default from 0.8.0 ...
    ("verl (vllm 0.8.3 + fsdp)", "v0", "vllm-v0"),  # ... unless the run's log shows the fall-back
    ("vllm", "V1", "vllm"),
    ("sglang 0.4.3.post4", "v0", "sglang"),
])
def test_rows_name_their_vllm_engine_generation(text, key, engine):
    from nereus.fidelity.catalog import engine_of

    assert engine_of(text, key) == engine


def test_a_bad_vllm_engine_key_is_refused():
    from nereus.fidelity.catalog import engine_of

    with pytest.raises(SpecError, match="vllm_engine must be v0 or v1, got 'v2'"):
        engine_of("vllm", "v2")


def test_vllm_v0_iteration_overhead_is_the_host_rows_line_and_explains_its_rl_generation():
    """vLLM's V0 engine: CostParams' default (o0, o1 per running sequence) is the robust line through
    the fit split's host-time rows (``engine_host_overhead``: two sources, two hosts, batch 8-200),
    each of which it predicts within 2x (the hosts themselves differ 1.8x), at median within 1.35x; it grows per sequence far faster than the generic (V1)
    overhead. On the held-out verl rows whose logs show V0 (Qwen2.5-0.5B, vLLM 0.8.3 falling back
    from V1), generation priced as V0 is slower than priced as V1 and closer to the measurement,
    most for the PPO run's 256 sequences per GPU (no fit reads these rows)."""
    from nereus.fidelity.fit import engine_host_overhead

    o0, o1, used = engine_host_overhead(ROWS, "vllm-v0")
    assert len(used) >= 10 and len({u.split("-")[0] for u in used}) >= 2
    p = CostParams()
    assert p.engine_overhead_terms("vllm-v0") == pytest.approx((o0, o1), rel=0.05)
    assert p.engine_overhead_terms("vllm-v0")[1] > 2 * p.engine_overhead_terms("vllm")[1]
    got = [predict(r, fitted_params).ratio for r in rows("host") if r.id in used]
    assert len(got) == len(used) and all(0.5 <= g <= 2 for g in got)  # the two hosts differ 1.8x
    assert statistics.median(max(g, 1 / g) for g in got) <= 1.35
    gen = [r for r in ROWS if r.id.startswith("playverl") and r.get("stage") == "gen" and r.get("vllm_engine") == "v0"]
    assert len(gen) == 4
    gains = []
    for r in gen:
        as_v0 = predict(r, fitted_params).predicted
        as_v1 = predict(replace(r, config={**r.config, "vllm_engine": "v1"}), fitted_params).predicted
        assert as_v1 < as_v0 < r.value
        gains.append(as_v0 / as_v1)
    ppo = [g for g, r in zip(gains, gen) if r.get("algo") == "ppo"]
    assert min(ppo) > 1.4 and max(gains) == max(ppo)


def test_per_layer_host_times_are_the_host_rows_medians_by_source():
    """The host floor's parts come from the fit split's ``host`` rows, one vote per source
    (``layer_host_s``): eager dispatch per layer and training pass from an eager / CUDA-graph pair
    (Llama-3.2-1B, 0.85 ms) and a host-bound fine-tuning floor (Qwen-1.8B, 1.19 ms); per no-grad
    forward from the pair's inference forward (0.39 ms); FSDP's hooks per unit and pass (1 ms).
    The defaults are those medians, and a row of the wrong metric is refused."""
    from nereus.fidelity.fit import layer_host_s
    from nereus.fidelity.predict import HOST_LAYER_METRICS

    p = CostParams()
    for metric, field in HOST_LAYER_METRICS.items():
        v, used = layer_host_s(ROWS, metric)
        assert getattr(p, field) == pytest.approx(v, rel=0.02), field
        assert all(r.split == "fit" for r in ROWS if r.id in used)
    _, used = layer_host_s(ROWS, "host_ms_per_layer_pass")
    assert len({r.source.split()[0] for r in ROWS if r.id in used}) >= 2
    assert p.layer_cpu_fwd_s < p.layer_cpu_train_s
    with pytest.raises(SpecError, match="host metric must be one of"):
        layer_host_s(ROWS, "host_ms_per_token")
    assert all(predict(r, fitted_params).ratio is not None for r in rows("host"))


def test_padded_batches_synchronise_every_layer_so_host_time_adds_to_gpu_time(monkeypatch):
    """A padded batch (verl ``use_remove_padding=False``) goes through Hugging Face's flash-attention
    path with its padding mask, which unpads it again in every layer (``nonzero`` and ``.item()``:
    a host-device synchronisation; huggingface/transformers#28160): the host's per-layer time can no
    longer hide under the GPU's, so the whole floor is added. On the held-out play-verl rows that pad
    (0.5B PPO actor and critic, 7B critic; no fit reads them) the predictions rise toward the
    measurement without passing it by more than 20%, and the remove-padding rows do not move."""
    p = CostParams()
    cpu = 10 * 24 * 3 * (p.fsdp_unit_cpu_s + p.layer_cpu_train_s)
    assert fsdp_cpu_floor_s(10, 24, 3, 5.0, p) == 0.0
    assert fsdp_cpu_floor_s(10, 24, 3, 5.0, p, synced=True) == pytest.approx(cpu)
    padded = [r for r in ROWS if r.id.startswith("playverl") and r.get("stage") in
              ("old_log_prob", "ref", "values", "update_actor", "update_critic")
              and r.get("critic_remove_padding" if r.get("stage") in ("values", "update_critic") else "remove_padding") == "0"]
    unpadded = [r for r in ROWS if r.id.startswith("playverl") and r.get("stage") in ("old_log_prob", "update_actor")
                and r.get("remove_padding") == "1"]
    assert len(padded) >= 12 and len(unpadded) >= 8
    synced, same = ratios(padded), ratios(unpadded)
    import nereus.planner.cost.passes as cost_model  # where the passes look it up
    real = cost_model.fsdp_cpu_floor_s
    monkeypatch.setattr(cost_model, "fsdp_cpu_floor_s", lambda *a, synced=False, **k: real(*a, **k))
    overlapped, same_without = ratios(padded), ratios(unpadded)
    assert all(s >= o for s, o in zip(synced, overlapped)) and statistics.median(synced) > 1.1 * statistics.median(overlapped)
    assert max(synced) <= 1.2
    assert same == pytest.approx(same_without, rel=1e-12)


def test_host_fits_give_each_source_one_vote():
    """``layer_host_s`` takes the median over sources of each source's median, and
    ``engine_host_overhead`` weighs each source the same: a source that repeats a figure many
    times does not outvote another (checked on copies of the corpus's own host rows; the robust loss
    keeps the engine line within 5% of one vote rather than exactly on it)."""
    from nereus.fidelity.fit import engine_host_overhead, layer_host_s

    pair = next(r for r in ROWS if r.id == "mleng-train")
    floor = next(r for r in ROWS if r.id == "swift-train")
    many = [replace(pair, id=f"mleng-copy-{i}", value=pair.value * 0.5) for i in range(5)]
    v, _ = layer_host_s([floor, *many], "host_ms_per_layer_pass")
    assert v == pytest.approx(statistics.median([pair.value * 0.5, floor.value]) * 1e-3)
    engine = [r for r in ROWS if r.category == "host" and r.metric == "host_ms_per_iteration"]
    base = engine_host_overhead(ROWS, "vllm-v0")
    lone = next(r for r in engine if r.id == "vllm6801-001")
    doubled = engine_host_overhead(ROWS + [replace(lone, id=f"vllm6801-copy-{i}") for i in range(11)], "vllm-v0")
    # twelve copies of one source: still about one vote (exactly one under a squared loss; soft-L1 bends it)
    assert doubled[:2] == pytest.approx(base[:2], rel=0.05)


def test_rl_rows_reach_the_engine_with_their_rollout_settings():
    """An RL row's rollout settings reach the job: its ``gpu_memory_utilization``, its
    ``max_num_seqs`` or verl's default 1024 on a verl row (vLLM's own 256 elsewhere), its engine."""
    from nereus.fidelity.catalog import resolve_model
    from nereus.fidelity.predict import VERL_MAX_NUM_SEQS, rl_job

    verl = next(r for r in ROWS if r.id == "playverl-001")
    job, _ = rl_job(verl, resolve_model(verl.model)[0])
    assert job.rollout.gpu_memory_utilization == pytest.approx(0.6) and job.rollout.max_num_seqs == VERL_MAX_NUM_SEQS == 1024
    assert job.rollout.engine == "vllm-v0" and job.rollout.enforce_eager
    nemo = next(r for r in ROWS if r.category == "rl_stages" and r.engine.startswith("NeMo") and r.num("mean_response_len"))
    job, _ = rl_job(nemo, resolve_model(nemo.model)[0])
    assert job.rollout.max_num_seqs == 256 and job.rollout.engine == "vllm"
    assert job.rollout.gpu_memory_utilization == pytest.approx(nemo.num("gpu_memory_utilization"))


@pytest.mark.parametrize("gpu", ["h100-80gb", "mi300x"])
def test_profile_fits_start_engines_from_their_defaults_and_keep_the_unseen_ones(gpu):
    """``fit_profile_params`` fits an engine its GPU's rows show from that engine's default (vLLM V0:
    the host-row line; MI300X's V0 rows move it), keeps the default of an engine they do not show
    (H100 has no V0 decode row), and the shipped profiles are what it gives."""
    fitted, record = fit_profile_params(ROWS, gpu)
    shipped = dict((e, (a, b)) for e, a, b in fitted_params(gpu).engine_overhead)
    mine = dict((e, (a, b)) for e, a, b in fitted.engine_overhead)
    assert set(mine) == set(shipped) and "vllm-v0" in mine
    for e in mine:
        assert mine[e] == pytest.approx(shipped[e], rel=1e-6), e
    if "vllm-v0" in record["engines"]:
        assert mine["vllm-v0"] != pytest.approx(CostParams().engine_overhead_terms("vllm-v0"), rel=0.01)
    else:
        assert mine["vllm-v0"] == CostParams().engine_overhead_terms("vllm-v0")


def test_verl_generation_timers_cover_what_verl_times():
    """verl's two generation timers: ``timing_s/gen`` (trainer side) is the whole generate_sequences
    call, so it covers the driver's dispatch and collection of the batch, the engine's wake-up and
    sleep and the actor -> rollout weight sync; ``generate_sequences`` (worker side, inside the
    rollout sharding manager) is the engine's generation alone. The 1B run logs both for one step: the gen row's prediction exceeds the
    generate_sequences row's by exactly wake/sleep + weight sync."""
    from nereus.fidelity.catalog import resolve_model
    from nereus.fidelity.predict import rl_job, _replica_cluster
    from nereus.planner.cost.model import weight_sync_s

    by_id = {r.id: r for r in ROWS}
    gen, worker = by_id["verlbm1b-001"], by_id["verlbm1b-002"]
    assert (gen.get("stage"), worker.get("stage")) == ("gen", "generate_sequences")
    p = fitted_params("h100-80gb")
    model = resolve_model(gen.model)[0]
    job, w = rl_job(gen, model)
    cluster = _replica_cluster(GPU_PRESETS["h100-80gb"], gen.gpus)
    rollout = ParallelConfig(tp=2, dp=4)
    from nereus.planner.cost.model import StageOptions
    e = estimate(job, cluster, "actor/generation", rollout, w, p, options=StageOptions(controller_width=512 + 1024))
    sync = weight_sync_s(model, ParallelConfig(tp=1, dp=8, zero=3), rollout, cluster, True, p)
    wake, driver = e.time_breakdown["engine_wake_sleep"], e.time_breakdown["controller_transfer"]
    assert wake > 0 and sync > 0 and driver > 0
    assert predict(worker, fitted_params).predicted == pytest.approx(e.time_s - wake - driver)
    assert predict(gen, fitted_params).predicted == pytest.approx(e.time_s + sync)


def test_blackwell_presets_halve_the_gpu_seconds_of_nemo_rl_steps_as_published():
    """GB200 / B200 presets are the datasheets' per-GPU figures (dense bf16 = half the sparse one).
    NeMo RL's performance tables run the same GRPO recipes on H100 and on GB200 with half the GPUs
    in about the same step time: GB200 takes 0.47-0.48 of H100's GPU-seconds per step. The model,
    with no GB200 fit, gives a ratio within 1.5x of that for both recipes (an H100-class GB200
    would give about 1)."""
    gb, b = GPU_PRESETS["gb200"], GPU_PRESETS["b200"]
    assert (gb.tflops_bf16, gb.hbm_tbps, gb.memory_gib, gb.intra_node_gbps) == (2500, 8.0, 186, 900)
    assert (b.tflops_bf16, b.hbm_tbps, b.memory_gib, b.intra_node_gbps) == (2250, 8.0, 180, 900)
    by_id = {r.id: r for r in ROWS}
    for gb_id, h_id in (("nemorlperf-010", "nemorlperf-001"), ("nemorlperf-012", "nemorlperf-003")):
        g, h = by_id[gb_id], by_id[h_id]
        assert (g.hardware, h.hardware, g.model, g.get("mode")) == ("gb200", "h100-80gb", h.model, h.get("mode"))
        measured = g.value * g.gpus / (h.value * h.gpus)
        pg, ph = predict(g, fitted_params), predict(h, fitted_params)
        model = pg.predicted * g.gpus / (ph.predicted * h.gpus)
        assert 0.45 < measured < 0.5 and measured / 1.5 < model < measured * 1.5, (gb_id, measured, model)



def test_verl_single_controller_transfer_is_the_measured_line_over_verls_batch_bytes():
    """verl moves every worker call's batch through its driver (``controller_transfer_s``): the
    defaults are the line ``benchmarks/verl_dispatch.py`` measured through verl's own RayWorkerGroup
    (its JSON, to the digits the defaults keep), inside the published range for the same path
    (0.05-0.45 GB/s: verl#2847, miles#591, verl#3425); the bytes are verl's batch at each call,
    every sequence padded to the prompt and response caps; verl rows carry it, other frameworks'
    rows do not, and it adds to every verl call the fidelity check predicts."""
    import json
    from pathlib import Path
    from nereus.fidelity.predict import controller_width, stage_settings
    from nereus.planner.cost.model import CONTROLLER_TRAIN_TENSORS, StageOptions, controller_transfer_s

    bench = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/verl_dispatch.json").read_text())
    p = CostParams()
    assert p.controller_gbps == pytest.approx(bench["fit"]["rate_gbps"], abs=5e-4)
    assert p.controller_call_s == pytest.approx(bench["fit"]["call_s"], abs=5e-5)
    assert 0.05 <= p.controller_gbps <= 0.45 and bench["versions"]["verl"] == "0.9.1"
    n, width, cap = 1000, 1536, 1024
    per = {s: (controller_transfer_s(s, n, width, cap, p) - p.controller_call_s) * p.controller_gbps * 1e9 / n
           for s in ("generation", "inference", "training")}
    assert per["generation"] == pytest.approx(3 * 512 * 8 + 4 * width * 8)
    assert per["inference"] == pytest.approx(4 * width * 8 + 8 * cap + 4 * cap)
    assert per["training"] == pytest.approx(4 * width * 8 + 8 * cap + CONTROLLER_TRAIN_TENSORS * 4 * cap)
    # the benchmark's own calls: the line is within 2x of every size's median above 10 MB
    for r in bench["rows"]:
        if r["sent_bytes"] > 1e7:
            line = p.controller_call_s + (r["sent_bytes"] + r["returned_bytes"]) / (p.controller_gbps * 1e9)
            assert 0.5 < line / r["median_s"] < 2, r
    by_id = {r.id: r for r in ROWS}
    verl, nemo = by_id["playverl-002"], by_id["nemorlperf-001"]
    assert controller_width(verl) == 512 + 192 and controller_width(nemo) == 0
    assert stage_settings(verl, "actor/inference", 1, 1, 8, True)[1].controller_width == 704
    with_it = predict(verl, fitted_params).predicted
    import nereus.fidelity.rl_rows as P  # where the RL rows look it up
    original = P.controller_width
    try:
        P.controller_width = lambda row: 0
        without = predict(verl, fitted_params).predicted
    finally:
        P.controller_width = original
    one_call = controller_transfer_s("inference", 512, 704, 192, fitted_params("h100-80gb"))
    assert with_it - without == pytest.approx(one_call)
    with pytest.raises(SpecError, match="controller_width"):
        StageOptions(controller_width=-1)
    job = load_job("examples/grpo-7b.yaml")
    with pytest.raises(SpecError, match="response cap"):
        estimate(job, H100, "actor/inference", ParallelConfig(dp=8, zero=3), options=StageOptions(controller_width=100))


def test_engine_wake_up_recreates_its_kv_pool_at_the_measured_rate_per_gib():
    """A colocated engine's wake-up brings its weights back over the host link and creates its KV
    pool again (``engine_wake_s``): ``kv_remap_s_per_gib`` is the fit split's one-vote-per-source
    median of the ``kv_remap_ms_per_gib`` host rows (vLLM 0.26 re-creating 69 GiB in 0.27 s). The
    vLLM sleep-mode blog's six A100 wake-ups (another source) check it: the weights' copy alone
    explains at most one within 2x (a 0.6B model's 0.26 s is 0.05 s of copy), with the pool four."""
    from nereus.fidelity.fit import layer_host_s
    from nereus.planner.cost.model import GiB, engine_wake_s, host_copy_s

    fitted, used = layer_host_s(ROWS, "kv_remap_ms_per_gib")
    assert CostParams().kv_remap_s_per_gib == pytest.approx(fitted, rel=0.01) and used == ["srtslurm-001"]
    p = CostParams()
    assert engine_wake_s(25e9, 10 * GiB, p) == pytest.approx(1.0 + 10 * p.kv_remap_s_per_gib)
    assert host_copy_s(25e9, p) == pytest.approx(1.0)
    wakes = rows("host", metric="engine_wake_s")
    assert len(wakes) == 6 and all(r.split == "fit" and r.source.startswith("https://blog.vllm.ai") for r in wakes)

    def within(params):
        preds = [predict(r, lambda _: params) for r in wakes]
        assert all(x.predicted is not None for x in preds), [x.reason for x in preds]
        return sum(0.5 <= x.ratio <= 2 for x in preds)

    assert within(p) >= 4 and within(replace(p, kv_remap_s_per_gib=0.0)) <= 1
    # generation of a colocated (sleeping) job pays it on its whole KV budget
    job = load_job("examples/grpo-7b.yaml")
    job = replace(job, rollout=replace(job.rollout, sleep=True))
    budget = 40 * GiB
    e = estimate(job, H100, "actor/generation", ParallelConfig(tp=1, dp=8), kv_budget_bytes=budget, params=p)
    e0 = estimate(job, H100, "actor/generation", ParallelConfig(tp=1, dp=8), kv_budget_bytes=budget,
                  params=replace(p, kv_remap_s_per_gib=0.0))
    assert e.time_breakdown["engine_wake_sleep"] - e0.time_breakdown["engine_wake_sleep"] == pytest.approx(
        40 * p.kv_remap_s_per_gib)
