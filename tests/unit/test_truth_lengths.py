"""The ground truth's response lengths (issue 29 item 6): a gamma body and the truncation spike at the
cap, fitted to published rows (docs/research/response_lengths.csv), not the planner's log-normal."""
import csv
import pathlib

import numpy as np
import pytest

from nereus.planner.cost.lengths import response_quantiles
from nereus.simulator.truth import lengths as L

CSV = pathlib.Path(__file__).resolve().parents[2] / "docs" / "research" / "response_lengths.csv"
NAN = np.nan


def _rows():
    with open(CSV, newline="") as fh:
        return {r["id"]: r for r in csv.DictReader(fh)}


def _sample(mean, cap, steps=8, prompts=512, samples=16, seed=1, p90=NAN):
    s = L.LengthSampler(prompts, samples, seed=seed)
    n = len(steps) if hasattr(steps, "__len__") else steps
    st = np.asarray(steps) if hasattr(steps, "__len__") else np.arange(steps)
    return s.sample(st, np.full(n, float(mean)), np.full(n, p90), np.full(n, float(cap)))


def test_fit_rows_are_csv_rows_with_their_sources():
    rows = _rows()
    assert len(rows) >= 20 and all(r["source"] for r in rows.values())
    for ids, kind, length, cap, clip in L.FIT_ROWS:
        pair = sorted((rows[i] for i in ids.split("+")), key=lambda r: r["metric"] != "clip_ratio")
        c, x = pair  # the clip-share row and the length row
        assert c["split"] == x["split"] == "fit" and c["metric"] == "clip_ratio"
        assert x["metric"] == f"response_len_{kind}"
        assert float(c["value"]) == clip and float(x["value"]) == pytest.approx(length)
        assert f"cap={int(cap)}" in c["config"]
    fitted = {i for ids, *_ in L.FIT_ROWS for i in ids.split("+")}
    assert fitted == {i for i, r in rows.items() if r["split"] == "fit"}  # every fit row is used


def test_constants_are_the_least_squares_fit_of_the_rows():
    def sse(k1, beta):
        return sum((L.predicted_clip(kind, x, cap, k1, beta) - c) ** 2 for _, kind, x, cap, c in L.FIT_ROWS)

    best = sse(L.K_AT_1000, L.BETA)
    assert best == pytest.approx(0.0067, abs=1e-4)
    for dk, db in ((1.02, 0), (0.98, 0), (1, 0.02), (1, -0.02)):
        assert sse(L.K_AT_1000 * dk, L.BETA + db) > best


@pytest.mark.parametrize("mean,cap", [(1000, 32768), (3500, 8192), (5500, 8192), (7000, 8192), (230, 256)])
def test_sampler_hits_the_requested_mean(mean, cap):
    x = _sample(mean, cap, steps=16)
    assert x.min() >= 1 and x.max() <= cap
    assert x.mean() == pytest.approx(mean, rel=0.02)


@pytest.mark.parametrize("mean,cap", [(3500, 8192), (5500, 8192), (6000, 8192), (1000, 32768), (230, 256)])
def test_spike_at_the_cap_has_the_mass_the_fit_says(mean, cap):
    x = _sample(mean, cap, steps=16)
    want = float(L.spike_mass(np.array([float(mean)]), np.array([float(cap)]))[0])
    assert (x == cap).mean() == pytest.approx(want, abs=0.01)


def test_spike_follows_the_published_clip_ratio():
    # DeepScaleR's 8k stage: 4.2% clipped at mean 3,500 (rlen-001/002); verl#2060: none at mean/cap 0.28
    assert 0.03 < L.spike_mass(np.array([3500.0]), np.array([8192.0]))[0] < 0.08
    assert L.spike_mass(np.array([288.698]), np.array([1024.0]))[0] < 1e-3
    m = np.linspace(500, 8000, 40)
    sp = L.spike_mass(m, np.full_like(m, 8192.0))
    assert (np.diff(sp) > 0).all()  # a mean nearer the cap truncates more


def test_not_the_planner_lognormal():
    """Would fail if the truth sampled the planner's formula: at DeepScaleR's 5,500 of 8,192 the
    planner's clipped log-normal cuts 12% of responses, the fitted spike 31%; its short end (p10)
    sits at 0.61 of the mean, the gamma body's at 0.34."""
    mean, cap = 5500.0, 8192
    planner = np.array(response_quantiles(mean, None, cap, 256))
    x = _sample(mean, cap, steps=8).ravel()
    assert (x == cap).mean() - (planner >= cap).mean() > 0.1
    assert np.percentile(planner, 10) / mean - np.percentile(x, 10) / mean > 0.15
    # far from the cap too (R1-Zero's 1,000 of 32,768): a narrower body than the planner's default p90
    planner = np.array(response_quantiles(1000.0, None, 32768, 256))
    x = _sample(1000, 32768, steps=8).ravel()
    assert np.percentile(planner, 90) / 1000 - np.percentile(x, 90) / 1000 > 0.1


def test_reproducible_by_seed_and_step():
    a, b = _sample(3500, 8192, steps=[3, 4], seed=5), _sample(3500, 8192, steps=[3, 4], seed=5)
    assert (a == b).all() and not (a[0] == a[1]).all()
    assert not (a == _sample(3500, 8192, steps=[3, 4], seed=6)).all()
    assert (_sample(3500, 8192, steps=[4], seed=5)[0] == a[1]).all()  # a step's lengths do not depend on the block


def test_a_prompts_samples_share_a_factor():
    x = _sample(2000, 32768, steps=4, prompts=256, samples=8).astype(float)
    per_prompt = x.reshape(4, 256, 8)
    between = per_prompt.mean(axis=2).var()
    within = per_prompt.var(axis=2).mean()
    rho = (between - within / 7) / (between - within / 7 + within)  # one-way ANOVA intraclass correlation
    assert rho == pytest.approx(L.PROMPT_CORRELATION, abs=0.1)


def test_p90_in_the_trace_sets_the_body_shape():
    x = _sample(1000, 32768, steps=8, p90=2200.0).ravel()
    assert np.percentile(x, 90) / 1000 == pytest.approx(2.2, rel=0.05)
    assert x.mean() == pytest.approx(1000, rel=0.02)
