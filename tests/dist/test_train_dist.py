"""Training continuity: k steps in A, transition, k steps in B against 2k steps that stayed in
A (same processes, same seed, same batches); Adam moments and the step count are carried."""
import pytest
import torch

from nereus.executor.checks import train_run
from nereus.executor.launch import launch
from nereus.executor.scenario import local_cluster, make_plan, tiny_job
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition

pytestmark = pytest.mark.dist
JOB = tiny_job(preset("tiny-4l-128h"))
LOSS_TOL = 1e-5
"""Stated tolerance: |loss_moved - loss_stayed| <= 1e-5 per step (fp32, changed reduction order)."""


def _assemble(states, kind):
    """Full tensors of ``kind`` from every rank's regions (replicas must agree bit for bit)."""
    full = {}
    for st in states:
        for r, t in st.items():
            if r.kind != kind:
                continue
            shape = tuple(o + n for o, n in zip(r.offsets, r.lengths))
            buf = full.setdefault(r.tensor, {})
            key = (tuple(zip(r.offsets, r.lengths)), shape)
            if key in buf:
                assert torch.equal(buf[key], t), f"replicas of {r.tensor}/{kind} disagree"
            buf[key] = t
    return full


def test_tp2pp2_to_dp4_zero1_continues_training():
    a, b = make_plan(tp=2, pp=2, micro_batch=2), make_plan(dp=4, zero=1)
    tplan = plan_transition(JOB, local_cluster(4), a, b, mixed_precision=False, scheduler="greedy")
    k = 2
    out = launch(train_run, 4, JOB, [(a, k), (b, k)], [tplan], 0, timeout_s=200)
    moved, stayed = out[0]["moved"], out[0]["stayed"]
    assert len(moved["losses"]) == len(stayed["losses"]) == 2 * k
    for lm, ls in zip(moved["losses"], stayed["losses"]):
        assert abs(lm - ls) <= LOSS_TOL, (moved["losses"], stayed["losses"])
    assert all(o["moved"]["losses"] == moved["losses"] for o in out), "every rank reports the same loss"
    # the step count is carried (2k), not reset
    assert all(o["moved"]["step"] == 2 * k and o["moved"]["carried"][0]["step_before"] == k for o in out)
    # Adam moments after the transition are exactly those before it, re-laid out
    for kind in ("exp_avg", "exp_avg_sq"):
        before = _assemble([o["moved"]["carried"][0]["before"] for o in out], kind)
        after = _assemble([o["moved"]["carried"][0]["after"] for o in out], kind)
        for name in before:
            full_b = _join(before[name])
            full_a = _join(after[name])
            assert torch.equal(full_b, full_a), f"{name}/{kind} changed in the transition"
            assert full_b.abs().sum() > 0, f"{name}/{kind} is zero: moments were not trained"
    # final params of the two runs agree within the stated tolerance
    pm = _join(_assemble([o["moved"]["final"] for o in out], "param")["layers.1.mlp.up_proj.weight"])
    ps = _join(_assemble([o["stayed"]["final"] for o in out], "param")["layers.1.mlp.up_proj.weight"])
    assert (pm - ps).abs().max() <= 1e-5


def _join(pieces):
    shape = tuple(max(s[d] for _, s in pieces) for d in range(len(next(iter(pieces))[1])))
    full = torch.full(shape, float("nan"))
    for (box, _), t in pieces.items():
        full[tuple(slice(o, o + n) for o, n in box)] = t
    assert not torch.isnan(full).any(), "regions do not cover the tensor"
    return full
