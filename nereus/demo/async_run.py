"""``nereus demo --schedule one_step_off``: the demo's GRPO run with rollout and training on disjoint
gloo ranks, one step apart (staleness 1), a real weight sync each step and a real re-split when the
online controller admits one (``async_worker.py`` runs the ranks).

The plan: the job's schedule is ``one_step_off`` and the planner lays out every model-stage. The run
starts at the rollout : trainer share verl's one-step-off documentation uses (4 : 12 of 16 GPUs,
1 : 3; here ``max(1, world // 4)`` rollout ranks, or ``DemoConfig.rollout_ranks``), the layouts
inside each pool chosen by the planner (``initial_split_plan``), as a user who copied that split
would run; the planner's own best split for the first step is reported beside it. From there the
controller (the same ``Controller`` the simulator and the sync demo use, on the same probed cost
model) is free to re-split: as the cap rises, one rollout rank decoding every sequence runs out of
KV room (the model prices the waves) and a second one pays. A re-split is a transition of the
trainer state through the executor, and the next weight sync creates the new rollout replica.

On 2 CPU cores the ranks of both pools share the same cores, so the overlap cannot make the run
faster than the sync demo: this mode shows the mechanism (concurrent pools, the sync, the
re-split, all verified), not a speed-up, and says so in its output.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from nereus.demo.async_plan import async_job, initial_split_plan, split_label
from nereus.demo.setup import DemoConfig, budget_cluster, budget_for
from nereus.planner.plan import Plan

MECHANISM_NOTE = ("2 CPU cores are shared by every rank of both pools: the overlap of rollout and training cannot "
                  "buy time here, so this run shows the mechanism (disjoint pools running at once, a verified weight "
                  "sync each step, a verified re-split), not a speed-up")
def summarize_async(records: list[dict]) -> dict:
    """Measured figures of a one-step-off run."""
    syncs = [r["sync"] for r in records if r.get("sync")] + [r["first_sync"] for r in records if r.get("first_sync")]
    trans = [r for r in records if r.get("transition_s")]
    checked = [s for s in syncs if "bit_exact" in s]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    return {"steps": len(records), "completed_steps": sum(1 for r in records if r.get("loss") is not None),
            "mean_step_s": mean([r["step_s"] for r in records]),
            "mean_rollout_s": mean([r["rollout_s"] for r in records if r["rollout_s"] > 0]),
            "mean_train_s": mean([r["train_s"] for r in records]),
            "mean_idle_share": {k: mean([r["idle_share"][k] for r in records[:-1] or records]) for k in ("rollout", "trainer")},
            "syncs": len(syncs), "syncs_verified": sum(1 for s in syncs if s["sync_verified"]),
            "syncs_bit_exact": sum(1 for s in checked if s["bit_exact"]) if checked else None,
            "syncs_checked": len(checked),
            "mean_sync_s": mean([s["sync_s"] for s in syncs]), "sync_bytes": syncs[0]["sync_bytes"] if syncs else 0,
            "sync_mb_per_s": mean([s["sync_bytes"] / s["sync_s"] / 1e6 for s in syncs if s["sync_s"] > 0]),
            "staleness": sorted({r["staleness"] for r in records}),
            "transitions": len(trans), "verified_transitions": sum(1 for r in trans if r.get("verified")),
            "resplits": [{"step": r["step"], "from": r["plan"], "to": r.get("next_plan"), "seconds": r["transition_s"],
                          "bytes": r.get("transition_bytes"), "verified": r.get("verified"), "reason": r.get("reason")}
                         for r in trans if r.get("resplit")],
            "splits": [f"{r['rollout_ranks']}:{r['trainer_ranks']}" for r in records],
            "peak_mem_frac": max(r["peak_mem_frac"] for r in records),
            "final_response_len_mean": records[-1]["response_len_mean"], "final_reward": records[-1]["reward"]}


def print_async(records: list[dict], summary: dict, log=print) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table("step", "cap", "len", "reward", "split (rollout : trainer)", "rollout s", "train s", "idle r / t",
              "sync s", "sync MB", "sync check", "stale", "decision")
    for r in records:
        s = r.get("sync") or {}
        check = "-" if not s else ("bit-exact" if s.get("bit_exact") else
                                   ("[red]DIFFERS[/]" if "bit_exact" in s else "verified" if s["sync_verified"] else "[red]?[/]"))
        dec = r.get("decision", "")
        if r.get("transition_s"):
            dec = (f"[bold]{dec} -> {r.get('next_plan', '')}[/] ({r['transition_s'] * 1e3:.0f} ms, "
                   f"{'verified' if r.get('verified') else 'NOT verified'}) {r.get('reason', '')}")
        elif r.get("reason"):
            dec = f"{dec}: {r['reason']}"
        t.add_row(str(r["step"]), str(r["cap"]), f"{r['response_len_mean']:.1f}", f"{r['reward']:.1f}",
                  f"{r['rollout_ranks']}:{r['trainer_ranks']}", f"{r['rollout_s']:.2f}", f"{r['train_s']:.2f}",
                  f"{r['idle_share']['rollout']:.0%} / {r['idle_share']['trainer']:.0%}",
                  f"{s.get('sync_s', 0.0):.3f}" if s else "-", f"{s['sync_bytes'] / 1e6:.1f}" if s else "-", check,
                  str(r["staleness"]), dec[:90])
    Console(width=200).print(t)
    log(f"steps completed {summary['completed_steps']} of {summary['steps']}; mean step {summary['mean_step_s']:.2f} s "
        f"(rollout {summary['mean_rollout_s']:.2f} s, train {summary['mean_train_s']:.2f} s; idle rollout "
        f"{summary['mean_idle_share']['rollout']:.0%}, trainer {summary['mean_idle_share']['trainer']:.0%})")
    log(f"weight syncs {summary['syncs']} ({summary['syncs_verified']} verified by the transition's checksums"
        + (f", {summary['syncs_bit_exact']} of {summary['syncs_checked']} bit-exact against the trainer's weights"
           if summary["syncs_checked"] else "")
        + f"): {summary['sync_bytes'] / 1e6:.2f} MB each, mean {summary['mean_sync_s'] * 1e3:.0f} ms "
          f"({summary['sync_mb_per_s']:.0f} MB/s); staleness {summary['staleness']}")
    for rs in summary["resplits"]:
        log(f"re-split after step {rs['step']}: {rs['from']} -> {rs['to']}, {rs['seconds'] * 1e3:.0f} ms, "
            f"{(rs['bytes'] or 0) / 1e6:.1f} MB, {'verified' if rs['verified'] else 'NOT verified'}")
    if not summary["resplits"]:
        log("no re-split: the controller admitted none in this run")
    log(f"note: {MECHANISM_NOTE}")


def run_one_step_off(cfg: DemoConfig, full, job, cluster, params, plan: Plan, ranks=None) -> list[dict] | None:
    """The run on ``ranks`` (an ``executor.launch.Ranks``, the probes' processes) or on ``cfg.world``
    freshly spawned ranks (``async_worker.async_main``): rank 0's per-step records (None on a
    torchrun rank other than 0)."""
    from nereus.demo.async_worker import async_main
    from nereus.executor.launch import launch

    args = (replace(cfg, budget_mb=budget_for(cfg)), full, job, cluster, params, plan)
    if ranks is not None:
        out = ranks.run(async_main, *args, timeout_s=cfg.timeout_s)
    else:
        out = launch(async_main, cfg.world, *args, timeout_s=cfg.timeout_s, pg_timeout_s=120.0)
    return None if out is None else out[0]


def run_async_demo(cfg: DemoConfig, log=print) -> dict | None:
    """Warm-up and probes (``run.prepare``), the initial split, one run on ``cfg.world`` spawned
    ranks, its table and summary; the records under ``out_dir/demo-async.json``."""
    from nereus.executor.launch import Ranks

    with Ranks(cfg.world, pg_timeout_s=120.0) as ranks:  # one set of processes for the probes and the run
        return _run_async_demo(cfg, log, ranks)


def _run_async_demo(cfg: DemoConfig, log, ranks) -> dict | None:
    from nereus.demo.run import prepare

    t_start = time.perf_counter()
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, budget_mb=budget_for(cfg))
    full, job, probed, params, _, probe = prepare(cfg, log, ranks)
    cluster = budget_cluster(probed, cfg)
    ajob = async_job(job)
    plan, planner_best = initial_split_plan(ajob, cluster, params, cfg)
    log(f"\n== one_step_off: {cfg.steps} GRPO steps on {cfg.world} gloo processes, budget {cfg.budget_mb:.1f} MiB per "
        f"process; start at verl's documented 1 : 3 share: {split_label(plan)} (predicted {plan.step_time_s:.2f} s); "
        f"the planner's own best for the first step: "
        f"{split_label(planner_best) if planner_best else 'none'}"
        + (f" ({planner_best.step_time_s:.2f} s)" if planner_best else "") + " ==")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    records = run_one_step_off(cfg, full, ajob, cluster, params, plan, ranks)
    if records is None:  # a torchrun rank other than 0
        return None
    run_s = time.perf_counter() - t0
    summary = summarize_async(records)
    print_async(records, summary, log)
    log(f"run {run_s:.1f} s wall; host load (1 min) {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    res = {"schedule": "one_step_off", "steps": cfg.steps, "world": cfg.world,
           "cap_schedule": [list(c) for c in cfg.cap_schedule], "budget_mb": cfg.budget_mb, "budget_k": cfg.budget_k,
           "initial_plan": split_label(plan), "initial_plan_rule": "verl's one-step-off 1 : 3 rollout : trainer share "
           "(rollout ranks = max(1, round(world / 4)) unless --rollout-ranks), layouts inside each pool by the planner",
           "planner_best_initial": split_label(planner_best) if planner_best else None,
           "predicted_step_s": {"initial": plan.step_time_s,
                                "planner_best": planner_best.step_time_s if planner_best else None},
           "summary": summary, "note": MECHANISM_NOTE, "probe": probe, "run_wall_s": run_s,
           "wall_s": time.perf_counter() - t_start, "host_load_1min": [load0, os.getloadavg()[0]]}
    (Path(cfg.out_dir) / "demo-async.json").write_text(json.dumps({**res, "records": records}, indent=1, default=str))
    log(f"per-step records: {Path(cfg.out_dir) / 'demo-async.json'}")
    return res
