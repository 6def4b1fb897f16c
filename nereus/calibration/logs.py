"""Job-log ingestion: per-step timing logs that RL frameworks already write, turned into per-stage
correction factors for the cost model, so a user can calibrate against their own cluster from
logs alone.

Accepted formats (``fmt="auto"`` tells them apart: ``.csv`` is CSV; a file whose first record line
opens with ``{`` is JSONL; a file with ``step:N - `` records is a verl console log):

- **JSONL**: one JSON object per line (verl's file logger, a W&B ``history`` dump).
- **CSV** with a header row, including W&B CSV exports of a run's history (``_step`` is the step;
  W&B's other ``_``-prefixed columns, ``_runtime`` and ``_timestamp``, are ignored quietly).
- **verl console log**: verl's console logger prints one line per step,
  ``step:12 - actor/pg_loss:0.01 - timing_s/gen:35.2 - response_length/mean:812.5 - ...``
  (``verl/utils/logger/aggregate_logger.py``, ``concat_dict_to_str`` in the verl 0.9.1 wheel;
  real lines in verl-project/verl issues #2060 and #7412). Values are ``pprint.pformat`` of
  numbers, so NumPy scalars appear as ``np.float64(35.2)``. Lines may carry a Ray prefix
  (``(TaskRunner pid=2412) step:1 - ...``) or colour codes; other lines (Ray, progress bars) are
  not records. Records with neither a timer nor a response length (validation lines such as
  ``step:0 - val-core/...``) are skipped and counted in one message.

Accepted keys (anything else is reported once and ignored):

================================  =====================================================
key                               meaning
================================  =====================================================
``timing_s/gen``                  actor/generation seconds (verl; also ``timing_s/generate_sequences``)
``timing_s/old_log_prob``         actor/inference seconds (verl)
``timing_s/ref``                  ref/inference seconds (verl; also ``timing_s/ref_log_prob``)
``timing_s/values``               critic/inference seconds (verl)
``timing_s/reward``               reward/inference seconds (verl; a model reward)
``timing_s/update_actor``         actor/training seconds (verl)
``timing_s/update_critic``        critic/training seconds (verl)
``time_s/<model>/<stage>``        the same, Nereus's own spelling (e.g. ``time_s/actor/training``)
``response_length/mean``          mean response tokens this step (required)
``response_length/max``           longest response this step (default: the job's cap)
``prompt_length/mean``            mean prompt tokens (default: the job's prompt_len)
``step``, ``training/global_step``, ``_step``  step number (default: line order)
``timing_s/step`` and other ``timing_s/*``  known verl timers without a model-stage: ignored quietly
================================  =====================================================

Bad input never loses good rows: a malformed line, a non-numeric value or a row without
``response_length/mean`` is skipped with a message naming the line; missing timers leave that
model-stage empty for the row. ``strict=True`` turns the first such message into an error that
names the file and the line.
"""
from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd

from nereus.errors import NereusError, SpecError
from nereus.jsonio import MAX_WHOLE, read_text, short_repr

STAGE_KEYS: dict[str, str] = {
    "timing_s/gen": "actor/generation", "timing_s/generate_sequences": "actor/generation",
    "timing_s/old_log_prob": "actor/inference", "timing_s/ref": "ref/inference",
    "timing_s/ref_log_prob": "ref/inference", "timing_s/values": "critic/inference",
    "timing_s/reward": "reward/inference", "timing_s/update_actor": "actor/training",
    "timing_s/update_critic": "critic/training",
}
WORKLOAD_KEYS = {"response_length/mean": "response_len_mean", "response_length/max": "response_len_max",
                 "prompt_length/mean": "prompt_len"}
STEP_KEYS = ("step", "training/global_step", "_step")
FORMATS = ("auto", "jsonl", "csv", "verl-console")
VERL_RECORD = re.compile(r"(?:^|(?<=[\s)\]]))step:(\d+) - ")
"""Where a verl console record starts in a line (after an optional Ray or logging prefix)."""
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NUMPY_SCALAR = re.compile(r"^np\.(?:float|int|uint)\d*\((.*)\)$")
REQUIRED = "response_length/mean"
MIN_STAGE_S = 1e-6
"""Shortest stage time taken as a measurement; a positive one below it (3e-282 s) is a corrupt value,
and fitting a factor to it overflows."""


