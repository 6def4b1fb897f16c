"""The ``async`` corpus category: published asynchronous RL runs, held out from every fit, predicted
by the planner's async step (``nereus.fidelity.async_rows``) and reported on their own."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nereus.errors import SpecError
from nereus.fidelity.async_rows import async_plan, composition_check
from nereus.fidelity.report import speedups
from nereus.fidelity.corpus import CATEGORIES, DEFAULT_DIR, fit_rows, load_corpus
from nereus.fidelity.predict import predict
from nereus.fidelity.report import fitted_params, summarize
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import GPU_PRESETS


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def async_rows(corpus):
    return [r for r in corpus if r.category == "async"]


def test_category_exists_and_every_step_row_is_held_out(corpus, async_rows):
    """Every async run is held out; the only async rows a fit may read are weight syncs measured on
    their own (checkpoint-engine benchmarks, ``corpus.FIT_STAGES``), never verl's ablation."""
    assert "async" in CATEGORIES
    assert len(async_rows) >= 50
    fit = [r for r in fit_rows(corpus) if r.category == "async"]
    assert fit and {r.get("stage") for r in fit} == {"weight_sync"}
    assert {r.split for r in async_rows if r.get("stage") != "weight_sync"} == {"heldout"}
    assert {r.split for r in async_rows if r.id.startswith("asyncsync-")} == {"heldout"}
    held_sources = {r.source for r in async_rows if r.split == "heldout"}
    assert not {r.source for r in fit} & held_sources
    # every row names its source and the split it was run with
    for r in async_rows:
        assert r.source.startswith("https://") and r.get("stage")
        assert r.get("stage") == "weight_sync" or (r.num("rollout_gpus") and r.num("train_gpus"))


def test_loader_refuses_an_async_row_in_the_fit_split(tmp_path: Path):
    d = tmp_path / "published"
    d.mkdir()
    text = (DEFAULT_DIR / "async.csv").read_text().splitlines()
    head, first = text[0], text[1]
    assert first.count(",heldout,") == 1
    (d / "async.csv").write_text(head + "\n" + first.replace(",heldout,", ",fit,") + "\n")
    with pytest.raises(SpecError, match="held out from every fit"):
        load_corpus(d)
    shutil.rmtree(d)


def test_reported_as_its_own_category(corpus, async_rows):
    preds = [predict(r, fitted_params) for r in async_rows]
    recs = [s for s in summarize(preds) if s["category"] == "async" and s["split"] == "heldout"]
    assert len(recs) == 1
    assert recs[0]["rows"] == sum(r.split == "heldout" for r in async_rows) and recs[0]["predicted"] >= 7
    assert {"within_2x", "median_error"} <= recs[0].keys()
    # rows the model cannot price carry the reason (MoE, unstated mean response length)
    reasons = {p.reason for p in preds if p.predicted is None}
    assert any("mixture-of-experts" in x for x in reasons) and any("response length" in x for x in reasons)


def test_async_row_is_priced_as_a_two_pool_plan(corpus):
    """A NeMo RL one-step-off row: the step is max(rollout, trainer) + the cross-pool sync, and the
    rollout pool pays no wake-up (it never sleeps)."""
    row = next(r for r in corpus if r.id == "asyncnemo-001")
    gpu = GPU_PRESETS["h100-80gb"]
    t = async_plan(row, gpu, CostParams())
    assert not t.violations
    assert t.step_s == pytest.approx(max(t.rollout_s, t.trainer_s) + t.sync_s)
    assert t.rollout_s == pytest.approx(t.stage_s["actor/generation"])
    assert t.trainer_s == pytest.approx(sum(v for k, v in t.stage_s.items() if k != "actor/generation"))


def test_speedups_pair_each_async_step_with_its_sync_baseline(corpus):
    preds = [predict(r, fitted_params) for r in corpus if r.category == "async"]
    sp = {s.async_id: s for s in speedups(corpus, preds, fitted_params)}
    s = sp["asyncnemo-001"]
    assert s.sync_id == "nemorlperf-001" and s.published == pytest.approx(97.7 / 74.6)
    assert s.predicted is not None and s.predicted > 1  # the model predicts a gain, as published
    assert sp["async1off-001"].published == pytest.approx(749 / 520) and sp["async1off-001"].predicted is None


def test_composition_check_uses_the_step_rule(corpus):
    recs = {c["step_row"]: c for c in composition_check(corpus)}
    c = recs["async1off-001"]  # verl FSDP2 4:12: max(458, 108 + 337) = 458 against the published 520
    assert c["composed_step_s"] == pytest.approx(458) and c["published_step_s"] == 520


def test_moe_weight_sync_rows_are_priced_from_the_preset_with_every_expert(corpus):
    """verl's checkpoint-engine ablation of Qwen3-30B-A3B and 235B-A22B: the sync moves every
    expert's bytes (total parameters, not active), so it is priced from the model's preset; the
    96 : 32 step rows of the same model still say why they are not priced."""
    from nereus.fidelity.async_rows import predict_async
    from nereus.fidelity.catalog import moe_preset
    from nereus.planner.cost.comm import weight_sync_s
    from nereus.planner.specs import ClusterSpec, ParallelConfig

    gpu, p = GPU_PRESETS["h20"], CostParams()
    rows = {r.id: r for r in corpus}
    for rid, name, n in (("asyncsync-003", "qwen3-30b-a3b", 16), ("asyncsync-005", "qwen3-235b-a22b", 64)):
        model = moe_preset(rows[rid].model)
        assert model is not None and model.name == moe_preset(name).name and model.num_params() > 30e9
        want = weight_sync_s(model, ParallelConfig(tp=1, dp=n), ParallelConfig(tp=1, dp=n),
                             ClusterSpec(gpu=gpu, nodes=2 * n // 8, gpus_per_node=8), False, p, method="per_tensor")
        assert rows[rid].get("checkpoint_engine") == "0"  # verl's per-tensor broadcast
        assert predict_async(rows[rid], gpu, p) == pytest.approx(want, rel=1e-12)
    dense = predict_async(rows["asyncsync-001"], gpu, p)
    assert predict_async(rows["asyncsync-003"], gpu, p) > 20 * dense  # 30.5B across nodes vs 7.6B on one node
    pred = predict(rows["asyncmoe-001"], fitted_params)
    assert pred.predicted is None and "mixture-of-experts" in pred.reason
