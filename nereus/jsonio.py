"""Reading spec files: JSON with one-line errors that name the file and the problem, and the
field checks every ``from_dict`` uses; writing output files atomically."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from nereus.errors import SpecError

MAX_WHOLE = 2**53
"""Largest whole number a spec field takes: every integer up to it is exact as a float, which the
cost model turns it into."""


def read_text(path: str | Path, what: str, hint: str = "") -> str:
    """Text of ``path``; SpecError naming ``what`` (e.g. "plan", "job log") on a missing file, a
    directory, a path the system cannot open, or bytes that are not UTF-8 text."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{what} not found: {p}{hint}") from None
    except IsADirectoryError:
        raise SpecError(f"{what}: expected a file, got a directory: {p}") from None
    except UnicodeDecodeError as e:
        raise SpecError(f"{what} {p}: cannot read as text (byte {e.start} is not UTF-8: "
                        f"{e.object[e.start:e.start + 1]!r})") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, a NUL byte in the path
        raise SpecError(f"{what} {p}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def read_json(path: str | Path, what: str, hint: str = "") -> Any:
    """Parsed JSON of ``path`` (errors as ``read_text``, plus invalid JSON with its line number)."""
    text = read_text(path, what, hint)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise SpecError(f"{what} {path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise SpecError(f"{what} {path}: not valid JSON ({str(e).split(':')[0]})") from None


def one_line(text: str) -> str:
    """``text`` with its line breaks (and the spaces around them) turned into single spaces."""
    return re.sub(r"\s*[\r\n]+\s*", " ", text).strip()


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Inside the block, a SpecError gets ``path`` as a prefix (unless its message names it
    already) and is made one line, so every reader's error says which file is wrong."""
    try:
        yield
    except SpecError as e:
        msg = one_line(str(e))
        raise SpecError(msg if str(path) in msg else f"{path}: {msg}") from None


def number(owner: str, name: str, v: Any, *, whole: bool = False, minimum: float = 0.0,
           allow_min: bool = True, maximum: float | None = None) -> Any:
    """``v`` when it is a finite number (a whole one if ``whole``; never a bool) within
    [``minimum``, ``maximum``] (``minimum`` itself excluded unless ``allow_min``); else a SpecError
    naming ``owner``, the field and the value. Whole numbers stop at MAX_WHOLE."""
    kind = "whole number" if whole else "number"
    if isinstance(v, bool) or not isinstance(v, int if whole else (int, float)):
        raise SpecError(f"{owner}: {name} must be a {kind}, got {short_repr(v)}")
    if not whole and not _finite(v):
        raise SpecError(f"{owner}: {name} must be a finite number, got {short_repr(v)}")
    if not (v >= minimum if allow_min else v > minimum):
        raise SpecError(f"{owner}: {name} must be {'>=' if allow_min else '>'} {minimum:g}, got {short_repr(v)}")
    top = MAX_WHOLE if whole and maximum is None else maximum
    if top is not None and v > top:
        raise SpecError(f"{owner}: {name} must be <= {top:g}, got {short_repr(v)}")
    return v


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past float range
        return False


def short_repr(v: Any) -> str:
    """repr of ``v``, cut to 60 characters (a 5,000-digit number or a long string stays readable)."""
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-12:]} ({len(text)} characters)"


def check_keys(owner: str, d: Mapping[str, Any], known: set[str] | frozenset[str],
               required: tuple[str, ...] = ()) -> None:
    """SpecError unless ``d`` is a mapping with no field outside ``known`` and every ``required`` one."""
    if not isinstance(d, Mapping):
        raise SpecError(f"{owner}: expected a mapping, got {type(d).__name__}")
    unknown = set(d) - set(known)
    if unknown:
        shown = ", ".join(short_repr(k) for k in sorted(unknown, key=str))
        raise SpecError(f"{owner}: unknown field(s) [{shown}]; known: {sorted(known)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise SpecError(f"{owner}: missing field(s) {missing}")


@contextlib.contextmanager
def atomic_path(path: str | Path, what: str = "", suffix: str | None = None) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write, ending in ``suffix`` (default:
    ``path``'s, for writers that go by it); when the block ends without error, ``os.replace`` moves
    it onto ``path``, so a reader sees the old file or the whole new one, never half. On an error the
    temporary file is removed and ``path`` is left as it was; an OSError becomes a one-line
    SpecError naming ``path``."""
    p = Path(path)
    label = f"cannot write {what + ' ' if what else ''}{p}"
    if p.is_dir():
        raise SpecError(f"{label}: it is a folder")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        end = p.suffix[:20] if suffix is None else suffix
        fd, name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name[:60]}.", suffix=f".tmp{end}")
        os.close(fd)
        os.unlink(name)  # the writer creates it, with the usual permissions
    except OSError as e:
        raise SpecError(f"{label}: {e.strerror or e}") from None
    tmp = Path(name)
    try:
        yield tmp
        if tmp.exists():
            os.replace(tmp, p)
    except OSError as e:
        raise SpecError(f"{label}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_atomic(path: str | Path, data: str | bytes, what: str = "") -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically (see ``atomic_path``)."""
    with atomic_path(path, what) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")
    return Path(path)
