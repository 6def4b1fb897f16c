"""``torchrun --nproc-per-node 2 -m nereus.cli reshard-check``: torchrun's processes and env://
rendezvous instead of spawned ones (``launch.torchrun_env``); rank 0 reports and writes the JSON.
torchrun picks its own free port (--standalone): the test skips if it cannot bind one here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
CANNOT_BIND = ("address already in use", "cannot assign requested address", "errno 99", "errno 98",
               "permission denied", "failed to bind", "the server socket has failed to listen")


def _torchrun(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "nereus.cli", *args]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    text = (p.stdout + p.stderr).lower()
    if p.returncode != 0 and any(s in text for s in CANNOT_BIND):
        pytest.skip(f"torchrun could not bind a port here: {text.strip().splitlines()[-1]}")
    return p


def test_reshard_check_under_torchrun_runs_on_its_processes_and_rank_0_reports(tmp_path):
    out = tmp_path / "rc.json"
    p = _torchrun(tmp_path, "reshard-check", "--world", "2", "--cases", "2", "--seed", "3", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    assert data["cases"] == data["passed"] == 2 and data["failed"] == 0 and data["bytes_moved"] > 0
    assert p.stdout.count("2 passed, 0 failed") == 1  # rank 0 only
    assert "torchrun gloo processes" in p.stdout or "PASS" in p.stdout


def test_the_demo_under_torchrun_runs_on_its_processes_and_rank_0_writes_the_json(tmp_path):
    out = tmp_path / "demo.json"
    p = _torchrun(tmp_path, "demo", "--world", "2", "--steps", "2", "--policy", "both", "--out-dir", str(tmp_path),
                  "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(out.read_text())
    summary = data["budgets"][0]["summary"]
    assert set(summary) == {"adaptive", "static"} and all(s["steps"] == 2 for s in summary.values()), summary


def test_the_demo_under_torchrun_refuses_hindsight_in_one_line(tmp_path):
    p = _torchrun(tmp_path, "demo", "--world", "2", "--steps", "2", "--policy", "all", "--out-dir", str(tmp_path))
    assert p.returncode != 0 and "nereus demo: error: demo under torchrun: --policy all includes model-hindsight" in p.stderr, p.stderr
