"""Profiles: versioned JSON round trip, shipped profiles, the CPU cluster override, notebook table."""
import json

import pandas as pd
import pytest

from nereus.calibration.fit import mape
from nereus.calibration.profile import SHIPPED, Hardware, Profile, analytic_profile, estimate_table, load_profile
from nereus.errors import SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import GPU_PRESETS


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_and_feed_cost_params(name):
    prof = load_profile(name)
    assert set(prof.fit["heldout_mape"]) == {"microbench", "stages"}
    assert prof.how and prof.when
    from importlib import resources
    path = resources.files("nereus.calibration").joinpath(f"profiles/{name}.json")
    assert CostParams.load(str(path)) == prof.params
    cluster = prof.cluster(nodes=1, gpus_per_node=2)
    assert cluster.gpu.peak_flops == pytest.approx(prof.hardware.tflops_bf16 * 1e12)


def test_cpu_profile_is_measured_and_says_how():
    prof = load_profile("cpu-local")
    assert prof.hardware.name == "cpu" and "cpu" not in GPU_PRESETS
    assert prof.how.startswith("nereus calibrate")
    # held-out MAPE (a fraction) within the README's goals plus a fifth for a re-calibration on a
    # shared machine: microbenchmarks 9.3% measured, goal 10%; stage timings 13.1%, goal 15%
    # (a profile measured under load from other jobs, 2-4x worse, should not ship); recomputed from
    # the held-out table itself, and better than the analytic defaults on the same points
    limit = {"microbench": 0.12, "stages": 0.18}
    for part in ("microbench", "stages"):
        table = prof.fit[part]["heldout_table"]
        assert len(table) >= 20
        measured = [r["measured_s"] for r in table]
        after = mape([r["predicted_s"] for r in table], measured)
        before = mape([r["analytic_s"] for r in table], measured)
        assert prof.fit["heldout_mape"][part] == pytest.approx(after, rel=1e-9)
        assert prof.fit["heldout_mape_before"][part] == pytest.approx(before, rel=1e-9)
        assert 0 < after <= limit[part], (part, after)
        assert after < 0.5 * before, (part, after, before)


def test_round_trip_and_errors(tmp_path):
    prof = analytic_profile("h200")
    p = prof.save(tmp_path / "h200.json")
    assert load_profile(p) == prof
    d = prof.to_dict()
    with pytest.raises(SpecError, match="version 9 not supported"):
        Profile.from_dict({**d, "version": 9})
    with pytest.raises(SpecError, match=r"unknown field\(s\) \['colour'\]"):
        Profile.from_dict({**d, "colour": "red"})
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_profile(bad)
    with pytest.raises(SpecError, match="profile not found"):
        load_profile(tmp_path / "missing.json")


def test_cpu_hardware_builds_a_cluster_without_a_preset():
    hw = Hardware(name="cpu", device="cpu", dtype="float32", memory_gib=8, tflops_bf16=0.083, hbm_tbps=0.03,
                  intra_node_gbps=1.5, inter_node_gbps=1.5, gpus_per_node=2, reserved_gib=0.5)
    c = hw.cluster()
    assert c.num_gpus == 2 and c.gpu.name == "cpu" and c.gpu.hbm_bytes_per_s == pytest.approx(3e10)
    assert Hardware.from_dict(json.loads(json.dumps(hw.to_dict()))) == hw


def test_estimate_table_has_estimate_measured_ratio():
    df = estimate_table("cpu-local")
    assert isinstance(df, pd.DataFrame) and len(df) > 0
    assert {"estimate", "measured", "ratio"} <= set(df.columns)
    assert (df["ratio"] - df["estimate"] / df["measured"]).abs().max() < 1e-12
    assert set(df["part"]) == {"microbench", "stages"}
