"""Workload traces: per RL step, response-length statistics and the GPUs the job may use.

CSV format (a public contract, see README "File formats"): lines starting with ``#`` are comments
(shipped traces cite their sources there); then a header row. Required columns
``step,response_len_mean,response_len_max,gpus``; optional ``response_len_p90,prompt_len_mean,
response_len_cap``. Steps are whole numbers in increasing order and may be sparse: a row's values
hold until the next row, so ``0,...`` and ``100,...`` describe 100 steps with the first row's values.

Lengths as real logs give them: with a ``response_len_cap`` column, that column is the trainer's
response limit (known before the step runs) and ``response_len_max`` is the step's *observed*
longest response (what verl logs as ``response_length/max``: an outcome, noisy, at most the cap).
Without the column, ``response_len_max`` is the cap (the meaning traces had before the column
existed). ``response_len_mean``/``p90`` are outcomes, known only after generation. ``gpus`` is what
the cluster manager grants for the step (known before it runs).
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nereus.errors import SpecError
from nereus.planner.specs import Workload

REQUIRED = ("step", "response_len_mean", "response_len_max", "gpus")
OPTIONAL = ("response_len_p90", "prompt_len_mean", "response_len_cap")
SHIPPED = ("r1zero_linear", "deepscaler_staged", "ramp_1024", "ramp_1024_noisy")
TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"
MAX_STEPS = 1_000_000
"""Longest trace, in steps after sparse rows are expanded (a million steps is years of RL training;
beyond it a step number is a typo, and expanding it would take minutes and gigabytes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRow:
    step: int
    response_len_mean: float
    response_len_max: int
    gpus: int
    response_len_p90: float | None = None
    prompt_len_mean: float | None = None
    response_len_cap: int | None = None
    """The trainer's response limit; None: ``response_len_max`` is the limit."""

    @property
    def cap(self) -> int:
        """The step's response limit (the cap column, else ``response_len_max``)."""
        return self.response_len_max if self.response_len_cap is None else self.response_len_cap

    def key(self) -> tuple:
        return (self.response_len_mean, self.response_len_max, self.gpus, self.response_len_p90,
                self.prompt_len_mean, self.response_len_cap)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REQUIRED + OPTIONAL}


