"""Audit log of controller decisions: one JSON object per line (JSONL), so a person can check why
the controller switched or stayed: step, forecast, current and candidate step times, transition
cost, break-even steps, decision and reason."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError


def _clean(v: Any) -> Any:
    """JSON has no inf/nan: write them as null (and say so in the field docs)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Mapping):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class AuditLog:
    """Keeps every record in memory (``records``) and appends it to ``path`` when given."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self._fh = None
        if path is not None:
            p = Path(path)
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                self._fh = p.open("w")
            except OSError as e:
                raise SpecError(f"cannot write audit log {p}: {e.strerror}") from None

    def record(self, entry: Mapping[str, Any]) -> None:
        rec = _clean(dict(entry))
        self.records.append(rec)
        if self._fh is not None:
            self._fh.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "AuditLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_audit(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
