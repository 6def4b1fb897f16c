"""Per-stage time of the cold 1,024-GPU solve: option tables (pricing, wherever it runs), greedy, the
floors deciding which groups to price (``greedy.price_groups``, ``group_floor``), bound pruning, the thinned
warm start, building the formulation, CP-SAT (model translation and search apart), and for async
schedules the per-rollout-size work of ``split.py``. Each problem is solved in a fresh subprocess
(cold tables and cost-model estimates), then ``--repeats`` more times with the tables cached, so
the post-table stages get several samples per process. CPU seconds (``time.process_time``) are the
steady figure on a shared machine; wall seconds beside them. Stage times are exclusive (a stage
nested in another, e.g. CP-SAT inside the warm start, counts only for itself).

    .venv/bin/python benchmarks/solve_stages.py [--runs 3] [--repeats 3] [--json OUT]
        [--compare OTHER_TREE]   # alternate runs with the same script in another checkout
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBLEMS = {  # name: (job yaml, schedule kind)
    "ppo-8b/sync": ("examples/ppo-8b.yaml", "sync"),
    "ppo-70b/sync": ("examples/ppo-70b.yaml", "sync"),
    "ppo-8b/one_step_off": ("examples/ppo-8b.yaml", "one_step_off"),
    "ppo-70b/one_step_off": ("examples/ppo-70b.yaml", "one_step_off"),
    "ppo-8b/fully_async": ("examples/ppo-8b.yaml", "fully_async"),
    "ppo-70b/fully_async": ("examples/ppo-70b.yaml", "fully_async"),
}
STAGES = ("tables", "greedy", "floors", "prune", "warm", "split", "formulation", "cpsat_build", "cpsat_search")


class _Clock:
    """Exclusive CPU / wall seconds per stage, through wrappers on module attributes."""

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(STAGES, 0.0)
        self.wall = dict.fromkeys(STAGES, 0.0)
        self.calls = dict.fromkeys(STAGES, 0)
        self.stack: list[list[float]] = []  # per open stage: [child cpu, child wall]

    def wrap(self, stage: str, fn):
        def timed(*a, **k):
            c0, w0 = time.process_time(), time.perf_counter()
            self.stack.append([0.0, 0.0])
            try:
                return fn(*a, **k)
            finally:
                child = self.stack.pop()
                dc, dw = time.process_time() - c0, time.perf_counter() - w0
                self.cpu[stage] += dc - child[0]
                self.wall[stage] += dw - child[1]
                self.calls[stage] += 1
                if self.stack:
                    self.stack[-1][0] += dc
                    self.stack[-1][1] += dw
        return timed

    def reset(self) -> None:
        for d in (self.cpu, self.wall, self.calls):
            for k in d:
                d[k] = 0


def _install(clock: _Clock) -> None:
    import importlib

    S = importlib.import_module("nereus.planner.solver.solve")
    from nereus.planner.solver import backends, formulation, split

    S.build_tables = clock.wrap("tables", S.build_tables)
    from nereus.planner.solver import candidates, greedy

    if hasattr(candidates, "TableBuilder"):  # tables priced on demand: pricing a group is "tables" wherever it
        # runs (inside greedy too); the floors and the group pruning of price_groups are "floors"
        candidates.TableBuilder.group = clock.wrap("tables", candidates.TableBuilder.group)
        S.price_groups = clock.wrap("floors", S.price_groups)
        greedy.price_groups = clock.wrap("floors", greedy.price_groups)  # (split.py's per rollout size)
        greedy.group_floor = clock.wrap("floors", greedy.group_floor)
    S.greedy = clock.wrap("greedy", S.greedy)
    S._warm_start = clock.wrap("warm", S._warm_start)
    for mod in (S, split):
        for name in ("tighten",):
            if hasattr(mod, name):
                setattr(mod, name, clock.wrap("prune", getattr(mod, name)))
    for name in ("split_bound", "tables_for", "_greedy_fill", "floor_bound"):
        if hasattr(split, name):
            setattr(split, name, clock.wrap("split", getattr(split, name)))
    formulation.Formulation = clock.wrap("formulation", formulation.Formulation)
    backends.solve_cpsat = clock.wrap("cpsat_build", backends.solve_cpsat)
    from ortools.sat.python import cp_model

    cp_model.CpSolver.solve = clock.wrap("cpsat_search", cp_model.CpSolver.solve)


def child(name: str, repeats: int) -> dict:
    from ortools.sat.python import cp_model  # noqa: F401  (imported before timing)

    from nereus.planner.schedules import ScheduleSpec
    from nereus.planner.solver import PlanProblem, solve
    from nereus.planner.specs import load_cluster, load_job

    job_path, kind = PROBLEMS[name]
    sched = {"sync": ScheduleSpec(), "one_step_off": ScheduleSpec(kind="one_step_off"),
             "fully_async": ScheduleSpec(kind="fully_async", staleness=2, sync_every=2)}[kind]
    job = replace(load_job(ROOT / job_path), schedule=sched)
    cluster = load_cluster(ROOT / "examples/cluster-h100-1n.yaml").with_gpus(1024)
    problem = PlanProblem(job=job, cluster=cluster, workload=job.workload())
    clock = _Clock()
    _install(clock)
    out = {"problem": name, "runs": []}
    for i in range(1 + repeats):  # the first cold, the rest with the option tables cached
        clock.reset()
        c0, w0 = time.process_time(), time.perf_counter()
        sol = solve(problem, backend="cpsat", time_limit_s=60, workers=1, seed=0)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        assert sol.status == "OPTIMAL", (name, sol.status)
        from nereus.planner.solver import candidates

        if i == 0 and hasattr(candidates, "table_builder"):  # (unit, pool size) groups priced of all
            b = candidates.table_builder(problem)
            out["groups_priced"] = [len(b.priced), len(b.units) * len(b.sizes)]
        out["runs"].append({"cold": i == 0, "objective": sol.objective, "cpu_s": cpu, "wall_s": wall,
                            "post_tables_cpu_s": cpu - clock.cpu["tables"],
                            "post_tables_wall_s": wall - clock.wall["tables"],
                            "cpu": dict(clock.cpu), "wall": dict(clock.wall), "calls": dict(clock.calls)})
    return out


def _spawn(tree: Path, name: str, repeats: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    py = tree / ".venv/bin/python"
    r = subprocess.run([str(py if py.exists() else sys.executable), str(tree / "benchmarks/solve_stages.py"),
                        "--child", name, "--repeats", str(repeats)], check=False, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(samples: list[dict]) -> dict:
    cold = [s["runs"][0] for s in samples]
    warm = [r for s in samples for r in s["runs"][1:]]
    med = lambda xs: statistics.median(xs) if xs else None
    return {"objective": cold[0]["objective"],
            "cold_cpu_s": med([r["cpu_s"] for r in cold]), "cold_wall_s": med([r["wall_s"] for r in cold]),
            "post_tables_cpu_s": med([r["post_tables_cpu_s"] for r in cold + warm]),
            "post_tables_wall_s": med([r["post_tables_wall_s"] for r in cold + warm]),
            "post_tables_cpu_s_min_max": [min(r["post_tables_cpu_s"] for r in cold + warm),
                                          max(r["post_tables_cpu_s"] for r in cold + warm)],
            "stage_cpu_s": {st: med([r["cpu"][st] for r in (cold if st == "tables" else cold + warm)]) for st in STAGES},
            "stage_wall_s": {st: med([r["wall"][st] for r in (cold if st == "tables" else cold + warm)]) for st in STAGES},
            "calls": cold[0]["calls"], "groups_priced": samples[0].get("groups_priced")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per problem (and per tree)")
    ap.add_argument("--repeats", type=int, default=3, help="extra solves per process with the tables cached")
    ap.add_argument("--problems", nargs="*", default=list(PROBLEMS), choices=list(PROBLEMS))
    ap.add_argument("--compare", metavar="TREE", help="another checkout to run alternately (e.g. the base commit)")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.repeats)))
        return 0
    trees = {"this": ROOT} | ({"other": Path(args.compare).resolve()} if args.compare else {})
    if args.compare:
        import shutil

        shutil.copy(__file__, trees["other"] / "benchmarks/solve_stages.py")
    result = {"load_avg_start": os.getloadavg(), "trees": {k: str(v) for k, v in trees.items()}, "problems": {}}
    for name in args.problems:
        samples = {k: [] for k in trees}
        for _ in range(args.runs):
            for k, tree in trees.items():  # alternating, so load drifts hit both sides alike
                samples[k].append(_spawn(tree, name, args.repeats))
        result["problems"][name] = {k: {"summary": _summary(v), "samples": v} for k, v in samples.items()}
        for k, v in result["problems"][name].items():
            s = v["summary"]
            st = " ".join(f"{x}={s['stage_cpu_s'][x]:.3f}" for x in STAGES)
            print(f"{name:22s} {k:5s} obj {s['objective']:.4f}  cold cpu {s['cold_cpu_s']:.3f} wall {s['cold_wall_s']:.3f}"
                  f"  post-tables cpu {s['post_tables_cpu_s']:.3f} wall {s['post_tables_wall_s']:.3f}  | {st}"
                  f"  groups priced {s['groups_priced']}", flush=True)
        if args.compare:
            a, b = (result["problems"][name][k]["summary"]["objective"] for k in ("this", "other"))
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (name, a, b)
    result["load_avg_end"] = os.getloadavg()
    print("load average start", result["load_avg_start"], "end", result["load_avg_end"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
