"""Reading JSON files with one-line errors that name the file and the problem."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nereus.errors import SpecError


def read_json(path: str | Path, what: str, hint: str = "") -> Any:
    """Parsed JSON of ``path``; SpecError naming ``what`` (e.g. "plan", "profile") on a missing file,
    a directory or invalid JSON (with line number)."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise SpecError(f"{what} not found: {p}{hint}") from None
    except IsADirectoryError:
        raise SpecError(f"{what}: expected a file, got a directory: {p}") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} {p}: not valid JSON ({e.msg} at line {e.lineno})") from None
