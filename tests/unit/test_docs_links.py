"""The README is a landing page and the docs hold the detail: README.md at most 300 lines, every
``docs/*.md`` linked from it, every relative link (markdown and image) in README.md and docs/*.md
resolving to a file (and, for a link into a markdown page, to one of its headings), and every
``nereus <subcommand> --flag`` quoted in their code names a real subcommand and one of its flags.

The parser is ``nereus.cli.build_parser()``: its subcommand modules import nothing heavy at import
time, so this needs neither torch nor a solver."""
from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from nereus.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")
INLINE = re.compile(r"(`+)(.+?)\1")
COMMAND = re.compile(r"(?:^|[\s$;&|(])(?:\S*/)?(?:nereus|-m nereus\.cli)\s+([a-z][a-z0-9-]*)(.*)")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def strip_code(text: str) -> str:
    """The text without fenced blocks and inline code (a link quoted in code is not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(INLINE.sub("", line))
    return "\n".join(out)


def links(text: str) -> list[str]:
    return LINK.findall(strip_code(text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*]", "", heading.strip().lower())  # underscores stay, as on GitHub (`one_step_off`)
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def code_spans(text: str) -> list[str]:
    """Every line of every fenced block, and every inline code span outside them."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            out.append(line)
        else:
            out.extend(m.group(2) for m in INLINE.finditer(line))
    return out


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def bad_commands(text: str, subs: dict[str, argparse.ArgumentParser]) -> list[str]:
    bad = []
    for span in code_spans(text):
        for m in COMMAND.finditer(span):
            name, rest = m.group(1), m.group(2)
            if name not in subs:
                bad.append(f"nereus {name}: no such subcommand ({span.strip()})")
                continue
            flags = {s for a in subs[name]._actions for s in a.option_strings}
            try:
                words = shlex.split(rest, comments=True)
            except ValueError:
                words = rest.split()
            for w in words:
                if w in ("|", ";", "&&", ">", "2>&1") or w.startswith(("#", ">")):
                    break  # the rest of the line is another command or a redirection
                flag = w.split("=", 1)[0]
                if flag.startswith("--") and flag not in flags:
                    bad.append(f"nereus {name}: no flag {flag} ({span.strip()})")
    return bad


def test_readme_is_a_landing_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES} (move detail to docs/)"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(README.read_text(encoding="utf-8"))}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert not broken_links(page)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_quoted_command_and_flag_exists(page):
    assert not bad_commands(page.read_text(encoding="utf-8"), subparsers())


# ---- the checks themselves: each must catch what it is for ------------------------------------
def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Solve time\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md) [ok](docs/a.md#solve-time) ![img](docs/missing.png)\n"
                    "[gone](docs/b.md) [bad anchor](docs/a.md#nowhere) [web](https://example.com)\n"
                    "`[not a link](nowhere.md)`\n", encoding="utf-8")
    assert broken_links(page) == ["README.md: docs/missing.png (no such file)",
                                  "README.md: docs/b.md (no such file)",
                                  "README.md: docs/a.md#nowhere (no heading #nowhere in a.md)"]


def test_an_unknown_subcommand_or_flag_is_caught():
    subs = subparsers()
    text = ("```\n$ nereus plan --job j.yaml --cluster c.yaml --emit verl\n"
            "nereus plann --job j.yaml\n"
            "nereus estimate --job j --cluster c --model-stage actor/training --tpp 2\n"
            ".venv/bin/nereus simulate --trace t --policy all | tail -3 --not-a-flag\n"
            "torchrun --nproc-per-node 4 -m nereus.cli reshard-check --world 4 --cases 2 --bogus\n```\n"
            "Inline: `nereus demo --budgets 1.5,2,3` and `nereus fidelity --splitt heldout`.\n")
    assert bad_commands(text, subs) == [
        "nereus plann: no such subcommand (nereus plann --job j.yaml)",
        "nereus estimate: no flag --tpp (nereus estimate --job j --cluster c --model-stage actor/training --tpp 2)",
        "nereus reshard-check: no flag --bogus (torchrun --nproc-per-node 4 -m nereus.cli reshard-check "
        "--world 4 --cases 2 --bogus)",
        "nereus fidelity: no flag --splitt (nereus fidelity --splitt heldout)",
    ]


def test_the_parser_holds_every_command_of_the_cli():
    from nereus.cli import COMMANDS

    assert {c.replace("_", "-") for c in COMMANDS} <= set(subparsers())
