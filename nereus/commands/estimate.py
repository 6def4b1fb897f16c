"""nereus estimate: time and memory of one model-stage under one parallel config."""
from __future__ import annotations

import argparse

from nereus.commands.common import GiB, add_job_cluster, console, load_specs, pos_float, pos_int, write_json


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("estimate", help="time and memory of one model-stage under one parallel config",
                       description="Analytic estimate of one model-stage's time and peak memory per GPU.")
    add_job_cluster(p)
    p.add_argument("--model-stage", required=True, help="e.g. actor/training, actor/generation, ref/inference")
    p.add_argument("--tp", type=pos_int, default=1)
    p.add_argument("--pp", type=pos_int, default=1)
    p.add_argument("--dp", type=pos_int, default=1)
    p.add_argument("--micro-batch", type=pos_int, default=1)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--response-len-mean", type=pos_float)
    p.add_argument("--response-len-max", type=pos_int)
    p.add_argument("--json", metavar="OUT", help="write the estimate as JSON")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from nereus.planner.cost.model import estimate
    from nereus.planner.specs import ParallelConfig

    job, cluster, params = load_specs(args)
    w = job.workload()
    if args.response_len_mean or args.response_len_max:
        w = w.with_lengths(mean=args.response_len_mean, max_=args.response_len_max)
    cfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch, zero=args.zero,
                         recompute=args.recompute)
    e = estimate(job, cluster, args.model_stage, cfg, w, params)
    con = console()
    con.print(f"[bold]{args.model_stage}[/] {cfg.label()} (micro-batch {cfg.micro_batch}, ZeRO-{cfg.zero}"
              f"{', recompute' if cfg.recompute else ''}) on {cluster.gpu.name}, "
              f"{w.sequences} sequences x ({w.prompt_len} prompt + {w.response_len_mean:g} mean / "
              f"{w.response_len_max} max response)")
    t = Table("time component", "seconds", "share")
    for k, v in e.time_breakdown.items():
        t.add_row(k, f"{v:.3f}", f"{v / e.time_s:.0%}" if e.time_s and e.time_s != float('inf') else "-")
    t.add_row("[bold]total[/]", f"[bold]{e.time_s:.3f}[/]", "")
    con.print(t)
    m = Table("memory per GPU", "GiB", "kind")
    for k, v in e.mem_breakdown.items():
        kind = "resident" if k in ("grads", "optimizer") or (k == "weights" and e.resident_bytes > 0) else "transient"
        m.add_row(k, f"{v / GiB:.2f}", kind)
    m.add_row("[bold]peak[/]", f"[bold]{e.mem_bytes / GiB:.2f}[/]", f"of {e.capacity_bytes / GiB:.1f} GiB usable")
    con.print(m)
    if e.waves > 1:
        con.print(f"generation runs in {e.waves} waves (KV cache cannot hold every sequence at once)")
    for n in e.notes:
        con.print(f"note: {n}")
    verdict = "[green]fits[/]" if e.fits else f"[red]does NOT fit[/] ({e.mem_bytes / GiB:.1f} > {e.capacity_bytes / GiB:.1f} GiB)"
    con.print(f"verdict: {verdict}")
    write_json(args.json, e.to_dict())
    return 0