def stage_of_key(key: str) -> str | None:
    if key in STAGE_KEYS:
        return STAGE_KEYS[key]
    if key.startswith("time_s/") and key.count("/") == 2:
        return key[len("time_s/"):]
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class LogTable:
    """Good rows of a job log (one per step) and every problem met while reading it."""

    frame: pd.DataFrame
    """Columns: step, prompt_len, response_len_mean, response_len_max, then one column of seconds
    per model-stage found (NaN where a row lacks it)."""
    issues: tuple[str, ...]
    source: str
    lines: int

    @property
    def model_stages(self) -> tuple[str, ...]:
        return tuple(c for c in self.frame.columns if "/" in c)


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int) and abs(v) > 2**1023:
        return None  # past float range
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(v) else None
    if isinstance(v, str) and v.strip():
        try:
            x = float(v)
            return x if math.isfinite(x) else None
        except ValueError:
            return None
    return None


def _row(record: Mapping[str, Any], where: str, issues: list[str], unknown: set[str]) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for key, raw in record.items():
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            continue  # an empty CSV cell is a missing value, not an error
        stage = stage_of_key(key)
        field = stage or WORKLOAD_KEYS.get(key) or ("step" if key in STEP_KEYS else None)
        if field is None:
            if not key.startswith(("timing_s/", "_")):  # verl timers without a model-stage; W&B's own columns
                unknown.add(key)
            continue
        x = _number(raw)
        if x is None or x < 0:
            issues.append(f"{where}: {key}={short_repr(raw)} is not a non-negative number; value dropped")
            continue
        if x > MAX_WHOLE:  # no length, step or time is this large; the cost model would overflow on it
            issues.append(f"{where}: {key}={short_repr(raw)} is above {MAX_WHOLE:.4g}; value dropped")
            continue
        if stage and 0 < x < MIN_STAGE_S:
            issues.append(f"{where}: {key}={short_repr(raw)} s is below {MIN_STAGE_S:g} s; value dropped")
            continue
        out[field] = x
    if "response_len_mean" not in out:
        issues.append(f"{where}: missing {REQUIRED}; row skipped")
        return None
    if not any("/" in k for k in out):
        issues.append(f"{where}: no stage timer (e.g. timing_s/gen, timing_s/update_actor); row skipped")
        return None
    return out


def detect_format(path: Path, text: str) -> str:
    """``csv`` by suffix; ``jsonl`` when the first non-empty line opens a JSON object; ``verl-console``
    when any line holds a verl ``step:N - `` record; else ``jsonl`` (whose errors then say why)."""
    if path.suffix.lower() == ".csv":
        return "csv"
    lines = text.splitlines()
    first = next((x.strip() for x in lines if x.strip()), "")
    if first.startswith("{"):
        return "jsonl"
    return "verl-console" if any(VERL_RECORD.search(ANSI.sub("", x)) for x in lines) else "jsonl"


def _csv_records(text: str, issues: list[str]) -> list[tuple[str, Mapping[str, Any]]]:
    reader = csv.reader(text.splitlines())
    try:
        header = next(reader)
    except StopIteration:
        return []
    out = []
    for n, cells in enumerate(reader, start=2):
        if not any(c.strip() for c in cells):
            continue
        if len(cells) != len(header):
            issues.append(f"line {n}: {len(cells)} fields, header has {len(header)}; row skipped")
            continue
        out.append((f"line {n}", dict(zip(header, cells))))
    return out


def _jsonl_records(text: str, issues: list[str]) -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            issues.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno}); row skipped")
            continue
        except (RecursionError, ValueError) as e:  # nested too deeply; an integer of over 4,300 digits
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0]
            issues.append(f"line {n}: not valid JSON ({why}); row skipped")
            continue
        if not isinstance(rec, dict):
            issues.append(f"line {n}: expected a JSON object, got {type(rec).__name__}; row skipped")
            continue
        out.append((f"line {n}", rec))
    return out


