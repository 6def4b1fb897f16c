"""How the demo turns its probe's measurements into cost parameters (no processes spawned): the
measured decode step is what the model predicts at the probed shape, not that plus the model's own
terms again."""
from dataclasses import replace

import pytest

from nereus.demo.run import _decode_overhead
from nereus.demo.setup import DEMO_MODEL, DemoConfig, demo_cluster, demo_params
from nereus.planner.cost.model import decode_iteration_s


@pytest.mark.parametrize("measured", [0.004, 0.012])
def test_the_probed_decode_step_is_predicted_as_measured(measured):
    cluster = demo_cluster(DemoConfig(), flops=4e10, mem_bw=2e9)
    params = replace(demo_params(3456.0, 9000.0), decode_step_overhead_s=measured)
    host = {"decode_step_s": measured, "timings": {"micro_batches": 8, "decode_steps": 16}}
    got, modelled = _decode_overhead(params, cluster, host, 4)
    assert 0 < modelled < measured
    assert got.decode_step_overhead_s == pytest.approx(measured - modelled, rel=1e-12)
    step = decode_iteration_s(DEMO_MODEL, 1, 1, 8, 4 + 8, cluster, got, engine="static")
    assert step == pytest.approx(measured, rel=1e-9)


def test_a_step_faster_than_the_model_leaves_no_negative_overhead():
    cluster = demo_cluster(DemoConfig(), flops=4e10, mem_bw=1e8)  # a slow memory: the model alone exceeds it
    host = {"decode_step_s": 1e-6, "timings": {"micro_batches": 8, "decode_steps": 16}}
    got, modelled = _decode_overhead(demo_params(3456.0, 9000.0), cluster, host, 4)
    assert modelled > 1e-6 and got.decode_step_overhead_s == 0.0


def test_the_probe_measures_tp_only_where_the_demo_model_splits():
    """``nereus demo --world 3`` is allowed, and the demo model's 4 heads do not split 3 ways: the
    probe's TP forward is skipped there instead of failing the whole demo."""
    from nereus.demo.probe import probe_tp

    assert [probe_tp(w) for w in (2, 3, 4)] == [2, None, 4]
