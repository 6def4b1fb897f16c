"""One-GPU checks of the executor's GPU path (run by ``benchmarks/gpu_check.sh``; needs CUDA).

On one rank with NCCL (``launch`` sets ``cuda:0`` before joining): the on-device checksum gives
the same value on the GPU as on the host for the same bytes (it is deterministic, integer-only)
and catches a flipped bit there; the reference transformer's logits, log-probs and a training
step run with every tensor on the GPU (torch's default device set to ``meta``: a tensor made
without ``device=`` would show up as meta, see ``nereus.executor.memory``), and the logits
match the unsharded host reference. Multi-GPU checks (transitions over NCCL, faults, rollback
with abort and rebuild) are ``nereus reshard-check --backend nccl``.

Without a process group: ``--hf-bf16`` (the executor's bf16 forward of tiny Hugging Face
models against transformers' own, on the device) and ``--model-timings`` (prefill, decode and
training-pass times of small HF models at several batch sizes, written as corpus rows whose
source is this check and the GPU's name). Both take ``--device cpu`` (with ``--quick`` for the
timings): the smoke form the tests run here, never a GPU result.

    python benchmarks/gpu_device_check.py --json OUT.json     # exit 1 when a check fails
    python benchmarks/gpu_device_check.py --model-timings --corpus-dir OUT/corpus --json OUT/timings.json
    python benchmarks/gpu_device_check.py --hf-bf16 --device cpu   # the CPU smoke form
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


def _randomized(model):
    """Every parameter random (transformers initialises norms to 1 and biases to 0, which would
    hide a norm or a bias applied wrongly)."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 / p.shape[-1] ** 0.5))
    return model.eval()


HF_BF16_SLACK = 1.5
"""``hf_bf16`` passes when the executor's bf16 logits are within this factor of transformers' own
bf16 error (both against transformers' fp32 forward on the host), plus 1e-3 of the logits' scale."""


def hf_bf16(device: str) -> dict:
    """HF model forward and logits in bf16 on ``device``: per dense architecture of
    ``nereus.executor.hf.arch.TINY`` (built from its config, every weight random, no download),
    the executor's one-rank bf16-mixed forward (state loaded from the model's state dict into a
    store on ``device``) beside transformers' bf16 forward on the same device, both compared
    with transformers' fp32 forward on the host."""
    import torch
    import transformers

    from nereus.executor.engine import Engine
    from nereus.executor.hf.arch import ARCHS, hf_config, spec_of
    from nereus.executor.hf.checkpoint import load_regions
    from nereus.executor.scenario import make_plan
    from nereus.executor.store import ShardStore

    dev = torch.device(device)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    placement = make_plan().home("actor")
    out: dict = {"device": str(dev), "gpu": _device_name(dev), "transformers": transformers.__version__, "archs": {}}
    for arch in ARCHS:
        cfg = hf_config(arch)
        spec = spec_of(cfg)
        hf32 = _randomized(transformers.AutoModelForCausalLM.from_config(cfg))
        state = {k: v for k, v in hf32.state_dict().items() if not (spec.tie_embeddings and k == "lm_head.weight")}
        # built in bf16 (a cast would also round the rotary inv_freq buffer, which transformers keeps fp32)
        hf16 = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        hf16.load_state_dict({k: v.bfloat16() for k, v in hf32.state_dict().items()})
        hf16.to(dev)
        store = ShardStore(dev)
        load_regions(store, spec, "actor", placement, 0, state, precision="bf16-mixed")
        eng = Engine(0, 1, spec, placement, store, precision="bf16-mixed")
        with torch.no_grad():
            ref32 = hf32(ids).logits
            ref16 = hf16(ids.to(dev)).logits
            got = eng.logits(ids.to(dev))
        row = {"logits_on_device": got.device.type == dev.type and ref16.device.type == dev.type,
               "state_on_device": all(t.device.type == dev.type for _, t in store.items()),
               "params_bf16": all(t.dtype == torch.bfloat16 for r, t in store.items() if r.kind == "param")}
        got, ref16 = got.float().cpu(), ref16.float().cpu()
        scale = float(ref32.abs().max())
        row.update(logits_scale=scale, executor_vs_hf_bf16=float((got - ref16).abs().max()),
                   executor_vs_hf_fp32=float((got - ref32).abs().max()),
                   hf_bf16_vs_hf_fp32=float((ref16 - ref32).abs().max()))
        row["ran_in_bf16"] = row["executor_vs_hf_fp32"] > 1e-4
        row["ok"] = bool(row["logits_on_device"] and row["state_on_device"] and row["params_bf16"] and row["ran_in_bf16"]
                         and torch.isfinite(got).all()
                         and row["executor_vs_hf_fp32"] <= HF_BF16_SLACK * row["hf_bf16_vs_hf_fp32"] + 1e-3 * scale)
        out["archs"][arch] = row
    out["passed"] = all(r["ok"] for r in out["archs"].values())
    return out


