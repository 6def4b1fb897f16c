"""Microbenchmarks on the machine we run on: matmul throughput over a grid of shapes and dtypes,
memory bandwidth (large copies), and collectives (p2p, all-reduce, all-gather) over real gloo
processes. Each returns a tidy pandas DataFrame, one row per measurement.

Why the median of corrected repeats: this code often runs on machines shared with other work.
Every repeat is timed as wall time minus the time the thread waited for a core (clock.py), which
removes most of the neighbours' effect; the median over repeats spread across passes then
discards both a disturbed repeat and a repeat whose correction overshot (the scheduler's and the
wall clock's accounting disagree now and then). Every row also keeps the fastest repeat.

A "device" is one CUDA GPU when one is present, otherwise one CPU process with one thread (so a
world of n ranks is n devices, as it is for the reference transformer's stage timings).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Callable

import pandas as pd

from nereus.calibration.clock import Stopwatch, world_device_time

COLLECTIVE_OPS = ("p2p", "all_reduce", "all_gather")


def pick_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``: the same command runs unchanged on both."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def compute_dtype(device: str) -> str:
    """The dtype a model computes in on this device: bf16 on GPUs, fp32 on CPUs (CPU bf16 matmul
    without AMX is an emulation, not what anyone trains with)."""
    return "bfloat16" if device == "cuda" else "float32"


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchGrid:
    """What to measure. ``quick()`` fits the 2-minute budget of ``nereus calibrate --quick``."""

    matmul_mnk: tuple[tuple[int, int, int], ...]
    matmul_dtypes: tuple[str, ...]
    """The first dtype runs the whole shape grid; the others only ``side_mnk`` (on a CPU, bf16
    matmul is an emulation two orders of magnitude slower: a few points suffice to show it)."""
    side_mnk: tuple[tuple[int, int, int], ...] = ()
    copy_bytes: tuple[int, ...]
    """Copy sizes; from 32 MiB up so that source + destination spill out of the last-level cache
    and the curve measures DRAM (HBM on GPUs), which is what decode streams from."""
    comm_bytes: tuple[int, ...]
    reps: int = 5
    budget_s: float = 0.25
    """Target seconds per measurement (repeats are added up to it)."""

    @classmethod
    def full(cls, device: str) -> "BenchGrid":
        dims = (64, 128, 256, 512, 1024, 2048) if device == "cpu" else (256, 512, 1024, 2048, 4096, 8192)
        mnk = tuple((m, n, k) for m in dims for n in dims[1::2] for k in dims[1::2])
        dtypes = (compute_dtype(device), "bfloat16" if device == "cpu" else "float32")
        side = tuple((d, d, d) for d in dims[:4])
        return cls(matmul_mnk=mnk, matmul_dtypes=dtypes, side_mnk=side,
                   copy_bytes=tuple(2**e for e in range(25, 30)),
                   comm_bytes=tuple(4**e for e in range(5, 13)), reps=15, budget_s=0.3)

    @classmethod
    def quick(cls, device: str) -> "BenchGrid":
        dims = (64, 128, 256, 512, 1024) if device == "cpu" else (512, 1024, 2048, 4096, 8192)
        mnk = tuple((d, d, d) for d in dims) + tuple((4 * d, d, 2 * d) for d in dims[:-1])
        return cls(matmul_mnk=mnk, matmul_dtypes=(compute_dtype(device),),
                   copy_bytes=tuple(2**e for e in range(25, 28)),
                   comm_bytes=tuple(4**e for e in range(5, 11)), reps=6, budget_s=0.08)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], device: str, reps: int, budget_s: float,
              barrier: Callable[[], object] | None = None) -> tuple[float, float]:
    """(median, min) device seconds of one call; each repeat loops enough calls to last ~budget/reps.
    ``barrier`` lines up all ranks before every repeat, so they measure while all are busy."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, int(budget_s / reps / one))
    if barrier is not None:  # every rank must loop the same number of times
        inner = barrier(inner)
    samples = []
    for _ in range(reps):
        if barrier is not None:
            barrier(0)
        with Stopwatch() as sw:
            for _ in range(inner):
                fn()
            _sync(device)
        samples.append(sw.device / inner)
    return median(samples), min(samples)


