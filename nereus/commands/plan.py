"""nereus plan: the best memory-feasible plan (TP/PP/DP and pool of every model-stage), a sweep of
how it changes as one workload knob grows, or the plan as a verl / OpenRLHF launch command (--emit)."""
from __future__ import annotations

import argparse
import math
import sys

from nereus.commands.common import (GiB, add_job_cluster, console, load_specs, pos_float, pos_int, save_figure,
                                    write_json)
from nereus.errors import InfeasibleError, SpecError
from nereus.frameworks import FRAMEWORKS, VERL_ENGINES

SWEEP_KEYS = ("response-len-mean", "response-len-max", "gpus")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="best memory-feasible plan for a job on a cluster",
                       description="Choose TP/PP/DP, micro-batch, ZeRO and GPU pool of every model-stage so that "
                                   "every GPU fits in memory and the predicted step time is minimal.")
    add_job_cluster(p)
    p.add_argument("--response-len-mean", type=pos_float, help="override the job's mean response length")
    p.add_argument("--response-len-max", type=pos_int, help="override the job's response length cap")
    p.add_argument("--gpus", type=pos_int, help="resize the cluster to this many GPUs")
    p.add_argument("--backend", choices=("cpsat", "pulp", "greedy", "brute"), default="cpsat")
    p.add_argument("--time-limit", type=pos_float, default=10.0, metavar="S", help="solver time limit (seconds)")
    p.add_argument("--workers", type=pos_int, default=1, help="solver threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", choices=("any", "colocated", "disaggregated"), default="any",
                   help="any (solver chooses), colocated (verl-like), disaggregated (OpenRLHF-like)")
    p.add_argument("--schedule", choices=("auto", "sync", "one_step_off", "fully_async"),
                   help="override the job's schedule: synchronous steps, or rollout and training overlapped on "
                        "disjoint pools (one_step_off: staleness 1; fully_async: streaming, a sync every "
                        "--sync-every steps); auto: the solver picks the fastest the staleness bound admits")
    p.add_argument("--staleness", type=int, metavar="N",
                   help="with --schedule: the most policy versions a response may lag (default 1 for async)")
    p.add_argument("--sync-every", type=pos_int, metavar="N", help="with --schedule fully_async/auto: steps per weight sync")
    p.add_argument("--offload", action="store_true",
                   help="let trainable models keep optimizer state in host memory (at its transfer time)")
    p.add_argument("--context-parallel", action="store_true",
                   help="let training and inference split long sequences by context parallelism (cp 2 and 4, "
                        "ring attention) besides Ulysses sp")
    p.add_argument("--sweep", metavar="KEY=START:STOP:STEP",
                   help=f"sweep one knob ({', '.join(SWEEP_KEYS)}); STEP is xK (multiply) or +K (add), "
                        "e.g. response-len-mean=1024:32768:x2 (the cap keeps the job's max/mean ratio)")
    p.add_argument("--plot", metavar="OUT.png", help="with --sweep: write a PNG of step time against the knob")
    p.add_argument("--json", metavar="OUT", help="write the plan (or the sweep rows) as JSON")
    g = p.add_argument_group("launch configuration")
    g.add_argument("--emit", choices=FRAMEWORKS,
                   help="write the plan as the framework's launch command (verl Hydra overrides, OpenRLHF "
                        "train_ppo_ray flags); where the framework cannot express the plan, the comments name what "
                        "and the command holds the closest plan it can express")
    g.add_argument("--out", metavar="FILE", help="with --emit: write the launch script here, atomically "
                                                 "(default: stdout, with the tables on stderr)")
    g.add_argument("--verl-engine", choices=VERL_ENGINES, default="auto",
                   help="with --emit verl: Megatron (TP/PP, ZeRO-1) or FSDP (ZeRO-3); auto takes the faster")
    g.add_argument("--dynamic-bsz", action="store_true",
                   help="with --emit: pack micro-batches by tokens (micro-batch x (prompt + response cap) per GPU) "
                        "instead of a fixed number of sequences")
    return p


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """'response-len-mean=1024:32768:x2' -> ('response-len-mean', [1024, 2048, ..., 32768])."""
    try:
        key, rng = text.split("=", 1)
        start_s, stop_s, step_s = rng.split(":")
        start, stop = float(start_s), float(stop_s)
        mult = step_s.startswith("x")
        step = float(step_s[1:] if step_s[:1] in ("x", "+") else step_s)
    except ValueError:
        raise SpecError(f"--sweep: expected KEY=START:STOP:STEP (e.g. response-len-mean=1024:32768:x2), got {text!r}") from None
    if key not in SWEEP_KEYS:
        raise SpecError(f"--sweep: unknown knob {key!r}; choose one of {', '.join(SWEEP_KEYS)}")
    if start <= 0 or stop < start or (mult and step <= 1) or (not mult and step <= 0):
        raise SpecError(f"--sweep: need 0 < START({start:g}) <= STOP({stop:g}) and a growing STEP({step_s})")
    values, v = [], start
    while v <= stop * (1 + 1e-12) and len(values) < 200:
        values.append(v)
        v = v * step if mult else v + step
    return key, values


