"""Run a function on ``world`` real processes joined by a gloo process group.

Why a helper of our own: microbenchmarks and stage timings both need the same launch discipline
as the multi-process tests (torch.multiprocessing spawn, file:// rendezvous in a fresh temp dir so
two runs never fight over a port, a per-rank error queue so a failure names its rank and carries
its traceback, join with a timeout that kills hung ranks).

Call order: the parent calls :func:`run_world`; every rank calls ``fn(rank, world, *args)`` after
``init_process_group``; what rank r returns comes back at index r.
"""
from __future__ import annotations

import os
import tempfile
import traceback
from typing import Any, Callable

from nereus.errors import NereusError


class WorldError(NereusError):
    """A rank of a calibration world failed or hung."""


_TICK: Callable[[int], Any] | None = None


def tick(n: int = 1) -> None:
    """Report ``n`` finished work items to the progress bar: rank 0's reach the parent through a
    queue; in-process callers set one with :func:`local_progress`."""
    if _TICK is not None:
        _TICK(n)


class local_progress:
    """``with local_progress(bar.update):`` routes :func:`tick` to ``bar.update`` in this process."""

    def __init__(self, fn: Callable[[int], Any] | None) -> None:
        self.fn = fn

    def __enter__(self) -> None:
        global _TICK
        self.prev, _TICK = _TICK, self.fn

    def __exit__(self, *exc: object) -> None:
        global _TICK
        _TICK = self.prev


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, threads: int, out_q, err_q,
           prog_q) -> None:
    import torch
    import torch.distributed as dist

    global _TICK
    _TICK = prog_q.put if rank == 0 else None
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        try:
            out_q.put((rank, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        err_q.put((rank, traceback.format_exc()))


def run_world(fn: Callable, world: int, args: tuple = (), timeout_s: float = 300.0, threads: int = 1,
              progress: Callable[[int], None] | None = None) -> list[Any]:
    """Spawn ``world`` ranks running ``fn``; return their results in rank order. Rank 0's
    :func:`tick` calls reach ``progress`` in the parent."""
    import torch.multiprocessing as mp

    if world < 1:
        raise WorldError(f"world size must be >= 1, got {world}")
    ctx = mp.get_context("spawn")
    out_q, err_q, prog_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="nereus-cal-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(r, world, init_file, fn, args, threads, out_q, err_q, prog_q))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            while len(results) < world:
                while progress is not None and not prog_q.empty():
                    progress(prog_q.get())
                if not err_q.empty():
                    rank, tb = err_q.get()
                    raise WorldError(f"rank {rank} of {world} failed:\n{tb}")
                try:
                    rank, value = out_q.get(timeout=min(timeout_s, 1.0))
                    results[rank] = value
                except Exception:  # queue.Empty: poll again until the deadline
                    timeout_s -= 1.0
                    if timeout_s <= 0:
                        raise WorldError(f"calibration world of {world} ranks timed out; "
                                         f"finished ranks: {sorted(results)}") from None
                    if all(not p.is_alive() for p in procs) and err_q.empty() and out_q.empty():
                        codes = [p.exitcode for p in procs]
                        raise WorldError(f"ranks exited without a result (exit codes {codes})") from None
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]
