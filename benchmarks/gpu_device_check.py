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


def hash_speed(device: str, sizes_mib: tuple[int, ...], repeat: int = 3) -> dict:
    """``device_hash`` throughput (GB/s, best of ``repeat``) and the memory it took beside the
    piece, per piece size, on ``device`` (``cpu`` too: the same torch ops). On CUDA the peak is
    ``max_memory_allocated`` above the piece; on the host it is the bound the chunking enforces
    (``device_hash_workspace_bytes``, measured in tests/unit/test_nccl_path.py)."""
    import time

    import torch

    from nereus.executor.reshard.checksum import DEVICE_HASH_CHUNK_BYTES, device_hash, device_hash_workspace_bytes

    rows = []
    for mib in sizes_mib:
        t = torch.randn(mib << 18, device=device)  # fp32: MiB x 2^18 elements
        best, extra = float("inf"), None
        for _ in range(repeat):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            int(device_hash(t))
            best = min(best, time.perf_counter() - t0)
            if device.startswith("cuda"):
                extra = torch.cuda.max_memory_allocated() - base
        rows.append({"piece_mib": mib, "seconds": round(best, 6), "gb_per_s": round(t.nbytes / best / 1e9, 3),
                     "extra_bytes": extra, "bound_bytes": device_hash_workspace_bytes()})
        del t
    return {"device": device, "chunk_bytes": DEVICE_HASH_CHUNK_BYTES, "rows": rows}


def _nccl_single(rank: int, world: int) -> dict:
    """One rank on NCCL: a self send/receive; a receive nobody sends to, polled against a
    deadline, then the communicators aborted and the group rebuilt; a self send/receive on the
    rebuilt group."""
    import time

    import torch
    import torch.distributed as dist

    from nereus.executor.parallel import abort_and_rebuild

    dev = torch.device("cuda", torch.cuda.current_device())

    def self_exchange() -> bool:
        a, b = torch.arange(1 << 20, device=dev, dtype=torch.float32), torch.empty(1 << 20, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 0), dist.P2POp(dist.irecv, b, 0)])
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return bool(torch.equal(a, b))

    out = {"self_send_recv": self_exchange()}
    stuck = dist.irecv(torch.empty(16, device=dev), 0)  # no matching send: never completes
    t0 = time.monotonic()
    while not stuck.is_completed() and time.monotonic() - t0 < 3.0:
        time.sleep(0.01)
    out["stuck_op_pending_after_3_s"] = not stuck.is_completed()
    t1 = time.monotonic()
    out["rebuilt"] = abort_and_rebuild(True, 10.0)
    out["abort_rebuild_s"] = round(time.monotonic() - t1, 3)
    out["self_send_recv_after_rebuild"] = self_exchange()
    return out


def _watchdog_child(handling: str) -> int:
    """A child with TORCH_NCCL_ASYNC_ERROR_HANDLING=handling, a 10 s process-group timeout and one
    stuck receive: prints "survived" when it is still alive 40 s later (the executor's setting, 0)."""
    import os
    import time

    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = handling
    import tempfile
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    path = tempfile.mktemp(prefix="nereus-wd-")
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1,
                            timeout=timedelta(seconds=10), device_id=torch.device("cuda", 0))
    dist.irecv(torch.empty(16, device="cuda"), 0)
    time.sleep(40)
    print("survived", flush=True)
    os._exit(0)


def watchdog(timeout_s: float = 80.0) -> dict:
    """The watchdog with and without the variable: handling 0 must survive a stuck operation past
    the process-group timeout; the default (3) / 1 tears the process down."""
    import subprocess

    out = {}
    for handling in ("0", "1"):
        try:
            r = subprocess.run([sys.executable, __file__, "--watchdog-child", handling], capture_output=True,
                               text=True, timeout=timeout_s)
            out[f"handling_{handling}"] = {"exit": r.returncode, "survived": "survived" in r.stdout}
        except subprocess.TimeoutExpired:
            out[f"handling_{handling}"] = {"exit": None, "survived": None}
    out["ok"] = bool(out["handling_0"]["survived"]) and not out["handling_1"]["survived"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--hash-speed", metavar="DEVICE", help="only device_hash throughput and memory on DEVICE (cpu ok)")
    ap.add_argument("--sizes-mib", default="64,256,1024", help="piece sizes for --hash-speed (MiB)")
    ap.add_argument("--nccl-single", action="store_true", help="only the one-rank NCCL checks (self send/recv, "
                    "stuck op then abort and rebuild)")
    ap.add_argument("--watchdog", action="store_true", help="only the watchdog check (two child processes)")
    ap.add_argument("--watchdog-child", metavar="HANDLING", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.watchdog_child is not None:
        return _watchdog_child(args.watchdog_child)
    import torch

    if args.hash_speed:
        res = hash_speed(args.hash_speed, tuple(int(x) for x in args.sizes_mib.split(",")))
        res["passed"] = True
        return _report(res, args.json)
    if not torch.cuda.is_available():
        print("gpu_device_check: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from nereus.executor.launch import launch

    if args.nccl_single:
        res = launch(_nccl_single, 1, backend="nccl", timeout_s=120)[0]
        res["passed"] = res["self_send_recv"] and res["stuck_op_pending_after_3_s"] and res["rebuilt"] \
            and res["self_send_recv_after_rebuild"]
        return _report(res, args.json)
    if args.watchdog:
        res = watchdog()
        res["passed"] = res["ok"]
        return _report(res, args.json)
    res = launch(_rank, 1, backend="nccl", timeout_s=600)[0]
    checks = ("hash_same_on_host_and_gpu", "hash_catches_a_flipped_bit_on_gpu", "logits_ok",
              "no_default_device_tensors", "state_on_gpu")
    res["passed"] = all(res[k] for k in checks)
    return _report(res, args.json)


def _report(res: dict, path: str | None) -> int:
    print(json.dumps(res, indent=2))
    if path:
        Path(path).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