TIMING_MODELS = {
    # Qwen2.5-0.5B's shape (config.json values), random weights: the corpus's small-run size
    "qwen2-0.5b-shape": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                         "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                         "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                         "tie_word_embeddings": True},
    "llama-8l-1024h": {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
                       "max_position_embeddings": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                       "tie_word_embeddings": False},
}
"""Small Hugging Face models timed by ``model_timings`` on a GPU, built from these configs."""
TIMING_SHAPES = {"batches": (1, 8, 32), "input_len": 512, "decode_prompt": 128, "decode_steps": 32, "train_seq": 512,
                 "train_batches": (1, 4, 8), "repeat": 3}
QUICK_SHAPES = {"batches": (1, 2), "input_len": 16, "decode_prompt": 8, "decode_steps": 4, "train_seq": 16,
                "train_batches": (1, 2), "repeat": 2}
"""``--quick`` (the CPU smoke run): the tiny Llama of ``TINY``, small shapes, the same code path."""


def _device_name(dev) -> str:
    import torch

    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def _hardware(name: str) -> str:
    """The corpus's hardware name for a device name: 'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' ->
    'h100-80gb'; the CPU smoke run is 'cpu'."""
    low = name.lower().replace("nvidia", "").replace("hbm3", "").replace("hbm3e", "").strip()
    return "-".join(low.split()) or "unknown"


def _best_s(fn, dev, repeat: int) -> float:
    """Best of ``repeat`` seconds of ``fn()`` after one warm-up call, the device synchronised."""
    import time

    import torch

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _decode_step_s(model, prompt, steps: int, dev, repeat: int) -> float:
    """Seconds per step of a greedy decode loop on the KV cache the prompt's forward built (that
    forward not timed), best of ``repeat`` after a warm-up. The cache argument is ``cache`` in
    transformers >= 5.2x, ``past_key_values`` before."""
    import inspect
    import time

    import torch

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.no_grad():
        for i in range(repeat + 1):
            out = model(prompt, use_cache=True)
            past, nxt = getattr(out, key), out.logits[:, -1:].argmax(-1)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(nxt, use_cache=True, **{key: past})
                past, nxt = getattr(out, key), out.logits[:, -1:].argmax(-1)
            sync()
            if i:  # the first loop is the warm-up
                best = min(best, (time.perf_counter() - t0) / steps)
    return best


def model_timings(device: str, quick: bool = False) -> dict:
    """Measured prefill, decode and training-pass times of small Hugging Face models (built from
    ``TIMING_MODELS`` configs, random weights, bf16, transformers eager, one device) at several
    batch sizes, as rows in the corpus's columns (``nereus.fidelity.corpus.COLUMNS``): prefill
    ``ttft_ms`` (one forward over the prompt, cache built), decode ``tpot_ms`` (per step of a
    greedy loop on the KV cache), training ``tok_s_per_gpu`` (one forward and backward with the
    LM loss; no optimizer step). Their source is this check, with the device's name; each row is
    held out (``split=heldout``): no fit reads a row until someone adds it to the corpus."""
    import torch
    import transformers

    from nereus.executor.hf.arch import TINY

    dev = torch.device(device)
    name = _device_name(dev)
    shapes = QUICK_SHAPES if quick else TIMING_SHAPES
    models = {"llama-tiny": dict(TINY["llama"])} if quick else TIMING_MODELS
    hardware = _hardware(name)
    source = f"nereus benchmarks/gpu_device_check.py --model-timings on {name} (this check)"
    engine = f"transformers {transformers.__version__} eager; torch {torch.__version__}"
    smoke = "CPU smoke run of the GPU check, not a GPU measurement; " if dev.type != "cuda" else ""
    rows: dict[str, list[dict]] = {"prefill": [], "decode": [], "training": []}
    g = torch.Generator().manual_seed(0)

    def row(category: str, model: str, config: str, metric: str, unit: str, value: float, notes: str) -> None:
        rows[category].append({"id": f"gpuchk-{sum(map(len, rows.values())) + 1:03d}", "source": source,
                               "source_kind": "measured", "hardware": hardware, "gpus": 1 if dev.type == "cuda" else 0,
                               "model": model, "engine": engine, "config": config, "metric": metric, "unit": unit,
                               "value": float(f"{value:.6g}"), "derived": 0, "split": "heldout", "notes": smoke + notes})

    for label, cfg_dict in models.items():
        cfg = transformers.AutoConfig.for_model(**cfg_dict)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(dev).eval()
        vocab = cfg.vocab_size
        for b in shapes["batches"]:
            ids = torch.randint(0, vocab, (b, shapes["input_len"]), generator=g).to(dev)
            with torch.no_grad():
                s = _best_s(lambda: model(ids, use_cache=True), dev, shapes["repeat"])
            row("prefill", label, f"tp=1;pp=1;batch={b};input_len={shapes['input_len']};output_len=1;dtype=bf16",
                "ttft_ms", "ms", s * 1e3, "one forward over the prompt with the KV cache built; best of "
                f"{shapes['repeat']} after a warm-up")
            prompt = torch.randint(0, vocab, (b, shapes["decode_prompt"]), generator=g).to(dev)
            tpot = _decode_step_s(model, prompt, shapes["decode_steps"], dev, shapes["repeat"])
            steps = shapes["decode_steps"]
            row("decode", label, f"tp=1;pp=1;batch={b};input_len={shapes['decode_prompt']};output_len={steps};"
                "dtype=bf16;enforce_eager=1", "tpot_ms", "ms", tpot * 1e3,
                f"greedy decode of {steps} tokens on the KV cache after the prompt's forward (not timed); best of "
                f"{shapes['repeat']} after a warm-up")
        model.train()
        for b in shapes["train_batches"]:
            ids = torch.randint(0, vocab, (b, shapes["train_seq"]), generator=g).to(dev)

            def step():
                model(ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)

            s = _best_s(step, dev, shapes["repeat"])
            row("training", label, f"tp=1;pp=1;dp=1;micro_batch={b};seq_len={shapes['train_seq']};dtype=bf16;"
                "recompute=none;task=sft", "tok_s_per_gpu", "tok/s/gpu", b * shapes["train_seq"] / s,
                f"one forward + backward with the LM loss, bf16 weights, no optimizer step; best of {shapes['repeat']}")
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": str(dev), "gpu": name, "hardware": hardware, "quick": quick, "shapes": shapes,
            "rows": rows, "passed": all(r["value"] > 0 for rs in rows.values() for r in rs) and any(rows.values())}


