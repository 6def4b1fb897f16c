"""verl's single-controller data path, measured: the time of one ``Dispatch.DP_COMPUTE_PROTO`` call of
verl's own ``RayWorkerGroup`` as a function of the bytes it moves.

Every verl worker call of an RL step (generate_sequences, compute_log_prob, compute_ref_log_prob,
compute_values, update_actor, update_critic) goes through the driver process: the driver splits the
step's ``DataProto`` into one chunk per worker, Ray serialises each chunk (DataProto's ``__getstate__``)
into its object store, every worker deserialises its chunk, runs, and serialises its result, which the
driver gets, deserialises and concatenates. None of that is GPU work, so the cost model's FLOP and
byte counts miss it (``CostParams.controller_gbps`` / ``controller_call_s``, ``controller_transfer_s``).

This script runs that path for real: verl 0.9.1's ``RayWorkerGroup`` with ``RayResourcePool(use_gpu=
False)``, workers whose method does no work beyond building a result of the size a log-prob call
returns (one fp32 value per response token), and a DataProto holding the int64 tensors verl's batch
holds at that point (prompts, responses, input_ids, attention_mask, position_ids, every sequence
padded to ``max_prompt_length + max_response_length``). It times ``wg.method(batch)`` from the driver
for batches of 1 MB to 220 MB (one warm-up call per size, then the sizes in turn, ``--reps`` rounds), then fits
``time = call_s + bytes / rate`` over every timed call (bytes: sent plus returned) by Theil-Sen
(the median of the slopes between calls of different sizes, then the median intercept, kept >= 0),
which the calls a shared machine slows down do not pull. The
fitted line is what ``CostParams`` holds. Measured on the CPU of the machine that runs it: a
server's faster cores move bytes faster, a loaded machine slower (the figure is host-bound).

Needs ray, tensordict and verl (not in Nereus's own requirements):

    python3.11 -m venv /tmp/rayv && /tmp/rayv/bin/pip install torch==2.13.0 ray tensordict omegaconf transformers
    /tmp/rayv/bin/pip install --no-deps verl==0.9.1
    /tmp/rayv/bin/python benchmarks/verl_dispatch.py --json benchmarks/results/verl_dispatch.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time

CASES = ((16, 512, 1024), (64, 512, 1024), (256, 512, 1024), (512, 512, 1024), (1024, 512, 1024), (2048, 512, 1024),
         (2048, 1024, 2048), (4096, 512, 1024))
"""(sequences, prompt cap, response cap) per call."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2: this machine has 2 cores)")
    ap.add_argument("--reps", type=int, default=27, help="timed calls per size, sizes interleaved (default 27)")
    ap.add_argument("--json", metavar="OUT", help="write the measurements and the fitted line as JSON")
    args = ap.parse_args()
    try:
        import ray
        import torch
        from verl import DataProto
        from verl.single_controller.base import Worker
        from verl.single_controller.base.decorator import Dispatch, register
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    except ImportError as e:
        print(f"error: {e}: this benchmark needs ray, tensordict and verl 0.9.1 (see the docstring)", file=sys.stderr)
        return 2
    import importlib.metadata as md

    @ray.remote
    class LogProbWorker(Worker):
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def compute_log_prob(self, data: DataProto) -> DataProto:
            b, r = data.batch["responses"].shape
            return DataProto.from_dict(tensors={"old_log_probs": torch.zeros(b, r, dtype=torch.float32)})

    ray.init(num_cpus=args.workers + 2, include_dashboard=False, log_to_driver=False)
    pool = RayResourcePool(process_on_nodes=[args.workers], use_gpu=False, max_colocate_count=1)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=LogProbWorker))
    batches = []
    for n, p_cap, r_cap in CASES:
        width = p_cap + r_cap
        batch = DataProto.from_dict(tensors={
            "prompts": torch.randint(0, 150_000, (n, p_cap)), "responses": torch.randint(0, 150_000, (n, r_cap)),
            "input_ids": torch.randint(0, 150_000, (n, width)), "attention_mask": torch.ones(n, width, dtype=torch.long),
            "position_ids": torch.arange(width).repeat(n, 1)})
        out = wg.compute_log_prob(batch)  # warm-up
        assert tuple(out.batch["old_log_probs"].shape) == (n, r_cap)
        batches.append(batch)
    times: list[list[float]] = [[] for _ in CASES]
    for _ in range(args.reps):  # sizes interleaved, so a slow spell of the machine hits every size
        for i, batch in enumerate(batches):
            t0 = time.perf_counter()
            wg.compute_log_prob(batch)
            times[i].append(time.perf_counter() - t0)
    rows = []
    for (n, p_cap, r_cap), batch, ts in zip(CASES, batches, times):
        sent = sum(t.numel() * t.element_size() for t in batch.batch.values())
        returned = n * r_cap * 4
        rows.append({"sequences": n, "prompt_cap": p_cap, "response_cap": r_cap, "sent_bytes": sent,
                     "returned_bytes": returned, "times_s": ts, "median_s": statistics.median(ts)})
        print(f"{n:5d} x {p_cap + r_cap:5d} tokens  {(sent + returned) / 1e6:7.1f} MB  median {rows[-1]['median_s']:.3f} s"
              f"  ({(sent + returned) / 1e9 / rows[-1]['median_s']:.3f} GB/s)", flush=True)
    ray.shutdown()
    pts = [(r["sent_bytes"] + r["returned_bytes"], t) for r in rows for t in r["times_s"]]
    # Theil-Sen: the median of the slopes between every two calls of different sizes, then the
    # median intercept (kept >= 0): robust to the calls a shared machine slows down
    slope = statistics.median((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(pts, 2)
                              if x2 != x1)
    call_s = max(0.0, statistics.median(y - slope * x for x, y in pts))
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    fit = {"rate_gbps": 1 / slope / 1e9, "call_s": call_s,
           "median_abs_rel_residual": statistics.median(abs(call_s + slope * x - y) / y for x, y in zip(xs, ys))}
    print(f"fit: time = {call_s:.4f} s + bytes / {fit['rate_gbps']:.3f} GB/s "
          f"(median residual {100 * fit['median_abs_rel_residual']:.0f}%)")
    if args.json:
        out = {"what": "verl 0.9.1 RayWorkerGroup DP_COMPUTE_PROTO call time vs bytes moved (sent + returned)",
               "command": "benchmarks/verl_dispatch.py", "workers": args.workers, "reps": args.reps,
               "host": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version()},
               "versions": {k: md.version(k) for k in ("verl", "ray", "tensordict", "torch")},
               "rows": rows, "fit": fit}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
