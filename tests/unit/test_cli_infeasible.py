"""CLI paths that must refuse, as subprocesses: exit code 2 and one line on stderr naming the
problem with its numbers. `estimate` of a config that does not fit (the same contract as `plan`
on an infeasible job), `transition` onto too few GPUs or too little memory, `demo` on a bad world."""
import json
import subprocess
import sys
from pathlib import Path

import yaml

from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--job", str(ROOT / "examples/ppo-8b.yaml"), "--cluster", str(ROOT / "examples/cluster-h100-4n.yaml")]


def nereus(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_estimate_of_a_config_that_does_not_fit_exits_2_naming_gib_needed_and_usable(tmp_path):
    """8B actor training unsharded without ZeRO: 16 bytes of model state per param alone is 120 GiB."""
    out = tmp_path / "e.json"
    r = nereus("estimate", *BASE, "--model-stage", "actor/training", "--tp", "1", "--dp", "1", "--zero", "0",
               "--json", str(out))
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = one_line(r.stderr)
    assert err.startswith("nereus estimate: error: actor/training tp1pp1dp1") and "does not fit" in err, err
    d = json.loads(out.read_text())  # the estimate is still written: it says where the memory goes
    assert d["fits"] is False and d["mem_bytes"] > d["capacity_bytes"]
    assert f"needs {d['mem_bytes'] / 2**30:.1f} GiB per GPU, {d['capacity_bytes'] / 2**30:.1f} GiB usable" in err, err
    assert "optimizer" in r.stdout and "peak" in r.stdout  # the breakdown is printed before the refusal


def test_estimate_of_generation_whose_kv_cache_cannot_hold_one_sequence_exits_2_with_the_reason():
    r = nereus("estimate", *BASE, "--model-stage", "actor/generation", "--response-len-max", "2000000")
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = one_line(r.stderr)
    assert "does not fit" in err and "GiB usable" in err and "of KV cache" in err, err


def test_estimate_of_a_config_that_fits_exits_0_with_nothing_on_stderr():
    r = nereus("estimate", *BASE, "--model-stage", "actor/generation", "--tp", "1", "--dp", "32")
    assert r.returncode == 0 and r.stderr == "" and "verdict: fits" in r.stdout, (r.returncode, r.stderr)


TINY = {"name": "tiny", "layers": 2, "hidden": 32, "ffn": 64, "heads": 4, "kv_heads": 2, "vocab": 64, "head_dim": 8}
HOME = {"actor": "actor/training", "critic": "critic/training", "ref": "ref/inference", "reward": "reward/inference"}


def _transition_files(tmp_path, cluster: dict) -> list[str]:
    def plan(cfg):
        return Plan(stages=tuple(StagePlacement(name=HOME[r], config=ParallelConfig(tp=tp, pp=pp, dp=dp), pool=i,
                                                first_gpu=0, gpus=tp * pp * dp)
                                 for i, (r, (tp, pp, dp)) in enumerate(cfg.items()))).to_dict()

    job = {"algorithm": "ppo", "models": {r: TINY for r in HOME}, "batch": {"prompts": 8},
           "sequence": {"prompt_len": 16, "response_len_mean": 16, "response_len_max": 32}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    (tmp_path / "a.json").write_text(json.dumps(plan({"actor": (2, 2, 2), "critic": (2, 1, 4), "ref": (4, 1, 2),
                                                      "reward": (1, 1, 8)})))
    (tmp_path / "b.json").write_text(json.dumps(plan({"actor": (4, 1, 2), "critic": (2, 2, 2), "ref": (2, 2, 2),
                                                      "reward": (2, 1, 4)})))
    return ["--job", str(tmp_path / "job.yaml"), "--cluster", str(tmp_path / "cluster.yaml"),
            "--from", str(tmp_path / "a.json"), "--to", str(tmp_path / "b.json"), "--scheduler", "greedy"]


def test_transition_onto_fewer_gpus_than_the_plans_use_exits_2_naming_both_counts(tmp_path):
    args = _transition_files(tmp_path, {"gpu": "h100-80gb", "nodes": 1, "gpus_per_node": 4})
    r = nereus("transition", *args, "--json", str(tmp_path / "t.json"))
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = one_line(r.stderr)
    assert err.startswith("nereus transition: error: ") and err.endswith("has 4"), err
    assert "8 GPUs" in err or "up to 7" in err, err  # the plan's GPUs, beside the cluster's 4
    assert not (tmp_path / "t.json").exists()


def test_transition_whose_new_state_does_not_fit_even_staged_to_host_exits_2_naming_gib(tmp_path):
    """Each GPU holds ~150-270 KB of the tiny models' state; 100 KB usable cannot take B's state
    even with A's state moved out to host memory."""
    args = _transition_files(tmp_path, {"gpu": "h100-80gb", "nodes": 2, "gpus_per_node": 4,
                                        "memory_gib": 2 + 100e3 / 2**30})
    r = nereus("transition", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    err = one_line(r.stderr)
    assert err.startswith("nereus transition: error: GPU ") and "destination state needs" in err, err
    assert "capacity is 0.00 GiB, even with its old state staged to host" in err, err


def test_demo_on_a_world_it_cannot_run_exits_2_before_spawning():
    r = nereus("demo", "--world", "5", "--steps", "1")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert one_line(r.stderr) == "nereus demo: error: --world must be 2, 3 or 4 (gloo processes on this machine), got 5"
