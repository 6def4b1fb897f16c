"""Hostile inputs at scale: 2,000 generated files per reader (the generators of
``tests/unit/fuzz_cases.py``: NaN, inf, 10^400, wrong types, contradictions, absurd clusters,
random bytes, non-UTF-8, empty, truncated), each fed to its reader and to every CLI command that
reads it (``nereus.cli.main`` in this process).

Per reader and per command: cases run; exit 0 (a parsed object / exit code 0); exit 2 (a
NereusError / exit code 2); other (any other exception or exit code, a time-out past the bound, a
memory blow-up: what must stay 0); violations (exit 0 or 2 that breaks the rest of the contract:
an exit-2 line that does not name the file or is not one line, an output written on exit 2, a
parsed object holding NaN); the slowest case in seconds. Inputs that hit a bug already pinned as a
strict xfail (``KNOWN_BUGS``) are not run and are counted apart, on top of the cases run.
Derandomized: the same cases every run.

    .venv/bin/python benchmarks/fuzz_inputs.py [--cases 2000] [--json benchmarks/results/fuzz_inputs.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from hypothesis import HealthCheck, Phase, assume, given, settings  # noqa: E402

from fuzz_cases import READERS, case_folder, known_bug  # noqa: E402
from fuzz_harness import cli_problems, reader_problems, run_cli  # noqa: E402
from nereus.jsonio import write_atomic  # noqa: E402

READ_BOUND_S, CLI_BOUND_S = 10.0, 30.0
KINDS = {"ok": "exit_0", "refused": "exit_2", "other": "other"}


def _tally() -> dict:
    return {"cases": 0, "exit_0": 0, "exit_2": 0, "other": 0, "violations": 0, "max_s": 0.0, "known_bug_skipped": 0,
            "first_other": [], "first_violations": []}


def _count(t: dict, out, bad: list[str], data: bytes) -> None:
    t["cases"] += 1
    t[KINDS[out.kind]] += 1
    t["max_s"] = round(max(t["max_s"], out.seconds), 3)
    if out.kind == "other" and len(t["first_other"]) < 3:
        t["first_other"].append({"input": repr(data[:200]), "what": out.detail[-600:]})
    elif bad:
        t["violations"] += 1
        if len(t["first_violations"]) < 3:
            t["first_violations"].append({"input": repr(data[:200]), "what": bad[0][-600:]})


def fuzz_reader(name: str, cases: int, folder: Path) -> dict[str, dict]:
    """``cases`` generated files fed to reader ``name`` and to its CLI commands."""
    reader = READERS[name]
    tallies = {name: _tally(), **{f"{name} -> nereus {label}": _tally() for label, _ in reader.cli}}
    reasons: Counter = Counter()

    @settings(max_examples=cases, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=reader.cases)
    def case(data):
        why = known_bug(name, data)
        if why:  # not run, and not counted among the cases: hypothesis draws another
            reasons[why] += 1
            for t in tallies.values():
                t["known_bug_skipped"] += 1
        assume(why is None)
        path = case_folder(reader, data, folder)
        out, bad = reader_problems(reader, path, READ_BOUND_S)
        _count(tallies[name], out, bad, data)
        for label, argv_of in reader.cli:
            out_dir = path.parent / f"out-{label}"
            out_dir.mkdir()
            out, bad = cli_problems(label, argv_of(path, out_dir / "out.json"), path, out_dir / "out.json", CLI_BOUND_S)
            _count(tallies[f"{name} -> nereus {label}"], out, bad, data)
        shutil.rmtree(path.parent, ignore_errors=True)

    case()
    for t in tallies.values():
        t["known_bug_reasons"] = dict(reasons)
    return tallies


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000, help="generated files per reader (default 2000)")
    ap.add_argument("--reader", action="append", choices=sorted(READERS), help="only these readers (repeatable)")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/fuzz_inputs.json"))
    args = ap.parse_args()
    run_cli(["--help"], 60)  # imports, outside any timed case
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nereus-fuzz-") as tmp:
        for name in args.reader or sorted(READERS):
            t1 = time.perf_counter()
            rows.update(fuzz_reader(name, args.cases, Path(tmp)))
            print(f"{name}: {time.perf_counter() - t1:.0f} s", file=sys.stderr, flush=True)
    print(f"{'reader / command':44} {'cases':>6} {'exit 0':>7} {'exit 2':>7} {'other':>6} {'viol.':>6} "
          f"{'known':>6} {'max s':>7}")
    for key, t in rows.items():
        print(f"{key:44} {t['cases']:>6} {t['exit_0']:>7} {t['exit_2']:>7} {t['other']:>6} {t['violations']:>6} "
              f"{t['known_bug_skipped']:>6} {t['max_s']:>7.2f}")
    total = {k: sum(t[k] for t in rows.values()) for k in ("cases", "exit_0", "exit_2", "other", "violations")}
    print(f"{'total':44} {total['cases']:>6} {total['exit_0']:>7} {total['exit_2']:>7} {total['other']:>6} "
          f"{total['violations']:>6}")
    out = {"cases_per_reader": args.cases, "bound_s": {"reader": READ_BOUND_S, "cli": CLI_BOUND_S},
           "wall_s": round(time.perf_counter() - t0, 1), "python": platform.python_version(), "total": total,
           "rows": rows}
    write_atomic(args.json, json.dumps(out, indent=2) + "\n")
    return 0 if total["other"] == 0 and total["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
