"""The demo's whole loop on 2 real gloo processes: GRPO steps, the controller deciding on measured
metrics, a transition applied through the executor when the response cap rises past what the
initial layout can hold."""
import json

import pytest

from nereus.demo.run import prepare, run_policy, summarize
from nereus.demo.setup import LAST_STEP, DemoConfig


@pytest.mark.dist
def test_adaptive_switches_before_the_cap_raise_and_verifies(tmp_path):
    cfg = DemoConfig(steps=4, world=2, budget_mb=15.0, cap_schedule=((0, 8), (2, 200)), warmup_steps=4,
                     prompts=4, samples=2, out_dir=str(tmp_path), timeout_s=300, recompute=False)
    full, job, cluster, params, plan, _ = prepare(cfg, log=lambda *_: None)
    records = run_policy(cfg, "adaptive", full, job, cluster, params, plan)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    switches = [r for r in records if r.get("transition_s")]
    # the cap rises to 200 at step 2, past what the initial layout holds with any knobs (at 96 a smaller
    # micro-batch could do, a knob change and no transition): the controller hears of it after step 1
    # and must move first
    assert switches and switches[0]["step"] <= 1, [(r["step"], r.get("decision"), r.get("reason")) for r in records]
    assert all(r["verified"] for r in switches)
    assert records[-1]["plan"] != records[0]["plan"]
    s = summarize(records, cfg.budget_mb)
    assert s["infeasible_steps"] == 0 and s["peak_mem_frac"] <= 1.0
    # a transition holds the old state until commit: measured, above the state alone, within budget here
    assert all(0 < r["transition_peak_mem_frac"] for r in switches)
    assert s["transition_peak_mem_frac"] == max(r["transition_peak_mem_frac"] for r in switches)
    audit = [json.loads(line) for line in open(tmp_path / "audit-adaptive.jsonl")]
    # the controller decides after steps 0-2; after the last step there is nothing left to switch for
    assert len(audit) == 3 and any(a["decision"] == "switch" for a in audit)
    assert records[-1]["reason"] == LAST_STEP["reason"] and not records[-1].get("transition_s")


@pytest.mark.dist
def test_a_transition_whose_bytes_fail_verification_rolls_back_and_is_recorded_unverified(tmp_path):
    """The first local copy rank 1 makes in every layout transition comes out one off (the switch
    here re-shards the replicated ref in place: local copies only): its checksum catches it, every
    rank rolls back, the record says verified False with the reason, the run goes on in the old layout."""
    from nereus.executor.apply import FaultSpec

    cfg = DemoConfig(steps=4, world=2, budget_mb=15.0, cap_schedule=((0, 8), (2, 200)), warmup_steps=4,
                     prompts=4, samples=2, out_dir=str(tmp_path), timeout_s=300, recompute=False,
                     fault=FaultSpec(rank=1, round=0, kind="corrupt-copy"))
    full, job, cluster, params, plan, _ = prepare(cfg, log=lambda *_: None)
    records = run_policy(cfg, "adaptive", full, job, cluster, params, plan)
    tried = [r for r in records if r.get("transition_s")]
    assert tried, [(r["step"], r.get("decision"), r.get("reason")) for r in records]
    for r in tried:
        assert r["verified"] is False and r["regions_verified"] == 0, r
        assert "checksum mismatch" in r["transition_error"] or "failed to verify" in r["transition_error"], r
    assert len({r["plan"] for r in records}) == 1  # every step ran in the initial layout
    assert [r["step"] for r in records] == [0, 1, 2, 3] and all(r.get("rolled_back") for r in tried)
    s = summarize(records, cfg.budget_mb)
    assert s["transitions"] == len(tried) and s["verified_transitions"] == 0
    # the rollback reached the controller: audited with the executor's reason, and every later
    # decision was taken from the old plan (the controller's plan is the one the run is on)
    audit = [json.loads(line) for line in open(tmp_path / "audit-adaptive.jsonl")]
    rollbacks = [a for a in audit if a["decision"] == "rollback"]
    assert [a["step"] for a in rollbacks] == [r["step"] for r in tried]
    for a, r in zip(rollbacks, tried):
        assert a["reason"] == r["transition_error"] and a["plan"] != a["failed_plan"]
    after = [a for a in audit if a["decision"] != "rollback" and a["step"] > tried[0]["step"]]
    assert all(a["plan"] == rollbacks[0]["plan"] or a["decision"] == "switch" for a in after)