def parse_verl_line(line: str) -> dict[str, str] | None:
    """One verl console record as {key: value text}, or None when the line holds none.
    Raises ValueError naming the field that is not ``key:value``.

    >>> parse_verl_line("(TaskRunner pid=7) step:3 - timing_s/gen:np.float64(35.2) - response_length/mean:812.5")
    {'step': '3', 'timing_s/gen': '35.2', 'response_length/mean': '812.5'}"""
    line = ANSI.sub("", line).rstrip()
    m = VERL_RECORD.search(line)
    if m is None:
        return None
    out = {"step": m.group(1)}
    for i, field in enumerate(line[m.end():].split(" - "), start=2):
        key, sep, value = field.strip().rpartition(":")
        if not sep or not key:
            raise ValueError(f"field {i} {field.strip()!r} is not key:value")
        value = value.strip()
        scalar = NUMPY_SCALAR.match(value)
        out[key.strip()] = scalar.group(1) if scalar else value
    return out


def _verl_console_records(text: str, issues: list[str]) -> list[tuple[str, Mapping[str, Any]]]:
    out, quiet = [], []
    for n, line in enumerate(text.splitlines(), start=1):
        try:
            rec = parse_verl_line(line)
        except ValueError as e:
            issues.append(f"line {n}: {e}; row skipped")
            continue
        if rec is None:
            continue
        if not any(k.startswith(("timing_s/", "time_s/")) or k in WORKLOAD_KEYS for k in rec):
            quiet.append(n)  # a validation line: no timers, no lengths
            continue
        out.append((f"line {n}", rec))
    if quiet:
        shown = ", ".join(map(str, quiet[:8])) + (" ..." if len(quiet) > 8 else "")
        issues.append(f"skipped {len(quiet)} step record(s) without timers or lengths (validation?): line {shown}")
    return out


def _records(path: Path, text: str, issues: list[str], fmt: str = "auto") -> list[tuple[str, Mapping[str, Any]]]:
    fmt = detect_format(path, text) if fmt == "auto" else fmt
    if fmt == "csv":
        return _csv_records(text, issues)
    if fmt == "verl-console":
        return _verl_console_records(text, issues)
    return _jsonl_records(text, issues)


def read_log(path: str | Path, *, fmt: str = "auto", strict: bool = False) -> LogTable:
    """Read a job log (JSONL, CSV / W&B export, or verl console log; see the module docstring).
    Raises when the file is missing or has no usable row, and with ``strict`` at the first line
    that is malformed or holds a bad value."""
    if fmt not in FORMATS:
        raise SpecError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    p = Path(path)
    text = read_text(p, "job log")
    issues: list[str] = []
    unknown: set[str] = set()
    recs = _records(p, text, issues, fmt)
    rows = []
    for where, rec in recs:
        r = _row(rec, where, issues, unknown)
        if r is not None:
            rows.append(r)
    if strict:
        bad = sorted((i for i in issues if i.startswith("line ")), key=lambda i: int(i.split()[1].rstrip(":")))
        if bad:
            raise SpecError(f"job log {p}: {bad[0]} ({len(bad)} problem line(s); without --strict they are skipped)")
    if unknown:
        shown = sorted(unknown)
        more = f" and {len(shown) - 12} more" if len(shown) > 12 else ""
        issues.append(f"ignored {len(shown)} unknown key(s): {', '.join(shown[:12])}{more}")
    if not rows:
        detail = f"; first problem: {issues[0]}" if issues else ""
        raise SpecError(f"job log {p}: no usable rows in {len(recs)} record(s){detail}")
    df = pd.DataFrame(rows)
    if "step" not in df:
        df["step"] = np.arange(len(df), dtype=float)
    df["step"] = df["step"].fillna(pd.Series(np.arange(len(df), dtype=float)))
    stages = sorted(c for c in df.columns if "/" in c)
    base = [c for c in ("step", "prompt_len", "response_len_mean", "response_len_max") if c in df]
    return LogTable(frame=df[base + stages].reset_index(drop=True), issues=tuple(issues), source=str(p),
                    lines=len(text.splitlines()))


