"""SIMULATED reproduction of the published online-adaptation figures (issue 16).

Everything here is a simulation: step and transition times come from the simulator's ground truth
(``nereus/simulator/truth``: sampled response lengths, continuous-batching engines and 1F1B
pipelines priced from published measurements; it shares no code with the planner's cost model),
not from GPUs. Nothing was tuned to hit the published numbers: the traces are the shipped ones
(sources in their header comments), the jobs are the shipped examples, every policy runs on every
run, and a job/trace pair that is not run (the model does not fit the trace's GPUs, or the time
budget) is listed as skipped with the reason. Step counts are cut (``RUNS``) so that the script runs in
about 15 minutes on the project's 2-core machine: the 1,000-step run to 1,024 GPUs is complete for
the 8B jobs; the other runs take the first 250-500 steps of their trace, said in every row.

Published (the paper this project follows): adaptive TP/PP cut mean step latency 27.7% against a fixed
TP/PP layout that only scales DP; in a 1,000-step run reaching 1,024 GPUs, 6 transitions took 0.079%
of run time; 8B PPO throughput 1.10-1.47x verl and 2.14-7.27x OpenRLHF.

Figures per run, for ``adaptive`` (live transitions) and ``adaptive-restart`` (restart mode: every
switch a checkpoint save + relaunch): mean step latency (wall time per step, transitions and crash
restarts included) against static-naive, static, the better of the two, and hindsight (and the
oracle's against static); number of transitions and their share of run time; throughput against
verl-like (the better of optimizer offload off and open to the solver) and OpenRLHF-like (the better
of its disaggregated and colocate-all modes). Every ratio is
taken on the steps both policies completed (``on_common_steps``), with the count beside it.

    .venv/bin/python benchmarks/simulate_repro.py --json benchmarks/results/simulate_repro.json
    .venv/bin/python benchmarks/simulate_repro.py --only ramp_1024_noisy --jobs ppo-8b --steps 50   # smoke test

Sensitivity (issue 29 item 5): ``--planner-conventions truth`` plans with the ground truth's memory
conventions (the driver's total, its non-torch memory, its logits bytes; ``planner_told_truth``),
``truth-no-reserve`` also without the planner's 13% model-error reserve; the truth is unchanged.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from nereus.commands.simulate import on_common_steps  # noqa: E402
from nereus.errors import NereusError  # noqa: E402
from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from nereus.simulator.policies import POLICIES  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import load_trace  # noqa: E402
from nereus.simulator.truth import memory as truth_memory  # noqa: E402

PUBLISHED = {"latency_reduction_vs_static": 0.277, "transitions": 6, "transition_overhead": 0.00079,
             "vs_verl": (1.10, 1.47), "vs_openrlhf": (2.14, 7.27)}
JOBS = ("ppo-8b", "grpo-8b", "ppo-32b", "grpo-32b", "ppo-70b", "grpo-70b")
RUNS = (  # (trace, cluster, steps: None = all, jobs); step counts cut so that the whole script runs in
    # about 15 minutes of one core (see SKIPPED and the README for what each cut leaves out)
    ("ramp_1024_noisy", "cluster-h100-128n", None, ("ppo-8b", "grpo-8b")),
    ("ramp_1024", "cluster-h100-128n", 500, ("ppo-32b", "grpo-32b", "grpo-70b")),
    ("ramp_1024", "cluster-h100-128n", 250, ("ppo-70b",)),
    ("deepscaler_staged", "cluster-h100-4n", 500, ("ppo-8b", "grpo-8b")),
    ("r1zero_linear", "cluster-h100-16n", 500, ("grpo-8b", "grpo-32b")),
)
SKIPPED = {("ramp_1024_noisy", j): "the 1,000-step noisy run to 1,024 GPUs is run for the 8B jobs only (time budget); "
           "the larger models run the same ramp without per-step noise, cut to 250-500 steps" for j in JOBS[2:]}
SKIPPED |= {("ramp_1024", j): "run on ramp_1024_noisy instead" for j in JOBS[:2]}
SKIPPED |= {("deepscaler_staged", j): "8-32 GPUs: a 32B/70B job does not fit 8 GPUs" for j in JOBS[2:]}
SKIPPED |= {("r1zero_linear", j): "not run: time budget; 8B and 32B GRPO cover the trace"
            for j in ("ppo-8b", "ppo-32b", "ppo-70b", "grpo-70b")}


NEREUS = ("adaptive", "adaptive-restart")
"""The policies the figures are about: live transitions, and restart mode (checkpoint + relaunch)."""
REFS = ("static-naive", "static", "hindsight", "verl", "verl-offload", "openrlhf", "openrlhf-colocate")
BEST_OF = {"static-best": ("static", "static-naive"), "verl-best": ("verl", "verl-offload"),
           "openrlhf-best": ("openrlhf", "openrlhf-colocate")}
"""Baselines reported as the better of two: the solver's step-0 layout or the framework example's
(what a user would keep, knowing both); verl with optimizer offload off or open to the solver; OpenRLHF
with its models apart or ``--colocate_all_models``."""


def planner_told_truth(cluster, reserve: bool = True):
    """The planner's cluster and cost parameters rewritten with the truth's memory conventions
    (issue 29 item 5's sensitivity row; ``docs/simulator.md``, "Memory in the ground truth"): the
    driver's total instead of the catalog size, the truth's non-torch memory of a GPU in a
    collective group (CUDA context + NCCL buffers) as the reserved memory, the truth's training
    logits bytes. ``reserve`` False also drops the planner's 13% model-error reserve (the truth
    counts allocated peaks with no slack). Only the planner is told: the truth keeps the catalog
    cluster. Returns (cluster, params, what changed)."""
    from dataclasses import replace

    from nereus.planner.cost.params import CostParams

    gpu = cluster.gpu
    total = truth_memory.total_bytes(gpu.memory_gib) / truth_memory.GiB
    held = truth_memory.non_torch_bytes(collective=True) / truth_memory.GiB
    told = replace(cluster, gpu=replace(gpu, memory_gib=total, reserved_gib=held))
    p = CostParams()
    p = replace(p, logits_copies_train=truth_memory.LOGITS_BYTES_TRAIN / p.logits_bytes,
                **({} if reserve else {"mem_reserve_frac": 0.0}))
    what = {"memory_gib": [gpu.memory_gib, round(total, 3)], "reserved_gib": [gpu.reserved_gib, round(held, 3)],
            "logits_copies_train": [CostParams().logits_copies_train, p.logits_copies_train],
            "mem_reserve_frac": [CostParams().mem_reserve_frac, p.mem_reserve_frac]}
    return told, p, what


def best_of(res: dict, names: tuple[str, str]) -> str | None:
    """The better of two baselines: lower mean seconds on the steps both completed (the one that
    completed more steps when they share none); None when neither ran."""
    ran = [n for n in names if n in res and not res[n].note and res[n].completed]
    if len(ran) < 2:
        return ran[0] if ran else None
    c = on_common_steps(res[ran[0]], res[ran[1]])
    if c is None:
        return max(ran, key=lambda n: res[n].completed)
    return ran[0] if c["mean_step_s"] <= c["mean_step_s_ref"] else ran[1]


def figures(res: dict, who: str = "adaptive") -> dict:
    """``who``'s figures against the baselines of one run (``PolicyResult``s ``res``): every ratio on
    the steps both policies completed (``on_common_steps``), with the step counts beside it."""
    a = res[who]
    if a.note or not a.completed:
        raise NereusError(f"{who} did not run: {a.note or 'no step completed'}")
    d = a.to_dict()
    vs = {ref: on_common_steps(a, res[ref]) for ref in REFS if ref in res}
    best = {k: best_of(res, names) for k, names in BEST_OF.items()}
    for k, name in best.items():
        vs[k] = None if name is None else {**(on_common_steps(a, res[name]) or {}), "which": name}

    def red(ref: str) -> float | None:
        return (vs.get(ref) or {}).get("latency_reduction")

    def thr(ref: str) -> float | None:
        return (vs.get(ref) or {}).get("throughput_x")

    return {"latency_reduction_vs_static_naive": red("static-naive"), "latency_reduction_vs_static": red("static"),
            "latency_reduction_vs_static_best": red("static-best"), "latency_reduction_vs_hindsight": red("hindsight"),
            "transitions": d["transitions"], "transition_overhead": d["transition_overhead"],
            "throughput_vs_verl": thr("verl-best"), "throughput_vs_openrlhf": thr("openrlhf-best"),
            "ooms": d["ooms"], "dropped_steps": d["dropped_steps"], "vs": vs}


def run_figures(res: dict) -> dict:
    d = {k: r.to_dict() for k, r in res.items()}
    oracle = on_common_steps(res["oracle"], res["static"]) if "oracle" in res and "static" in res else None
    out = {"oracle_reduction_vs_static": None if oracle is None else oracle["latency_reduction"],
           "ooms": {k: v["ooms"] for k, v in d.items()}, "dropped_steps": {k: v["dropped_steps"] for k, v in d.items()},
           "not_run": {k: v["not_run"] for k, v in d.items() if "not_run" in v}}
    out["by_policy"] = {}
    for who in NEREUS:
        try:
            out["by_policy"][who] = figures(res, who)
        except NereusError as e:
            out["by_policy"][who] = {"not_run": str(e)}
    return out, d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write all figures as JSON (rewritten after every run)")
    ap.add_argument("--steps", type=int, help="only the first N steps of each trace (smoke test)")
    ap.add_argument("--only", choices=[r[0] for r in RUNS], help="one trace only")
    ap.add_argument("--jobs", nargs="+", choices=JOBS, help="these jobs only")
    ap.add_argument("--merge", action="store_true", help="update the runs of --json that this call re-runs, keep the rest")
    ap.add_argument("--workers", type=int, default=1, help="processes for the online policies of a run (identical results)")
    ap.add_argument("--planner-conventions", choices=("own", "truth", "truth-no-reserve"), default="own",
                    help="sensitivity (issue 29 item 5): plan with the truth's memory conventions (the truth is unchanged)")
    args = ap.parse_args(argv)
    out = {"published": PUBLISHED, "label": "SIMULATED", "runs": [], "skipped": [],
           "planner_conventions": args.planner_conventions}
    if args.merge and args.json and Path(args.json).exists():
        out = json.loads(Path(args.json).read_text())
        redo = {(j, t) for t, _, _, jobs in RUNS if not args.only or t == args.only
                for j in jobs if not args.jobs or j in args.jobs}
        out["runs"] = [r for r in out["runs"] if (r["job"], r["trace"]) not in redo]
        redo |= {(j, t) for t in {t for t, _, _, _ in RUNS if not args.only or t == args.only} for j in JOBS
                 if not args.jobs or j in args.jobs}
        out["skipped"] = [r for r in out["skipped"] if (r["job"], r["trace"]) not in redo]  # re-listed below
    planned = {(t, j) for t, _, _, jobs in RUNS for j in jobs}
    for trace_name in dict.fromkeys(t for t, _, _, _ in RUNS):
        if args.only and trace_name != args.only:
            continue
        for job_name in JOBS:
            if (trace_name, job_name) not in planned and (not args.jobs or job_name in args.jobs):
                out["skipped"].append({"job": job_name, "trace": trace_name, "why": SKIPPED.get((trace_name, job_name), "")})
    for trace_name, cluster_name, steps, jobs in RUNS:
        if args.only and trace_name != args.only:
            continue
        for job_name in jobs:
            if args.jobs and job_name not in args.jobs:
                continue
            trace = load_trace(trace_name)
            n = args.steps or steps
            if n:
                trace = trace.head(n)
            job, cluster = load_job(ROOT / f"examples/{job_name}.yaml"), load_cluster(ROOT / f"examples/{cluster_name}.yaml")
            t0 = time.perf_counter()
            extra, told = {}, None
            if args.planner_conventions != "own":
                from nereus.simulator.schedules import TransitionSchedules
                from nereus.simulator.truth.machine import GroundTruth
                plan_cluster, params, told = planner_told_truth(cluster, args.planner_conventions == "truth")
                extra = {"gt": GroundTruth(job, cluster, trace, seed=0, schedule_fn=TransitionSchedules(job, cluster)),
                         "params": params}
                cluster = plan_cluster
            try:
                res = simulate(job, cluster, trace, POLICIES, time_limit_s=1.0, seed=0, workers=args.workers, **extra)
            except NereusError as e:
                out["skipped"].append({"job": job_name, "trace": trace_name, "why": str(e)})
                print(f"{job_name} / {trace_name}: skipped ({e})", file=sys.stderr)
                continue
            figs, d = run_figures(res)
            run = {"job": job_name, "trace": trace_name, "steps": len(trace), "of_steps": len(load_trace(trace_name)),
                   "gpus": f"{trace.rows[0].gpus}->{trace.max_gpus}" if trace.rows[0].gpus != trace.max_gpus
                   else str(trace.max_gpus), "wall_s": time.perf_counter() - t0, "load_avg_1_5_15": os.getloadavg(),
                   **({"planner_told": told} if told else {}), **figs, "policies": d}
            out["runs"].append(run)
            print(f"[{run['wall_s']:.0f}s] {job_name} / {trace_name}: done", file=sys.stderr)
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    order = {(t, j): k for k, (t, j) in enumerate((t, j) for t, _, _, jobs in RUNS for j in jobs)}
    out["runs"].sort(key=lambda r: order.get((r["trace"], r["job"]), 0))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float) + "\n")
    print(table(out))
    return 0


def table(out: dict) -> str:
    from repro_table import step_table
    from repro_table import table as main_table

    return ("SIMULATED (ground truth built from published measurements, not hardware); every ratio on the steps "
            "both policies completed.\n" + main_table(out) + "\n\n" + step_table(out))


if __name__ == "__main__":
    sys.exit(main())
