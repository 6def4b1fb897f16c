"""Reading spec files: JSON with one-line errors that name the file and the problem, and the
field check every ``from_dict`` uses."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError


def read_text(path: str | Path, what: str, hint: str = "") -> str:
    """Text of ``path``; SpecError naming ``what`` (e.g. "plan", "job log") on a missing file, a
    directory or bytes that are not text."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise SpecError(f"{what} not found: {p}{hint}") from None
    except IsADirectoryError:
        raise SpecError(f"{what}: expected a file, got a directory: {p}") from None
    except UnicodeDecodeError:
        raise SpecError(f"{what} {p}: cannot read as text") from None


def read_json(path: str | Path, what: str, hint: str = "") -> Any:
    """Parsed JSON of ``path`` (errors as ``read_text``, plus invalid JSON with its line number)."""
    text = read_text(path, what, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno})") from None


def check_keys(owner: str, d: Mapping[str, Any], known: set[str] | frozenset[str],
               required: tuple[str, ...] = ()) -> None:
    """SpecError unless ``d`` is a mapping with no field outside ``known`` and every ``required`` one."""
    if not isinstance(d, Mapping):
        raise SpecError(f"{owner}: expected a mapping, got {type(d).__name__}")
    unknown = set(d) - set(known)
    if unknown:
        raise SpecError(f"{owner}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise SpecError(f"{owner}: missing field(s) {missing}")
