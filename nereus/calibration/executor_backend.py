"""Stage timing on the executor's parallel reference transformer (``nereus.executor.engine``):
real Megatron-style TP, GPipe PP and DP over gloo, the same code the RL loop and transitions run.

Runs inside every rank of a calibration world (see ``stages.measure``). A config of w = tp*pp*dp
ranks runs as world // w replicas on consecutive rank ranges, so every device is busy whatever
the layout. Every rank builds every replica's Engine (their process groups are collective) but
computes only in its own.

How the executor maps onto the cost model: ``logprobs`` and ``generate`` push the whole local
batch through the pipeline at once (no micro-batches), so inference configs carry
micro_batch = batch / dp, which makes the analytic pipeline bubble (p-1)/m with m = 1 describe
the sequential stages exactly; ``train_step`` runs GPipe over micro_batch-sized chunks.
"""
from __future__ import annotations

import statistics

from dataclasses import replace

LAYOUTS_BY_WORLD = {
    1: ((1, 1, 1),),
    2: ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)),
    4: ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)),
}
LAYOUTS = LAYOUTS_BY_WORLD[4]


def available() -> bool:
    try:
        from nereus.executor.engine import Engine  # noqa: F401
        from nereus.executor.scenario import make_plan  # noqa: F401
    except ImportError:
        return False
    return True


def adapt(configs: tuple) -> tuple:
    """Inference configs take the whole local batch as one micro-batch (what the executor does)."""
    return tuple(replace(c, micro_batch=c.batch // c.dp) if c.stage == "inference" else c for c in configs)


def _engines(rank: int, world: int, configs: tuple, seed: int, device: str) -> dict:
    """(tp, pp, dp, micro_batch) -> this rank's Engine, built collectively in config order."""
    from nereus.calibration.subject import TIMED_MODEL
    from nereus.executor.engine import Engine
    from nereus.executor.scenario import make_plan
    from nereus.executor.store import ShardStore

    out = {}
    for c in configs:
        key = (c.tp, c.pp, c.dp, c.micro_batch)
        if key in out:
            continue
        w = c.tp * c.pp * c.dp
        for i in range(world // w):
            plan = make_plan(c.tp, c.pp, c.dp, first_gpu=i * w, zero=0, micro_batch=c.micro_batch)
            eng = Engine(rank, world, TIMED_MODEL, plan.stage("actor/training"), ShardStore(device))
            if eng.in_pool:
                eng.init_state(seed)
                out[key] = eng
    return out


def time_configs(rank: int, world: int, configs: tuple, reps: int, seed: int, device: str = "cpu") -> list[float]:
    """Device seconds of each config (slowest rank), median over ``reps`` passes after a warm-up pass."""
    import torch
    import torch.distributed as dist

    from nereus.calibration.clock import Stopwatch, world_device_time
    from nereus.calibration.spawn import tick
    from nereus.calibration.subject import TIMED_MODEL

    if not dist.is_initialized():
        raise RuntimeError("the executor backend runs inside a calibration world (stages.measure)")
    engines = _engines(rank, world, configs, seed, device)
    gen = torch.Generator().manual_seed(seed)  # same tokens on every rank: a replica shares its batch
    toks = {c: torch.randint(0, TIMED_MODEL.vocab, (c.batch, c.prompt_len + c.response_len), generator=gen)
            .to(device) for c in configs}

    def run(c) -> None:
        eng, ids = engines[(c.tp, c.pp, c.dp, c.micro_batch)], toks[c]
        if c.stage == "generation":
            eng.generate(ids[:, :c.prompt_len], c.response_len)
        elif c.stage == "inference":
            eng.logprobs(ids)
        else:
            eng.train_step(ids)

    samples: dict = {c: [] for c in configs}
    for pas in range(reps + 1):
        for c in configs:
            dist.barrier()
            with Stopwatch() as sw:
                run(c)
            dt = world_device_time(sw)  # slowest rank, less time lost to other processes
            if pas:
                samples[c].append(dt)
            tick(1)
    return [statistics.median(samples[c]) for c in configs]
