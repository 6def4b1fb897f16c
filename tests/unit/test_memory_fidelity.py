"""Peak memory against published measurements (issue 32 items 1-3): the corpus's memory category,
the fitted memory coefficients, and the plan reserve derived from the held-out error."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from nereus.fidelity.corpus import load_corpus
from nereus.fidelity.fit import fit_memory_params, memory_reserve_frac
from nereus.fidelity.report import evaluate, fitted_params, summarize
from nereus.models.spec import preset
from nereus.planner.cost.estimates import reserve_bytes
from nereus.planner.cost.memory import MAIN_GRAD_BYTES, model_state_bytes
from nereus.planner.cost.model import estimate
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import BatchSpec, JobSpec, ParallelConfig, SequenceSpec, Workload, load_cluster

ROWS = [r for r in load_corpus() if r.category == "memory"]


def test_memory_rows_split_by_source_with_20_heldout_and_more_fit():
    held = [r for r in ROWS if r.split == "heldout"]
    fit = [r for r in ROWS if r.split == "fit"]
    assert len(held) >= 20 and len(fit) > len(held)
    assert not {r.source for r in held} & {r.source for r in fit}


def test_heldout_memory_goals():
    s = {x["split"]: x for x in summarize(evaluate(ROWS, fitted_params)) if x["category"] == "memory"}["heldout"]
    assert s["predicted"] >= 20
    assert s["within_25pct"] >= 0.8
    assert s["median_abs_error"] <= 0.15


def test_memory_fit_reads_no_heldout_row_and_gives_the_shipped_coefficients():
    base = fitted_params("h100-80gb")
    moved = [replace(r, value=r.value * 3) if r.split == "heldout" else r for r in ROWS]
    a, _ = fit_memory_params(ROWS, base)
    b, _ = fit_memory_params(moved, base)
    assert a == pytest.approx(b, rel=1e-9)
    d = CostParams()
    assert a["mem_fragmentation"] == pytest.approx(d.mem_fragmentation, abs=2e-3)
    assert a["logits_copies_train"] == pytest.approx(d.logits_copies_train, abs=2e-3)
    assert base.mem_fragmentation == d.mem_fragmentation  # the profiles ship the same fit


def test_reserve_is_the_heldout_p90_rounded_up():
    r, rec = memory_reserve_frac(ROWS, fitted_params)
    assert rec["rows"] >= 20 and rec["quantile"] == 0.9
    assert CostParams().mem_reserve_frac == math.ceil(r * 100 - 1e-9) / 100
    assert fitted_params("h100-80gb").mem_reserve_frac == CostParams().mem_reserve_frac


def test_model_states_megatron_fp32_main_grads_fsdp_16_bytes():
    s = model_state_bytes(1e9, 8, 1)
    assert MAIN_GRAD_BYTES == 4
    assert (s["weights"], s["grads"], s["optimizer"]) == (2e9, 4e9, 12e9 / 8)
    assert model_state_bytes(1e9, 8, 2)["grads"] == 4e9 / 8
    assert sum(model_state_bytes(1e9, 8, 3).values()) == pytest.approx(16e9 / 8)


def _train(p, zero=1, pp=1):
    m = preset("llama-3.1-8b")
    job = JobSpec(algorithm="grpo", models=(("actor", m),), batch=BatchSpec(prompts=8, samples_per_prompt=2),
                  sequence=SequenceSpec(prompt_len=512, response_len_mean=512, response_len_max=1024))
    node = load_cluster("examples/cluster-h100-1n.yaml")
    w = Workload(sequences=16, prompt_len=512, response_len_mean=512, response_len_max=1024)
    return estimate(job, node, "actor/training", ParallelConfig(tp=1, pp=pp, dp=8 // pp, zero=zero), w, p)


def test_reserve_is_the_fraction_of_the_peak_and_fragmentation_stays_out_of_plans():
    """The reserve is a fraction of the plan's peak; the allocator's slack (fitted on reserved-memory
    rows) predicts reserved measurements only: a plan's estimate does not change with it."""
    p0 = replace(CostParams(), mem_reserve_frac=0.0, mem_fragmentation=1.0)
    e0 = _train(p0)
    e1 = _train(replace(p0, mem_reserve_frac=0.2))
    assert reserve_bytes(e0) == 0
    assert reserve_bytes(e1) == pytest.approx(0.2 * e0.mem_bytes)
    e2 = _train(replace(p0, mem_fragmentation=1.5))
    assert e2.mem_bytes == e0.mem_bytes and "fragmentation" not in e2.mem_breakdown
    assert e0.mem_breakdown["fsdp_unsharded"] == 0
    assert _train(p0, zero=3).mem_breakdown["fsdp_unsharded"] > 0
