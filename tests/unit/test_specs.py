import json

import pytest

from nereus.errors import SpecError
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, load_cluster, load_job

JOB = {
    "algorithm": "ppo",
    "models": {"actor": "llama-3.1-8b", "critic": "llama-3.1-8b", "ref": "llama-3.1-8b", "reward": "llama-3.1-8b"},
    "batch": {"prompts": 256, "samples_per_prompt": 4, "ppo_epochs": 1, "mini_batches": 4},
    "sequence": {"prompt_len": 1024, "response_len_mean": 2048, "response_len_max": 8192},
}


def test_job_roundtrip_through_json():
    job = JobSpec.from_dict(JOB)
    again = JobSpec.from_dict(json.loads(json.dumps(job.to_dict())))
    assert again == job


def test_cluster_roundtrip_and_overrides():
    c = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 4, "gpus_per_node": 8, "inter_node_gbps": 25})
    assert c.gpu.inter_node_gbps == 25 and c.gpu.tflops_bf16 == 989
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.num_gpus == 32


def test_ppo_dataflow():
    job = JobSpec.from_dict(JOB)
    assert job.phases() == (("actor/generation",),
                            ("actor/inference", "ref/inference", "critic/inference", "reward/inference"),
                            ("actor/training", "critic/training"))


def test_grpo_dataflow_rule_reward():
    d = {**JOB, "algorithm": "grpo", "models": {"actor": "qwen2.5-7b", "ref": "qwen2.5-7b"}}
    job = JobSpec.from_dict(d)
    assert job.model_stages() == ("actor/generation", "actor/inference", "ref/inference", "actor/training")


@pytest.mark.parametrize("patch, msg", [
    ({"algorithm": "dpo"}, "algorithm must be"),
    ({"models": {"actor": "llama-3.1-8b", "ref": "llama-3.1-8b"}}, "ppo needs models.critic"),
    ({"batch": {"prompts": -4}}, "prompts must be > 0"),
    ({"sequence": {"prompt_len": 10, "response_len_mean": 900, "response_len_max": 100}}, r"response_len_mean\(900\)"),
    ({"models": {"actor": "nope", "critic": "x", "ref": "x"}}, "unknown model preset 'nope'"),
    ({"extra": 1}, "unknown field"),
])
def test_job_errors_name_the_problem(patch, msg):
    with pytest.raises(SpecError, match=msg):
        JobSpec.from_dict({**JOB, **patch})


def test_cluster_errors():
    with pytest.raises(SpecError, match="unknown gpu preset 'rubin-r100'"):
        ClusterSpec.from_dict({"gpu": "rubin-r100", "nodes": 1})
    with pytest.raises(SpecError, match="nodes must be > 0"):
        ClusterSpec.from_dict({"gpu": "h200", "nodes": 0})
    with pytest.raises(SpecError, match="missing field"):
        ClusterSpec.from_dict({"gpu": "h200"})


def test_malformed_yaml(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text("algorithm: ppo\nmodels: {actor: [\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        load_job(p)
    with pytest.raises(SpecError, match="file not found"):
        load_cluster(tmp_path / "missing.yaml")


def test_parallel_config_validation():
    with pytest.raises(SpecError, match="zero must be"):
        ParallelConfig(zero=4)
    assert ParallelConfig(tp=2, pp=2, dp=3).gpus == 12
    assert ParallelConfig.from_dict(ParallelConfig(tp=4).to_dict()) == ParallelConfig(tp=4)


def test_examples_load():
    for j in ("ppo-8b", "ppo-70b", "grpo-7b"):
        load_job(f"examples/{j}.yaml")
    for c in ("1n", "4n", "16n", "128n"):
        load_cluster(f"examples/cluster-h100-{c}.yaml")
