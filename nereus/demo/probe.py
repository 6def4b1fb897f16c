"""Host overheads of the demo's processes, measured on the run's own ``world`` gloo processes
before the initial plan is chosen (``probe_world``).

On CPU processes sharing a few cores, a tiny model's training micro-batch costs mostly a fixed
amount (Python dispatch, autograd bookkeeping, ranks waiting on each other), not FLOPs, and an
optimizer step mostly the per-tensor ZeRO all-gathers. The analytic cost model has no term for
either unless told (``CostParams.micro_batch_overhead_s``, ``optimizer_step_overhead_s``); without
them it predicted training 10-25x too fast and the online correction factors sat at their clamp.

Method, on a DP=world, TP=1, ZeRO-1 actor with the run's batch (the memory meter attached, as in the
run): the same batch trained at micro-batch 1 and at one micro-batch per rank; the difference per
extra micro-batch, divided by 3 (forward + backward = 3 forward passes), is the per-pass overhead.
Log-probs (no autograd) the same way, at micro-batch 1 and one micro-batch per rank: the difference
per extra micro-batch is ``CostParams.infer_pass_overhead_s``; a call on one row of two tokens per
rank, all fixed cost, less that, is ``infer_call_overhead_s`` (gathering the result, the barrier).
The optimizer step is timed on its own; so is a decode step of the batch on these processes (what
``CostParams.decode_step_overhead_s`` is set to: the processes share cores, so one process alone
decodes faster than the world does); a one-float all-reduce over the world gives the latency of
one collective step (``CostParams.allreduce_latency_s``: TP all-reduces in every layer of every
decode step). Each figure is the median of its tries: the run's steps are single tries on the same
shared cores, so a typical figure is what they see. (Before: the fastest try, the
idle machine's figure; inference priced with the training pass's overhead, itself a difference of
two such minima; and the executor ran log-probs in one pass whatever the micro-batch. The CI
machine then measured actor/inference at 4x its prediction or more in every step.)
"""
from __future__ import annotations

import math
import statistics
import time

import torch