def with_schedule_args(args, job):
    """The job with ``--schedule`` / ``--staleness`` / ``--sync-every`` applied (errors name the numbers)."""
    from dataclasses import replace

    from nereus.planner.schedules import ScheduleSpec

    if args.schedule is None:
        if args.staleness is not None or args.sync_every is not None:
            raise SpecError("--staleness and --sync-every need --schedule (or set them in the job's schedule:)")
        return job
    kw = {"kind": args.schedule}
    if args.staleness is not None:
        kw["staleness"] = args.staleness
    if args.sync_every is not None:
        kw["sync_every"] = args.sync_every
    return replace(job, schedule=ScheduleSpec(**kw))


def _problem(args, job, cluster, params, *, mean=None, max_=None, gpus=None):
    from nereus.planner.solver import CandidateSettings, PlanConstraints, PlanProblem

    w = job.workload()
    mean = mean if mean is not None else args.response_len_mean
    max_ = max_ if max_ is not None else args.response_len_max
    if mean is not None and max_ is None and mean > w.response_len_max:
        max_ = int(math.ceil(mean * w.response_len_max / w.response_len_mean))  # keep the job's tail ratio
    if mean is not None or max_ is not None:
        if mean is not None and max_ is not None and mean > max_:
            raise SpecError(f"response-len-mean({mean:g}) > response-len-max({max_})")
        w = w.with_lengths(mean=mean, max_=max_)
    gpus = gpus or args.gpus
    if gpus:
        cluster = cluster.with_gpus(int(gpus))
    return PlanProblem(job=job, cluster=cluster, workload=w, params=params,
                       constraints=PlanConstraints(placement=args.placement),
                       candidates=CandidateSettings(offload=(False, True) if args.offload else (False,),
                                                    cps=(1, 2, 4) if args.context_parallel else (1,)))


