"""The corpus of published measurements: one row per number someone published, read from the CSV
files of ``nereus/calibration/published`` (or any directory laid out the same way) and checked.

Every file has the same columns; ``config`` is ``key=value`` pairs separated by ``;``. The split
(``fit`` / ``heldout``) is fixed per source in the files: fitting reads only ``fit`` rows
(``fit_rows``), and a test holds it to that.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from nereus.errors import SpecError
from nereus.jsonio import naming
from nereus.planner.specs import MAX_GPUS

CATEGORIES = ("decode", "prefill", "collectives", "training", "rl_stages", "host", "async", "memory", "moe")
"""``host``: framework time on the CPU that FLOP and byte counts miss: an inference engine's per
decode iteration outside the forward (scheduler, input preparation, sampling, output processing)
at a stated batch; eager PyTorch's per decoder layer and pass; FSDP's hooks per unit and pass.
``async``: asynchronous RL runs (rollout and trainer on disjoint pools), always held out.
``memory``: published peak memory per GPU with its configuration (a training step's allocator peak,
allocated or reserved; an inference engine's weights and KV-cache pool at its memory fraction).
``moe``: mixture-of-experts runs with their expert layout (ep / etp as the source states), always
held out; the other categories' files keep their MoE rows unpredicted (``catalog.resolve_model``),
so no fit reads a MoE measurement."""
HELDOUT_ONLY = ("async", "moe")
"""Categories no fit may ever read: a row of them in the fit split is refused, except an ``async``
row of ``stage=weight_sync`` (``FIT_STAGES``)."""
FIT_STAGES = {"async": ("weight_sync",)}
"""Stages of a held-out category a fit may read: a weight sync between disjoint pools measured on
its own (a checkpoint engine's benchmark) is a transfer, like a collective; it fits
``weight_sync_tensor_s`` (``fit.weight_sync_tensor_s``) and nothing else, and no async step row is
ever in the fit split."""
COLUMNS = ("id", "source", "source_kind", "hardware", "gpus", "model", "engine", "config", "metric", "unit", "value",
           "derived", "split", "notes")
SPLITS = ("fit", "heldout")
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "calibration" / "published"


@dataclass(frozen=True, slots=True)
class Row:
    """One published number and what it was measured on."""

    id: str
    category: str
    source: str
    hardware: str
    gpus: int
    model: str
    engine: str
    config: Mapping[str, str]
    metric: str
    unit: str
    value: float
    derived: bool
    split: str
    notes: str

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.config.get(key, default)

    def num(self, key: str, default: float | None = None) -> float | None:
        """A config value as a number; None (or ``default``) when absent or not numeric."""
        v = self.config.get(key)
        try:
            return float(v) if v is not None else default
        except ValueError:
            return default


def _parse_config(text: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (x.strip() for x in text.split(";"))):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SpecError(f"{where}: config entry {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def load_file(path: Path, category: str) -> list[Row]:
    """Rows of one corpus file; a malformed file is a one-line SpecError naming file, line and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a UTF-8 text file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    try:
        with naming(path):
            return _rows(path, category, csv.DictReader(text.splitlines()))
    except csv.Error as e:  # a NUL byte, a field past the csv module's size limit
        raise SpecError(f"{path}: not a readable CSV file ({e})") from None


def _rows(path: Path, category: str, reader: csv.DictReader) -> list[Row]:
    if reader.fieldnames is None or tuple(reader.fieldnames) != COLUMNS:
        raise SpecError(f"{path}: header must be {','.join(COLUMNS)}, got {','.join(reader.fieldnames or [])[:200]!r}")
    rows = []
    for i, r in enumerate(reader, start=2):
        where = f"{path}:{i}"
        if None in r or any(v is None for v in r.values()):
            raise SpecError(f"{where}: expected {len(COLUMNS)} fields")
        try:
            value = float(r["value"])
        except ValueError:
            raise SpecError(f"{where}: value {r['value']!r} is not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise SpecError(f"{where}: value must be a finite number > 0, got {r['value']}")
        if r["split"] not in SPLITS:
            raise SpecError(f"{where}: split must be fit or heldout, got {r['split']!r}")
        if category in HELDOUT_ONLY and r["split"] != "heldout" and not _fit_stage(category, r["config"], where):
            raise SpecError(f"{where}: {category} rows are held out from every fit (split heldout), got {r['split']!r}")
        if r["derived"] not in ("0", "1"):
            raise SpecError(f"{where}: derived must be 0 or 1, got {r['derived']!r}")
        try:
            gpus = int(r["gpus"]) if r["gpus"] else 0
        except ValueError:
            raise SpecError(f"{where}: gpus {r['gpus'][:40]!r} is not a whole number") from None
        if not 0 <= gpus <= MAX_GPUS:
            raise SpecError(f"{where}: gpus must be between 0 (unstated) and {MAX_GPUS}, got {gpus}")
        if not r["id"]:
            raise SpecError(f"{where}: empty id")
        rows.append(Row(id=r["id"], category=category, source=r["source"], hardware=r["hardware"].strip().lower(),
                        gpus=gpus, model=r["model"], engine=r["engine"], config=_parse_config(r["config"], where),
                        metric=r["metric"], unit=r["unit"], value=value, derived=r["derived"] == "1",
                        split=r["split"], notes=r["notes"]))
    return rows


def _fit_stage(category: str, config: str, where: str) -> bool:
    return _parse_config(config, where).get("stage") in FIT_STAGES.get(category, ())


def load_corpus(directory: str | Path | None = None) -> list[Row]:
    """Every row of every category file in ``directory`` (default: the shipped corpus). Ids are
    unique, and each source sits in one split only."""
    d = Path(directory) if directory is not None else DEFAULT_DIR
    if not d.is_dir():
        raise SpecError(f"corpus directory not found: {d}")
    files = [(d / f"{c}.csv", c) for c in CATEGORIES if (d / f"{c}.csv").exists()]
    if not files:
        raise SpecError(f"{d}: no corpus file ({', '.join(c + '.csv' for c in CATEGORIES)})")
    rows = [r for path, c in files for r in load_file(path, c)]
    seen: dict[str, str] = {}
    split_of: dict[str, str] = {}
    for r in rows:
        if r.id in seen:
            raise SpecError(f"{d}: id {r.id!r} appears twice ({seen[r.id]} and {r.category})")
        seen[r.id] = r.category
        if split_of.setdefault(r.source, r.split) != r.split:
            raise SpecError(f"{d}: source {r.source[:80]!r} has rows in both splits (row {r.id})")
    return rows


def fit_rows(rows: list[Row]) -> list[Row]:
    """The rows a fit may read: the fit split only."""
    return [r for r in rows if r.split == "fit"]
