"""Local multi-process launch: ``torch.multiprocessing`` spawn, file:// rendezvous in a temp dir.

``launch(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` fresh processes with a
gloo (or NCCL) process group and returns the per-rank results. Each rank reports its result or
its formatted traceback on a queue; the parent joins with a deadline, kills ranks that hang, and
raises ``RankFailed`` naming the rank and quoting its traceback. ``fn`` must be importable
(module level) because spawn pickles it by name. ``Ranks(world)`` keeps the spawned ranks and
their process group for several calls (``ranks.run(fn, *args)``), so a job of many runs pays the
spawn, the torch import and the rendezvous once.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR`` in the environment,
``torchrun_env``) nothing is spawned: ``launch`` joins torchrun's env:// rendezvous (once per
process), runs ``fn`` on this process's rank, and the results travel through the rendezvous
store (not a collective: a failed transition leaves the data groups suspect); rank 0 gets the
list, the other ranks None. So ``torchrun --nproc-per-node N -m nereus.cli reshard-check ...``
runs the same code on N torchrun processes, on one node or several (docs/torchrun.md).

NCCL: each process calls ``torch.cuda.set_device(local rank)`` before it joins, so every CUDA
tensor and communicator of the rank is on its own GPU (``rank_device``).
"""
from __future__ import annotations

import atexit
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


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world, local rank) when this process was started by torchrun (or any launcher that
    sets the env:// variables), else None."""
    if not all(v in os.environ for v in TORCHRUN_VARS):
        return None
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError:
        raise NereusError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (set by torchrun), got "
                          + ", ".join(f"{v}={os.environ[v]!r}" for v in TORCHRUN_VARS[:3])) from None


