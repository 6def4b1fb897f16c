"""More of the cost model's terms against what they say they compute (the mutation run of
``planner/cost/model.py`` found each unchecked): the decode step's one-node all-reduce against the
general ``allreduce_s``, eager decode, the KV refusal's message, padded micro-batches in training and
inference, attention growing with E[s^2], Ulysses all-to-alls with recomputation, the logits copies,
the stage factor of training, and ``StageOptions``' validation."""
from dataclasses import replace

import pytest

from nereus.errors import SpecError
from nereus.models import preset
from nereus.planner.cost import model as cm
from nereus.planner.cost.comm import links
from nereus.planner.cost.model import StageOptions, decode_terms, estimate
from nereus.planner.cost.params import CostParams, allreduce_s
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, RolloutSpec

GiB = 1024**3
H100 = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 1})
M8B = preset("llama-3.1-8b")


def job(mean=1024, mx=4096, prompt=512, prompts=64, spp=4, **seq):
    return JobSpec.from_dict({
        "algorithm": "ppo", "models": {"actor": "llama-3.1-8b", "critic": "llama-3.1-8b", "ref": "llama-3.1-8b"},
        "batch": {"prompts": prompts, "samples_per_prompt": spp, "ppo_epochs": 1, "mini_batches": 4},
        "sequence": {"prompt_len": prompt, "response_len_mean": mean, "response_len_max": mx, **seq}})


@pytest.mark.parametrize("tp", (2, 4, 8))
def test_one_node_decode_all_reduce_is_the_general_all_reduce(tp):
    """decode_terms computes the one-node all-reduce's latency and ring factor once; per layer it must
    equal ``allreduce_s`` on one node (2 all-reduces per layer of the active rows' hidden states)."""
    p = CostParams()
    intra, inter = links(H100, p)
    terms = decode_terms(M8B, tp, 1, H100, p)
    for active in (1.0, 37.0, 256.0):
        act = active * M8B.hidden * 2
        want = 2 * M8B.layers * allreduce_s(act, tp, intra, p.allreduce_latency_s, nodes=1,
                                            alpha_inter=p.inter_latency_s, bw_inter=inter)
        assert terms(active, 1000.0)[2] == pytest.approx(want, rel=1e-12)
    assert decode_terms(M8B, 1, 1, H100, p)(64.0, 1000.0)[2] == 0.0


def test_eager_decode_pays_the_per_layer_launch_cost_every_iteration():
    """A 1.5B model decoding 2 sequences per GPU: the GPU part of an iteration (about a millisecond)
    is shorter than 28 layers of eager launches, so without CUDA graphs every iteration lasts the launches."""
    p = CostParams()
    small = JobSpec.from_dict({
        "algorithm": "grpo", "models": {"actor": "deepseek-r1-distill-qwen-1.5b", "ref": "deepseek-r1-distill-qwen-1.5b"},
        "batch": {"prompts": 8, "samples_per_prompt": 2, "mini_batches": 1},
        "sequence": {"prompt_len": 256, "response_len_mean": 1024, "response_len_max": 1024}})
    model = small.model("actor")
    cfg = ParallelConfig(tp=1, dp=8)
    graphs, eager = (estimate(replace(small, rollout=RolloutSpec(enforce_eager=e)), H100, "actor/generation", cfg,
                              params=p) for e in (False, True))
    assert eager.time_s > graphs.time_s
    # about one iteration per response token (all 1,024 long), each at least L x eager_layer_cpu_s
    gpu = sum(eager.time_breakdown[k] for k in ("decode_memory", "decode_compute", "tp_comm", "eager_launch"))
    assert gpu >= 0.9 * 1024 * model.layers * p.eager_layer_cpu_s
    assert "eager_launch" not in graphs.time_breakdown


def test_a_kv_budget_too_small_for_one_sequence_names_what_is_left():
    budget = 0.25 * GiB
    e = estimate(job(mx=100_000, mean=50_000), H100, "actor/generation", ParallelConfig(tp=1, dp=8),
                 kv_budget_bytes=budget)
    assert not e.fits or e.time_s == float("inf")
    assert any("0.25 GiB left" in n for n in e.notes), e.notes


