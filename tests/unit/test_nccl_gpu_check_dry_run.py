"""``benchmarks/gpu_check.sh --dry-run``: every one-GPU check with its budget, the budgets within
8 minutes, and what one GPU cannot check listed; the run reads the same table."""
import pathlib
import re
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_the_dry_run_lists_every_check_within_480_s_and_what_one_gpu_cannot_check():
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    one_gpu = r.stdout.split("with 2+ GPUs")[0]
    budgets = {m[1]: int(m[2]) for m in re.finditer(r"^  (\S+)\s+(\d+) s$", one_gpu, re.M)}
    assert {"device_check", "nccl_single", "watchdog", "hash_speed", "calibrate_cuda", "hf_bf16",
            "model_timings"} <= set(budgets)
    total = int(re.search(r"total\s+(\d+) s", one_gpu)[1])
    assert total == sum(budgets.values()) <= 480
    cannot = r.stdout.split("cannot be checked on one GPU:")[1].split("CPU smoke form")[0]
    assert "transitions between ranks over NCCL" in cannot and cannot.count("  - ") >= 4
    # the run uses the table the dry run prints: every one-GPU name appears once in ONE_GPU
    text = SCRIPT.read_text()
    table = text.split("ONE_GPU=(")[1].split("\n)")[0]
    assert sorted(re.findall(r'^  "([^|]+)\|(\d+)\|', table, re.M)) == sorted((k, str(v)) for k, v in budgets.items())


def test_without_cuda_the_run_says_so_and_checks_nothing(tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 3 and "no CUDA device" in r.stderr
