"""Workload traces: per RL step, response-length statistics and the GPUs the job may use.

CSV format (a public contract, see README "File formats"): lines starting with ``#`` are comments
(shipped traces cite their sources there); then a header row. Required columns
``step,response_len_mean,response_len_max,gpus``; optional ``response_len_p90,prompt_len_mean``.
Steps are whole numbers in increasing order and may be sparse: a row's values hold until the next
row, so ``0,...`` and ``100,...`` describe 100 steps with the first row's values.

``response_len_max`` is the step's length limit (the trainer's response cap, which it knows before
the step runs); ``response_len_mean``/``p90`` are outcomes, known only after generation. ``gpus`` is
what the cluster manager grants for the step (known before it runs).
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nereus.errors import SpecError
from nereus.planner.specs import Workload

REQUIRED = ("step", "response_len_mean", "response_len_max", "gpus")
OPTIONAL = ("response_len_p90", "prompt_len_mean")
SHIPPED = ("r1zero_linear", "deepscaler_staged", "ramp_1024")
TRACE_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRow:
    step: int
    response_len_mean: float
    response_len_max: int
    gpus: int
    response_len_p90: float | None = None
    prompt_len_mean: float | None = None

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

    def workload(self, i: int, base: Workload) -> Workload:
        """The workload of row ``i``: batch size from ``base``, lengths from the trace."""
        r = self.rows[i]
        prompt = base.prompt_len if r.prompt_len_mean is None else max(1, round(r.prompt_len_mean))
        p90 = None if r.response_len_p90 is None else min(float(r.response_len_p90), float(r.response_len_max))
        return replace(base, prompt_len=prompt, response_len_mean=min(r.response_len_mean, r.response_len_max),
                       response_len_max=r.response_len_max, response_len_p90=p90)

    def head(self, n: int) -> "Trace":
        return replace(self, rows=self.rows[:n])

    def to_csv(self) -> str:
        out = io.StringIO()
        for line in self.source.splitlines():
            out.write(f"# {line}\n")
        w = csv.writer(out, lineterminator="\n")
        w.writerow(REQUIRED + OPTIONAL)
        prev = None
        for r in self.rows:
            key = (r.response_len_mean, r.response_len_max, r.gpus, r.response_len_p90, r.prompt_len_mean)
            if key != prev:
                w.writerow([_fmt(getattr(r, k)) for k in REQUIRED + OPTIONAL])
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
    return parse_trace(text, p.stem)