@pytest.mark.parametrize("stage", ("actor/training", "actor/inference"))
def test_padded_micro_batches_compute_every_row_to_the_longest(stage):
    """``sequence.padded``: each micro-batch's rows run to its longest sequence, so a padded job with
    a long tail computes more than the same job unpadded (and no less than its real tokens)."""
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=4, zero=1)
    plain = estimate(job(mean=1024, mx=8192), H100, stage, cfg)
    padded = estimate(job(mean=1024, mx=8192, padded=True), H100, stage, cfg)
    assert padded.time_breakdown["compute"] > 1.5 * plain.time_breakdown["compute"]


def test_inference_attention_grows_with_the_square_of_the_sequence_length():
    """Same tokens per step, 16x longer sequences: the matmuls cost the same, attention (2 L heads d
    per sequence x s^2) grows 16x, which is a quarter or more of a 16k-token pass of Llama-3.1-8B."""
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=1)
    short = estimate(job(mean=512, mx=512, prompt=512, prompts=256, spp=4), H100, "actor/inference", cfg)
    long_ = estimate(job(mean=16384 - 512, mx=16384 - 512, prompt=512, prompts=16, spp=4), H100, "actor/inference", cfg)
    assert long_.time_breakdown["compute"] > 1.2 * short.time_breakdown["compute"]


def test_inference_workspace_is_the_parameters_gib():
    p = CostParams(workspace_gib=1.5)
    e = estimate(job(), H100, "actor/inference", ParallelConfig(tp=1, dp=8), params=p)
    assert e.mem_breakdown["workspace"] == pytest.approx(1.5 * GiB)


def test_ulysses_all_to_alls_are_12_per_layer_with_recomputation_and_8_without():
    cfg = ParallelConfig(tp=1, dp=4, sp=2, micro_batch=1, zero=1)
    off = estimate(job(), H100, "actor/training", cfg).time_breakdown["sp_comm"]
    on = estimate(job(), H100, "actor/training", replace(cfg, recompute=True)).time_breakdown["sp_comm"]
    assert off > 0 and on == pytest.approx(1.5 * off, rel=1e-9)


def test_training_logits_memory_counts_each_copy():
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=2, zero=1)
    one, two = (estimate(job(), H100, "actor/training", cfg, params=CostParams(logits_copies_train=c))
                for c in (1.0, 2.0))
    assert one.mem_breakdown["logits"] > 0
    assert two.mem_breakdown["logits"] == pytest.approx(2 * one.mem_breakdown["logits"], rel=1e-12)


def test_the_training_stage_factor_scales_every_training_term():
    cfg = ParallelConfig(tp=2, dp=4, micro_batch=2, zero=1)
    base = estimate(job(), H100, "actor/training", cfg)
    scaled = estimate(job(), H100, "actor/training", cfg, params=CostParams(stage_factor=(("training", 2.0),)))
    assert scaled.time_s == pytest.approx(2 * base.time_s, rel=1e-12)
    for k, v in base.time_breakdown.items():
        assert scaled.time_breakdown[k] == pytest.approx(2 * v, rel=1e-12)


def test_stage_options_refuse_bad_values_and_name_them():
    with pytest.raises(SpecError, match="fp8_linear must be true or false, got 'yes'"):
        StageOptions(fp8_linear="yes")
    for b in (0, 1, 2, 4):
        assert StageOptions(grad_reduce_bytes=b).grad_reduce_bytes == b
    with pytest.raises(SpecError, match="grad_reduce_bytes"):
        StageOptions(grad_reduce_bytes=3)



# ---- the second mutation run's survivors (after context parallelism changed the sample) -------------
Q7 = preset("qwen2.5-7b")  # qkv bias, untied embeddings


def test_parameters_per_gpu_add_up_to_the_model_and_shard_by_tp():
    for m in (M8B, Q7):
        assert cm.params_per_gpu(m, 1, 1) == pytest.approx(m.num_params(), rel=1e-9), m.name
        # TP splits the q/o, gate/up/down, embedding and head, and the q bias; layernorms and (here) k/v stay whole
        two = cm.params_per_gpu(m, 2, 1)
        assert m.num_params() / 2 < two < 0.6 * m.num_params()
        # pipeline: the most loaded stage holds half the layers and the larger of embedding and head
        pp2 = cm.params_per_gpu(m, 1, 2)
        assert pp2 < 0.6 * m.num_params()
        assert pp2 > (m.num_params() - 2 * m.vocab * m.hidden) / 2