@dataclass(frozen=True, slots=True, kw_only=True)
class Trace:
    """A dense trace: ``rows[i]`` is step ``first_step + i`` (sparse input rows expanded by holding)."""

    name: str
    rows: tuple[TraceRow, ...]
    source: str = ""
    """The header comment of the CSV (where the numbers come from)."""

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def max_gpus(self) -> int:
        return max(r.gpus for r in self.rows)

    @property
    def has_cap(self) -> bool:
        """Whether the trace gives the cap apart from the observed longest response."""
        return any(r.response_len_cap is not None for r in self.rows)

    def workload(self, i: int, base: Workload) -> Workload:
        """The workload of row ``i`` as the planner sees it: batch size from ``base``, mean and p90
        from the trace, ``response_len_max`` = the step's cap."""
        r = self.rows[i]
        prompt = base.prompt_len if r.prompt_len_mean is None else max(1, round(r.prompt_len_mean))
        p90 = None if r.response_len_p90 is None else min(float(r.response_len_p90), float(r.cap))
        return replace(base, prompt_len=prompt, response_len_mean=min(r.response_len_mean, r.cap),
                       response_len_max=r.cap, response_len_p90=p90)

    def head(self, n: int) -> "Trace":
        return replace(self, rows=self.rows[:n])

    def to_csv(self) -> str:
        out = io.StringIO()
        for line in self.source.splitlines():
            out.write(f"# {line}\n")
        w = csv.writer(out, lineterminator="\n")
        cols = REQUIRED + (OPTIONAL if self.has_cap else OPTIONAL[:2])
        w.writerow(cols)
        prev = None
        for r in self.rows:
            key = r.key()
            if key != prev:
                w.writerow([_fmt(getattr(r, k)) for k in cols])
            prev = key
        return out.getvalue()


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _num(text: str, where: str, col: str, whole: bool) -> float | int:
    try:
        v = float(text)
    except ValueError:
        raise SpecError(f"{where}: {col} must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise SpecError(f"{where}: {col} must be a finite number, got {text!r}")
    if whole:
        if not v.is_integer():
            raise SpecError(f"{where}: {col} must be a whole number, got {text!r}")
        return int(v)
    return v


def _parse_row(rec: dict[str, str], where: str) -> TraceRow:
    vals: dict[str, Any] = {}
    for col in REQUIRED:
        text = (rec.get(col) or "").strip()
        if not text:
            raise SpecError(f"{where}: missing value for {col}")
        vals[col] = _num(text, where, col, col != "response_len_mean")
    for col in OPTIONAL:
        text = (rec.get(col) or "").strip()
        vals[col] = _num(text, where, col, False) if text else None
    if vals["step"] < 0:
        raise SpecError(f"{where}: step must be >= 0, got {vals['step']}")
    for col in ("response_len_mean", "response_len_max", "gpus"):
        if not vals[col] > 0:
            raise SpecError(f"{where}: {col} must be > 0, got {vals[col]}")
    cap = vals["response_len_cap"]
    if cap is not None:
        if not float(cap).is_integer() or cap <= 0:
            raise SpecError(f"{where}: response_len_cap must be a whole number > 0, got {cap}")
        cap = vals["response_len_cap"] = int(cap)
        if vals["response_len_max"] > cap:
            raise SpecError(f"{where}: response_len_max({vals['response_len_max']}) > response_len_cap({cap}): the "
                            f"observed longest response cannot exceed the cap")
    if vals["response_len_mean"] > vals["response_len_max"]:
        raise SpecError(f"{where}: response_len_mean({vals['response_len_mean']}) > "
                        f"response_len_max({vals['response_len_max']})")
    p90 = vals["response_len_p90"]
    if p90 is not None and not 0 < p90 <= vals["response_len_max"]:
        raise SpecError(f"{where}: response_len_p90({p90}) must be in (0, response_len_max({vals['response_len_max']})]")
    return TraceRow(**vals)


def parse_trace(text: str, name: str = "trace") -> Trace:
    """Parse CSV text; sparse steps are expanded so that every step has a row."""
    lines = text.splitlines()
    comments = [ln.lstrip("#").strip() for ln in lines if ln.lstrip().startswith("#")]
    body = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")]
    if not body:
        raise SpecError(f"{name}: no header row (need columns {', '.join(REQUIRED)})")
    header = [c.strip() for c in next(csv.reader([body[0][1]]))]
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise SpecError(f"{name}: missing column(s) {missing}; required: {list(REQUIRED)}")
    unknown = [c for c in header if c not in REQUIRED + OPTIONAL]
    if unknown:
        raise SpecError(f"{name}: unknown column(s) {unknown}; known: {list(REQUIRED + OPTIONAL)}")
    sparse: list[TraceRow] = []
    for lineno, ln in body[1:]:
        cells = next(csv.reader([ln]))
        if len(cells) != len(header):
            raise SpecError(f"{name} line {lineno}: {len(cells)} values for {len(header)} columns")
        row = _parse_row(dict(zip(header, cells)), f"{name} line {lineno}")
        if sparse and row.step <= sparse[-1].step:
            raise SpecError(f"{name} line {lineno}: step {row.step} does not follow step {sparse[-1].step}")
        if row.step - (sparse[0].step if sparse else row.step) >= MAX_STEPS:
            raise SpecError(f"{name} line {lineno}: step {row.step} makes the trace longer than {MAX_STEPS:,} steps "
                            f"(from step {sparse[0].step})")
        sparse.append(row)
    if not sparse:
        raise SpecError(f"{name}: header only, no steps")
    dense: list[TraceRow] = []
    for cur, nxt in zip(sparse, sparse[1:] + [None]):
        end = cur.step + 1 if nxt is None else nxt.step
        dense.extend(replace(cur, step=s) for s in range(cur.step, end))
    return Trace(name=name, rows=tuple(dense), source="\n".join(comments))


def load_trace(path: str | Path) -> Trace:
    """Load a trace file, or a shipped trace by name (``ramp_1024``, ``r1zero_linear``, ...)."""
    p = Path(path)
    if not p.exists() and str(path) in SHIPPED:
        p = TRACE_DIR / f"{path}.csv"
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError(f"trace not found: {p} (shipped traces: {', '.join(SHIPPED)})") from None
    except IsADirectoryError:
        raise SpecError(f"expected a trace file, got a directory: {p}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from None
    return parse_trace(text, p.stem)


def trace_from_log(path: str | Path, *, cap: int, gpus: int, name: str | None = None) -> Trace:
    """A trace from a job's own log (verl console lines, JSONL or CSV; read by
    ``nereus.calibration.logs.read_log``): per logged step its mean and observed longest response
    (``response_length/max``) and prompt length; ``cap`` is the trainer's response limit (the log does
    not carry it) and ``gpus`` the GPUs the job ran on. Steps are renumbered from 0 in log order."""
    from nereus.calibration.logs import read_log

    table = read_log(path)
    frame = table.frame.sort_values("step", kind="stable")
    rows = []
    for i, rec in enumerate(frame.to_dict("records")):
        mean = float(rec["response_len_mean"])
        mx = rec.get("response_len_max")
        mx = int(round(mx)) if mx is not None and mx == mx and mx >= 1 else cap
        if mx > cap:
            raise SpecError(f"{path}: step {rec['step']:g} logs a response of {mx} tokens, longer than the cap {cap} "
                            f"(pass the trainer's limit with --response-len-cap)")
        prompt = rec.get("prompt_len")
        rows.append(TraceRow(step=i, response_len_mean=min(max(mean, 1.0), float(mx)), response_len_max=max(mx, 1),
                             gpus=int(gpus), prompt_len_mean=None if prompt is None or prompt != prompt else float(prompt),
                             response_len_cap=int(cap)))
    src = f"from job log {path} ({len(rows)} steps; cap {cap} and {gpus} GPUs given on the command line)"
    return Trace(name=name or Path(path).stem, rows=tuple(rows), source=src)


def looks_like_trace_csv(path: str | Path) -> bool:
    """Whether ``path`` is a trace CSV (its header has the trace's required columns)."""
    p = Path(path)
    if p.suffix.lower() != ".csv" or not p.is_file():
        return False
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError):
        return False  # not a readable text file: the log reader names the problem
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            header = {c.strip() for c in line.split(",")}
            return all(c in header for c in REQUIRED)
    return False


def as_logged(trace: Trace, prompts: int, samples: int, seed: int = 0, name: str | None = None) -> Trace:
    """``trace`` as a job would log it: per step, ``prompts x samples`` responses drawn from the
    row's length distribution (``truth.lengths``: an empirically shaped mixture, a gamma body fitted
    to published RL runs and the spike of responses cut at the cap); the row becomes their mean and
    longest (``response_len_max``), with the cap in ``response_len_cap``. Every step then differs,
    by the sampling noise a real run shows."""
    import numpy as np

    from nereus.simulator.truth.lengths import LengthSampler

    rows = trace.rows
    sampler = LengthSampler(prompts, samples, seed=seed + 1_000_003)
    steps = np.array([r.step for r in rows])
    mean = np.array([r.response_len_mean for r in rows], float)
    p90 = np.array([np.nan if r.response_len_p90 is None else r.response_len_p90 for r in rows], float)
    cap = np.array([r.cap for r in rows], float)
    out = []
    for lo in range(0, len(rows), 256):
        hi = min(len(rows), lo + 256)
        lengths = sampler.sample(steps[lo:hi], mean[lo:hi], p90[lo:hi], cap[lo:hi])
        for k, r in enumerate(rows[lo:hi]):
            x = lengths[k]
            out.append(replace(r, response_len_mean=round(float(x.mean()), 1), response_len_max=int(x.max()),
                               response_len_p90=None, response_len_cap=r.cap))
    src = (f"{trace.source}\nAs logged: per step {prompts} x {samples} responses sampled from the row's length "
           f"distribution (seed {seed}); mean and longest of the sample, cap in response_len_cap.")
    return Trace(name=name or f"{trace.name}_logged", rows=tuple(out), source=src)


def constant_trace(w: Workload, gpus: int, steps: int, name: str = "constant") -> Trace:
    """``steps`` steps of one workload on ``gpus`` GPUs (``response_len_max`` is the cap)."""
    row = TraceRow(step=0, response_len_mean=float(w.response_len_mean), response_len_max=int(w.response_len_max),
                   gpus=int(gpus), response_len_p90=w.response_len_p90, prompt_len_mean=float(w.prompt_len))
    return Trace(name=name, rows=tuple(replace(row, step=i) for i in range(steps)))