def _rank(rank: int, world: int, full: dict, sequences: int, length: int, repeats: int, decode_steps: int = 16) -> dict:
    import torch.distributed as dist

    from nereus.demo.setup import DEMO_MODEL
    from nereus.demo.worker import _fill
    from nereus.executor.engine import Engine
    from nereus.executor.memory import MemoryMeter
    from nereus.executor.optim import AdamW
    from nereus.executor.store import ShardStore
    from nereus.planner.plan import StagePlacement
    from nereus.planner.specs import ParallelConfig

    per_rank = max(1, sequences // world)
    ids = torch.randint(1, DEMO_MODEL.vocab, (per_rank * world, length), generator=torch.Generator().manual_seed(0))
    out: dict[str, list[float]] = {"train_mb1": [], "train_mbn": [], "optimizer": [], "infer_mb1": [], "infer_mbn": []}
    for mb in (1, per_rank):
        place = StagePlacement(name="actor/training", config=ParallelConfig(tp=1, pp=1, dp=world, micro_batch=mb, zero=1),
                               pool=0, first_gpu=0, gpus=world)
        eng = Engine(rank, world, DEMO_MODEL, place, ShardStore(), role="actor", trainable=True, optim=AdamW(lr=0.0))
        _fill(eng, full)
        eng.meter = MemoryMeter(None)
        opt = eng._optimizer_step
        opt_s = [0.0]

        def timed_opt() -> None:
            t0 = time.perf_counter()
            opt()
            opt_s[0] = time.perf_counter() - t0

        eng._optimizer_step = timed_opt
        tag = "mb1" if mb == 1 else "mbn"
        for i in range(repeats + 1):  # the first try warms up
            dist.barrier()
            t0 = time.perf_counter()
            eng.train_step(ids)
            dist.barrier()
            t_train = time.perf_counter() - t0
            if i:
                out[f"train_{tag}"].append(t_train)
                if mb != 1:
                    out["optimizer"].append(opt_s[0])
        for i in range(3 * repeats + 1):  # log-probs in micro-batches of mb (cheap: more tries)
            dist.barrier()
            t0 = time.perf_counter()
            eng.logprobs(ids)
            dist.barrier()
            if i:
                out[f"infer_{tag}"].append(time.perf_counter() - t0)
    stub = ids[:world, :2]  # one row of two tokens per rank: a call that is all fixed cost
    for i in range(3 * repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        eng.logprobs(stub)
        dist.barrier()
        if i:
            out.setdefault("infer_stub", []).append(time.perf_counter() - t0)
    # decode steps of the whole batch on the same processes (prefill included, no early stop)
    prompts = ids[:, :4]
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        eng.generate(prompts, decode_steps, temperature=1.0, seed=i)
        dist.barrier()
        if i:
            out.setdefault("decode_step", []).append((time.perf_counter() - t0) / decode_steps)
    # a tensor-parallel forward (the widest TP that splits the model and the world) of one row per
    # rank, at micro-batch 1 and at one micro-batch: each extra micro-batch adds a pass and its TP
    # collectives (embedding, two per layer, the vocab-parallel head), where a collective's real
    # latency shows
    tp = probe_tp(world)
    if tp is not None:
        place = StagePlacement(name="ref/inference", config=ParallelConfig(tp=tp, pp=1, dp=world // tp, micro_batch=1),
                               pool=0, first_gpu=0, gpus=world)
        tp_eng = Engine(rank, world, DEMO_MODEL, place, ShardStore(), role="ref", trainable=False)
        _fill(tp_eng, full)
        rows = ids[:world]  # tp rows per data-parallel group
        for i in range(2 * repeats + 1):
            for mb in (1, tp):
                dist.barrier()
                t0 = time.perf_counter()
                tp_eng.logprobs(rows, mb)
                dist.barrier()
                if i:
                    out.setdefault(f"tp_infer_mb{'1' if mb == 1 else 'n'}", []).append(time.perf_counter() - t0)
    tiny = torch.zeros(1)
    for i in range(4 * repeats + 1):  # one small all-reduce over the world: a collective's latency
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tiny)
        if i:
            out.setdefault("allreduce", []).append(time.perf_counter() - t0)
    # all-reduces as a TP layer meets them: after a layer's matmul on the rank's rows, without a
    # barrier first, so the ranks arrive as the scheduler lets them (4 processes on 2 cores take
    # turns): one float (latency) and the layer's activations (latency + bytes / link bandwidth)
    x = torch.randn(per_rank * length, DEMO_MODEL.hidden, generator=torch.Generator().manual_seed(1))
    w = torch.randn(DEMO_MODEL.hidden, DEMO_MODEL.ffn, generator=torch.Generator().manual_seed(2))
    for i in range(2 * repeats + 1):
        for kind in ("layer", "layer_allreduce", "layer_allreduce_act"):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(16):
                y = x @ w
                if kind == "layer_allreduce":
                    dist.all_reduce(y[0, :1].clone())
                elif kind == "layer_allreduce_act":
                    dist.all_reduce(y[:, :DEMO_MODEL.hidden].contiguous())
            dist.barrier()
            if i:
                out.setdefault(kind, []).append((time.perf_counter() - t0) / 16)
    out["act_bytes"] = [float(x.numel() * x.element_size())]
    return {k: statistics.median(v) for k, v in out.items() if v} | {"micro_batches": per_rank,
                                                                     "decode_steps": decode_steps}


def tp_collectives(layers: int) -> int:
    """Collectives of one tensor-parallel forward of one micro-batch, as the cost model counts them:
    two per layer (attention and MLP outputs) and ``model.TP_EDGE_COLLECTIVES`` (the vocab-parallel
    embedding's and head's); ``tests/dist/test_tp_collectives_dist.py`` counts the executor's."""
    from nereus.planner.cost.model import TP_EDGE_COLLECTIVES

    return 2 * layers + TP_EDGE_COLLECTIVES


def probe_tp(world: int) -> int | None:
    """The widest TP > 1 that divides the world and splits the demo model (heads, KV heads, FFN,
    vocabulary), or None (3 processes: the model's 4 heads do not split 3 ways)."""
    from nereus.demo.setup import DEMO_MODEL
    from nereus.errors import SpecError
    from nereus.models.inventory import check_tp

    for tp in range(world, 1, -1):
        if world % tp or DEMO_MODEL.vocab % tp:
            continue
        try:
            check_tp(DEMO_MODEL, tp)
        except SpecError:
            continue
        return tp
    return None


def probe_world(full: dict, world: int, sequences: int, length: int, repeats: int = 3, ranks=None) -> dict:
    """Measured host overheads of ``world`` processes: ``micro_batch_overhead_s`` (one forward pass
    of one training micro-batch), ``infer_pass_overhead_s`` (one no-grad forward of one micro-batch
    of log-probs), ``optimizer_step_overhead_s``, ``allreduce_latency_s``, ``link_bytes_per_s``
    (achieved all-reduce bandwidth; None when the activations' all-reduce cost no more than a
    float's), ``decode_step_s`` and the raw timings they come from. On ``ranks`` (an
    ``executor.launch.Ranks`` the runs use after it) when given, else on freshly spawned ones."""
    from nereus.demo.setup import DEMO_MODEL
    from nereus.executor.launch import launch

    layers = DEMO_MODEL.layers
    args = (_rank, world, full, sequences, length, repeats) if ranks is None else (_rank, full, sequences, length, repeats)
    r = (launch if ranks is None else ranks.run)(*args, timeout_s=300.0, everywhere=True)[0]
    n = r["micro_batches"]
    extra = max(1, n - 1)
    train_pass = max(0.0, (r["train_mb1"] - r["train_mbn"]) / extra / 3)
    infer_pass = max(0.0, (r["infer_mb1"] - r["infer_mbn"]) / extra)
    infer_call = max(0.0, r["infer_stub"] - infer_pass)
    steps = 2 * math.ceil(math.log2(world))  # what the cost model's small all-reduce pays (allreduce_s)
    # a collective's latency as a layer meets it (never below the tight loop's), and the bandwidth
    # its bytes see: 2 (n - 1) / n x S over the extra seconds of an S-byte all-reduce (allreduce_s)
    latency = max(r["allreduce"], r["layer_allreduce"] - r["layer"]) / steps
    tp = probe_tp(world)
    if tp is not None:  # and as a TP forward meets them: per extra micro-batch, less the pass's own cost
        per_pass = (r["tp_infer_mb1"] - r["tp_infer_mbn"]) / (tp - 1)
        per_collective = (per_pass - infer_pass) / tp_collectives(layers)
        latency = max(latency, per_collective / (2 * math.ceil(math.log2(tp))))
    extra_s = r["layer_allreduce_act"] - r["layer_allreduce"]
    link = 2 * (world - 1) / world * r["act_bytes"] / extra_s if extra_s > 0 else None
    return {"micro_batch_overhead_s": train_pass, "infer_pass_overhead_s": infer_pass, "infer_call_overhead_s": infer_call,
            "optimizer_step_overhead_s": r["optimizer"], "allreduce_latency_s": latency,
            "link_bytes_per_s": link,
            "decode_step_s": r["decode_step"], "timings": r}
