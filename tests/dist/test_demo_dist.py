"""The demo's whole loop on 2 real gloo processes: GRPO steps, the controller deciding on measured
metrics, a transition applied through the executor when the response cap rises past what the
initial layout can hold."""
import json

import pytest

from nereus.demo.run import prepare, run_policy, summarize
from nereus.demo.setup import DemoConfig


@pytest.mark.dist
def test_adaptive_switches_before_the_cap_raise_and_verifies(tmp_path):
    cfg = DemoConfig(steps=4, world=2, budget_mb=15.0, cap_schedule=((0, 8), (2, 96)), warmup_steps=4,
                     prompts=4, samples=2, out_dir=str(tmp_path), timeout_s=300)
    full, job, cluster, params, plan, _ = prepare(cfg, log=lambda *_: None)
    records = run_policy(cfg, "adaptive", full, job, cluster, params, plan)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    switches = [r for r in records if r.get("transition_s")]
    # the cap rises to 96 at step 2: the controller hears of it after step 1 and must move first
    assert switches and switches[0]["step"] <= 1, [(r["step"], r.get("decision"), r.get("reason")) for r in records]
    assert all(r["verified"] for r in switches)
    assert records[-1]["plan"] != records[0]["plan"]
    s = summarize(records, cfg.budget_mb)
    assert s["infeasible_steps"] == 0 and s["peak_mem_frac"] <= 1.0
    # a transition holds the old state until commit: measured, above the state alone, within budget here
    assert all(0 < r["transition_peak_mem_frac"] for r in switches)
    assert s["transition_peak_mem_frac"] == max(r["transition_peak_mem_frac"] for r in switches)
    audit = [json.loads(line) for line in open(tmp_path / "audit-adaptive.jsonl")]
    assert len(audit) == 4 and any(a["decision"] == "switch" for a in audit)


@pytest.mark.dist
def test_a_transition_whose_bytes_fail_verification_rolls_back_and_is_recorded_unverified(tmp_path):
    """The first local copy rank 1 makes in every layout transition comes out one off (the switch
    here re-shards the replicated ref in place: local copies only): its checksum catches it, every
    rank rolls back, the record says verified False with the reason, the run goes on in the old layout."""
    from nereus.executor.apply import FaultSpec

    cfg = DemoConfig(steps=4, world=2, budget_mb=15.0, cap_schedule=((0, 8), (2, 96)), warmup_steps=4,
                     prompts=4, samples=2, out_dir=str(tmp_path), timeout_s=300,
                     fault=FaultSpec(rank=1, round=0, kind="corrupt-copy"))
    full, job, cluster, params, plan, _ = prepare(cfg, log=lambda *_: None)
    records = run_policy(cfg, "adaptive", full, job, cluster, params, plan)
    tried = [r for r in records if r.get("transition_s")]
    assert tried, [(r["step"], r.get("decision"), r.get("reason")) for r in records]
    for r in tried:
        assert r["verified"] is False and r["regions_verified"] == 0, r
        assert "checksum mismatch" in r["transition_error"] or "failed to verify" in r["transition_error"], r
    assert len({r["plan"] for r in records}) == 1  # every step ran in the initial layout
    s = summarize(records, cfg.budget_mb)
    assert s["transitions"] == len(tried) and s["verified_transitions"] == 0