def _rec(step, *, oom, step_s, mean, transition_s=0.0):
    return {"step": step, "oom": oom, "step_s": step_s, "response_len_mean": mean, "sequences": 8, "reward": 1.0,
            "peak_mem_frac": 0.5, "plan": "at:tp1dp2", "transition_s": transition_s}


def test_throughput_counts_completed_steps_only():
    """Tokens of completed steps over the time of completed steps (and transitions): an over-budget
    step adds neither; dividing by all the run's time would give 800 / 110 here, not 800 / 10."""
    records = [_rec(0, oom=False, step_s=4.0, mean=50.0), _rec(1, oom=True, step_s=100.0, mean=60.0),
               _rec(2, oom=False, step_s=5.0, mean=50.0, transition_s=1.0)]
    s = summarize(records, 10.0)
    assert s["completed_tokens"] == 800.0
    assert s["tokens_per_s"] == pytest.approx(800.0 / 10.0)
    assert s["wall_tokens_per_s"] == pytest.approx(800.0 / 110.0)
    assert s["lost_s"] == 100.0 and s["completed_steps"] == 2 and s["infeasible_steps"] == 1


@pytest.mark.dist
def test_every_baseline_runs_beside_adaptive_repeated_with_the_aa_spread_and_factors_off_the_clamp(tmp_path):
    """Every policy twice, interleaved: the JSON has each with throughput on completed steps (median
    over its runs, each run's beside it), static never recomputes while static+recompute may,
    model-hindsight keeps one plan for every run (the A/A control) and the budget reports its
    spread and the comparisons it judged; the online correction factors are reported per
    model-stage, away from the clamp."""
    import statistics

    from nereus.demo.policy import candidates_for
    from nereus.demo.run import run_demo
    from nereus.demo.setup import AA_POLICY, POLICIES

    cfg = DemoConfig(steps=3, world=2, budget_k=2.0, cap_schedule=((0, 32), (1, 96)), warmup_steps=4, prompts=4,
                     samples=2, out_dir=str(tmp_path), timeout_s=300, repeats=2)
    out = run_demo(cfg, log=lambda *_: None)
    run = json.loads((tmp_path / "demo-run.json").read_text())
    b = out["budgets"][0]
    assert set(b["summary"]) == set(POLICIES), b["plans"]
    for policy, runs in run["records"][0]["runs"].items():
        s = b["summary"][policy]
        assert len(runs) == 2 and s["runs"] == 2
        per_run = []
        for recs in runs:
            ok = [r for r in recs if not r["oom"]]
            time_ok = sum(r["step_s"] for r in ok) + sum(r.get("transition_s", 0.0) for r in recs)
            per_run.append(sum(r["response_len_mean"] * r["sequences"] for r in ok) / time_ok)
        assert s["tokens_per_s_runs"] == pytest.approx(per_run)
        assert s["tokens_per_s"] == pytest.approx(statistics.median(per_run))
    assert True in candidates_for("static+recompute").recompute and True not in candidates_for("static").recompute
    assert b["summary"]["static"]["recompute_steps"] == 0
    aa_runs = run["records"][0]["runs"][AA_POLICY]
    assert len({r["plan"] for recs in aa_runs for r in recs}) == 1
    assert not any(r.get("transition_s") for recs in aa_runs for r in recs)
    assert b["plans"][AA_POLICY].startswith(aa_runs[0][0]["plan"])
    assert b["plan_choice"][AA_POLICY]["candidates"]
    assert b["aa_policy"] == AA_POLICY and b["aa_spread"] == pytest.approx(
        b["summary"][AA_POLICY]["tokens_per_s_spread"]) and b["aa_spread"] is not None
    assert {c["vs"] for c in b["comparisons"]} == set(POLICIES) - {"adaptive"}
    for c in b["comparisons"]:
        assert (c["verdict"] == "tie") == (abs(c["diff"]) <= b["aa_spread"])
    lo, hi = out["clamp"]
    for policy in POLICIES:
        factors = b["factors"][policy]
        assert set(factors) == {"actor/generation", "actor/inference", "ref/inference", "actor/training"}
    for ms, f in b["factors"]["adaptive"].items():
        if ms == "actor/generation":
            # this 4-prompt, 3-step config's generation is fixed per-call cost the model lacks: on a clean
            # clone its factor sits at the clamp (3.4-4.0; docs/notes-round.md); the demo's own runs put it
            # at 0.6 (docs/demo.json). Reported, and finite, but not held off the clamp here.
            assert lo <= f["min"] <= f["median"] <= f["max"] <= hi, (ms, f)
            continue
        assert lo < f["median"] < hi and f["at_clamp_steps"] < f["steps"], (ms, f)
