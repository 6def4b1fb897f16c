"""Real (small) measurements: microbenchmarks in-process and on 2 gloo processes, stage timing on
the plain and executor backends, the shared-host clock, CLI argument errors."""
import subprocess
import sys
import time

import pytest
import torch

from nereus.calibration import microbench as mb
from nereus.calibration.clock import Stopwatch, corrected, run_delay_s
from nereus.calibration.reference import PlainLM
from nereus.calibration.stages import StageConfig, heldout_configs, measure, predict, stage_grid
from nereus.calibration.subject import TIMED_MODEL

TINY = mb.BenchGrid(matmul_mnk=((32, 32, 32), (64, 64, 64), (128, 64, 64)), matmul_dtypes=("float32",),
                    copy_bytes=(1 << 20, 1 << 21, 1 << 22), comm_bytes=(1024, 16384, 262144), reps=2, budget_s=0.01)


def test_in_process_microbench_tables_are_tidy_and_positive():
    t = mb.run_all(TINY, "cpu", 1)
    assert list(t["matmul"]["m"]) == [32, 64, 128] and (t["matmul"]["seconds"] > 0).all()
    assert (t["matmul"]["tflops"] > 0).all() and (t["copy"]["gbps"] > 0).all()
    assert t["comm"].empty
    assert set(t["matmul"].columns) >= {"seconds", "seconds_min"}


def test_time_call_reports_the_median_and_the_fastest_repeat():
    """Repeats of known, distinct lengths (sleeps: no run-queue delay to subtract): the median is
    the middle one, the minimum the shortest, each a repeat's own time, not a mix."""
    lengths = iter([0.02, 0.02, 0.03, 0.005, 0.2, 0.01, 0.02])  # two calls size the loop, then 5 repeats
    med, fastest = mb.time_call(lambda: time.sleep(next(lengths)), "cpu", reps=5, budget_s=0.0)
    assert 0.02 <= med < 0.03 and 0.005 <= fastest < 0.01, (med, fastest)  # the mean would be 0.053


def test_passes_merge_to_the_median_of_pass_medians_and_the_fastest_repeat():
    rows = [{"m": 1, "seconds": s, "seconds_min": m} for s, m in ((3.0, 2.0), (1.0, 0.5), (2.0, 1.5))]
    rows += [{"m": 2, "seconds": 7.0, "seconds_min": 6.0}]
    merged = {r["m"]: r for r in mb._merge(rows, ("m",))}
    assert (merged[1]["seconds"], merged[1]["seconds_min"]) == (2.0, 0.5)
    assert (merged[2]["seconds"], merged[2]["seconds_min"]) == (7.0, 6.0)


def test_two_process_world_measures_every_collective():
    t = mb.run_all(TINY, "cpu", 2)
    comm = t["comm"]
    assert sorted(set(comm["kind"])) == ["all_gather", "all_reduce", "p2p"]
    assert len(comm) == 9 and (comm["world"] == 2).all() and (comm["seconds"] > 0).all()
    assert len(t["matmul"]) == 3


def test_plain_transformer_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    net = PlainLM(TIMED_MODEL)
    prompt = torch.randint(0, TIMED_MODEL.vocab, (2, 5))
    out = net.generate(prompt, 6)
    with torch.no_grad():
        again = net(out[:, :-1]).argmax(-1)
    assert torch.equal(again[:, 4:], out[:, 5:])


def test_stage_timing_plain_in_process_and_prediction_is_finite():
    cfgs = (StageConfig(stage="inference", batch=2, micro_batch=2, prompt_len=8, response_len=8),
            StageConfig(stage="training", batch=2, micro_batch=1, prompt_len=8, response_len=8),
            StageConfig(stage="generation", batch=2, micro_batch=2, prompt_len=4, response_len=4))
    df = measure(cfgs, 1, reps=1, backend="plain")
    assert list(df["stage"]) == ["inference", "training", "generation"] and (df["seconds"] > 0).all()
    from nereus.calibration.profile import load_profile
    hw = load_profile("cpu-local").hardware
    assert all(0 < predict(c, load_profile("cpu-local").params, hw) < 60 for c in cfgs)


def test_stage_timing_on_executor_across_tp_and_pp():
    pytest.importorskip("nereus.executor.engine")
    cfgs = (StageConfig(stage="inference", tp=2, batch=2, micro_batch=2, prompt_len=8, response_len=8),
            StageConfig(stage="training", pp=2, batch=2, micro_batch=1, prompt_len=8, response_len=8))
    df = measure(cfgs, 2, reps=1, backend="executor")
    assert (df["seconds"] > 0).all() and list(df["backend"]) == ["executor", "executor"]


def test_grid_and_holdout_keep_extremes_in_the_fit():
    cfgs = stage_grid(True, 2, ((1, 1, 1), (1, 1, 2)))
    held = heldout_configs(cfgs)
    assert 0 < sum(held) < len(cfgs)
    for stage in ("generation", "inference", "training"):
        group = [(c, h) for c, h in zip(cfgs, held) if c.stage == stage and c.dp == 1]
        tokens = [c.batch * (c.prompt_len + c.response_len) for c, _ in group]
        for (c, h), n in zip(group, tokens):
            if n in (min(tokens), max(tokens)):
                assert not h


def test_stopwatch_subtracts_run_queue_delay_conservatively():
    with Stopwatch() as sw:
        sum(range(20000))
    assert 0 < sw.device <= sw.wall and run_delay_s() >= 0
    assert corrected(1.0, 0.7) == pytest.approx(0.3)
    assert corrected(1.0, 0.99) == 1.0  # the clocks disagree: keep the wall time


@pytest.mark.parametrize("args, msg", [
    (["--world", "9"], "--world must be between 1 and 8, got 9"),
    (["--from-logs", "x.jsonl"], "--from-logs needs --job and --cluster"),
    pytest.param(["--device", "cuda", "--quick"], "--device cuda: no usable CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_cli_bad_arguments_exit_2_with_one_line(args, msg):
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "calibrate", *args], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
