"""Generation's per-response host cost: a term of its own, n x gen_response_host_s per replica,
its constant read off the fit split's host rows (never an RL row)."""
from dataclasses import replace

import pytest

from nereus.fidelity.corpus import load_corpus
from nereus.fidelity.fit import layer_host_s
from nereus.fidelity.predict import HOST_LAYER_METRICS, predict
from nereus.planner.cost.params import CostParams


def test_constant_is_the_fit_split_median():
    rows = load_corpus()
    s, ids = layer_host_s(rows, "host_ms_per_response")
    assert CostParams().gen_response_host_s == pytest.approx(s)
    assert ids and all(r.split == "fit" and r.category == "host" for r in rows if r.id in ids)
    assert HOST_LAYER_METRICS["host_ms_per_response"] == "gen_response_host_s"


def test_host_row_predicted_from_the_field():
    row = next(r for r in load_corpus() if r.metric == "host_ms_per_response")
    p = predict(row, lambda _: CostParams())
    assert p.predicted == pytest.approx(CostParams().gen_response_host_s * 1e3)


def _gen(p):
    from nereus.fidelity.catalog import resolve_gpu
    from nereus.fidelity.predict import _model, _replica_cluster, rl_job
    from nereus.planner.cost.model import estimate
    from nereus.planner.specs import ParallelConfig

    row = next(r for r in load_corpus() if r.id == "playverl-017")
    gpu, _ = resolve_gpu(row.hardware)
    model, gpu = _model(row, gpu)
    job, w = rl_job(row, model)
    return estimate(job, _replica_cluster(gpu, 8), "actor/generation", ParallelConfig(tp=1, dp=8), w, p), w


def test_generation_pays_n_responses_per_replica():
    base = CostParams()
    e, w = _gen(base)
    n = w.sequences / 8
    assert e.time_breakdown["response_host"] == pytest.approx(n * base.gen_response_host_s)
    e0, _ = _gen(replace(base, gen_response_host_s=0.0))
    e2, _ = _gen(replace(base, gen_response_host_s=2 * base.gen_response_host_s))
    assert e.time_s - e0.time_s == pytest.approx(n * base.gen_response_host_s, rel=1e-6)
    assert e2.time_s - e.time_s == pytest.approx(n * base.gen_response_host_s, rel=1e-6)
