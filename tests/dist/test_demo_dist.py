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
