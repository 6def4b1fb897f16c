"""The command transcripts in the README and docs are what the commands print today.

Every fenced block that holds ``$ nereus plan|estimate|transition ...`` lines is re-run (in a temp
dir, in order, so a later command can read an earlier one's ``--json`` file), and every line the
page shows under a command must appear in what it printed: whitespace collapsed, ``...`` a
wildcard, solver and planning wall times masked (they are measured, not predicted). ``$ cat FILE``
lines check the file the block's commands wrote. A page that quotes a step time, a memory figure
or a launch key the code no longer produces fails here, naming the page, the command and the line.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
CHECKED = ("plan", "estimate", "transition")
"""Subcommands whose output is a deterministic function of the repo (seconds-long solves)."""
TIMING = [
    (re.compile(r"(cpsat|pulp|greedy|brute) in [0-9.]+ s"), r"\1 in <t> s"),
    (re.compile(r"planning time(\W+)[0-9.]+ s"), r"planning time\1<t> s"),
]


def _norm(text: str) -> str:
    for pat, rep in TIMING:
        text = pat.sub(rep, text)
    return " ".join(text.split())


def blocks(page: str) -> list[list[tuple[str, list[str]]]]:
    """Per fenced block: [(command, [shown output lines])], commands joined over ``\\`` lines."""
    out, cur, inside = [], None, False
    lines = (ROOT / page).read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            if inside and cur:
                out.append(cur)
            inside, cur = not inside, []
            i += 1
            continue
        if inside and line.startswith("$ "):
            cmd = line[2:]
            while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            cur.append((cmd.split("  #")[0].strip(), []))
        elif inside and cur:
            cur[-1][1].append(line)
        i += 1
    return [b for b in out if any(c.startswith("nereus ") for c, _ in b)]


def cases():
    for page in PAGES:
        for k, block in enumerate(blocks(page)):
            first = next(c for c, _ in block if c.startswith("nereus "))
            yield pytest.param(page, block, id=f"{page}#{k}:{first[:60]}")


def _matches(shown: str, printed: str) -> bool:
    parts = [re.escape(p) for p in _norm(shown).split("...")]
    return re.search(".*".join(parts), printed) is not None


@pytest.mark.parametrize("page,block", list(cases()))
def test_documented_output_is_what_the_command_prints(page, block, tmp_path):
    env = {**os.environ, "COLUMNS": "220", "PYTHONPATH": str(ROOT)}
    nereus = [sys.executable, "-m", "nereus.cli"]
    for cmd, shown in block:
        argv = shlex.split(cmd.replace("examples/", f"{ROOT}/examples/"))
        if argv[0] == "cat":
            printed = _norm((tmp_path / argv[1]).read_text())
        elif argv[0] == "nereus" and argv[1] in CHECKED:
            res = subprocess.run(nereus + argv[1:], check=False, cwd=tmp_path, env=env, capture_output=True,
                                 text=True, timeout=300)
            printed = _norm(res.stdout + res.stderr)
            assert res.returncode == 0, f"{page}: `{cmd}` exited {res.returncode}:\n{res.stderr[-2000:]}"
        else:
            continue  # a command this test does not run (slow, or measured): its lines are not checked
        for line in shown:
            if not line.strip() or line.strip() == "..." or set(line.strip()) <= set("┏┳┓┡╇┩└┴┘━─"):
                continue
            assert _matches(line, printed), (
                f"{page}: `{cmd}` no longer prints\n  {line.strip()}\n(printed, normalised):\n{printed[:3000]}")


def test_the_transcript_parser_sees_the_pages_commands():
    """The check above is not vacuous: the README's plan and estimate blocks are found and parsed."""
    cmds = [c for b in blocks("README.md") for c, _ in b]
    assert any(c.startswith("nereus plan ") for c in cmds)
    assert any(c.startswith("nereus estimate ") for c in cmds)
    assert all(shown for b in blocks("README.md") for c, shown in b if c.startswith("nereus estimate"))


PY_PAGES = ("README.md", "docs/api.md")
"""Pages whose ``python`` blocks are complete programs a user would paste and run."""


def python_blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), flags=re.DOTALL | re.MULTILINE)


def _distinct_blocks() -> list[tuple[str, int]]:
    seen, out = set(), []
    for p in PY_PAGES:
        for k, code in enumerate(python_blocks(p)):
            if code not in seen:  # the README's loop is also api.md's: run once
                seen.add(code)
                out.append((p, k))
    return out


@pytest.mark.parametrize("page,k", _distinct_blocks())
def test_every_python_example_runs_as_shown(page, k, tmp_path):
    """Each block runs as a script in a fresh directory (``examples/`` at hand): exit 0, no
    traceback, and it prints something. The executor example spawns its own 4 gloo ranks."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = tmp_path / "example.py"
    script.write_text(python_blocks(page)[k])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, f"{page} block {k}:\n{res.stderr[-3000:]}"
    assert res.stdout.strip(), f"{page} block {k} printed nothing"
    assert " inf " not in f" {res.stdout} ", f"{page} block {k} prints an infinite figure:\n{res.stdout}"
