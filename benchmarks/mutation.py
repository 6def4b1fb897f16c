"""Mutation score of the modules Nereus's claims rest on, each against its own fast unit tests
(mutmut 3.x: ``pip install -e '.[dev]'``).

    python benchmarks/mutation.py [--modules apply,controller,solve,formulation,cost] [--sample 60]
                                  [--seed 0] [--max-children 2] [--json benchmarks/results/mutation.json]
                                  [--source-ref HEAD]   # the package as committed, the working tree's tests

Per module: nereus/, tests/, examples/ and pyproject.toml (with a ``[tool.mutmut]`` section naming
the module and its tests) are copied into a scratch directory, where mutmut copies them again into
``./mutants``; every mutant is generated, a seeded sample of ``--sample`` of them is run (``0``: all),
the verdicts are read from mutmut's ``.meta`` file, and the scratch directory is removed. A mutant
is "killed" when a selected test fails on it; a mutant no selected test reaches counts as survived.

score = killed / (total - equivalent), where total counts the mutants run and equivalent the
survivors listed in ``mutation_equivalent.json`` (next to this script) with the reason each one
cannot change behaviour. Prints one line per module and writes the JSON (killed, survived,
timeout, suspicious, total, equivalent, score, sampled, the surviving mutants' names and diffs).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.json")

MODULES: dict[str, dict] = {
    "apply": {"path": "nereus/executor/apply.py", "isolation": "forkserver",
              "tests": ["tests/unit/test_executor_apply.py", "tests/unit/test_executor_verify.py",
                        "tests/unit/test_executor_apply_paths.py", "tests/unit/test_executor_merge.py"]},
    "controller": {"path": "nereus/planner/online/controller.py", "isolation": "fork",
                   "tests": ["tests/unit/test_controller_thresholds.py", "tests/unit/test_controller_decisions.py",
                             "tests/unit/test_controller_api.py",
                             "tests/unit/test_controller_restart.py", "tests/unit/test_controller_rollback.py",
                             "tests/unit/test_shape_calibration.py"]},
    "admission": {"path": "nereus/planner/online/admission.py", "isolation": "fork",
                   "tests": ["tests/unit/test_controller_thresholds.py", "tests/unit/test_controller_decisions.py",
                             "tests/unit/test_controller_api.py",
                             "tests/unit/test_controller_restart.py", "tests/unit/test_controller_rollback.py",
                             "tests/unit/test_shape_calibration.py"]},
    "solve": {"path": "nereus/planner/solver/solve.py", "isolation": "fork",
              "tests": ["tests/unit/test_solver.py", "tests/unit/test_solver_oracle.py",
                        "tests/unit/test_solver_statuses.py"],
              "deselect": [f"tests/unit/test_solver.py::test_backends_agree_with_brute_force[{i}]" for i in range(10, 30)]},
    "formulation": {"path": "nereus/planner/solver/formulation.py", "isolation": "fork",
                    "tests": ["tests/unit/test_solver.py", "tests/unit/test_solver_oracle.py",
                              "tests/unit/test_solver_statuses.py"],
                    "deselect": [f"tests/unit/test_solver.py::test_backends_agree_with_brute_force[{i}]"
                                 for i in range(10, 30)]},
    "cost": {"path": "nereus/planner/cost/passes.py", "isolation": "fork",
             "tests": ["tests/unit/test_cost.py", "tests/unit/test_cost_mechanisms.py",
                       "tests/unit/test_cost_formulas.py", "tests/unit/test_cost_terms.py"]},
    "generation": {"path": "nereus/planner/cost/generation.py", "isolation": "fork",
                   "tests": ["tests/unit/test_cost.py", "tests/unit/test_cost_mechanisms.py",
                             "tests/unit/test_cost_formulas.py", "tests/unit/test_cost_terms.py"]},
}
"""Module -> the file mutated, its fast unit tests (files that do not exist are skipped; ``deselect``:
slow parametrisations left out, 10 of the solver's 30 random brute-force instances are kept), and
how mutmut isolates each mutant's run (``forkserver`` where the tests start torch threads)."""

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "survived", 33: "survived", 34: "skipped", 35: "suspicious",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 37: "killed",
          -9: "suspicious", -11: "suspicious", None: "not run"}
