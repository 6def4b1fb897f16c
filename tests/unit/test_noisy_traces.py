"""Traces as real logs give them: a cap column apart from the observed longest response, noise in the
observed max read as noise (not a cap change), and a job's own verl log replayed (SIMULATED)."""
import json

import pytest

from nereus.cli import main
from nereus.errors import SpecError
from nereus.models.spec import preset
from nereus.planner.online.audit import read_audit
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, SequenceSpec
from nereus.simulator.simulate import simulate
from nereus.simulator.trace import as_logged, load_trace, parse_trace, trace_from_log

JOB = JobSpec(algorithm="grpo", models=(("actor", preset("llama-3.1-8b")), ("ref", preset("llama-3.1-8b"))),
              batch=BatchSpec(prompts=64, samples_per_prompt=8, mini_batches=2),
              sequence=SequenceSpec(prompt_len=512, response_len_mean=2048, response_len_max=8192))
H200 = ClusterSpec(gpu=GPU_PRESETS["h200"], nodes=1)
FLAT = "step,response_len_mean,response_len_max,gpus\n0,2000,8192,8\n39,2000,8192,8\n"


def test_cap_column_is_the_limit_and_max_the_observed_longest():
    t = parse_trace("step,response_len_mean,response_len_max,gpus,response_len_cap\n0,1000,3000,8,8192\n2,1100,2500,8,8192\n")
    assert [r.cap for r in t.rows] == [8192] * 3 and [r.response_len_max for r in t.rows] == [3000, 3000, 2500]
    assert t.workload(0, JOB.workload()).response_len_max == 8192  # the planner plans for the cap
    assert parse_trace(t.to_csv()).rows == t.rows
    old = parse_trace(FLAT)  # without the column, max keeps its old meaning: the cap
    assert not old.has_cap and old.rows[0].cap == 8192 and "response_len_cap" not in old.to_csv()
    with pytest.raises(SpecError, match=r"response_len_max\(9000\) > response_len_cap\(8192\)"):
        parse_trace("step,response_len_mean,response_len_max,gpus,response_len_cap\n0,1000,9000,8,8192\n")


def test_a_logged_trace_differs_every_step_within_its_cap():
    t = as_logged(parse_trace(FLAT), prompts=64, samples=8, seed=1)
    means = [r.response_len_mean for r in t.rows]
    maxes = [r.response_len_max for r in t.rows]
    # sampled step means (rounded to 0.1 token) may coincide by chance; a trace that repeats one mean would not
    assert len(set(means)) >= len(means) - 2 and len(set(maxes)) > 5
    assert all(r.cap == 8192 and r.response_len_max <= 8192 for r in t.rows)
    assert 0.9 < sum(means) / len(means) / 2000 < 1.1
    shipped = load_trace("ramp_1024_noisy")
    assert len(shipped) == 1000 and shipped.has_cap and len({r.response_len_mean for r in shipped.rows}) > 990


def test_flat_noisy_trace_makes_at_most_one_transition(tmp_path):
    noisy = as_logged(parse_trace(FLAT), prompts=64, samples=8, seed=1)
    audit = tmp_path / "a.jsonl"
    res = simulate(JOB, H200, noisy, ["adaptive"], time_limit_s=2, seed=0, audit_path=str(audit))["adaptive"]
    assert res.to_dict()["transitions"] <= 1, [r["reason"] for r in read_audit(audit) if r["decision"] == "switch"]
    recs = read_audit(audit)
    assert {f["response_len_max"] for r in recs for f in r["forecast"]} == {8192}  # the cap never moved
    assert sum(r["resolved"] for r in recs[10:]) <= 2  # noisy steps do not trigger re-solves


def _verl_lines(n: int = 12) -> str:
    out = []
    for s in range(1, n + 1):
        mean, mx = 1500 + 40 * s, min(8192, 4000 + 300 * s)
        out.append(f"(TaskRunner pid=2412) step:{s} - actor/pg_loss:np.float64(0.01) - timing_s/gen:{30 + s} - "
                   f"timing_s/update_actor:{12 + s} - response_length/mean:{mean} - response_length/max:{mx} - "
                   f"prompt_length/mean:512.0")
    return "\n".join(["some ray banner line"] + out) + "\n"


@pytest.mark.parametrize("kind", ["console", "jsonl"])
def test_a_verl_log_replays_through_the_simulator(tmp_path, kind):
    if kind == "console":
        log = tmp_path / "verl.log"
        log.write_text(_verl_lines())
    else:
        log = tmp_path / "verl.jsonl"
        log.write_text("".join(json.dumps({"step": s, "timing_s/gen": 30.0 + s, "response_length/mean": 1500.0 + 40 * s,
                                           "response_length/max": 4000 + 300 * s}) + "\n" for s in range(1, 13)))
    trace = trace_from_log(log, cap=8192, gpus=8)
    assert len(trace) == 12 and trace.has_cap and trace.rows[0].response_len_max == 4300
    with pytest.raises(SpecError, match="longer than the cap"):
        trace_from_log(log, cap=4096, gpus=8)
    out = tmp_path / "s.json"
    rc = main(["simulate", "--job", "examples/grpo-7b.yaml", "--cluster", "examples/cluster-h100-1n.yaml",
               "--trace", str(log), "--response-len-cap", "8192", "--policy", "static", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())["static"]
    assert data["steps"] == 12 and data["label"] == "SIMULATED"