def _set_device(backend: str, local_rank: int) -> None:
    """NCCL: this process's GPU is ``cuda:local_rank``, set before any CUDA work or communicator."""
    if "nccl" in backend:
        import torch

        if not torch.cuda.is_available():
            raise NereusError("backend nccl needs CUDA, and torch.cuda.is_available() is False on this machine")
        if local_rank >= torch.cuda.device_count():
            raise NereusError(f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible")
        torch.cuda.set_device(local_rank)


NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": "0"}
"""Set before an NCCL group is made: the watchdog must not tear the process down on a stuck
operation (its default); the executor bounds every wait itself (polled deadlines), aborts the
communicators and rolls back. Blocking wait stays off (``Work.wait`` must not block the host)."""

_JOINED: dict = {}
"""What this process joined with: the rendezvous ``store`` (captured right after init: an abort
or rebuild replaces the default group's) and the process-group ``timeout_s``."""


def join_group(backend: str, local_rank: int, *, init_method: str, rank: int | None = None,
               world: int | None = None, pg_timeout_s: float = 60.0) -> None:
    """Join the default process group. NCCL: the device set first, ``NCCL_ENV`` set before init,
    and the device bound (``device_id``), so NCCL creates the world's communicator eagerly, here,
    on every rank together, instead of inside the first batched send/receive, which torch
    requires every rank of the group to enter (ranks with nothing to send would never come); then
    one all-ranks warm-up all-reduce on the device. The rendezvous store and the timeout are
    recorded (``rendezvous_store``, ``joined_timeout_s``)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    kwargs = {} if rank is None else {"rank": rank, "world_size": world}
    nccl = "nccl" in backend
    if nccl:
        os.environ.update(NCCL_ENV)
        _set_device(backend, local_rank)
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(backend, init_method=init_method, timeout=timedelta(seconds=pg_timeout_s), **kwargs)
    _JOINED.update(store=c10d._get_default_store(), timeout_s=pg_timeout_s)
    if nccl:
        dist.all_reduce(torch.zeros(1, device=kwargs["device_id"]))
        torch.cuda.synchronize(kwargs["device_id"])


def rendezvous_store():
    """The rendezvous store this process joined through (None before ``join_group``)."""
    return _JOINED.get("store")


def joined_timeout_s() -> float | None:
    """The process-group timeout this process joined with (None if not joined by ``join_group``)."""
    return _JOINED.get("timeout_s")


def rank_device():
    """The device this rank keeps its tensors on: ``cuda:<local rank>`` under NCCL, else CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _entry(rank: int, world: int, init_file: str, backend: str, pg_timeout_s: float, fn: Callable, args: tuple,
           results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_RANK"] = str(rank)  # one node: the local rank is the rank
    try:
        join_group(backend, rank, init_method=f"file://{init_file}", rank=rank, world=world,
                   pg_timeout_s=pg_timeout_s)
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


_CALLS = [0]
"""``launch`` calls under torchrun in this process (the same sequence on every rank): the key of
each call's results in the rendezvous store."""


def _launch_torchrun(fn: Callable, world: int, args: tuple, timeout_s: float, backend: str, pg_timeout_s: float,
                     allow_hung: bool, everywhere: bool = False) -> list[Any] | None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    rank, size, local_rank = torchrun_env()
    if size != world:
        raise NereusError(f"torchrun started {size} processes (WORLD_SIZE) but this run needs {world}: "
                          f"pass --nproc-per-node/--nnodes for {world}, or --world {size}")
    if not dist.is_initialized():
        join_group(backend, local_rank, init_method="env://", pg_timeout_s=pg_timeout_s)
        # torchrun's processes outlive a launch: tear the group down before the interpreter does, or a
        # communicator thread still running at exit aborts the process ("terminate called without an
        # active exception", SIGABRT) after its work is done
        atexit.register(_destroy_group)
    _CALLS[0] += 1
    key = f"nereus-launch/{_CALLS[0]}/"
    try:
        status, value = "ok", pickle.dumps(fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to rank 0 with the traceback
        status, value = "error", traceback.format_exc().encode()
    store = rendezvous_store() or c10d._get_default_store()  # the one joined through: survives an abort
    store.set(f"{key}{rank}", pickle.dumps((status, value)))
    if rank != 0 and not everywhere:
        store.wait([f"{key}done"], timedelta(seconds=timeout_s + 30))  # leave only once rank 0 has read every answer
        return None
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < world and time.monotonic() < deadline:
        for r in range(world):
            if r not in got and store.check([f"{key}{r}"]):
                got[r] = pickle.loads(store.get(f"{key}{r}"))
        time.sleep(0.05)
    if rank == 0:
        store.set(f"{key}done", b"1")
    return _results(got, world, [r for r in range(world) if r not in got], allow_hung,
                    f"did not finish within {timeout_s:g} s")


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0, backend: str = "gloo",
           pg_timeout_s: float = 60.0, allow_hung: bool = False, everywhere: bool = False) -> list[Any] | None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; results in rank order. Under
    torchrun (``torchrun_env``): on this process's rank only; the list on rank 0, None elsewhere,
    or on every rank with ``everywhere`` (results every rank needs to go on the same way, e.g. a
    measurement that picks the plan)."""
    if torchrun_env() is not None:
        return _launch_torchrun(fn, world, args, timeout_s, backend, pg_timeout_s, allow_hung, everywhere)
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
    return _results(got, world, hung, allow_hung, f"did not finish within {timeout_s:g} s and were killed")


def _serve(rank: int, world: int, init_file: str, backend: str, pg_timeout_s: float, tasks, results) -> None:
    """A kept rank (``Ranks``): join the group once, then run each ``(call, fn, args)`` taken from
    ``tasks`` until None, reporting ``(call, rank, status, value)`` as ``_entry`` does."""
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        join_group(backend, rank, init_method=f"file://{init_file}", rank=rank, world=world,
                   pg_timeout_s=pg_timeout_s)
    except BaseException:  # noqa: BLE001 - reported with the rank's traceback
        results.put((0, rank, "error", traceback.format_exc()))
        return
    try:
        while (task := tasks.get()) is not None:
            call, fn, args = task
            try:
                results.put((call, rank, "ok", pickle.dumps(fn(rank, world, *args))))
            except BaseException:  # noqa: BLE001 - reported with the rank's traceback; the parent stops the ranks
                results.put((call, rank, "error", traceback.format_exc()))
            del task, fn, args
            gc.collect()  # the last call's state, before the next call measures anything
    finally:
        if dist.is_initialized():
            _destroy_group()


class Ranks:
    """``world`` spawned ranks kept for several calls: ``ranks.run(fn, *args)`` is ``launch(fn,
    world, *args)`` on the same processes and process group (spawn, torch import and rendezvous
    paid once). Each call's ``fn`` starts from the state the last one left in the process (module
    caches such as ``parallel.group_of``'s groups stay; the garbage is collected between calls).
    A call that fails or hangs stops the ranks (``RankFailed`` as ``launch`` raises it); the next
    call spawns fresh ones. Under torchrun every call is ``launch``'s. Use as a context manager,
    or ``close()``."""

    def __init__(self, world: int, *, backend: str = "gloo", pg_timeout_s: float = 60.0) -> None:
        self.world, self.backend, self.pg_timeout_s = world, backend, pg_timeout_s
        self._procs: list = []
        self._calls = 0

    def _start(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="nereus-rdzv-")
        init_file = os.path.join(self._tmp.name, "rendezvous")
        self._results, self._tasks = ctx.Queue(), [ctx.Queue() for _ in range(self.world)]
        procs = [ctx.Process(target=_serve, args=(r, self.world, init_file, self.backend, self.pg_timeout_s,
                                                  self._tasks[r], self._results), daemon=True)
                 for r in range(self.world)]
        for p in procs:
            try:
                p.start()
            except BaseException:
                self._procs = [q for q in procs if q.pid is not None]
                self.close(kill=True)
                raise
        self._procs = procs

    def run(self, fn: Callable, *args: Any, timeout_s: float = 120.0, allow_hung: bool = False,
            everywhere: bool = False) -> list[Any] | None:
        if torchrun_env() is not None:
            return launch(fn, self.world, *args, timeout_s=timeout_s, backend=self.backend,
                          pg_timeout_s=self.pg_timeout_s, allow_hung=allow_hung, everywhere=everywhere)
        if not self._procs:
            self._start()
        self._calls += 1
        for q in self._tasks:
            q.put((self._calls, fn, args))
        got: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world and time.monotonic() < deadline:
            try:
                call, rank, status, value = self._results.get(timeout=0.2)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in self._procs):
                    break
                continue
            if call == self._calls or status == "error":
                got[rank] = (status, value)
        hung = [r for r in range(self.world) if r not in got]
        if hung or any(s == "error" for s, _ in got.values()):
            self.close(kill=True)  # a rank failed or hung: the group is suspect, the next call starts afresh
        return _results(got, self.world, hung, allow_hung, f"did not finish within {timeout_s:g} s and were killed")

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (asked to leave; killed if ``kill`` or not gone within 10 s)."""
        if not self._procs:
            return
        if not kill:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            if not kill:
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []
        self._tmp.cleanup()

    def __enter__(self) -> Ranks:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What a rank's error says when it failed only because another rank died first."""


def _results(got: dict[int, tuple[str, Any]], world: int, hung: list[int], allow_hung: bool, late: str) -> list[Any]:
    """Per rank in order, the unpickled result (``HUNG`` for a rank without one); a failing rank's
    traceback raised as ``RankFailed`` (the first whose error is its own: a rank that only saw a
    peer's connection close failed because that peer did), and missing ranks unless ``allow_hung``."""
    errors = [(r, v.decode() if isinstance(v, bytes) else v) for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        errors.sort(key=lambda e: any(m in e[1] for m in _PEER_GONE))  # stable: by rank within each kind
        r, tb = errors[0]
        raise RankFailed(f"rank {r} of {world} failed ({len(errors)} rank(s) failed, no answer: {hung}):\n{tb}")
    if hung and not allow_hung:
        raise RankFailed(f"rank(s) {hung} of {world} {late}")
    return [pickle.loads(got[r][1]) if r in got else HUNG for r in range(world)]
