"""Local multi-process launch: ``torch.multiprocessing`` spawn, file:// rendezvous in a temp dir.

``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` fresh processes with a
gloo (or NCCL) process group and returns the per-rank results. Each rank reports its result or
its formatted traceback on a queue; the parent joins with a deadline, kills ranks that hang, and
raises ``RankFailed`` naming the rank and quoting its traceback. ``fn`` must be importable
(module level) because spawn pickles it by name.

Multi-node runs use torchrun instead, with the same per-rank function::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 your_script.py

where ``your_script.py`` calls ``dist.init_process_group("nccl")`` and then ``fn(rank, world, ...)``.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from nereus.errors import NereusError

HUNG = object()
"""Placeholder result of a rank that was killed for not finishing (``allow_hung=True``)."""


class RankFailed(NereusError):
    """A rank raised or hung; the message carries the rank's traceback."""


def _entry(rank: int, world: int, init_file: str, backend: str, pg_timeout_s: float, fn: Callable, args: tuple,
           results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        out = fn(rank, world, *args)
        # by value: a tensor shared through a file descriptor dies with this process
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit, with the rank's traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def launch(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo",
           pg_timeout_s: float = 60.0, allow_hung: bool = False) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; results in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="nereus-rdzv-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world, init_file, backend, pg_timeout_s, fn, args, results),
                             daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                got[rank] = (status, value)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        hung = [r for r, p in enumerate(procs) if r not in got]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    errors = [(r, v) for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        r, tb = errors[0]
        raise RankFailed(f"rank {r} of {world} failed ({len(errors)} rank(s) failed, hung: {hung}):\n{tb}")
    if hung and not allow_hung:
        raise RankFailed(f"rank(s) {hung} of {world} did not finish within {timeout_s:g} s and were killed")
    return [pickle.loads(got[r][1]) if r in got else HUNG for r in range(world)]
