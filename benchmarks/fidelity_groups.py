"""Held-out RL stage rows grouped by run and stage, before -> after: median ratio predicted /
measured and rows within 2x. Reads two ``nereus fidelity --json`` outputs (the older tree's, then
this one's), e.g.

    git worktree add /tmp/before a0344b6
    (cd /tmp/before && PYTHONPATH=. "$OLDPWD/.venv/bin/python" -m nereus.cli fidelity --split heldout --json /tmp/before.json)
    .venv/bin/nereus fidelity --split heldout --json /tmp/after.json
    .venv/bin/python benchmarks/fidelity_groups.py /tmp/before.json /tmp/after.json

Groups: the verl runs of 0.5B-1B models by stage (value / critic, log-prob / reference / actor
update, generation, whole step), the Qwen2-7B play-verl runs (generation, the other stages), every
other run's rows together.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.fidelity.corpus import load_corpus  # noqa: E402

SMALL = {"values": "values / update_critic", "update_critic": "values / update_critic",
         "old_log_prob": "old_log_prob / ref / update_actor", "ref": "old_log_prob / ref / update_actor",
         "update_actor": "old_log_prob / ref / update_actor", "gen": "gen", "generate_sequences": "gen",
         "step": "step"}


def group(row) -> tuple[str, str]:
    stage = row.get("stage", "")
    if row.id.startswith(("playverl", "verlbm1b")) and ("0.5B" in row.model or "1B" in row.model):
        return "Qwen2.5-0.5B, Llama-3.2-1B (verl)", SMALL.get(stage, stage)
    if row.id.startswith("playverl") and "7B" in row.model:
        return "Qwen2-7B (play-verl)", "gen" if stage == "gen" else "other stages"
    return "other runs", "all"


def ratios(path: str) -> dict[str, float]:
    rows = json.loads(Path(path).read_text())["rows"]
    return {r["id"]: r["ratio"] for r in rows if r["category"] == "rl_stages" and r["ratio"] is not None}


def main(before: str, after: str) -> None:
    b, a = ratios(before), ratios(after)
    rows = {r.id: r for r in load_corpus() if r.id in a and r.id in b}
    groups: dict[tuple[str, str], list[str]] = {}
    for i, r in rows.items():
        groups.setdefault(group(r), []).append(i)
    print("| runs | stage | rows | median ratio | within 2x |\n|---|---|---|---|---|")
    for (runs, stage), ids in sorted(groups.items()):
        med = lambda d: statistics.median(d[i] for i in ids)  # noqa: E731
        inside = lambda d: sum(1 for i in ids if 0.5 <= d[i] <= 2)  # noqa: E731
        print(f"| {runs} | {stage} | {len(ids)} | {med(b):.2f} -> {med(a):.2f} | {inside(b)} -> {inside(a)} |")
    print(f"all: {sum(1 for i in rows if 0.5 <= b[i] <= 2)} -> {sum(1 for i in rows if 0.5 <= a[i] <= 2)} "
          f"of {len(rows)} within 2x")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: fidelity_groups.py BEFORE.json AFTER.json (nereus fidelity --json outputs)")
    main(*sys.argv[1:])