def write_corpus_rows(rows: dict[str, list[dict]], directory: str) -> list[str]:
    """One CSV per category in the corpus's columns (``nereus.fidelity.corpus.load_corpus`` reads
    the directory); returns the files written."""
    import csv

    from nereus.fidelity.corpus import COLUMNS

    Path(directory).mkdir(parents=True, exist_ok=True)
    written = []
    for category, rs in rows.items():
        path = Path(directory) / f"{category}.csv"
        with path.open("w", newline="", encoding="utf-8") as fh:
            w = csv.DictWriter(fh, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rs)
        written.append(str(path))
    return written


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
    stuck receive: prints "survived" when it is still alive 30 s later, 20 s past the timeout (the
    executor's setting, 0)."""
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
    time.sleep(30)
    print("survived", flush=True)
    os._exit(0)


def watchdog(timeout_s: float = 55.0) -> dict:
    """The watchdog with and without the variable: handling 0 must survive a stuck operation past
    the process-group timeout; 1 tears the process down. The two children run at the same time
    (one process group each, on the same GPU), so the check takes one child's time; their output
    goes to files (a full pipe would block a child that the other one's wait is not reading)."""
    import subprocess
    import tempfile

    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="nereus-wd-") as tmp:
        logs = {h: open(f"{tmp}/child{h}.log", "w+") for h in ("0", "1")}
        children = {h: subprocess.Popen([sys.executable, __file__, "--watchdog-child", h], stdout=logs[h],
                                        stderr=subprocess.STDOUT, text=True) for h in logs}
        for handling, child in children.items():
            try:
                child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                out[f"handling_{handling}"] = {"exit": None, "survived": None}
                continue
            logs[handling].seek(0)
            text = logs[handling].read()
            out[f"handling_{handling}"] = {"exit": child.returncode, "survived": "survived" in text,
                                           "log_tail": text[-400:]}
        for fh in logs.values():
            fh.close()
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
    ap.add_argument("--hf-bf16", action="store_true", help="only the HF bf16 forward and logits check")
    ap.add_argument("--model-timings", action="store_true", help="only the prefill/decode/training-pass timings "
                    "of small HF models, written as corpus rows")
    ap.add_argument("--device", default="cuda", help="device of --hf-bf16 / --model-timings (cpu: the smoke run)")
    ap.add_argument("--quick", action="store_true", help="--model-timings on the tiny Llama and small shapes")
    ap.add_argument("--corpus-dir", metavar="DIR", help="where --model-timings writes its corpus CSVs")
    args = ap.parse_args(argv)
    if args.watchdog_child is not None:
        return _watchdog_child(args.watchdog_child)
    import torch

    if args.hash_speed:
        res = hash_speed(args.hash_speed, tuple(int(x) for x in args.sizes_mib.split(",")))
        res["passed"] = True
        return _report(res, args.json)
    if (args.hf_bf16 or args.model_timings) and args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_device_check: --device {args.device} needs CUDA (torch.cuda.is_available() is False); "
              "--device cpu runs the smoke form", file=sys.stderr)
        return 2
    if args.hf_bf16:
        return _report(hf_bf16(args.device), args.json)
    if args.model_timings:
        res = model_timings(args.device, quick=args.quick)
        if args.corpus_dir:
            res["corpus_files"] = write_corpus_rows(res["rows"], args.corpus_dir)
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
