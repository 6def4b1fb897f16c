"""One-GPU checks of the executor's GPU path (run by ``benchmarks/gpu_check.sh``; needs CUDA).

On one rank with NCCL (``launch`` sets ``cuda:0`` before joining): the on-device checksum gives
the same value on the GPU as on the host for the same bytes (it is deterministic, integer-only)
and catches a flipped bit there; the reference transformer's logits, log-probs and a training
step run with every tensor on the GPU (torch's default device set to ``meta``: a tensor made
without ``device=`` would show up as meta, see ``nereus.executor.memory``), and the logits
match the unsharded host reference. Multi-GPU checks (transitions over NCCL, faults, rollback
with abort and rebuild) are ``nereus reshard-check --backend nccl``.

    python benchmarks/gpu_device_check.py --json OUT.json     # exit 1 when a check fails
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank(rank: int, world: int) -> dict:
    import torch

    from nereus.executor.checks import LOGITS_TOL, batch
    from nereus.executor.memory import tensors_created_on
    from nereus.executor.engine import Engine
    from nereus.executor.launch import rank_device
    from nereus.executor.scenario import init_store, make_plan, reference_logits, tiny_job
    from nereus.executor.store import ShardStore, checksum, device_hash
    from nereus.models.spec import preset

    out: dict = {"device": str(rank_device()), "gpu": torch.cuda.get_device_name()}
    dev = rank_device()
    g = torch.Generator().manual_seed(0)
    same = []
    for t in (torch.randn(1000, 37, generator=g), torch.randn(333, generator=g).bfloat16(),
              torch.randint(0, 255, (4097,), dtype=torch.uint8, generator=g), torch.randn(4096, 1024, generator=g)):
        same.append(int(device_hash(t)) == int(device_hash(t.to(dev))) == checksum(t.to(dev)))
    flipped = torch.randn(1 << 20, generator=g).to(dev)
    h0 = checksum(flipped)
    flipped.view(torch.int32)[12345] ^= 1 << 7
    out["hash_same_on_host_and_gpu"] = all(same)
    out["hash_catches_a_flipped_bit_on_gpu"] = checksum(flipped) != h0
    job = tiny_job(preset("tiny-4l-128h"))
    plan = make_plan()
    store = ShardStore(dev)
    init_store(store, job, plan, rank, 0)
    eng = Engine(rank, world, job.model("actor"), plan.home("actor"), store)
    ids = batch(job.model("actor").vocab, 4, 12, 1).to(dev)
    with tensors_created_on("meta") as rec:
        logits = eng.logits(ids)
        eng.logprobs(ids)
        loss = eng.train_step(ids)
    ref = reference_logits(job, 0, ids.cpu())
    out["logits_max_diff_vs_host_reference"] = float((logits.cpu() - ref).abs().max())
    out["logits_ok"] = out["logits_max_diff_vs_host_reference"] <= 10 * LOGITS_TOL  # TF32/cuBLAS order
    out["loss"] = loss
    out["tensor_devices"] = dict(rec.devices)
    out["no_default_device_tensors"] = "meta" not in rec.devices and rec.devices.get("cuda", 0) > 0
    out["state_on_gpu"] = all(t.device == dev for _, t in store.items())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_device_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from nereus.executor.launch import launch

    res = launch(_rank, 1, backend="nccl", timeout_s=600)[0]
    checks = ("hash_same_on_host_and_gpu", "hash_catches_a_flipped_bit_on_gpu", "logits_ok",
              "no_default_device_tensors", "state_on_gpu")
    res["passed"] = all(res[k] for k in checks)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
