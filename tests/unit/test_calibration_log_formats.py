"""`nereus calibrate --from-logs` on verl console logs and W&B CSV exports (fixtures in tests/data/):
records found among other lines, NumPy scalars and Ray prefixes understood, every malformed line
named by its number, `--strict` turning the first into a one-line error (exit 2)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nereus.calibration.logs import detect_format, parse_verl_line, read_log
from nereus.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
CONSOLE, WANDB = "tests/data/verl_console.log", "tests/data/wandb_export.csv"
JOB, CLUSTER = "examples/ppo-8b.yaml", "examples/cluster-h100-4n.yaml"


def test_verl_console_log_records_among_other_lines():
    t = read_log(ROOT / CONSOLE)
    f = t.frame
    assert list(f["step"]) == [1.0, 2.0, 4.0, 5.0, 6.0, 7.0]  # 0 is validation, 3 is cut short
    assert list(f["actor/generation"]) == [52.1, 53.0, 54.6, 55.2, 56.0, 56.8]  # step 2 logged np.float64(53.0)
    assert list(f["critic/training"])[:2] == [22.8, 23.1] and list(f["reward/inference"])[-1] == 5.6
    assert list(f["response_len_mean"])[:3] == [1980.5, 2010.0, 2080.0] and set(f["prompt_len"]) == {1024.0}
    assert f["ref/inference"].isna().tolist() == [False, False, True, False, False, False]
    assert t.issues == ("line 6: field 7 'r' is not key:value; row skipped",
                        "skipped 1 step record(s) without timers or lengths (validation?): line 2",
                        "line 7: timing_s/ref='fast' is not a non-negative number; value dropped",
                        "ignored 4 unknown key(s): actor/entropy, actor/pg_loss, critic/score/mean, perf/mfu/actor")


def test_parse_verl_line():
    assert parse_verl_line("Training Progress: 1/100 [step:1]") is None
    assert parse_verl_line("\x1b[36m(TaskRunner pid=7)\x1b[0m step:12 - timing_s/gen:np.float64(35.2) - x/y:3") == {
        "step": "12", "timing_s/gen": "35.2", "x/y": "3"}
    assert parse_verl_line("\x1b[32mstep:4 - timing_s/gen:1.5\x1b[0m") == {"step": "4", "timing_s/gen": "1.5"}
    assert parse_verl_line("step:1 - val-core/gsm8k/acc/mean@1:0.5") == {"step": "1", "val-core/gsm8k/acc/mean@1": "0.5"}
    assert parse_verl_line("mystep:1 - a:1") is None  # 'step:' must start a word
    with pytest.raises(ValueError, match=r"field 3 ':5' is not key:value"):
        parse_verl_line("step:1 - a:1 - :5")


def test_wandb_csv_export():
    t = read_log(ROOT / WANDB)
    assert list(t.frame["step"]) == [1.0, 2.0, 4.0, 5.0, 6.0, 7.0]  # from _step
    assert list(t.frame["actor/training"])[-1] == 25.2
    assert t.issues == ("line 4: 11 fields, header has 12; row skipped",
                        "line 5: timing_s/ref='NaN' is not a non-negative number; value dropped",
                        "ignored 1 unknown key(s): actor/pg_loss")  # _runtime and _timestamp quietly


def test_format_detection(tmp_path):
    text = (ROOT / CONSOLE).read_text()
    assert detect_format(Path("run.log"), text) == "verl-console"
    assert detect_format(Path("run.csv"), text) == "csv"
    assert detect_format(Path("run.txt"), '{"step": 1}\nstep:1 - a:1\n') == "jsonl"
    assert detect_format(Path("run.txt"), "nothing here\n") == "jsonl"
    with pytest.raises(SpecError, match="log format must be one of auto, jsonl, csv, verl-console, got 'xml'"):
        read_log(ROOT / CONSOLE, fmt="xml")
    # forced JSONL on a console log: every line is reported as not JSON, no usable row
    with pytest.raises(SpecError, match=r"no usable rows in 0 record\(s\); first problem: line 1: not valid JSON"):
        read_log(ROOT / CONSOLE, fmt="jsonl")


@pytest.mark.parametrize("log,line", [(CONSOLE, "line 6: field 7 'r' is not key:value"),
                                      (WANDB, "line 4: 11 fields, header has 12")])
def test_strict_stops_at_the_first_bad_line_naming_file_and_line(log, line):
    with pytest.raises(SpecError) as e:
        read_log(ROOT / log, strict=True)
    msg = str(e.value)
    assert msg.startswith(f"job log {ROOT / log}: {line}") and "2 problem line(s)" in msg and "\n" not in msg


def nereus(*args):
    return subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_cli_fits_a_console_log_and_names_every_bad_line(tmp_path):
    out = tmp_path / "prof.json"
    r = nereus("calibrate", "--from-logs", CONSOLE, "--job", JOB, "--cluster", CLUSTER, "--tp", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"warning: {CONSOLE}: line 6: field 7 'r' is not key:value; row skipped" in r.stdout
    assert f"warning: {CONSOLE}: line 7: timing_s/ref='fast'" in r.stdout
    assert f"6 good rows from {CONSOLE}" in r.stdout
    prof = json.loads(out.read_text())
    assert prof["where"]["rows"] == 6 and prof["where"]["issues"] == 4
    assert set(prof["fit"]["stages"]["factors"]) == {"generation", "inference", "training"}


@pytest.mark.parametrize("args,message", [
    (("--from-logs", CONSOLE, "--strict"), f"job log {CONSOLE}: line 6: field 7 'r' is not key:value"),
    (("--from-logs", WANDB, "--strict"), f"job log {WANDB}: line 4: 11 fields, header has 12"),
    (("--from-logs", "tests/data/verl_console_bad.log"), "no usable rows in 2 record(s); first problem: line 1:"),
])
def test_cli_bad_logs_exit_2_with_one_line(args, message):
    r = nereus("calibrate", *args, "--job", JOB, "--cluster", CLUSTER)
    assert r.returncode == 2, r.stdout
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