def test_the_value_heads_model_state_is_priced_with_its_value_head():
    job_ = job()
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=2, zero=1)
    critic = estimate(job_, H100, "critic/inference", cfg)
    assert critic.mem_breakdown["weights"] == pytest.approx(2 * cm.params_per_gpu(M8B, 1, 1, "value"))
    train = estimate(job_, H100, "critic/training", cfg)
    actor = estimate(job_, H100, "actor/training", cfg)
    assert train.resident_bytes < actor.resident_bytes  # a 1-wide value head, not a vocabulary head


def test_one_micro_batch_makes_the_whole_pass_a_pipeline_bubble():
    """pp = 2 with every sequence of a rank in one micro-batch: nothing overlaps, the bubble is the
    whole compute ((pp - 1) / m with m = 1); two micro-batches halve it."""
    j = job(prompts=8, spp=1)  # 8 sequences on dp 4: 2 per rank
    one = estimate(j, H100, "actor/inference", ParallelConfig(pp=2, dp=4, micro_batch=2))
    two = estimate(j, H100, "actor/inference", ParallelConfig(pp=2, dp=4, micro_batch=1))
    assert one.time_breakdown["pp_bubble"] == pytest.approx(one.time_breakdown["compute"])
    assert two.time_breakdown["pp_bubble"] == pytest.approx(two.time_breakdown["compute"] / 2)


def test_recomputation_adds_the_forwards_tensor_parallel_all_reduces():
    cfg = ParallelConfig(tp=2, dp=4, micro_batch=2, zero=1)
    off = estimate(job(), H100, "actor/training", cfg).time_breakdown["tp_comm"]
    on = estimate(job(), H100, "actor/training", replace(cfg, recompute=True)).time_breakdown["tp_comm"]
    assert off > 0 and on == pytest.approx(1.5 * off, rel=1e-9)  # 6 instead of 4 per layer


def test_fsdp_gathers_the_parameters_for_forward_and_backward_in_training_and_once_in_inference():
    j = job(prompts=64, spp=1)  # ... with one mini-batch below: the same micro-batches in both stages
    j = replace(j, batch=replace(j.batch, mini_batches=1))
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=2, zero=3)
    train = estimate(j, H100, "actor/training", cfg).time_breakdown["fsdp_gather"]
    infer = estimate(j, H100, "actor/inference", cfg).time_breakdown["fsdp_gather"]
    assert infer > 0 and train == pytest.approx(2 * infer, rel=1e-9)


def test_the_vocabulary_pass_is_paid_by_the_lm_head_only_and_more_in_training():
    cfg = ParallelConfig(tp=1, dp=8, micro_batch=2, zero=1)
    j = replace(job(), batch=replace(job().batch, mini_batches=1))
    actor = estimate(j, H100, "actor/training", cfg).time_breakdown
    assert actor["logprob_vocab"] > estimate(j, H100, "actor/inference", cfg).time_breakdown["logprob_vocab"] > 0
    assert "logprob_vocab" not in estimate(j, H100, "critic/training", cfg).time_breakdown


