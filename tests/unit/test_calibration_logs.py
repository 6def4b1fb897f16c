"""Job-log ingestion: bad lines, missing and unknown keys give clear messages and lose no good row;
fitting from logs recovers the stage factors the log was generated with."""
import json
import subprocess
import sys

import pytest

from nereus.calibration.logs import fit_from_logs, read_log, row_workload
from nereus.errors import SpecError
from nereus.planner.cost.model import estimate
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

JOB, CLUSTER = "examples/ppo-8b.yaml", "examples/cluster-h100-4n.yaml"
VERL = {"actor/generation": "timing_s/gen", "actor/inference": "timing_s/old_log_prob", "ref/inference": "timing_s/ref",
        "critic/inference": "timing_s/values", "reward/inference": "timing_s/reward",
        "actor/training": "timing_s/update_actor", "critic/training": "timing_s/update_critic"}
FACTORS = {"generation": 1.4, "inference": 0.8, "training": 1.25}


def synthetic_log(path, steps=16, drop=()):
    """A verl-style JSONL log whose times are the cost model's times x FACTORS."""
    job, cluster = load_job(JOB), load_cluster(CLUSTER)
    cfg = ParallelConfig(tp=2, dp=16)
    lines = []
    for i in range(steps):
        row = {"training/global_step": i, "response_length/mean": 1500 + 60 * i, "response_length/max": 8192,
               "prompt_length/mean": 1024, "actor/pg_loss": 0.1, "timing_s/step": 1.0}
        w = row_workload(job, {"response_len_mean": row["response_length/mean"], "response_len_max": 8192,
                               "prompt_len": 1024})
        for ms, key in VERL.items():
            if key in drop:
                continue
            row[key] = estimate(job, cluster, ms, cfg, w).time_s * FACTORS[ms.split("/")[1]]
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return job, cluster, {ms: cfg for ms in job.model_stages()}


def test_bad_lines_missing_and_unknown_keys_are_reported_and_good_rows_kept(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text("\n".join([
        json.dumps({"step": 1, "timing_s/gen": 10.0, "response_length/mean": 900, "timing_s/update_actor": 5.0}),
        "{not json",
        json.dumps({"step": 2, "timing_s/gen": 11.0}),                      # missing response length
        json.dumps({"step": 3, "timing_s/gen": "fast", "timing_s/ref": 2.0, "response_length/mean": 950,
                    "critic/vf_loss": 0.3, "perf/mfu/actor": 0.4}),          # bad value + unknown keys
        json.dumps([1, 2, 3]),
        "",
        json.dumps({"step": 4, "timing_s/gen": 12.0, "response_length/mean": 1000}),  # update_actor missing
    ]) + "\n")
    t = read_log(p)
    assert list(t.frame["step"]) == [1.0, 3.0, 4.0]
    assert t.frame["actor/training"].isna().tolist() == [False, True, True]
    assert t.frame["actor/generation"].isna().tolist() == [False, True, False]
    msgs = "\n".join(t.issues)
    assert "line 2: not valid JSON" in msgs
    assert "line 3: missing response_length/mean; row skipped" in msgs
    assert "line 4: timing_s/gen='fast' is not a non-negative number; value dropped" in msgs
    assert "line 5: expected a JSON object, got list" in msgs
    assert "ignored 2 unknown key(s): critic/vf_loss, perf/mfu/actor" in msgs
    assert len(t.issues) == 5


def test_csv_log_with_short_row_and_empty_cells(tmp_path):
    p = tmp_path / "log.csv"
    p.write_text("step,timing_s/gen,timing_s/update_actor,response_length/mean\n"
                 "0,10.5,4.0,800\n1,11.0\n2,,4.5,820\n")
    t = read_log(p)
    assert list(t.frame["step"]) == [0.0, 2.0]
    assert t.issues == ("line 3: 2 fields, header has 4; row skipped",)
    assert t.frame["actor/generation"].isna().tolist() == [False, True]


def test_unusable_log_is_one_clear_error(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"foo": 1}\n')
    with pytest.raises(SpecError, match=r"no usable rows in 1 record\(s\); first problem: line 1: missing"):
        read_log(p)
    with pytest.raises(SpecError, match="job log not found"):
        read_log(tmp_path / "nope.jsonl")


def test_fit_from_logs_recovers_stage_factors(tmp_path):
    p = tmp_path / "log.jsonl"
    job, cluster, cfgs = synthetic_log(p)
    res = fit_from_logs(read_log(p), job, cluster, cfgs)
    for stage, f in FACTORS.items():
        assert res["factors"][stage] == pytest.approx(f, rel=0.02)
    assert res["summary"]["points"] > 0 and res["summary"]["mape_after"] < 0.01
    assert res["summary"]["mape_before"] > 0.1
    assert dict(res["params"].stage_factor)["generation"] == pytest.approx(1.4, rel=0.02)


def test_cli_from_logs_writes_profile_and_rejects_bad_input(tmp_path):
    p = tmp_path / "log.jsonl"
    synthetic_log(p, steps=8, drop=("timing_s/values",))
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "calibrate", "--from-logs", str(p), "--job", JOB,
                        "--cluster", CLUSTER, "--tp", "2", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert prof["params"]["stage_factor"]["training"] == pytest.approx(1.25, rel=0.02)
    assert set(prof["fit"]["heldout_mape"]) == {"microbench", "stages"}
    assert "--from-logs" in prof["how"]
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "calibrate", "--from-logs", str(tmp_path / "none.jsonl"),
                        "--job", JOB, "--cluster", CLUSTER], capture_output=True, text=True)
    assert r.returncode == 2 and "job log not found" in r.stderr and "Traceback" not in r.stderr
