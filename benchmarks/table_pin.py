"""Fingerprints of the planner's option tables, pinned so speed work on ``build_tables`` cannot change
them: for every problem of ``PROBLEMS``, every unit's options with their config, durations, stage
times, memory, KV budget, weight-sync terms and offload flag, floats rounded to 12 significant
digits. ``tests/data/table_pin.json`` holds what the code gave before that work (commit 04f4914);
``tests/unit/test_table_pin.py`` rebuilds the cheap problems and compares, ``--check`` compares all.

    .venv/bin/python benchmarks/table_pin.py --check [--only NAME ...]   # every problem against the pin
    .venv/bin/python benchmarks/table_pin.py --write                     # re-pin (only on purpose)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: benchmarks/table_speed.py prices another checkout with it

from nereus.planner.cost.params import CostParams
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.solver import (
    CandidateSettings,
    PlanConstraints,
    PlanProblem,
    candidates,
)
from nereus.planner.solver.candidates import build_tables
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

PIN = ROOT / "tests/data/table_pin.json"
EX = ROOT / "examples"
DIGITS = 12
CONFIG_FIELDS = tuple(f.name for f in fields(ParallelConfig))


def _problem(job: str, gpus: int, cluster: str = "cluster-h100-1n.yaml", schedule: ScheduleSpec | None = None,
             **kw) -> PlanProblem:
    j = load_job(EX / job)
    if schedule is not None:
        j = replace(j, schedule=schedule)
    c = load_cluster(EX / cluster).with_gpus(gpus)
    return PlanProblem(job=j, cluster=c, workload=j.workload(), **kw)


ONE_STEP_OFF = ScheduleSpec(kind="one_step_off")
FULLY_ASYNC = ScheduleSpec(kind="fully_async", staleness=2, sync_every=2)
WIDE = CandidateSettings(cps=(1, 2, 4), offload=(False, True), frozen_zeros=(1, 3))
"""Every optional axis of the tables on: context parallelism, optimizer offload, ZeRO-3 frozen models."""
CALIBRATED = CostParams(stage_factor=(("generation", 1.07), ("inference", 0.93), ("training", 1.21)),
                        micro_batch_overhead_s=2e-4, optimizer_step_overhead_s=1e-3, mem_reserve_frac=0.0)

PROBLEMS = {
    **{f"ppo-8b@{g}": (lambda g=g: _problem("ppo-8b.yaml", g)) for g in (8, 64, 256, 1024)},
    **{f"ppo-70b@{g}": (lambda g=g: _problem("ppo-70b.yaml", g)) for g in (8, 64, 256, 1024)},
    **{f"grpo-qwen3-30b-a3b@{g}": (lambda g=g: _problem("grpo-qwen3-30b-a3b.yaml", g)) for g in (32, 256)},
    "ppo-8b@64:one_step_off": lambda: _problem("ppo-8b.yaml", 64, schedule=ONE_STEP_OFF),
    "ppo-8b@64:fully_async": lambda: _problem("ppo-8b.yaml", 64, schedule=FULLY_ASYNC),
    "ppo-70b@64:fully_async": lambda: _problem("ppo-70b.yaml", 64, schedule=FULLY_ASYNC),
    "grpo-7b@32": lambda: _problem("grpo-7b.yaml", 32),
    "grpo-8b@16": lambda: _problem("grpo-8b.yaml", 16),
    "grpo-32b@64": lambda: _problem("grpo-32b.yaml", 64),
    "grpo-70b@64": lambda: _problem("grpo-70b.yaml", 64),
    "ppo-32b@32": lambda: _problem("ppo-32b.yaml", 32),
    "ppo-8b@4:one-node": lambda: _problem("ppo-8b.yaml", 4),
    "ppo-8b@32:wide": lambda: _problem("ppo-8b.yaml", 32, candidates=WIDE),
    "grpo-qwen3-30b-a3b@32:wide": lambda: _problem("grpo-qwen3-30b-a3b.yaml", 32, candidates=WIDE),
    "ppo-8b@32:calibrated": lambda: _problem("ppo-8b.yaml", 32, params=CALIBRATED),
    "ppo-8b@64:colocated": lambda: _problem("ppo-8b.yaml", 64, constraints=PlanConstraints(placement="colocated")),
    "ppo-70b@64:fixed_tp_pp": lambda: _problem("ppo-70b.yaml", 64, constraints=PlanConstraints(
        fixed_tp_pp=(("actor/training", 8, 2), ("actor/generation", 4, 1)))),
}
CHEAP = ("ppo-8b@8", "ppo-8b@64", "ppo-70b@8", "ppo-70b@64", "grpo-qwen3-30b-a3b@32", "ppo-8b@64:one_step_off",
         "ppo-8b@64:fully_async", "grpo-7b@32", "grpo-8b@16", "ppo-8b@4:one-node", "ppo-8b@32:wide",
         "grpo-qwen3-30b-a3b@32:wide", "ppo-8b@32:calibrated", "ppo-8b@64:colocated", "ppo-70b@64:fixed_tp_pp")
"""The problems the unit test rebuilds (a few seconds); ``--check`` rebuilds all of them."""


def _r(x):
    if isinstance(x, float):
        return float(f"{x:.{DIGITS - 1}e}") if math.isfinite(x) else repr(x)
    if isinstance(x, (list, tuple)):
        return [_r(v) for v in x]
    return x


def cold() -> None:
    candidates._build_tables_cached.cache_clear()
    candidates._estimates.clear()


def fingerprint(problem: PlanProblem) -> dict:
    """The option tables of ``problem``, built cold, as JSON-ready rows."""
    cold()
    t = build_tables(problem)
    return {"units": [u.name for u in t.units], "sizes": list(t.sizes), "sync_keys": [list(k) for k in t.sync_keys],
            "capacity_kib": t.capacity_kib, "n_phases": t.n_phases, "config_fields": list(CONFIG_FIELDS),
            "options": [[o.unit, o.size, [getattr(o.config, f) for f in CONFIG_FIELDS],
                         _r(o.durations), _r(o.stage_times), o.resident_kib, o.transient_kib, _r(o.kv_budget_bytes),
                         _r(o.sync), o.offload] for opts in t.options for o in opts]}


def diff(name: str, got: dict, want: dict) -> list[str]:
    """Readable differences between two fingerprints (empty when they are the same)."""
    if got == want:
        return []
    out = [f"{name}: {k} differs" for k in got if k != "options" and got[k] != want.get(k)]
    g, w = got["options"], want["options"]
    if len(g) != len(w):
        out.append(f"{name}: {len(g)} options, pinned {len(w)}")
    out += [f"{name}: option {i}: {a} != pinned {b}" for i, (a, b) in enumerate(zip(g, w)) if a != b][:5]
    return out or [f"{name}: differs"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="re-pin every problem")
    ap.add_argument("--check", action="store_true", help="compare every problem against the pin")
    ap.add_argument("--only", nargs="*", help="problem names (default: all)")
    a = ap.parse_args()
    names = a.only or list(PROBLEMS)
    pinned = json.loads(PIN.read_text()) if PIN.exists() else {}
    bad = []
    for name in names:
        t0 = time.process_time()
        fp = fingerprint(PROBLEMS[name]())
        print(f"{name}: {len(fp['options'])} options, {time.process_time() - t0:.2f} s cpu", file=sys.stderr)
        if a.write:
            pinned[name] = fp
        elif a.check:
            bad += diff(name, fp, pinned[name])
    if a.write:
        PIN.parent.mkdir(parents=True, exist_ok=True)
        PIN.write_text(json.dumps(pinned, separators=(",", ":")) + "\n")
    print("\n".join(bad) if bad else "tables identical to the pin" if a.check else "pinned")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
