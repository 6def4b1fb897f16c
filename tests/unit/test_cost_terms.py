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
from nereus.planner.cost.model import StageOptions, decode_terms, estimate
from nereus.planner.cost.params import CostParams, allreduce_s
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, RolloutSpec, SequenceSpec

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
    intra, inter = cm._links(H100, p)
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


def test_the_sequence_spec_default_is_unpadded():
    assert SequenceSpec(prompt_len=1, response_len_mean=1, response_len_max=1).padded is False
