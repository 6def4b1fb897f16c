"""nereus transition: plan the move from one plan's layout to another's and print what it costs."""
from __future__ import annotations

import argparse

from nereus.commands.common import GiB, add_job_cluster, console, pos_float, write_json

MAX_GPUS = 1024
"""Largest plan this command plans a transition for. Measured on 2 cores (ppo-8b, 2k -> 8k or 32k
responses): 1,024 GPUs in 1.5 s; 2,048 GPUs in 2 minutes (4,937,536 ops, 5,608 rounds); 4,096 GPUs
past 5 minutes. Refused in one line rather than left to run for minutes."""


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("transition", help="plan the transition between two plans (bytes, ops, makespan, memory)",
                       description="Plan the transition from plan A to plan B: what stays in place, what moves where, "
                                   "a memory-safe schedule, its makespan and lower bound.")
    add_job_cluster(p, profile=False)
    p.add_argument("--from", dest="plan_from", required=True, metavar="A.json", help="plan A (nereus plan --json)")
    p.add_argument("--to", dest="plan_to", required=True, metavar="B.json", help="plan B (nereus plan --json)")
    p.add_argument("--json", metavar="OUT", help="write the summary as JSON")
    p.add_argument("--graph", metavar="OUT.graphml", help="write the transition graph as GraphML")
    p.add_argument("--scheduler", choices=("auto", "cpsat", "greedy"), default="auto")
    p.add_argument("--time-limit", type=pos_float, default=2.0, help="CP-SAT deterministic time limit (s)")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from nereus.planner.plan import Plan
    from nereus.planner.specs import load_cluster, load_job
    from nereus.planner.transition.build import build_transition, describe

    job, cluster = load_job(args.job), load_cluster(args.cluster)
    a, b = (_load_plan(Plan, path, job, cluster, args.cluster) for path in (args.plan_from, args.plan_to))
    con = console()
    with con.status("planning transition..."):
        res = build_transition(job, cluster, a, b, scheduler=args.scheduler, time_limit_s=args.time_limit,
                               materialize=False)
    tp, st = res.plan, dict(res.plan.stats)
    t = Table("transition", "value")
    t.add_row("bytes kept in place", f"{tp.bytes_kept / GiB:.2f} GiB")
    t.add_row("bytes moved", f"{tp.bytes_moved / GiB:.2f} GiB")
    t.add_row("  local copies", f"{st['bytes_local_copy'] / GiB:.2f} GiB")
    t.add_row("  intra-node", f"{st['bytes_intra_node'] / GiB:.2f} GiB")
    t.add_row("  inter-node", f"{st['bytes_inter_node'] / GiB:.2f} GiB")
    t.add_row("ops (regions) / buckets / rounds", f"{st['ops']} / {st['buckets']} / {st['rounds']}")
    ratio = tp.makespan_s / tp.lower_bound_s if tp.lower_bound_s > 0 else 1.0
    t.add_row("makespan", f"{tp.makespan_s:.3f} s ({tp.scheduler})")
    t.add_row("lower bound", f"{tp.lower_bound_s:.3f} s")
    t.add_row("makespan / lower bound", f"{ratio:.3f}")
    t.add_row("peak memory per GPU", f"{st['peak_mem_bytes'] / GiB:.2f} GiB of {st['capacity_bytes'] / GiB:.2f} GiB "
              f"({tp.peak_mem_frac:.0%})")
    keep = st.get("peak_mem_bytes_keep_old", 0.0)
    t.add_row("  old state kept until commit", f"{keep / GiB:.2f} GiB ({keep / st['capacity_bytes']:.0%}; the executor's "
              "rollback)")
    t.add_row("staged via host", "yes" if tp.staged_via_host else "no")
    t.add_row("planning time", f"{tp.plan_s:.2f} s")
    con.print(t)
    if not st.get("keep_old_fits", True):
        con.print(f"[yellow]warning:[/] with the old state kept until commit a GPU would hold {keep / GiB:.2f} GiB of "
                  f"{st['capacity_bytes'] / GiB:.2f} GiB: the executor keeps it for rollback and has no host staging yet")
    write_json(args.json, describe(tp))
    if args.graph:
        _write_graph(res.graph(), args.graph)
    return 0


def _load_plan(plan_cls, path: str, job, cluster, cluster_path: str):
    """Plan.load, then the checks that tie the plan to this job and cluster, each a one-line error
    naming the plan file (the transition planner's own errors name neither file)."""
    from nereus.errors import SpecError
    from nereus.jsonio import naming

    from nereus.planner.plan import HOME_STAGE

    plan = plan_cls.load(path)
    with naming(path):
        have = [s.name for s in plan]
        missing = [HOME_STAGE[r] for r in job.roles if HOME_STAGE[r] not in have]  # where each model's state lives
        if missing:
            raise SpecError(f"plan has no model-stage {missing} of the job; it has {have}")
        if plan.num_gpus > cluster.num_gpus:
            last = max(plan, key=lambda s: s.first_gpu + s.gpus)
            raise SpecError(f"{last.name} uses GPUs up to {last.first_gpu + last.gpus - 1} but the cluster "
                            f"{cluster_path} has {cluster.num_gpus}")
        if plan.num_gpus > MAX_GPUS:
            raise SpecError(f"the plan spans {plan.num_gpus} GPUs; transitions are planned for at most {MAX_GPUS} "
                            f"(past that this planner takes minutes)")
    return plan


def _write_graph(g, path: str) -> None:
    import networkx as nx

    from nereus.jsonio import atomic_path

    with atomic_path(path) as tmp:  # a reader never sees half a graph
        nx.write_graphml(g, tmp)