# ---- fit ---------------------------------------------------------------------------------------------
def row_workload(job: Any, row: Mapping[str, Any]) -> Any:
    """The job's workload with this step's observed lengths."""
    w = job.workload()
    mx = row.get("response_len_max")
    mx = int(mx) if mx is not None and not math.isnan(mx) and mx >= 1 else w.response_len_max
    mean = min(float(row["response_len_mean"]), mx)
    w = w.with_lengths(mean=max(mean, 1.0), max_=mx)
    pl = row.get("prompt_len")
    if pl is not None and not math.isnan(pl) and pl >= 1:
        from dataclasses import replace

        w = replace(w, prompt_len=int(round(pl)))
    return w


def fit_from_logs(table: LogTable, job: Any, cluster: Any, configs: Mapping[str, Any], params: Any = None,
                  heldout_every: int = 4) -> dict[str, Any]:
    """Per-stage correction factors that bring ``cost.estimate`` onto the logged times.

    ``configs`` maps each model-stage to the ParallelConfig it ran with. Every ``heldout_every``-th
    row (by position) is held out and scores the fit. Returns the fitted CostParams, the factors,
    and an error table (analytic = ``params`` as given, predicted = with fitted factors)."""
    from dataclasses import replace as _replace

    from nereus.calibration.fit import fit_positive, mape
    from nereus.planner.cost.model import estimate
    from nereus.planner.cost.params import STAGES, CostParams

    base = params or CostParams()
    base = base.with_stage_factors(**{s: 1.0 for s in STAGES})
    points = []  # (row position, model-stage, stage, measured, unit prediction)
    for i, row in enumerate(table.frame.to_dict("records")):
        w = row_workload(job, row)
        for ms in table.model_stages:
            t = row.get(ms)
            if t is None or math.isnan(t) or t <= 0:
                continue
            if ms not in configs:
                raise SpecError(f"log has {ms} timings but no parallel config for it (plan or --tp/--pp/--dp)")
            unit = estimate(job, cluster, ms, configs[ms], w, base).time_s
            if math.isfinite(unit) and unit > 0:
                points.append((i, ms, ms.split("/")[1], float(t), unit))
    if not points:
        raise SpecError(f"job log {table.source}: no row has a stage time the job can predict")
    held = [p for p in points if p[0] % heldout_every == heldout_every - 1]
    fit_pts = [p for p in points if p[0] % heldout_every != heldout_every - 1] or points
    stages = [s for s in STAGES if any(p[2] == s for p in fit_pts)]
    names = [f"factor_{s}" for s in stages]

    def predict(v: dict[str, float], pts: list) -> np.ndarray:
        return np.array([p[4] * v.get(f"factor_{p[2]}", 1.0) for p in pts])

    try:
        pf = fit_positive(names, [1.0] * len(names), lambda v: predict(v, fit_pts), [p[3] for p in fit_pts])
    except NereusError:
        raise
    except (ValueError, ArithmeticError, np.linalg.LinAlgError) as e:  # scipy on values it cannot fit
        raise SpecError(f"job log {table.source}: the stage times cannot be fitted ({e})") from None
    factors = {n[len("factor_"):]: x for n, x in pf.as_dict().items()}
    fitted = _replace(params or CostParams()).with_stage_factors(**factors)
    before_f = dict((params or CostParams()).stage_factor)
    rows = [{"what": f"step {table.frame['step'].iloc[p[0]]:g} {p[1]}", "stage": p[2], "measured_s": p[3],
             "analytic_s": p[4] * before_f.get(p[2], 1.0), "predicted_s": p[4] * factors.get(p[2], 1.0)}
            for p in held]
    err = pd.DataFrame(rows, columns=["what", "stage", "measured_s", "analytic_s", "predicted_s"])
    err["ratio"] = err["predicted_s"] / err["measured_s"]
    return {"params": fitted, "factors": factors, "fit_points": len(fit_pts), "fit_mape": pf.fit_mape,
            "table": err, "summary": {"mape_before": mape(err["analytic_s"], err["measured_s"]),
                                      "mape_after": mape(err["predicted_s"], err["measured_s"]),
                                      "points": int(len(err))}}
