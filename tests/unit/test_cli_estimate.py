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
