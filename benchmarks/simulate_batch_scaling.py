"""Simulator speed against the batch (SIMULATED results; the timing is real): wall and CPU time of
``nereus simulate --policy all`` on the 1,000-step ramp to 1,024 GPUs (mean response 1,500 -> 16,000
tokens, cap 20,480 = DAPO's 16,384 + 4,096 overlong buffer) with 1k, 8k and 32k responses per step,
examples/ppo-8b.yaml with its batch replaced, examples/cluster-h100-128n.yaml. Goal (issue 29): the
8k run (DAPO-sized: 512 prompts x 16 responses) within 60 s on the project's 2-core machine, and time
that does not grow linearly with the batch.

Each size's trace is ``ramp_1024`` as that job logs it (``trace.as_logged``: per step the mean and
longest of its own sampled responses, the cap in its own column; the 1k trace is the shipped
``ramp_1024_noisy``). Besides the whole run, ``truth_s`` is the ground truth alone: the step times
of every plan the run used, over the whole trace, on a fresh ``GroundTruth`` (cold caches, one
process), and ``generation_events`` how many of its engine replicas needed the event simulation
(KV or slot pressure). Side by side in the same process, ``truth_unshared_s`` /
``generation_events_unshared``: the same on a truth whose engines that differ only in their KV
budget share nothing (``GroundTruth(share_engines=False)``, the code before the sharing); the
step times must be identical (the script fails otherwise). ``offline_scoring_s`` /
``offline_scoring_unshared_s``: the same pair for what dominated the offline policies' time, the
truth's step-time matrix of their candidates (``simulate.offline_candidates`` of the run, without
the solver's extra picks, with every layout family at every GPU count, on the steps each is scored),
one process, cold caches.

    .venv/bin/python benchmarks/simulate_batch_scaling.py --json benchmarks/results/simulate_batch_scaling.json
    .venv/bin/python benchmarks/simulate_batch_scaling.py --sizes 8192 --steps 100   # quicker
    .venv/bin/python benchmarks/simulate_batch_scaling.py --sizes 8192 --whole-run-only   # the run alone
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import numpy as np
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.planner.specs import load_cluster, load_job  # noqa: E402
from nereus.simulator.policies import POLICIES  # noqa: E402
from nereus.simulator.schedules import TransitionSchedules  # noqa: E402
from nereus.simulator.simulate import simulate  # noqa: E402
from nereus.simulator.trace import as_logged, load_trace  # noqa: E402
from nereus.simulator.truth import machine  # noqa: E402
from nereus.simulator.truth.machine import GroundTruth  # noqa: E402
from benchmarks.machine_info import machine_info  # noqa: E402

SHAPES = {1024: (256, 4), 8192: (512, 16), 32768: (2048, 16)}
"""Responses per step -> (prompts, samples per prompt): the shipped job's, DAPO's, and 4x DAPO's."""


