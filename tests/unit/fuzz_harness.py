"""The harness that feeds hostile inputs to Nereus's readers and CLI and checks the contract
(shared by ``tests/unit/test_fuzz_inputs.py`` and ``benchmarks/fuzz_inputs.py``; the inputs are
``fuzz_cases.py``'s).

The contract: a reader returns a parsed object whose numbers are finite, or raises a
:class:`NereusError` whose message is one line naming the file; the CLI exits 0 or 2, and on 2
prints one line on stderr naming the file and writes no output. Never another exception, never
more than ``bound_s`` seconds, never more than MEMORY_HEADROOM of new memory.
"""
from __future__ import annotations

import contextlib
import io
import math
import resource
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nereus.errors import NereusError


# ---- running one case ------------------------------------------------------------------------------
class CaseTimeout(BaseException):
    """Raised inside a case that runs past its time bound (a BaseException, so that no
    ``except Exception`` in the code under test swallows it)."""


MEMORY_HEADROOM = 4 << 30
"""Address space a case may add to the process (a MemoryError past it): a reader that allocates
without bound fails its case instead of swapping the shared machine."""


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def time_bound(seconds: float):
    """Interrupt the block after ``seconds`` of wall time with CaseTimeout, and cap the memory it may
    add at MEMORY_HEADROOM. Restores any timer that was already set (pytest-timeout's), minus the
    time spent here, and the previous memory limit.

    The alarm repeats every 0.25 s after the first: a CaseTimeout raised while the garbage collector
    runs a finalizer is swallowed ("Exception ignored in ..."), and a one-shot alarm lost that way let
    a runaway case (a trace expanded to 10^12 rows) allocate 19 GB."""
    def on_alarm(signum, frame):
        raise CaseTimeout(f"still running after {seconds:g} s")

    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + MEMORY_HEADROOM
    if old_limit[0] == resource.RLIM_INFINITY or cap < old_limit[0]:
        resource.setrlimit(resource.RLIMIT_AS, (cap, old_limit[1]))
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, 0.25)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


@dataclass
class Outcome:
    kind: str
    """ok (a parsed object / exit 0), refused (a NereusError / exit 2), other (any other exception,
    exit code or a time-out)."""
    detail: str = ""
    """The error message, or the traceback's last lines."""
    seconds: float = 0.0
    value: Any = None
    stderr: str = ""


def _tail(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)[-6:]).strip()


def feed(read: Callable[[Path], Any], path: Path, bound_s: float) -> Outcome:
    """Outcome of ``read(path)`` within ``bound_s`` seconds."""
    t0 = time.perf_counter()
    try:
        with time_bound(bound_s):
            value = read(path)
    except NereusError as e:
        return Outcome("refused", str(e), time.perf_counter() - t0)
    except CaseTimeout as e:
        return Outcome("other", f"hang: {e}", time.perf_counter() - t0)
    except MemoryError:
        return Outcome("other", f"memory: past {MEMORY_HEADROOM >> 30} GiB more", time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - anything else is what the fuzz looks for
        return Outcome("other", _tail(e), time.perf_counter() - t0)
    return Outcome("ok", "", time.perf_counter() - t0, value)


def run_cli(argv: list[str], bound_s: float) -> Outcome:
    """``nereus argv`` in this process (``nereus.cli.main``), stdout and stderr captured."""
    from nereus.cli import main

    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    try:
        with time_bound(bound_s), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 2
    except CaseTimeout as e:
        return Outcome("other", f"hang: {e}", time.perf_counter() - t0, stderr=err.getvalue())
    except Exception as e:  # noqa: BLE001
        return Outcome("other", _tail(e), time.perf_counter() - t0, stderr=err.getvalue())
    kind = {0: "ok", 2: "refused"}.get(code, "other")
    return Outcome(kind, f"exit {code}", time.perf_counter() - t0, stderr=err.getvalue())


# ---- the contract -----------------------------------------------------------------------------
def finite_problems(obj: Any, where: str = "") -> list[str]:
    """Every float in a nested to_dict() that is NaN or infinite."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [f"{where or 'value'} = {obj}"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in finite_problems(v, f"{where}.{k}" if where else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in finite_problems(v, f"{where}[{i}]")]
    return []


def names_file(message: str, path: Path) -> bool:
    """Whether an error message names the damaged file (a corpus file: its folder)."""
    return (path.parent.name if path.name == "decode.csv" else path.stem) in message


def reader_problems(reader: Any, path: Path, bound_s: float) -> tuple[Outcome, list[str]]:
    """Feed one case to a reader; the outcome and what breaks the contract."""
    out = feed(reader.read, reader.target(path), bound_s)
    if out.kind == "ok":
        return out, [f"parsed object: {p}" for p in reader.check(out.value)]
    if out.kind == "refused":
        bad = []
        if "\n" in out.detail or not out.detail.strip():
            bad.append(f"error is not one line: {out.detail!r}")
        if not names_file(out.detail, path):
            bad.append(f"error does not name {path.name}: {out.detail!r}")
        return out, bad
    return out, [out.detail]


VERDICTS = (": error: INFEASIBLE: ", " does not fit: needs ")
"""Exit-2 lines that are a verdict on valid inputs (no memory-feasible plan; the config does not fit),
not a refused file: they need not name it, and their JSON is written on purpose."""


def cli_problems(command: str, argv: list[str], path: Path, out_file: Path,
                 bound_s: float) -> tuple[Outcome, list[str]]:
    """Run one CLI command on a case; the outcome and what breaks the contract (exit 0 or 2; on 2
    one stderr line naming the file and no output written; no temporary file left behind)."""
    out = run_cli(argv, bound_s)
    bad = []
    if out.kind == "other":
        bad.append(f"{out.detail}; stderr: {out.stderr[-500:]}")
    elif out.kind == "refused":
        lines = out.stderr.strip().splitlines()
        infeasible = bool(lines) and any(v in lines[-1] for v in VERDICTS)
        if len(lines) != 1 or not lines[0].startswith(f"nereus {command}: error: "):
            bad.append(f"stderr is not one error line: {out.stderr[-800:]!r}")
        elif not infeasible and not names_file(lines[0], path):
            bad.append(f"error does not name {path.name}: {lines[0]!r}")
        if out_file.exists() and not infeasible:  # an infeasible plan's JSON records the verdict
            bad.append(f"exit 2 but {out_file.name} was written")
    elif not out_file.exists():
        bad.append(f"exit 0 but {out_file.name} was not written")
    left = sorted(p.name for p in out_file.parent.iterdir() if p != out_file)
    if left:
        bad.append(f"files left beside the output: {left}")
    return out, bad
