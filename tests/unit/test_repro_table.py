"""``benchmarks/repro_table.py --compare``: the sensitivity table of docs/repro.md from the JSONs."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from repro_table import compare_table  # noqa: E402


def _run(job: str, steps: dict[str, tuple[float, int]]) -> dict:
    return {"job": job, "trace": "t", "policies": {p: {"mean_step_s": s, "ooms": o} for p, (s, o) in steps.items()}}


def test_each_policy_reads_a_to_b_per_run_and_the_crash_totals_add_up():
    a = {"runs": [_run("j1", {"static": (10.0, 2), "adaptive": (9.0, 0), "verl": (20.0, 1), "verl-offload": (18.0, 0)}),
                  _run("only-a", {"static": (1.0, 5)})]}
    b = {"runs": [_run("j1", {"static": (11.0, 0), "adaptive": (8.5, 3), "verl": (17.0, 0), "verl-offload": (19.0, 4)})]}
    out = compare_table([a, b])
    row = next(line for line in out.splitlines() if line.startswith("| j1 / t |"))
    assert "| 10.0 (2) -> 11.0 |" in row and "| 9.0 -> 8.5 (3) |" in row
    assert row.endswith("| 18.0 -> 17.0 |")  # the better verl-like of each run
    assert "not run -> not run" in row  # hindsight is in neither
    assert "only-a" not in out  # a run missing from one JSON is left out
    assert "every policy and run: 8 -> 7; adaptive's 0 -> 3, static's 7 -> 0." in out