def job_and_trace(responses: int, steps: int | None):
    prompts, samples = SHAPES.get(responses, (responses // 16, 16))
    job = load_job(ROOT / "examples/ppo-8b.yaml")
    job = replace(job, batch=replace(job.batch, prompts=prompts, samples_per_prompt=samples))
    if (prompts, samples) == (256, 4):
        trace = load_trace("ramp_1024_noisy")  # as_logged(ramp_1024, 256, 4, seed 0): the shipped one
    else:
        trace = as_logged(load_trace("ramp_1024"), prompts, samples, seed=0,
                          name=f"ramp_1024_{prompts}x{samples}_noisy")
    return job, (trace.head(steps) if steps else trace)


def truth_alone(job, cluster, trace, plans) -> dict:
    """The ground truth's own time on ``plans`` over the trace (cold caches, this process), with its
    engines sharing runs across KV budgets and, side by side, without (the same numbers)."""
    out, times = {}, {}
    for tag, share in (("_unshared", False), ("", True)):
        calls = {"event_replicas": 0}
        orig = machine._simulate

        def counting(reps, *a, **k):
            calls["event_replicas"] += len(reps)
            return orig(reps, *a, **k)

        machine._simulate = counting
        try:
            t0, c0 = time.perf_counter(), time.process_time()
            gt = GroundTruth(job, cluster, trace, seed=0, share_engines=share)
            times[tag] = [gt.step_times(p) for p in plans]
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        finally:
            machine._simulate = orig
        out.update({f"truth{tag}_s": wall, f"truth{tag}_cpu_s": cpu, f"generation_events{tag}": calls["event_replicas"]})
    same = all(np.array_equal(a, b) for a, b in zip(times[""], times["_unshared"]))
    if not same:
        raise SystemExit("the truth's step times differ with and without shared engine runs")
    return {**out, "plans": len(plans), "identical_with_and_without_sharing": same}


def offline_scoring(job, cluster, trace, results) -> dict:
    """The offline policies' step-time matrix over their candidates, with and without shared engine
    work, side by side (identical matrices, or the script fails)."""
    from nereus.planner.online.plan_cache import scale_plan
    from nereus.simulator import oracle
    from nereus.simulator.simulate import offline_candidates

    cands, _, used = offline_candidates(job, results, [], cluster.gpus_per_node)
    gpus = np.array([r.gpus for r in trace.rows])
    cands = oracle.complete_families(cands, sorted(set(gpus.tolist())), scale_plan)
    steps = oracle.usable_steps(cands, gpus, used)
    out, mats = {"offline_candidates": len(cands), "offline_cells": int(sum(len(x) for x in steps))}, {}
    for tag, share in (("_unshared", False), ("", True)):
        t0 = time.perf_counter()
        gt = GroundTruth(job, cluster, trace, seed=0, share_engines=share)
        mats[tag] = oracle.step_time_matrix(gt, cands, steps, len(trace))
        out[f"offline_scoring{tag}_s"] = time.perf_counter() - t0
    if not np.array_equal(mats[""], mats["_unshared"]):
        raise SystemExit("the offline candidates' step times differ with and without shared engine runs")
    return out


def one(responses: int, steps: int | None, workers: int, cluster, checks: bool = True) -> dict:
    job, trace = job_and_trace(responses, steps)
    load0 = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    ch0 = os.times()
    res = simulate(job, cluster, trace, POLICIES, time_limit_s=1.0, seed=0, workers=workers)
    wall = time.perf_counter() - t0
    ch1 = os.times()
    cpu = time.process_time() - c0 + (ch1.children_user - ch0.children_user) + (ch1.children_system - ch0.children_system)
    plans = {p.key(): p for r in res.values() for p in r.plans}
    row = {"responses_per_step": job.batch.sequences, "prompts": job.batch.prompts,
           "samples_per_prompt": job.batch.samples_per_prompt, "trace": trace.name, "steps": len(trace),
           "max_gpus": trace.max_gpus, "wall_s": wall, "cpu_s": cpu, "load_average_before": load0,
           "load_average_after": os.getloadavg()[0],
           "per_policy": {k: {"wall_s": r.wall_s, "solves": r.solves, "mean_step_s": r.to_dict()["mean_step_s"],
                              "transitions": r.to_dict()["transitions"], "ooms": r.to_dict()["ooms"]}
                          for k, r in res.items()}}
    if checks:
        row.update(truth_alone(job, cluster, trace, list(plans.values())))
        row.update(offline_scoring(job, cluster, trace, list(res.values())))
    row["load_average_end"] = os.getloadavg()[0]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768], help="responses per step")
    ap.add_argument("--steps", type=int, help="first N steps of the trace (default: all 1,000)")
    ap.add_argument("--workers", type=int, default=2, help="processes (the machine has 2 cores)")
    ap.add_argument("--whole-run-only", action="store_true",
                    help="time the whole run alone (no truth-alone or offline-scoring side-by-side checks)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cluster = load_cluster(ROOT / "examples/cluster-h100-128n.yaml")
    rows = []
    for n in args.sizes:
        row = one(n, args.steps, args.workers, cluster, checks=not args.whole_run_only)
        rows.append(row)
        if args.whole_run_only:
            print(f"SIMULATED {row['responses_per_step']:6,} responses/step, {row['steps']} steps to {row['max_gpus']} "
                  f"GPUs, all {len(row['per_policy'])} policies: wall {row['wall_s']:6.1f} s, CPU {row['cpu_s']:6.1f} s "
                  f"(load {row['load_average_before']:.1f} -> {row['load_average_after']:.1f})", flush=True)
            continue
        print(f"SIMULATED {row['responses_per_step']:6,} responses/step ({row['prompts']} x {row['samples_per_prompt']}), "
              f"{row['steps']} steps to {row['max_gpus']} GPUs, all {len(row['per_policy'])} policies: wall "
              f"{row['wall_s']:6.1f} s, CPU {row['cpu_s']:6.1f} s (load {row['load_average_before']:.1f} -> "
              f"{row['load_average_after']:.1f}); truth alone {row['truth_s']:5.1f} s on {row['plans']} plans "
              f"({row['generation_events']:,} engine replicas event-simulated), without shared engine runs "
              f"{row['truth_unshared_s']:5.1f} s ({row['generation_events_unshared']:,}; identical step times); "
              f"offline candidates' matrix ({row['offline_candidates']} plans, {row['offline_cells']:,} cells) "
              f"{row['offline_scoring_s']:5.1f} s, without shared engine runs {row['offline_scoring_unshared_s']:5.1f} s "
              f"(identical; load at the end {row['load_average_end']:.1f})", flush=True)
    base = rows[0]
    for r in rows[1:] if not args.whole_run_only else ():
        x = r["responses_per_step"] / base["responses_per_step"]
        print(f"  {x:4.0f}x the responses: {r['wall_s'] / base['wall_s']:.2f}x the wall time, "
              f"{r['truth_s'] / base['truth_s']:.2f}x the truth's")
    if args.whole_run_only:
        for r in rows[1:]:
            print(f"  {r['responses_per_step'] / base['responses_per_step']:4.0f}x the responses: "
                  f"{r['wall_s'] / base['wall_s']:.2f}x the wall time")
    if args.json:
        out = {"machine": machine_info(), "label": "SIMULATED results; timing measured", "goal": "8,192 responses/step, 1,000 steps to 1,024 "
               "GPUs, every policy: <= 60 s wall on the 2-core machine", "workers": args.workers, "runs": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