def test_the_fsdp_cpu_floor_counts_the_layers_of_one_pipeline_stage():
    p = CostParams(fsdp_unit_cpu_s=0.05, layer_cpu_train_s=0.0)  # CPU-bound on purpose
    j = job(prompts=8, spp=1)
    j = replace(j, batch=replace(j.batch, mini_batches=1))
    t = {pp: estimate(j, H100, "actor/training", ParallelConfig(pp=pp, dp=8 // pp, zero=3), params=p).time_breakdown
         for pp in (1, 2)}
    # the floor is micro-batches x layers of the stage x 2 passes x 50 ms, less the GPU time
    for pp, tb in t.items():
        gpu = sum(v for k, v in tb.items() if k != "fsdp_cpu_bound")
        micro = 8 // (8 // pp)  # one sequence per micro-batch, 8 sequences over dp = 8 / pp
        assert tb["fsdp_cpu_bound"] == pytest.approx(micro * (M8B.layers // pp) * 2 * 0.05 - gpu, rel=1e-9)


def test_replicated_block_inputs_are_not_divided_by_tp():
    """``act_bytes_replicated``: the kept inputs of recomputed blocks are whole on every TP rank."""
    cfg = ParallelConfig(tp=2, dp=4, micro_batch=1, zero=1, recompute=True)
    rep, split = (estimate(job(), H100, "actor/training", cfg, params=CostParams(act_bytes_replicated=r))
                  .mem_breakdown["activations"] for r in (1.0, 0.0))
    assert rep > split
    one = estimate(job(), H100, "actor/training", replace(cfg, tp=1, dp=8),
                   params=CostParams(act_bytes_replicated=1.0)).mem_breakdown["activations"]
    # replicated, the kept part does not shrink with tp; only the one recomputed layer's working set does
    assert rep > 0.5 * one


def test_decode_attention_work_grows_with_the_context():
    p = CostParams()
    terms = decode_terms(M8B, 1, 1, H100, p)
    (_, c1, _), (_, c2, _) = terms(64.0, 1000.0), terms(64.0, 9000.0)
    # per sequence and token of context 4 L heads d FLOPs (QK^T and AV), beside 2 N for the matmuls, at
    # one efficiency (set by the batch): the growth from 1k to 9k context is 8k x 4 L h d / (2 N + 1k x 4 L h d)
    n_attn, n_mat = 4 * M8B.layers * M8B.heads * M8B.head_dim, 2 * M8B.matmul_params()
    assert (c2 - c1) / c1 == pytest.approx(n_attn * 8000.0 / (n_mat + n_attn * 1000.0), rel=1e-9)


def test_prefill_charges_attention_and_smaller_gemms_under_tp():
    p = CostParams()
    short = cm.prefill_s(M8B, 1, 1, 512, 64, 64, H100, p)
    long_ = cm.prefill_s(M8B, 1, 1, 8192, 4, 4, H100, p)  # same tokens, 16x longer prompts
    assert long_ > 1.1 * short  # attention grows with the square of the prompt
    # per-rank GEMMs 8x smaller under tp 8 run less efficiently: the size penalty (a profile's
    # matmul_half_flops) costs tp 8 a larger share of its time than tp 1
    sized = CostParams(matmul_half_flops=1e9)
    r = {tp: cm.prefill_s(M8B, tp, 1, 2048, 8, 1, H100, sized) / cm.prefill_s(M8B, tp, 1, 2048, 8, 1, H100, p)
         for tp in (1, 8)}
    assert r[8] > r[1] > 1.0, r


def test_fp8_gemm_efficiency_follows_the_per_rank_gemm():
    p = CostParams(matmul_half_flops=1e9)  # the size dependence the GPU profiles fit (about 1e9 on H100)
    kw = dict(model=M8B, layer_flops=1e15, tokens=1e5, mb_tokens=64.0, gpu=H100.gpu, p=p)
    t1 = cm.fp8_linear_s(cfg=ParallelConfig(tp=1, dp=8), **kw)
    t8 = cm.fp8_linear_s(cfg=ParallelConfig(tp=8, dp=1), **kw)
    assert t8 > t1  # an 8x smaller GEMM per rank is less efficient for the same FLOPs


def test_no_padding_by_default_and_the_length_tail_counts_in_attention():
    from nereus.planner.specs import Workload

    w = Workload(sequences=8, prompt_len=100, response_len_mean=500, response_len_max=4000)
    assert cm.padded_tokens(w) == w.tokens
    light = Workload(sequences=8, prompt_len=100, response_len_mean=500, response_len_max=4000, response_len_p90=600)
    heavy = Workload(sequences=8, prompt_len=100, response_len_mean=500, response_len_max=4000, response_len_p90=1500)
    assert cm.seq_moments(heavy)[1] > cm.seq_moments(light)[1]


def test_a_pipeline_as_deep_as_the_model_is_allowed_and_deeper_is_refused_by_name():
    tiny = JobSpec.from_dict({"algorithm": "grpo", "models": {"actor": "tiny-4l-128h"},
                              "batch": {"prompts": 8, "samples_per_prompt": 2},
                              "sequence": {"prompt_len": 8, "response_len_mean": 8, "response_len_max": 16}})
    assert estimate(tiny, H100, "actor/training", ParallelConfig(pp=4, dp=2)).time_s > 0
    with pytest.raises(SpecError, match=r"pp\(8\) > layers\(4\)"):
        estimate(tiny, H100, "actor/training", ParallelConfig(pp=8, dp=1))
    with pytest.raises(SpecError, match="job has no model-stage 'critic/training'"):
        estimate(tiny, H100, "critic/training", ParallelConfig(dp=8))


def test_context_parallel_inference_pays_the_ring_where_attention_cannot_hide_it():
    cfg = ParallelConfig(tp=1, dp=8, cp=8, micro_batch=4)
    e = estimate(job(mean=256, mx=512), H100, "actor/inference", cfg)
    assert e.time_breakdown["cp_comm"] > 0