def _passes(grid: BenchGrid) -> int:
    """Repeats are spread over passes through the whole grid, so that a burst of load from a
    neighbour spoils one pass of a point, not all its repeats (the median over passes is kept)."""
    return max(1, min(3, grid.reps // 2))


def _merge(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """Per point (same ``keys``): median over passes of the per-pass medians, fastest repeat."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[x] for x in keys), []).append(r)
    out = []
    for rs in groups.values():
        r = dict(rs[0])
        r["seconds"] = median(x["seconds"] for x in rs)
        r["seconds_min"] = min(x["seconds_min"] for x in rs)
        out.append(r)
    return out


def bench_matmul(grid: BenchGrid, device: str, progress: Callable[[int], None] | None = None,
                 barrier: Callable[[int], int] | None = None) -> pd.DataFrame:
    """C[m,n] = A[m,k] @ B[k,n]: 2mnk FLOPs per call."""
    import torch

    rows = []
    passes = _passes(grid)
    for pas in range(passes):
        for i, dtype in enumerate(grid.matmul_dtypes):
            dt = getattr(torch, dtype)
            for m, n, k in grid.matmul_mnk if i == 0 else grid.side_mnk:
                a = torch.randn(m, k, device=device, dtype=dt)
                b = torch.randn(k, n, device=device, dtype=dt)
                t_med, t_min = time_call(lambda: a @ b, device, max(1, grid.reps // passes), grid.budget_s / passes,
                                         barrier)
                flops = 2.0 * m * n * k
                rows.append({"kind": "matmul", "dtype": dtype, "m": m, "n": n, "k": k, "flops": flops,
                             "seconds": t_med, "seconds_min": t_min})
                if progress:
                    progress(1)
    df = pd.DataFrame(_merge(rows, ("dtype", "m", "n", "k")))
    df["tflops"] = df["flops"] / df["seconds"] / 1e12
    return df


def bench_copy(grid: BenchGrid, device: str, progress: Callable[[int], None] | None = None,
               barrier: Callable[[int], int] | None = None) -> pd.DataFrame:
    """dst.copy_(src) of S bytes moves 2S bytes (one read, one write)."""
    import torch

    rows = []
    passes = _passes(grid)
    for pas in range(passes):
        for nbytes in grid.copy_bytes:
            src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
            dst = torch.empty_like(src)
            t_med, t_min = time_call(lambda: dst.copy_(src), device, max(1, grid.reps // passes),
                                     grid.budget_s / passes, barrier)
            rows.append({"kind": "copy", "bytes": float(nbytes), "moved_bytes": 2.0 * nbytes, "seconds": t_med,
                         "seconds_min": t_min})
            del src, dst
            if progress:
                progress(1)
    df = pd.DataFrame(_merge(rows, ("bytes",)))
    df["gbps"] = df["moved_bytes"] / df["seconds"] / 1e9
    return df


def _collective_rank(rank: int, world: int, sizes: tuple[int, ...], reps: int, budget_s: float) -> list[dict]:
    """Runs on every rank. p2p is a ping-pong between ranks 0 and 1 (one-way time = half the
    round trip); all-reduce / all-gather involve all ranks. Rank 0's timings are returned."""
    import torch
    import torch.distributed as dist

    rows = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        buf = torch.ones(n)
        parts = [torch.empty(max(1, n // world)) for _ in range(world)]

        def ping() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        ops = {"p2p": ping, "all_reduce": lambda: dist.all_reduce(buf),
               "all_gather": lambda: dist.all_gather(parts, parts[rank])}
        for op in COLLECTIVE_OPS:
            samples = []
            inner = None
            for r in range(reps + 1):
                dist.barrier()
                if inner is None:  # rank 0 decides the loop count; everyone must agree
                    t0 = time.perf_counter()
                    ops[op]()
                    one = torch.tensor([time.perf_counter() - t0])
                    dist.broadcast(one, 0)
                    inner = max(1, int(budget_s / reps / max(float(one), 1e-6)))
                    continue
                with Stopwatch() as sw:
                    for _ in range(inner):
                        ops[op]()
                samples.append(world_device_time(sw) / inner)
            t_min, t_med = min(samples), median(samples)
            if op == "p2p":
                t_min, t_med = t_min / 2, t_med / 2
            moved = 4.0 * (n if op != "all_gather" else max(1, n // world) * world)
            rows.append({"kind": op, "world": world, "bytes": moved, "seconds": t_med, "seconds_min": t_min})
    return rows


def count_steps(grid: BenchGrid, world: int) -> int:
    """Progress-bar units of :func:`run_all`."""
    mm = len(grid.matmul_mnk) + len(grid.side_mnk) * (len(grid.matmul_dtypes) - 1)
    return _passes(grid) * (mm + len(grid.copy_bytes)) + (1 if world > 1 else 0)


def _max_barrier(value: int) -> int:
    """Barrier that also agrees on a loop count (the largest any rank proposed)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _all_rank(rank: int, world: int, grid: BenchGrid, device: str) -> dict[str, list[dict]]:
    """Every rank runs the compute and copy grid at the same time (a device is measured while its
    neighbours are busy too, as in a running job: on a CPU they share DRAM bandwidth and cache),
    then the collectives. Rank 0's rows are the result."""
    from nereus.calibration.spawn import tick

    mm = bench_matmul(grid, device, tick, _max_barrier)
    cp = bench_copy(grid, device, tick, _max_barrier)
    comm = _collective_rank(rank, world, tuple(grid.comm_bytes), grid.reps, grid.budget_s)
    tick(1)
    return {"matmul": mm.to_dict("records"), "copy": cp.to_dict("records"), "comm": comm}


def run_all(grid: BenchGrid, device: str, world: int, progress: Callable[[int], None] | None = None
            ) -> dict[str, pd.DataFrame]:
    """The three tables, keyed ``matmul``, ``copy``, ``comm``, measured on ``world`` processes
    (one process, and no collectives, when world is 1). On CUDA the compute and copy grids run
    in this process on the one GPU and only the collectives are spawned (gloo, CPU tensors)."""
    import torch

    from nereus.calibration.spawn import run_world

    if device == "cuda":
        out = {"matmul": bench_matmul(grid, device, progress), "copy": bench_copy(grid, device, progress)}
        comm = run_world(_collective_rank, world, (tuple(grid.comm_bytes), grid.reps, grid.budget_s),
                         timeout_s=900)[0] if world > 1 else []
        if progress and world > 1:
            progress(1)
        out["comm"] = pd.DataFrame(comm, columns=["kind", "world", "bytes", "seconds", "seconds_min"])
        return out
    if world <= 1:
        threads = torch.get_num_threads()
        if device == "cpu":
            torch.set_num_threads(1)
        try:
            return {"matmul": bench_matmul(grid, device, progress), "copy": bench_copy(grid, device, progress),
                    "comm": pd.DataFrame(columns=["kind", "world", "bytes", "seconds", "seconds_min"])}
        finally:
            torch.set_num_threads(threads)
    res = run_world(_all_rank, world, (grid, device), timeout_s=900, progress=progress)[0]
    return {k: pd.DataFrame(v) for k, v in res.items()}


def save_tables(tables: dict[str, pd.DataFrame], folder: str) -> tuple[str, ...]:
    """One CSV per table; returns the paths written."""
    from pathlib import Path

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, df in tables.items():
        p = d / f"{name}.csv"
        df.to_csv(p, index=False)
        paths.append(str(p))
    return tuple(paths)
def cpu_nominal_tflops(threads: int = 1) -> float:
    """Datasheet-style peak of ``threads`` x86 cores: GHz x FP32 FLOPs per cycle (16 per FMA unit
    pair with AVX2, 32 with AVX-512; 2 units), from /proc/cpuinfo. 0 when it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return 0.0
    mhz = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    per_cycle = 64 if " avx512f" in flags else 32 if " fma" in flags else 8
    return (max(mhz) if mhz else 0.0) * 1e6 * per_cycle * threads / 1e12