"""mutmut's exit codes (``mutmut.stats.status_by_exit_code``), folded: "no tests" reach the
mutant counts as survived (nothing would catch it), a type-checker catch as killed."""


def _scratch(name: str, spec: dict, tests: list[str], source_ref: str | None) -> Path:
    """A copy of the project for one module's run, with its [tool.mutmut] section; ``source_ref``:
    the package (nereus/) as committed there instead of as it is in the working tree."""
    work = Path(tempfile.mkdtemp(prefix=f"nereus-mutation-{name}-"))
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for d in ("tests", "examples") if source_ref else ("nereus", "tests", "examples"):
        shutil.copytree(ROOT / d, work / d, ignore=skip)
    if source_ref:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", source_ref, "nereus"], check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(work)], input=tar, check=True)
    section = {"source_paths": ["nereus"], "only_mutate": [spec["path"]], "also_copy": ["examples"],
               "pytest_add_cli_args_test_selection": tests,
               "pytest_add_cli_args": ["-p", "no:cacheprovider", "-p", "no:randomly", "--timeout", "300",
                                       *(f"--deselect={d}" for d in spec.get("deselect", ()))],
               "process_isolation": spec["isolation"], "use_git_change_detection": False,
               "track_dependencies": False}
    lines = [f"{k} = {json.dumps(v)}" for k, v in section.items()]
    text = (ROOT / "pyproject.toml").read_text()
    (work / "pyproject.toml").write_text(text + "\n[tool.mutmut]\n" + "\n".join(lines) + "\n")
    return work


def _generate(work: Path, spec: dict) -> list[str]:
    """Every mutant's name (mutmut writes the mutated copy and a .meta file listing them)."""
    code = ("from pathlib import Path\n"
            "from mutmut.__main__ import create_file_mutants\n"
            "from mutmut.utils.file_utils import copy_src_dir\n"
            "copy_src_dir()\n"
            f"r = create_file_mutants(Path({spec['path']!r}))\n"
            "assert r.error is None, r.error\n")
    subprocess.run([sys.executable, "-c", code], cwd=work, check=True, capture_output=True, text=True)
    meta = json.loads((work / "mutants" / (spec["path"] + ".meta")).read_text())
    return sorted(meta["exit_code_by_key"], key=_natural)


def _natural(name: str) -> tuple:
    base, _, n = name.rpartition("__mutmut_")
    return base, int(n) if n.isdigit() else 0


def _mutmut() -> str:
    exe = Path(sys.executable).with_name("mutmut")
    return str(exe) if exe.exists() else "mutmut"


