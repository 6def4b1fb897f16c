"""nereus simulate: replay a workload trace through plan policies against a simulated ground truth."""
from __future__ import annotations

import argparse
import contextlib
import math

from nereus.commands.common import (add_job_cluster, console, load_specs, nonneg_int, pos_float, pos_int, save_figure,
                                    write_json)
from nereus.jsonio import atomic_path

def policy_list(text: str) -> tuple[str, ...]:
    """``--policy``: one policy or several separated by commas, each named in CHOICES, none twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in CHOICES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(map(repr, bad)) or repr(text)} "
                                         f"(choose from {', '.join(CHOICES)})")
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"a policy named twice in {text!r}")
    return names


CHOICES = ("static-naive", "static", "hindsight", "adaptive", "adaptive-restart", "always", "oracle", "verl",
           "verl-offload", "openrlhf", "openrlhf-colocate", "gamma", "gamma-restart", "always-restart", "static-split",
           "hindsight-split", "verl-one-step-off", "verl-fully-async", "verl-fully-async-dynamic", "all")


def nonneg_float(text: str) -> float:
    """A number >= 0; "inf" allowed (the gamma rule's any-saving end)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 (or inf), got {text!r}") from None
    if math.isnan(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="replay a trace through policies (SIMULATED ground truth)",
                       description="Replay a workload trace (CSV: step,response_len_mean,response_len_max,gpus[,"
                                   "response_len_p90,prompt_len_mean,response_len_cap]) or a job's own log (verl "
                                   "console lines, JSONL or CSV) through plan policies. Times come from a SIMULATED "
                                   "ground truth (request-level engines, micro-batch pipelines, published "
                                   "measurements) that shares no code with the planner's cost model.")
    add_job_cluster(p)
    p.add_argument("--trace", required=True, help="trace CSV, a shipped trace (r1zero_linear, deepscaler_staged, "
                                                  "ramp_1024, ramp_1024_noisy), or a job log to replay")
    p.add_argument("--response-len-cap", type=pos_int, help="the trainer's response cap when --trace is a job log "
                                                            "(default: the job's sequence.response_len_max)")
    p.add_argument("--gpus", type=pos_int, help="GPUs of the logged run when --trace is a job log (default: the "
                                                "cluster's)")
    p.add_argument("--policy", type=policy_list, default=("all",), metavar="|".join(CHOICES),
                   help="a policy, several separated by commas (static,adaptive,hindsight), or all: every "
                        "policy (with --schedule other than sync also the async baselines)")
    p.add_argument("--schedule", choices=("auto", "sync", "one_step_off", "fully_async"),
                   help="override the job's schedule (async: rollout and trainer on disjoint pools; the sync "
                        "policies keep synchronous steps, adaptive and static-split plan the schedule asked)")
    p.add_argument("--staleness", type=int, metavar="N", help="with --schedule: the staleness bound (default 1)")
    p.add_argument("--sync-every", type=pos_int, metavar="N", help="with --schedule fully_async/auto: steps per sync")
    p.add_argument("--steps", type=pos_int, help="only the first N steps of the trace")
    p.add_argument("--horizon", type=pos_int, default=200, help="steps a switch is amortised over (default 200)")
    d = _defaults()
    p.add_argument("--margin", type=nonneg_float, default=d.margin,
                   help=f"saving must exceed cost x (1 + margin) (default {d.margin:g})")
    p.add_argument("--min-gain", type=nonneg_float, default=d.min_gain,
                   help=f"savings below this fraction of the horizon time are model noise (default {d.min_gain:g})")
    p.add_argument("--patience", type=nonneg_int, default=d.patience,
                   help=f"steps in a row a winner must win before a switch (default {d.patience})")
    p.add_argument("--min-dwell", type=nonneg_int, default=d.min_dwell,
                   help=f"steps after a costly switch before the next (default {d.min_dwell})")
    p.add_argument("--confidence", type=nonneg_float, default=d.confidence,
                   help=f"standard errors of measurement noise a saving must clear; 0: off (default {d.confidence:g})")
    p.add_argument("--gamma", type=nonneg_float, default=d.gamma,
                   help=f"the gamma policies: switch when transition cost / saving per step <= gamma x steps to the "
                        f"next drift trigger; 0: free switches only, inf: any saving (default {d.gamma:g})")
    p.add_argument("--replan-change", type=pos_float, default=d.replan_change,
                   help=f"the gamma policies' drift trigger: relative change of the mean response length (default "
                        f"{d.replan_change:g})")
    p.add_argument("--seed", type=int, default=0, help="ground-truth noise seed")
    p.add_argument("--time-limit", type=pos_float, default=1.0, help="seconds per solver call (default 1)")
    p.add_argument("--json", metavar="OUT", help="write per-policy summaries as JSON")
    p.add_argument("--csv", metavar="STEPS.csv", help="write per-step times of every policy")
    p.add_argument("--plot", metavar="OUT.png", help="plot step time per step with transitions marked")
    p.add_argument("--audit", metavar="OUT.jsonl", help="write the adaptive controller's decisions (JSONL)")
    return p


def on_common_steps(a, b) -> dict | None:
    """``a`` against ``b`` (``PolicyResult``s) on the steps both completed: mean seconds per step of
    each there (step + transition + crash restarts of those steps), ``a``'s latency reduction and
    throughput ratio, and how many steps that is beside each one's completed steps. None when either
    did not run or they share no completed step."""
    import numpy as np

    if a.note or b.note:
        return None
    wall = [np.asarray(r.step_s, float) + np.asarray(r.transition_s, float) + np.asarray(r.restart_s, float)
            for r in (a, b)]
    both = ~np.asarray(a.dropped, bool) & ~np.asarray(b.dropped, bool) & np.isfinite(wall[0]) & np.isfinite(wall[1])
    n = int(both.sum())
    if not n:
        return None
    ma, mb = float(wall[0][both].mean()), float(wall[1][both].mean())
    return {"steps_both": n, "completed": a.completed, "completed_ref": b.completed, "mean_step_s": ma,
            "mean_step_s_ref": mb, "latency_reduction": 1 - ma / mb, "throughput_x": mb / ma}


def _defaults():
    from nereus.planner.online.admission import AdmissionConstants

    return AdmissionConstants()


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from nereus.commands.plan import with_schedule_args
    from nereus.simulator.async_policies import ASYNC_POLICIES
    from nereus.simulator.policies import POLICIES
    from nereus.simulator.simulate import simulate
    from nereus.simulator.trace import SHIPPED, load_trace, looks_like_trace_csv, trace_from_log

    from nereus.planner.online.admission import AdmissionConstants

    admission = AdmissionConstants(margin=args.margin, min_gain=args.min_gain, patience=args.patience,
                                   min_dwell=args.min_dwell, confidence=args.confidence, gamma=args.gamma,
                                   replan_change=args.replan_change)
    job, cluster, params = load_specs(args)
    job = with_schedule_args(args, job)
    if args.trace in SHIPPED or looks_like_trace_csv(args.trace):
        trace = load_trace(args.trace)
    else:
        trace = trace_from_log(args.trace, cap=args.response_len_cap or job.sequence.response_len_max,
                               gpus=args.gpus or cluster.num_gpus)
    if args.steps:
        trace = trace.head(args.steps)
    policies = (POLICIES + (ASYNC_POLICIES if job.schedule.kind != "sync" else ())) if "all" in args.policy \
        else args.policy
    with atomic_path(args.audit) if args.audit else contextlib.nullcontext() as audit:  # whole, or not at all
        results = simulate(job, cluster, trace, policies, params=params, horizon=args.horizon, margin=args.margin,
                           seed=args.seed, time_limit_s=args.time_limit, audit_path=audit and str(audit),
                           progress=True, admission=admission)
    summary = {name: r.to_dict() for name, r in results.items()}
    con = console()
    con.print(f"[bold]SIMULATED[/] trace {trace.name} ({len(trace)} steps, up to {trace.max_gpus} GPUs), "
              f"{cluster.gpu.name}; ground truth = request-level engines and micro-batch pipelines built from "
              f"published measurements, sampled lengths (seed {args.seed})")
    t = Table()
    t.add_column("policy", no_wrap=True, min_width=8)
    for name in ("mean step s", "total h", "switches", "switch s", "switch %", "OOM", "restart s", "dropped",
                 "vs static", "idle roll/train"):
        t.add_column(name, justify="right")
    for name, d in summary.items():
        vs = on_common_steps(results[name], results["static"]) if "static" in results else None
        rel = "-" if vs is None else f"{vs['latency_reduction']:+.1%}" + (
            f" ({vs['steps_both']} steps)" if vs["steps_both"] < len(trace) else "")
        t.add_row(name, f"{d['mean_step_s']:.2f}", f"{d['total_s'] / 3600:.2f}", str(d["transitions"]),
                  f"{d['transition_s']:.1f}", f"{d['transition_overhead']:.3%}", str(d["ooms"]),
                  f"{d['restart_s']:.0f}", str(d["dropped_steps"]), rel,
                  f"{d['idle_share_rollout']:.0%}/{d['idle_share_trainer']:.0%}" if "idle_share_rollout" in d else "-")
    con.print(t)
    con.print("SIMULATED. mean step s: wall time per completed step, transitions and restarts included. switches: "
              "live transitions (switch s: their blocking time; switch %: share of run time). OOM: steps that ran "
              "out of memory (a crash: the work until then and a restart are lost, the step is retried). vs static: "
              "reduction of mean step latency on the steps both completed (positive = faster; the count when "
              "fewer than all). idle roll/train: share of the run each pool of an "
              "async plan waits (rollout: nothing to generate; trainer: waiting for a batch or the sync barrier; "
              "over the steps run on async plans).")
    write_json(args.json, {name: {k: d[k] for k in ("label", "steps", "mean_step_s", "total_s", "transition_s",
                                                    "transition_overhead", "transitions", "infeasible_steps")}
                           | {"diagnostics": {k: v for k, v in d.items() if k not in ("steps", "label")}}
                           for name, d in summary.items()})
    if args.csv:
        _write_csv(args.csv, trace, results)
    if args.plot:
        _plot(args.plot, trace, results)
    return 0


def _write_csv(path: str, trace, results) -> None:
    import csv

    from nereus.commands.common import SpecError

    names = list(results)
    try:
        with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "response_len_mean", "gpus"] + [f"{n}_step_s" for n in names]
                       + [f"{n}_transition_s" for n in names] + [f"{n}_restart_s" for n in names]
                       + [f"{n}_ooms" for n in names] + [f"{n}_dropped" for n in names])
            for i, row in enumerate(trace.rows):
                r = [results[n] for n in names]
                w.writerow([row.step, row.response_len_mean, row.gpus] + [f"{x.step_s[i]:.4f}" for x in r]
                           + [f"{x.transition_s[i]:.4f}" for x in r] + [f"{x.restart_s[i]:.4f}" for x in r]
                           + [x.ooms[i] for x in r] + [int(x.dropped[i]) for x in r])
    except OSError as e:
        raise SpecError(f"cannot write {path}: {e.strerror}") from None


def _plot(path: str, trace, results) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in trace.rows]
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, r in results.items():
        line, = ax.plot(steps, r.step_s, lw=1, label=name)
        xs = [steps[i] for i, t in enumerate(r.transition_s) if t > 0]
        ax.plot(xs, [r.step_s[steps.index(x)] for x in xs], "v", color=line.get_color(), ms=5)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r.response_len_mean for r in trace.rows], "k--", lw=0.8, alpha=0.5, label="response length")
    ax2.set_ylabel("mean response length (tokens)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"SIMULATED: {trace.name} (triangles = transitions; gaps = dropped steps)")
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
