"""Timing on a shared host: wall time minus the time this thread waited for a core.

Linux's /proc/thread-self/schedstat gives the thread's run-queue delay: time it was ready to run
while another process held the core. On a machine shared with other work, that delay is noise
that no dedicated device would see, so a measurement subtracts it. Across ranks the correction
uses the *largest* delay of any rank (``dist.all_reduce(MAX)``): a rank stalled by its peer is
blocked, not runnable, so only the stalled rank's own delay is certain to be on the critical
path; the correction therefore never removes more than one rank's worth (conservative when
several ranks were delayed one after another). Where schedstat is missing (macOS, some
containers) the delay reads 0 and times are plain wall time.
"""
from __future__ import annotations

import time

_PATH = "/proc/thread-self/schedstat"


def run_delay_s() -> float:
    """Cumulative run-queue delay of the calling thread, in seconds (0 when unavailable)."""
    try:
        with open(_PATH) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.wall``, ``sw.delay``, ``sw.device``."""

    def __enter__(self) -> "Stopwatch":
        self.d0 = run_delay_s()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.delay = max(0.0, run_delay_s() - self.d0)

    @property
    def device(self) -> float:
        return corrected(self.wall, self.delay)


def world_device_time(sw: Stopwatch) -> float:
    """Device time of a collective step: slowest wall minus the largest run-queue delay of any
    rank (both agreed over the default process group; plain values outside one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return sw.device
    t = torch.tensor([sw.wall, sw.delay], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return corrected(float(t[0]), float(t[1]))


def corrected(wall: float, delay: float) -> float:
    """wall - delay; the plain wall time (an honest upper bound) when the delay claims 95% or
    more of it, where the scheduler's clock and the wall clock may simply disagree (a VM)."""
    return wall - delay if delay < 0.95 * wall else wall
