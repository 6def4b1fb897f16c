import json
import subprocess
import sys

import pytest

BASE = ["--job", "examples/ppo-8b.yaml", "--cluster", "examples/cluster-h100-4n.yaml"]


def nereus(*args):
    return subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True)


def test_estimate_prints_breakdown_and_json(tmp_path):
    out = tmp_path / "e.json"
    r = nereus("estimate", *BASE, "--model-stage", "actor/training", "--tp", "2", "--dp", "16", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "dp_grad_sync" in r.stdout and "verdict" in r.stdout
    d = json.loads(out.read_text())
    assert d["tp"] == 2 and d["fits"] is True and d["time_s"] > 0


@pytest.mark.parametrize("args, msg", [
    (["--model-stage", "actor/training", "--tp", "3"], "tp(3) does not divide heads(32)"),
    (["--model-stage", "critic/generation"], "no model-stage 'critic/generation'"),
    (["--model-stage", "actor/training", "--dp", "-1"], "must be >= 0"),
])
def test_estimate_bad_input_exit_2_no_traceback(args, msg):
    r = nereus("estimate", *BASE, *args)
    assert r.returncode == 2
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_yaml_and_unknown_preset(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("algorithm: ppo\nmodels: [unclosed\n")
    r = nereus("estimate", "--job", str(bad), "--cluster", "examples/cluster-h100-4n.yaml", "--model-stage", "actor/training")
    assert r.returncode == 2 and "malformed YAML" in r.stderr and "Traceback" not in r.stderr
    c = tmp_path / "c.yaml"
    c.write_text("gpu: tpu-v9\nnodes: 2\n")
    r = nereus("estimate", "--job", "examples/ppo-8b.yaml", "--cluster", str(c), "--model-stage", "actor/training")
    assert r.returncode == 2 and "unknown gpu preset 'tpu-v9'" in r.stderr


def test_estimate_takes_what_real_jobs_set(tmp_path):
    """Sequence parallelism, a token budget, optimizer offload, the engine's memory fraction and
    engine change the estimate the way they change the job."""
    import json
    import subprocess
    import sys

    def run(*extra, stage="actor/training", dp="8"):
        out = tmp_path / f"e{len(list(tmp_path.iterdir()))}.json"
        r = subprocess.run([sys.executable, "-m", "nereus.cli", "estimate", "--job", "examples/ppo-8b.yaml", "--cluster",
                            "examples/cluster-h100-4n.yaml", "--model-stage", stage, "--dp", dp, "--recompute",
                            "--json", str(out), *extra], capture_output=True, text=True)
        d = json.loads(out.read_text())
        assert r.returncode == (0 if d["fits"] else 2), (r.returncode, d["fits"], r.stderr)  # the verdict is the exit
        return d

    base = run()
    sp = run("--sp", "2")
    assert sp["mem_breakdown"]["activations"] < base["mem_breakdown"]["activations"]
    assert sp["time_breakdown"]["sp_comm"] > 0 == base["time_breakdown"]["sp_comm"]
    off = run("--offload")
    assert off["mem_breakdown"]["optimizer"] == 0 < base["mem_breakdown"]["optimizer"]
    assert off["time_breakdown"]["offload"] > 0
    # packing up to 32,768 tokens holds more than one micro-batch of the longest sequence (the default)
    budget = run("--token-budget", "32768")
    assert budget["token_budget"] == 32768 and budget["mem_breakdown"]["activations"] > base["mem_breakdown"]["activations"]
    gen = run(stage="actor/generation", dp="32")
    small = run("--gpu-memory-utilization", "0.3", "--max-num-seqs", "8", "--engine", "sglang",
                stage="actor/generation", dp="32")
    assert small["mem_breakdown"]["kv_cache"] < gen["mem_breakdown"]["kv_cache"]
    assert small["time_s"] > gen["time_s"] and small["waves"] > 1  # 8 at a time: the rest wait


def test_estimate_enforce_eager_adds_launch_time_to_generation(tmp_path):
    """--enforce-eager: every decode iteration of a 1.5B model lasts its kernel launches (eager_launch),
    which its GPU time does not hide."""
    job = tmp_path / "grpo-1.5b.yaml"
    job.write_text("algorithm: grpo\nmodels: {actor: deepseek-r1-distill-qwen-1.5b, ref: deepseek-r1-distill-qwen-1.5b}\n"
                   "batch: {prompts: 64, samples_per_prompt: 8}\n"
                   "sequence: {prompt_len: 512, response_len_mean: 64, response_len_max: 256}\n")
    outs = []
    for extra in ((), ("--enforce-eager",)):
        out = tmp_path / f"g{len(outs)}.json"
        r = nereus("estimate", "--job", str(job), "--cluster", "examples/cluster-h100-4n.yaml",
                   "--model-stage", "actor/generation", "--tp", "1", "--dp", "32",
                   "--response-len-mean", "64", "--response-len-max", "256", "--json", str(out), *extra)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(out.read_text()))
    graph, eager = outs
    assert "eager_launch" not in graph["time_breakdown"]
    assert eager["time_breakdown"]["eager_launch"] > 0 and eager["time_s"] > graph["time_s"]


def test_estimate_vllm_v0_engine_pays_more_per_running_sequence(tmp_path):
    """--engine vllm-v0: vLLM's V0 engine prices each iteration's Python work per running sequence
    (CostParams.engine_overhead), so 128 sequences per engine pay more step_overhead than on V1."""
    job = tmp_path / "grpo-1.5b.yaml"
    job.write_text("algorithm: grpo\nmodels: {actor: deepseek-r1-distill-qwen-1.5b, ref: deepseek-r1-distill-qwen-1.5b}\n"
                   "batch: {prompts: 64, samples_per_prompt: 8}\n"
                   "sequence: {prompt_len: 512, response_len_mean: 64, response_len_max: 256}\n")
    outs = {}
    for engine in ("vllm", "vllm-v0"):
        out = tmp_path / f"{engine}.json"
        r = nereus("estimate", "--job", str(job), "--cluster", "examples/cluster-h100-1n.yaml",
                   "--model-stage", "actor/generation", "--tp", "1", "--dp", "4", "--engine", engine, "--json", str(out))
        assert r.returncode == 0, r.stderr
        outs[engine] = json.loads(out.read_text())
    v1, v0 = outs["vllm"]["time_breakdown"]["step_overhead"], outs["vllm-v0"]["time_breakdown"]["step_overhead"]
    assert v0 > 1.4 * v1  # the running batch shrinks as responses end: not 128 throughout
    r = nereus("estimate", *BASE, "--model-stage", "actor/generation", "--engine", "vllm-v2")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


def test_estimate_takes_verl_fsdp_worker_settings(tmp_path):
    """--no-remove-padding pads every sequence to prompt + max response (more compute) and, under FSDP,
    adds the host floor whole; --param-offload per_call pays the host link; --grad-sync micro_batch
    with --grad-reduce-fp32 reduces fp32 gradients after every micro-batch."""
    job = tmp_path / "grpo-0.5b.yaml"
    job.write_text("algorithm: grpo\nmodels: {actor: qwen2.5-0.5b, ref: qwen2.5-0.5b}\n"
                   "batch: {prompts: 256, samples_per_prompt: 2, mini_batches: 4}\n"
                   "sequence: {prompt_len: 105, response_len_mean: 188, response_len_max: 192}\n")

    def run(*extra):
        out = tmp_path / f"e{len(list(tmp_path.iterdir()))}.json"
        r = nereus("estimate", "--job", str(job), "--cluster", "examples/cluster-h100-1n.yaml", "--profile", "h100-80gb",
                   "--model-stage", "actor/training", "--dp", "8", "--zero", "3", "--micro-batch", "4", "--recompute",
                   "--json", str(out), *extra)
        assert r.returncode == 0, r.stderr
        return json.loads(out.read_text())["time_breakdown"]

    base, padded = run(), run("--no-remove-padding")
    assert padded["compute"] > base["compute"]
    assert padded["fsdp_cpu_bound"] > base.get("fsdp_cpu_bound", 0.0)
    assert run("--param-offload", "per_call")["param_offload"] > 0 and "param_offload" not in base
    per_mb = run("--grad-sync", "micro_batch")
    assert per_mb["dp_grad_sync"] > 2 * base["dp_grad_sync"]
    assert run("--grad-sync", "micro_batch", "--grad-reduce-fp32")["dp_grad_sync"] > 1.5 * per_mb["dp_grad_sync"]
    # --single-controller: the 512 sequences padded to 105 + 192 tokens go through verl's driver
    from nereus.planner.cost.model import controller_transfer_s
    from nereus.fidelity.report import fitted_params
    assert "controller_transfer" not in base
    assert run("--single-controller")["controller_transfer"] == pytest.approx(
        controller_transfer_s("training", 512, 105 + 192, 192, fitted_params("h100-80gb")))
    r = nereus("estimate", *BASE, "--model-stage", "actor/training", "--param-offload", "always")
    assert r.returncode == 2 and "invalid choice" in r.stderr
