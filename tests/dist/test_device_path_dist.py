"""The GPU path's discipline, checked on CPU gloo processes (no GPU here):

- every tensor the Engine and the transition create follows the store's device: run with
  torch's default device set to ``meta``, any tensor made without ``device=`` would be a meta
  tensor (``executor.memory.tensors_created_on``); none may appear, and a planted one must;
- the on-device checksum (``store.device_hash``, what CUDA ranks use, forced on CPU with
  ``DEVICE_HASH_ON_CPU``) verifies a real transition bit-exact and catches a bit flipped in
  flight, every rank rolling back to identical checksums.
What this does not check: NCCL itself, the stream ordering, the abort and rebuild of the
communicators (``benchmarks/gpu_check.sh`` runs those on a GPU machine)."""
import pytest
import torch

from nereus.executor.apply import FaultSpec
from nereus.executor.checks import batch
from nereus.executor.launch import launch
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, tiny_job
from nereus.models.spec import ModelSpec
from nereus.planner.transition.build import plan_transition

pytestmark = pytest.mark.dist
JOB = tiny_job(ModelSpec(name="tiny-2l-64h", layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=64,
                         head_dim=16))
A, B = make_plan(tp=2), make_plan(dp=2, zero=1)
TPLAN = plan_transition(JOB, local_cluster(2), A, B, mixed_precision=False, scheduler="greedy")


def _rank(rank, world):
    import nereus.executor.reshard.checksum as store_mod
    from nereus.errors import TransitionError
    from nereus.executor.memory import tensors_created_on
    from nereus.executor.engine import Engine
    from nereus.executor.launch import rank_device
    from nereus.executor.store import ShardStore

    store_mod.DEVICE_HASH_ON_CPU = True  # the GPU path's checksum, on every rank of this run
    device = rank_device()
    ids = batch(JOB.model("actor").vocab, 4, 12, 1).to(device)
    store = ShardStore(device)
    init_store(store, JOB, A, rank, 0)
    eng = Engine(rank, world, JOB.model("actor"), A.home("actor"), store)
    with tensors_created_on("meta") as planted:
        torch.zeros(1)  # the check must see a tensor made without device=
    with tensors_created_on("meta") as rec:
        logits_a = eng.logits(ids)
        report = eng.apply_transition(TPLAN, B.home("actor"), timeout_s=10)
        logits_b = eng.logits(ids)
        sampled = eng.generate(ids[:, :5], 3, temperature=1.0, seed=2)
    bad = mismatches(store, JOB, 0)
    with tensors_created_on("meta") as rec_train:
        loss = eng.train_step(ids)
    # a bit flipped in flight, caught by the on-device checksum: every rank rolls back intact
    store2 = ShardStore(device)
    init_store(store2, JOB, A, rank, 0)
    eng2 = Engine(rank, world, JOB.model("actor"), A.home("actor"), store2)
    before = store2.checksums()
    try:
        eng2.apply_transition(TPLAN, B.home("actor"), timeout_s=10, fault=FaultSpec(rank=1, round=0, kind="corrupt"),
                              staging_bytes=None)
        error = ""
    except TransitionError as e:
        error = str(e)
    return {"planted": dict(planted.devices), "devices": dict(rec.devices), "train_devices": dict(rec_train.devices),
            "meta_ops": sorted(rec.ops_on.get("meta", set()) | rec_train.ops_on.get("meta", set())),
            "mismatches": bad, "logits_diff": float((logits_a - logits_b).abs().max()), "sampled": sampled.shape,
            "loss": loss, "regions_verified": report.regions_verified, "fault_error": error,
            "fault_checksums_equal": store2.checksums() == before}


def test_engine_and_transition_follow_the_store_device_and_the_device_checksum_verifies():
    out = launch(_rank, 2, timeout_s=120)
    for o in out:
        assert o["planted"].get("meta") == 1  # the check sees a tensor made without device=
        assert o["devices"].get("cpu", 0) > 100 and o["train_devices"].get("cpu", 0) > 100
        assert "meta" not in o["devices"] and "meta" not in o["train_devices"], o["meta_ops"]
        assert o["mismatches"] == [] and o["logits_diff"] <= 1e-5 and o["regions_verified"] > 0
        assert o["loss"] is not None and tuple(o["sampled"]) == (4, 8)
        assert "rolled back" in o["fault_error"] and o["fault_checksums_equal"], o["fault_error"]
    assert "checksum mismatch" in out[1]["fault_error"]