def _diff(work: Path, name: str) -> str:
    r = subprocess.run([_mutmut(), "show", name], cwd=work, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    return "\n".join(lines)


def run_module(name: str, sample: int, seed: int, max_children: int, log_dir: Path | None,
               source_ref: str | None = None) -> dict:
    spec = MODULES[name]
    tests = [t for t in spec["tests"] if (ROOT / t).exists()]
    work = _scratch(name, spec, tests, source_ref)
    t0 = time.perf_counter()
    try:
        names = _generate(work, spec)
        chosen = names if not sample or sample >= len(names) else sorted(random.Random(seed).sample(names, sample),
                                                                         key=_natural)
        cmd = [_mutmut(), "run", "--max-children", str(max_children), *chosen]
        r = subprocess.run(cmd, cwd=work, capture_output=True, text=True)
        if log_dir is not None:
            (log_dir / f"mutation-{name}.log").write_text(r.stdout[-200_000:] + "\n--- stderr ---\n" + r.stderr[-50_000:])
        meta_path = work / "mutants" / (spec["path"] + ".meta")
        codes = json.loads(meta_path.read_text())["exit_code_by_key"] if meta_path.exists() else {}
        if r.returncode != 0 or not codes or all(codes.get(m) is None for m in chosen):
            tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
            return {"path": spec["path"], "tests": tests, "error": f"mutmut exited {r.returncode}: " + " | ".join(tail),
                    "mutants": len(names), "seconds": round(time.perf_counter() - t0, 1)}
        verdict = {m: STATUS.get(codes.get(m), "suspicious") for m in chosen}
        survivors = sorted((m for m, v in verdict.items() if v == "survived"), key=_natural)
        diffs = {m: _diff(work, m) for m in survivors}
        equivalent = _load_equivalent().get(name, {})
        eq_run = {m: e["why"] for m, e in equivalent.items() if m in diffs and diffs[m] == e["diff"]}
        count = {k: sum(1 for v in verdict.values() if v == k) for k in ("killed", "survived", "timeout", "suspicious")}
        total = len(chosen)
        denom = total - len(eq_run)
        return {"path": spec["path"], "tests": tests, "mutants": len(names), "sampled": total < len(names),
                "seed": seed, "source": f"git {source_ref}" if source_ref else "working tree", **count, "total": total, "equivalent": len(eq_run),
                "score": round(count["killed"] / denom, 4) if denom else None,
                "equivalent_mutants": eq_run,
                "surviving_mutants": {m: diffs[m] for m in survivors if m not in eq_run},
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load_equivalent() -> dict[str, dict[str, dict]]:
    """module -> {mutant name: {"diff": its diff when judged, "why": why it cannot change behaviour}}."""
    if not EQUIVALENT.exists():
        return {}
    return {k: v for k, v in json.loads(EQUIVALENT.read_text()).items() if not k.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, from {', '.join(MODULES)}")
    ap.add_argument("--sample", type=int, default=60, help="mutants run per module, a seeded sample (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/mutation.json"))
    ap.add_argument("--logs", help="directory for mutmut's output per module")
    ap.add_argument("--min-score", type=float, default=0.8,
                    help="exit 1 when a module run now scores below this (the goal: 80%% of non-equivalent killed)")
    ap.add_argument("--source-ref", metavar="REF",
                    help="mutate the package as committed at REF (e.g. HEAD), with the working tree's tests")
    args = ap.parse_args(argv)
    mods = [m.strip() for m in args.modules.split(",") if m.strip()]
    unknown = [m for m in mods if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    log_dir = Path(args.logs) if args.logs else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.json)
    results = json.loads(out_path.read_text()).get("modules", {}) if out_path.exists() else {}
    below = []
    for m in mods:
        res = run_module(m, args.sample, args.seed, args.max_children, log_dir, args.source_ref)
        results[m] = res
        if "error" in res:
            print(f"{m:12s} {res['path']}: ERROR {res['error']}", flush=True)
            below.append(m)
        else:
            if res["score"] is None or res["score"] < args.min_score:
                below.append(m)
            how = f"a sample of {res['total']} of {res['mutants']} (seed {res['seed']})" if res["sampled"] else \
                f"all {res['total']}"
            print(f"{m:12s} {res['path']}: score {res['score']:.0%} = {res['killed']} killed / ({res['total']} - "
                  f"{res['equivalent']} equivalent); survived {res['survived']}, timeout {res['timeout']}, "
                  f"suspicious {res['suspicious']}; {how}; {res['seconds']:.0f} s", flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"tool": "mutmut " + _version(), "sample": args.sample, "seed": args.seed,
                                        "modules": results}, indent=2) + "\n")
    if below:
        print(f"below {args.min_score:.0%} (or failed): {', '.join(below)}", file=sys.stderr)
        return 1
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("mutmut")


if __name__ == "__main__":
    sys.exit(main())