def _solve(args, problem):
    from nereus.planner.solver import solve

    return solve(problem, backend=args.backend, time_limit_s=args.time_limit, workers=args.workers, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    job, cluster, params = load_specs(args)
    if args.plot and not args.sweep:
        raise SpecError("--plot needs --sweep")
    if (args.out or args.dynamic_bsz) and not args.emit:
        raise SpecError(f"{'--out' if args.out else '--dynamic-bsz'} needs --emit {'|'.join(FRAMEWORKS)} "
                        f"(--json writes the plan itself)")
    if args.verl_engine != "auto" and args.emit != "verl":
        raise SpecError(f"--verl-engine {args.verl_engine} needs --emit verl")
    if args.emit and args.sweep:
        raise SpecError("--emit writes the launch command of one plan; it does not combine with --sweep")
    job = with_schedule_args(args, job)
    if args.sweep:
        return _run_sweep(args, job, cluster, params)
    problem = _problem(args, job, cluster, params)
    sol = _solve(args, problem)
    write_json(args.json, {**sol.to_dict(), **({"memory_headroom": memory_headroom(problem, sol.plan)} if sol.plan else {})})
    if sol.plan is None:
        raise InfeasibleError(f"INFEASIBLE: {sol.message}")
    if args.emit:
        return _run_emit(args, problem, sol)
    print_plan(problem, sol)
    return 0


def _run_emit(args: argparse.Namespace, problem, sol) -> int:
    """The optimum, then the framework's launch command (stdout, or --out with the tables on stdout)."""
    from nereus.frameworks import emit
    from nereus.frameworks.common import write_atomic

    con = console(stderr=not args.out)
    print_plan(problem, sol, con)
    em = emit(args.emit, problem, sol.plan, lambda q: _solve(args, q), verl_engine=args.verl_engine,
              dynamic_bsz=args.dynamic_bsz)
    if em.gaps:
        con.print(f"[bold]{em.framework} cannot express this plan:[/]")
        for gap in em.gaps:
            con.print(f"  - {gap}", soft_wrap=True)
        con.print(f"closest plan {em.framework} can express ({em.variant}):")
        con.print(plan_table(problem, em.plan))
        con.print(f"predicted step time: [bold]{em.step_time_s:.2f} s[/] in {em.framework} beside "
                  f"{em.optimum.step_time_s:.2f} s for the optimum ({100 * em.slowdown:+.1f}%)")
    else:
        con.print(f"{em.framework} expresses the optimal plan as is ({em.variant}): predicted step time "
                  f"[bold]{em.step_time_s:.2f} s[/]")
    text = em.render(title=f"{args.job} on {args.cluster}")
    if args.out:
        write_atomic(args.out, text)
        con.print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


def plan_table(problem, plan):
    from rich.table import Table

    cap = problem.cluster.gpu.usable_bytes / GiB
    offloaded = dict(plan.extras).get("offload") or ()
    t = Table("model-stage", "tp", "pp", "dp", "options", "pool", "GPUs", "time (s)", "mem/GPU (GiB)")
    for s in plan.stages:
        cfg = s.config
        opts = "" if s.stage == "generation" else f"mb{cfg.micro_batch}" + \
            (f" zero{cfg.zero}" if s.stage == "training" else "") + (" recompute" if cfg.recompute else "") + \
            (f" sp{cfg.sp}" if cfg.sp > 1 else "") + (f" cp{cfg.cp}" if cfg.cp > 1 else "") + \
            (f" tokens{cfg.token_budget}" if cfg.token_budget else "") + (" offload" if s.name in offloaded else "")
        if cfg.ep > 1 or cfg.etp > 1:  # expert layout of a mixture-of-experts model
            opts = (opts + f" ep{cfg.ep} etp{cfg.etp}").strip()
        t.add_row(s.name, str(cfg.tp), str(cfg.pp), str(cfg.dp), opts, str(s.pool),
                  f"{s.first_gpu}-{s.first_gpu + s.gpus - 1} ({s.gpus})", f"{s.time_s:.2f}",
                  f"{s.mem_gib:.1f} / {cap:.1f}")
    return t


def print_plan(problem, sol, con=None) -> None:
    con = con or console()
    con.width = max(con.width, 120)
    c, w = problem.cluster, problem.workload
    con.print(f"[bold]{problem.job.algorithm.upper()}[/] on {c.num_gpus} x {c.gpu.name}, {w.sequences} sequences x "
              f"({w.prompt_len} prompt + {w.response_len_mean:g} mean / {w.response_len_max} max response)")
    con.print(plan_table(problem, sol.plan))
    ex = dict(sol.plan.extras)
    phases = ", ".join(f"{x:.2f}" for x in ex.get("phase_makespan_s", ()))
    con.print(f"predicted step time: [bold]{sol.plan.step_time_s:.2f} s[/] (phases {phases}; weight sync "
              f"{ex.get('weight_sync_s', 0.0):.3f} s)")
    m = memory_headroom(problem, sol.plan)
    con.print(f"memory: fits with [bold]{m['headroom_gib']:.1f} GiB headroom[/] on the fullest GPU "
              f"({m['predicted_peak_gib']:.1f} of {m['capacity_gib']:.1f} GiB predicted); held-out memory error p90 "
              f"{100 * m['heldout_error_p90']:.0f}% (a reserve of that much of every training / inference peak is kept)")
    gap = "-" if not math.isfinite(sol.gap) else f"{sol.gap:.2%}"
    con.print(f"status {sol.status}, gap {gap}, {sol.backend} in {sol.wall_s:.2f} s")
    sched = ex.get("schedule")
    if sched:
        idle = ex.get("idle_share") or {}
        pools = ", ".join(f"{k} pool idle {v:.0%}" for k, v in idle.items())
        con.print(f"schedule: [bold]{sched['kind']}[/] (staleness {sched.get('staleness', 0)}"
                  + (f", a weight sync every {sched['sync_every']} steps" if sched.get("sync_every", 1) > 1 else "")
                  + (f"; {pools}" if pools else "") + ")")
    steps = ex.get("schedule_step_s")
    if steps:
        best = sched["kind"]
        alts = "; ".join(f"{k} {v:.2f} s" if v is not None else f"{k} infeasible" for k, v in steps.items())
        con.print(f"schedule auto chose {best}: step time by schedule: {alts}")


def memory_headroom(problem, plan) -> dict:
    """The plan's memory guarantee: the predicted peak of the fullest GPU without the reserve, the
    capacity, the headroom between them, and the reserve fraction (``CostParams.mem_reserve_frac``,
    the held-out memory error's 90th percentile) the solver kept on every training and inference
    stage's peak."""
    from dataclasses import replace

    from nereus.planner.solver import evaluate_plan

    bare = evaluate_plan(replace(problem, params=replace(problem.params, mem_reserve_frac=0.0)), plan)
    return {"predicted_peak_gib": bare.peak_mem_gib, "capacity_gib": bare.capacity_gib,
            "headroom_gib": bare.capacity_gib - bare.peak_mem_gib,
            "heldout_error_p90": problem.params.mem_reserve_frac}


def _row(key, value, sol) -> dict:
    row = {key: value, "status": sol.status, "step_time_s": sol.objective if sol.plan else None,
           "solve_s": sol.wall_s, "gap": sol.gap if sol.plan else None}
    if sol.plan is not None:
        row["model_stages"] = [s.to_dict() for s in sol.plan.stages]
    else:
        row["message"] = sol.message
    return row


def _run_sweep(args, job, cluster, params) -> int:
    from rich.progress import track
    from rich.table import Table

    key, values = parse_sweep(args.sweep)
    rows, sols = [], []
    for v in track(values, description=f"sweeping {key}", console=console(), transient=True):
        kw = {"mean": v} if key == "response-len-mean" else {"max_": int(v)} if key == "response-len-max" else {"gpus": int(v)}
        problem = _problem(args, job, cluster, params, **kw)
        sol = _solve(args, problem)
        rows.append(_row(key, v, sol))
        sols.append(sol)
    t = Table(key, "status", "step (s)", "solve (s)", "generation", "actor/training", "critic/training",
              "ref/inference", "reward/inference")
    for v, sol in zip(values, sols):
        cells = []
        for name in ("actor/generation", "actor/training", "critic/training", "ref/inference", "reward/inference"):
            if sol.plan is None or name not in {s.name for s in sol.plan.stages}:
                cells.append("-")
                continue
            s = sol.plan.stage(name)
            cells.append(f"{s.config.label()}@{s.gpus}")
        step = f"{sol.objective:.2f}" if sol.plan else "-"
        t.add_row(f"{v:g}", sol.status, step, f"{sol.wall_s:.2f}", *cells)
    con = console()
    con.width = max(con.width, 140)
    con.print(t)
    infeasible = [r for r in rows if r["status"] == "INFEASIBLE"]
    if infeasible:
        con.print(f"first infeasible at {key}={infeasible[0][key]:g}: {infeasible[0].get('message', '')}")
    write_json(args.json, rows)
    if args.plot:
        plot_sweep(key, values, sols, args.plot)
        con.print(f"wrote {args.plot}")
    return 0


def plot_sweep(key: str, values, sols, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [v for v, s in zip(values, sols) if s.plan is not None]
    ys = [s.objective for s in sols if s.plan is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o", label="optimal plan (predicted, analytic cost model)")
    prev = None
    for x, s in zip(xs, [s for s in sols if s.plan is not None]):
        g = s.plan.stage("actor/generation").config
        label = f"gen {g.label()}"
        if label != prev:
            ax.annotate(label, (x, s.objective), textcoords="offset points", xytext=(4, 6), fontsize=7)
            prev = label
    bad = [v for v, s in zip(values, sols) if s.plan is None]
    for v in bad:
        ax.axvline(v, color="red", alpha=0.3)
    if bad:
        ax.plot([], [], color="red", alpha=0.3, label="infeasible (OOM at every plan)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel("predicted step time (s)")
    ax.set_title("nereus plan sweep (predicted by the cost model, not measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        save_figure(fig, out)
    finally:
        plt.close(fig)
