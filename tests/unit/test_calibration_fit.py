"""Fitting recovers known parameters from synthetic data generated with them (within 2%)."""
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from nereus.calibration.fit import (FitError, fit_alpha_beta, fit_positive, fit_saturating, heldout_mask, mape,
                                    ring_coeffs)
from nereus.calibration.profile import Hardware
from nereus.calibration.stages import StageConfig, fit_stage_params, predict
from nereus.planner.cost.params import CostParams


def close(a, b, tol=0.02):
    return abs(a - b) <= tol * abs(b)


def test_saturating_curve_recovers_peak_and_half_with_noise():
    rng = np.random.default_rng(0)
    peak, half = 7.7e10, 3.1e5
    x = np.geomspace(1e4, 1e10, 24)
    t = (x + half) / peak * (1 + rng.normal(0, 0.003, x.size))
    fit = fit_saturating(x, t)
    assert close(fit.peak, peak) and close(fit.half, half)
    assert fit.fit_mape < 0.01


def test_saturating_curve_robust_to_one_disturbed_point():
    peak, half = 2.0e10, 1.0e6
    x = np.geomspace(1e5, 1e9, 16)
    t = (x + half) / peak
    t[7] *= 3.0  # a neighbour's burst of load
    fit = fit_saturating(x, t)
    assert close(fit.peak, peak) and close(fit.half, half)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "p2p"])
def test_alpha_beta_recovers_latency_and_bandwidth_over_mixed_worlds(op):
    alpha, bw = 35e-6, 4.2e9
    sizes = np.geomspace(1e3, 6.4e7, 12)
    rows = []
    for n in (2, 4):
        ca, cb = ring_coeffs(op, n)
        rows += [{"world": n, "bytes": s, "seconds": ca * alpha + cb * s / bw} for s in sizes]
    fit = fit_alpha_beta(pd.DataFrame(rows), op)
    assert close(fit.alpha_s, alpha) and close(fit.bandwidth, bw)


def test_stage_factors_and_decode_overhead_recovered_through_the_cost_model():
    hw = Hardware(name="cpu", device="cpu", dtype="float32", memory_gib=8, tflops_bf16=0.08, hbm_tbps=0.025,
                  intra_node_gbps=2.0, inter_node_gbps=2.0, gpus_per_node=2, reserved_gib=0.5)
    base = CostParams(mfu_train=0.9, mfu_prefill=0.9, mfu_decode=0.9, matmul_half_flops=2e5)
    truth = base.with_stage_factors(generation=1.3, inference=1.7, training=2.2)
    truth = replace(truth, decode_step_overhead_s=4e-3)
    cfgs = [StageConfig(stage=s, dp=dp, batch=b, micro_batch=mb, prompt_len=p, response_len=r)
            for s in ("generation", "inference", "training") for dp in (1, 2)
            for b, mb, p, r in ((4, 2, 16, 16), (8, 4, 32, 32), (16, 8, 16, 64), (8, 8, 64, 16))]
    rows = pd.DataFrame([{**{k: getattr(c, k) for k in ("stage", "tp", "pp", "dp", "batch", "micro_batch",
                                                        "prompt_len", "response_len")},
                          "seconds": predict(c, truth, hw)} for c in cfgs])
    fitted, info = fit_stage_params(rows, base, hw)
    got = dict(fitted.stage_factor)
    assert close(got["inference"], 1.7) and close(got["training"], 2.2)
    # generation: factor and per-step overhead are both identifiable here (compute is not negligible)
    assert close(got["generation"], 1.3) and close(fitted.decode_step_overhead_s, 4e-3)
    assert info["fit_mape"] < 1e-3


def test_fit_positive_needs_enough_points_and_names_numbers():
    with pytest.raises(FitError, match=r"needs >= 2 measurements, got 1"):
        fit_positive(("a", "b"), (1.0, 1.0), lambda v: np.array([v["a"]]), [1.0])
    with pytest.raises(FitError, match="2 distinct sizes"):
        fit_saturating([5.0, 5.0], [1.0, 1.0])


def test_heldout_mask_interpolates_and_mape_is_a_fraction():
    sizes = [8, 1, 4, 2, 64, 16, 32]
    m = heldout_mask(sizes)
    held = sorted(np.asarray(sizes)[m])
    assert 1 not in held and 64 not in held and held == [2, 16]
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(0.1)


def test_microbench_pipeline_recovers_cost_params_from_synthetic_tables():
    """Tables generated from known curves -> fitted CostParams predict held-out rows exactly."""
    from nereus.calibration.fit import ring_coeffs
    from nereus.calibration.pipeline import calibrate_microbench

    peak, half, bw_copy = 6.0e10, 2.5e5, 2.4e10
    alpha_ar, alpha_p2p, bw_link = 2.0e-4, 6.0e-5, 1.5e9
    dims = (64, 128, 256, 512, 1024)
    mm = pd.DataFrame([{"kind": "matmul", "dtype": "float32", "m": m, "n": n, "k": n, "flops": 2.0 * m * n * n,
                        "seconds": (2.0 * m * n * n + half) / peak} for m in dims for n in dims[1::2]])
    sizes = [2.0**e for e in range(25, 30)]
    cp = pd.DataFrame([{"kind": "copy", "bytes": s, "moved_bytes": 2 * s, "seconds": 2 * s / bw_copy} for s in sizes])
    rows = []
    for op in ("p2p", "all_reduce", "all_gather"):
        for s in (4.0**e for e in range(5, 12)):
            ca, cb = ring_coeffs(op, 2)
            a = alpha_p2p if op == "p2p" else alpha_ar
            rows.append({"kind": op, "world": 2, "bytes": s, "seconds": ca * a + cb * s / bw_link})
    res = calibrate_microbench({"matmul": mm, "copy": cp, "comm": pd.DataFrame(rows)}, "cpu", 2)
    p, hw = res["params"], res["hardware"]
    assert close(p.matmul_half_flops, half)
    assert close(hw.hbm_tbps * 1e12 * p.hbm_eff, bw_copy)
    assert close(hw.intra_node_gbps * 1e9 * p.intra_link_eff, bw_link)
    assert close(p.allreduce_latency_s, alpha_ar) and close(p.p2p_latency_s, alpha_p2p)
    assert res["summary"]["mape_after"] < 0.02 and res["summary"]["points"] >= 10
