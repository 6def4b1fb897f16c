"""Pure pieces of the demo's one-step-off mode: the rank-0 comparison of the rollout's weights with
the trainer's, the idle shares of a step, the placements a split may start from."""
import pytest
import torch

from nereus.demo.async_plan import rollout_ranks, split_anchors, trainer_ranks
from nereus.demo.async_run import summarize_async
from nereus.demo.async_worker import add_sync, compare_copies
from nereus.errors import SpecError
from nereus.planner.transition.types import Region


def _region(tensor: str, offsets, lengths) -> Region:
    return Region(model="actor", tensor=tensor, kind="param", offsets=tuple(offsets), lengths=tuple(lengths),
                  dtype="fp32")


def _pieces(w: torch.Tensor, rollout: torch.Tensor):
    """Trainer: two row halves on two ranks; rollout: the whole tensor on one rank."""
    return [("trainer", [(_region("w", (0, 0), (2, 3)), w[:2].clone())]),
            ("trainer", [(_region("w", (2, 0), (2, 3)), w[2:].clone())]),
            ("rollout", [(_region("w", (0, 0), (4, 3)), rollout.clone())])]


def test_an_equal_copy_is_bit_exact_and_the_digests_agree():
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7
    out = compare_copies(_pieces(w, w), {"w": (4, 3)})
    assert out["bit_exact"] and not out["mismatches"]
    assert out["rollout_digest"] == out["trainer_digest"]


def test_one_flipped_bit_on_the_rollout_is_caught():
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 7
    bad = w.clone()
    bad.view(-1).view(torch.int32)[5] ^= 1  # the last mantissa bit of one element
    out = compare_copies(_pieces(w, bad), {"w": (4, 3)})
    assert not out["bit_exact"] and out["rollout_digest"] != out["trainer_digest"]
    assert "rollout w@(0, 0) differs" in out["mismatches"][0]


def test_a_tensor_the_rollout_does_not_hold_is_caught():
    w = torch.ones(4, 3)
    pieces = _pieces(w, w)[:2] + [("rollout", [(_region("w", (0, 0), (2, 3)), w[:2].clone())])]
    out = compare_copies(pieces, {"w": (4, 3)})
    assert not out["bit_exact"] and out["mismatches"] == ["rollout does not hold all of w"]


def test_idle_shares_are_each_pools_wait_in_the_overlapped_phase():
    rec = {"overlap_s": 3.0, "handoff_s": 0.5, "rollout_s": 3.0, "train_s": 1.0}
    out = add_sync(rec, {"sync_s": 0.5})
    assert out["step_s"] == pytest.approx(4.0)
    assert out["idle_share"] == pytest.approx({"rollout": 0.0, "trainer": 0.5})
    assert add_sync(rec, None)["sync_s"] == 0.0  # the last step has no sync


@pytest.mark.parametrize("world,rollout", [(4, 1), (4, 2), (3, 1), (2, 1)])
def test_split_anchors_are_disjoint_pools_covering_every_rank(world, rollout):
    plans = split_anchors(world, rollout)
    assert plans
    for p in plans:
        r, t = set(rollout_ranks(p)), set(trainer_ranks(p))
        assert len(r) == rollout and not r & t and r | t == set(range(world))


def test_a_split_without_a_trainer_rank_is_refused():
    with pytest.raises(SpecError, match="1 to world - 1"):
        split_anchors(4, 4)


def test_summary_counts_syncs_transitions_and_staleness():
    sync = {"sync_s": 0.1, "sync_bytes": 1_000_000, "sync_verified": True, "bit_exact": True}
    recs = [{"step": k, "loss": 1.0, "step_s": 1.0, "rollout_s": 0.5, "train_s": 0.8, "staleness": min(k, 1),
             "idle_share": {"rollout": 0.3, "trainer": 0.0}, "sync": sync if k < 2 else None, "rollout_ranks": 1,
             "trainer_ranks": 3, "peak_mem_frac": 0.5, "plan": "a", "response_len_mean": 5.0, "reward": 4.0}
            for k in range(3)]
    recs[0]["first_sync"] = sync
    recs[1].update(transition_s=0.2, resplit=True, verified=True, next_plan="b", transition_bytes=5)
    s = summarize_async(recs)
    assert s["syncs"] == 3 and s["syncs_bit_exact"] == 3 and s["staleness"] == [0, 1]
    assert s["transitions"] == 1 and s["verified_transitions"] == 1 and s["resplits"][0]["to"] == "b"
    assert s["sync_mb_per_s"] == pytest.approx(10.0)


class _Decision:
    def __init__(self, plan):
        self.plan, self.reason = plan, "must switch: out of memory"


class _Controller:
    def __init__(self):
        self.rollbacks = []

    def report_rollback(self, reason, step=None):
        self.rollbacks.append((reason, step))


def test_both_demo_workers_refuse_a_plan_the_executor_cannot_run_and_tell_the_controller():
    """A decision for a ZeRO-3 plan (the executor runs ZeRO 0-2) is refused with the reason, and the
    controller is told it was not applied; a plan it can run passes (``refuse_unexecutable``, used by
    the sync and the one-step-off worker alike)."""
    from dataclasses import replace

    from nereus.demo.worker import refuse_unexecutable
    from nereus.planner.plan import Plan, StagePlacement
    from nereus.planner.specs import ParallelConfig

    ok = Plan(stages=(StagePlacement(name="actor/training", config=ParallelConfig(tp=1, pp=1, dp=2, zero=1),
                                     pool=0, gpus=2, first_gpu=0),))
    z3 = replace(ok, stages=(replace(ok.stages[0], config=replace(ok.stages[0].config, zero=3)),))
    ctl = _Controller()
    assert refuse_unexecutable(_Decision(ok), ctl, {"decision": "switch"}, 7) is None and not ctl.rollbacks
    out = refuse_unexecutable(_Decision(z3), ctl, {"decision": "switch"}, 7)
    assert out["decision"] == "refused" and "ZeRO-3" in out["reason"] and "not applied" in out["reason"]
    assert len(ctl.rollbacks) == 1 and ctl.rollbacks[0][1] == 7 and "ZeRO-3" in ctl.rollbacks[0][0]
