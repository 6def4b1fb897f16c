"""Regenerate the notebooks from their cell sources and execute them in place (real outputs).

    .venv/bin/python notebooks/build_notebooks.py

CI executes them again with ``pytest --nbmake`` (``make test``). Logic lives in the package; the
notebooks only call it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SETUP = """from pathlib import Path
import pandas as pd
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
%matplotlib inline
ROOT = Path.cwd() if (Path.cwd() / "examples").exists() else Path.cwd().parent
EX = ROOT / "examples"
pd.set_option("display.width", 160)"""

NOTEBOOKS = {
    "01_capacity_planning.ipynb": [
        ("md", """# Capacity planning

What plan, how fast and how much memory, for the bundled example jobs, and what if the cluster were
bigger or had other GPUs. Data: `examples/*.yaml` and the analytic cost model with its default
(uncalibrated) efficiencies from `shared/reference/COST_MODEL.md`; plans from the exact CP-SAT solver.
All figures are model predictions, not measurements."""),
        ("code", SETUP + """
from nereus.planner.specs import load_job, load_cluster, ClusterSpec
from nereus.planner.solver import PlanProblem, solve, evaluate_plan

def plan_table(job, cluster):
    sol = solve(PlanProblem(job=job, cluster=cluster, workload=job.workload()), time_limit_s=10)
    df = pd.DataFrame(sol.plan.to_dict()["model_stages"])[["name", "tp", "pp", "dp", "pool", "first_gpu", "gpus",
                                                          "micro_batch", "zero", "time_s", "mem_gib"]]
    return sol, df

job8 = load_job(EX / "ppo-8b.yaml")
sol, df = plan_table(job8, load_cluster(EX / "cluster-h100-4n.yaml"))
print(f"{sol.status}: predicted step {sol.objective:.1f} s, solved in {sol.wall_s:.2f} s, gap {sol.gap:.0%}")
df"""),
        ("md", "## What if: GPU type and cluster size (Llama-3.1-8B PPO)"),
        ("code", """rows = []
for gpu in ("a100-80gb", "h100-80gb", "h200"):
    for nodes in (2, 4, 8):
        c = ClusterSpec.from_dict({"gpu": gpu, "nodes": nodes})
        s = solve(PlanProblem(job=job8, cluster=c, workload=job8.workload()), time_limit_s=10)
        rows.append({"gpu": gpu, "gpus": c.num_gpus, "status": s.status,
                     "step_s": s.objective if s.plan else None,
                     "samples_per_s": job8.batch.sequences / s.objective if s.plan else None})
whatif = pd.DataFrame(rows)
whatif.pivot(index="gpus", columns="gpu", values="step_s").round(1)"""),
        ("code", """ax = whatif.pivot(index="gpus", columns="gpu", values="samples_per_s").plot(marker="o", logx=True)
ax.set_ylabel("predicted samples / s"); ax.set_title("8B PPO throughput vs cluster size (model prediction)");"""),
        ("md", "## Memory breakdown of the chosen plan (per GPU, GiB)"),
        ("code", """from nereus.planner.cost.model import estimate
parts = []
for s in sol.plan.stages:
    e = estimate(job8, load_cluster(EX / "cluster-h100-4n.yaml"), s.name, s.config)
    parts.append({"model-stage": s.name, **{k: v / 2**30 for k, v in e.mem_breakdown.items()}})
mem = pd.DataFrame(parts).set_index("model-stage").fillna(0)
ax = mem.plot.barh(stacked=True, figsize=(8, 4)); ax.set_xlabel("GiB per GPU (standalone)")
mem.round(2)"""),
        ("md", "## The other examples: 70B PPO on 16 nodes, 7B GRPO on one node"),
        ("code", """for j, c in (("ppo-70b", "cluster-h100-16n"), ("grpo-7b", "cluster-h100-1n")):
    s, d = plan_table(load_job(EX / f"{j}.yaml"), load_cluster(EX / f"{c}.yaml"))
    print(f"{j} on {c}: {s.status}, step {s.objective:.1f} s (solve {s.wall_s:.2f} s)")
    display(d)"""),
    ],
    "02_plans_vs_response_length.ipynb": [
        ("md", """# Plans vs response length

How the optimal layout of each model-stage moves as responses grow (mean from 1k to 32k tokens,
cap 4x the mean), and where each fixed layout stops fitting in memory. Data: `examples/ppo-8b.yaml`
on `examples/cluster-h100-4n.yaml`, analytic cost model (predictions, not measurements)."""),
        ("code", SETUP + """
from nereus.planner.specs import load_job, load_cluster
from nereus.planner.solver import PlanProblem, solve, evaluate_plan
job = load_job(EX / "ppo-8b.yaml"); cluster = load_cluster(EX / "cluster-h100-4n.yaml")
means = [1024, 2048, 4096, 8192, 16384, 32768]
plans, rows = {}, []
for m in means:
    w = job.workload().with_lengths(mean=m, max_=4 * m)
    s = solve(PlanProblem(job=job, cluster=cluster, workload=w), time_limit_s=10)
    plans[m] = s.plan
    row = {"mean": m, "max": 4 * m, "status": s.status, "step_s": s.objective if s.plan else None}
    if s.plan:
        for st in s.plan.stages:
            c = st.config
            row[st.name] = f"tp{c.tp} pp{c.pp} dp{c.dp} @{st.first_gpu}+{st.gpus}"
    rows.append(row)
sweep = pd.DataFrame(rows); sweep"""),
        ("md", "## Where each fixed layout becomes infeasible\nEvery optimal plan above, held fixed and evaluated by the independent checker at every length."),
        ("code", """grid = []
for m0, p in plans.items():
    if p is None:
        continue
    for m in means:
        w = job.workload().with_lengths(mean=m, max_=4 * m)
        ev = evaluate_plan(PlanProblem(job=job, cluster=cluster, workload=w), p)
        grid.append({"plan chosen at": m0, "response mean": m,
                     "step_s": ev.step_time_s if ev.feasible else float("nan"),
                     "peak GiB": ev.peak_mem_gib})
g = pd.DataFrame(grid)
g.pivot(index="response mean", columns="plan chosen at", values="step_s").round(1)"""),
        ("code", """fig, axes = plt.subplots(1, 2, figsize=(12, 4))
g.pivot(index="response mean", columns="plan chosen at", values="step_s").plot(ax=axes[0], marker="o", logx=True, logy=True)
axes[0].set_ylabel("predicted step time (s); gaps = out of memory")
g.pivot(index="response mean", columns="plan chosen at", values="peak GiB").plot(ax=axes[1], marker="o", logx=True)
axes[1].axhline(cluster.gpu.usable_bytes / 2**30, color="black", lw=1); axes[1].set_ylabel("peak GiB per GPU")
fig.suptitle("fixed plans vs response length (model prediction)");"""),
    ],
    "03_transition_cost_vs_savings.ipynb": [
        ("md", """# Transition cost vs savings

For real plan pairs (the optimal plans at neighbouring mean response lengths, under a fixed 32k cap so
that the older plan still fits), what the transition costs
(scheduled makespan of the transition graph), what it saves per step, and after how many steps it
pays for itself; then how the scale-out bandwidth changes that decision. Data: `examples/ppo-8b.yaml`
on 4 DGX-H100 nodes; analytic cost model and transition planner (predictions)."""),
        ("code", SETUP + """
from dataclasses import replace
from nereus.planner.specs import load_job, load_cluster, ClusterSpec
from nereus.planner.solver import PlanProblem, solve, evaluate_plan
from nereus.planner.transition.build import plan_transition
job = load_job(EX / "ppo-8b.yaml"); cluster = load_cluster(EX / "cluster-h100-4n.yaml")
CAP = 32768
def workload(m): return job.workload().with_lengths(mean=m, max_=CAP)
means = [1024, 2048, 4096, 8192]
plans = {m: solve(PlanProblem(job=job, cluster=cluster, workload=workload(m)), time_limit_s=10).plan for m in means}
rows = []
for a, b in zip(means, means[1:]):
    t = plan_transition(job, cluster, plans[a], plans[b])
    w = workload(b)
    old = evaluate_plan(PlanProblem(job=job, cluster=cluster, workload=w), plans[a])
    new = evaluate_plan(PlanProblem(job=job, cluster=cluster, workload=w), plans[b])
    saving = old.step_time_s - new.step_time_s if old.feasible else float("inf")
    rows.append({"from (mean)": a, "to (mean)": b, "GB moved": t.bytes_moved / 1e9, "GB kept": t.bytes_kept / 1e9,
                 "makespan_s": t.makespan_s, "lower_bound_s": t.lower_bound_s, "old plan fits": old.feasible,
                 "saving_per_step_s": saving, "break_even_steps": t.makespan_s / saving if saving > 0 else float("nan")})
pairs = pd.DataFrame(rows); pairs.round(3)"""),
        ("md", "## How bandwidth changes the decision\nThe pair with the largest transfer, on clusters whose scale-out bandwidth is 0.5 to 100 GB/s per GPU; a controller with 20 steps left switches only when the break-even is below 20."),
        ("code", """big = pairs.sort_values("GB moved").iloc[-1]
a, b = int(big["from (mean)"]), int(big["to (mean)"])
rows = []
for gbps in (0.5, 2, 5, 12.5, 25, 50, 100):
    c = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 4, "inter_node_gbps": gbps})
    t = plan_transition(job, c, plans[a], plans[b])
    w = workload(b)
    saving = (evaluate_plan(PlanProblem(job=job, cluster=c, workload=w), plans[a]).step_time_s
              - evaluate_plan(PlanProblem(job=job, cluster=c, workload=w), plans[b]).step_time_s)
    rows.append({"inter_node_GBps": gbps, "makespan_s": t.makespan_s, "lower_bound_s": t.lower_bound_s,
                 "saving_per_step_s": saving, "break_even_steps": t.makespan_s / saving if saving > 0 else float("nan")})
bw = pd.DataFrame(rows)
bw["switch with 20 steps left"] = bw["break_even_steps"] < 20
print(f"plans optimal at mean {a} -> {b}")
ax = bw.plot(x="inter_node_GBps", y="break_even_steps", marker="o", logx=True)
ax.set_ylabel("steps to repay the transition"); ax.set_title("break-even vs scale-out bandwidth (model prediction)")
bw.round(3)"""),
    ],
    "04_calibration.ipynb": [
        ("md", """# Calibration: estimate beside measurement beside ratio

From the profile measured on this project's CPU machine (`nereus/calibration/profiles/cpu-local.json`,
produced by the command in its `how` field): every held-out microbenchmark and stage configuration,
the calibrated estimate, the measured time and their ratio, with the uncalibrated analytic estimate
beside it. The measurements are real (taken when the profile was made); the estimates are the model's."""),
        ("code", SETUP + """
import json
from nereus.calibration.profile import estimate_table, load_profile
prof = load_profile("cpu-local")
print("how:", prof.how); print("when:", prof.when)
print("held-out MAPE after calibration:", json.dumps(prof.heldout_mape))
print("held-out MAPE with analytic defaults:", json.dumps(prof.fit.get("heldout_mape_before", {})))
table = estimate_table(prof)
table.round(4)"""),
        ("code", """summary = table.assign(err=(table["ratio"] - 1).abs(), err_uncal=(table["ratio_uncalibrated"] - 1).abs())\\
    .groupby("part")[["err", "err_uncal"]].mean().rename(columns={"err": "MAPE calibrated", "err_uncal": "MAPE analytic"})
ax = summary.plot.bar(); ax.set_ylabel("mean |estimate/measured - 1|"); ax.set_yscale("log")
summary.round(3)"""),
    ],
}


def build(name: str, cells: list[tuple[str, str]], execute: bool = True) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    if execute:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, HERE / name)
    print("wrote", HERE / name)


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, cells in NOTEBOOKS.items():
        if not only or any(o in name for o in only):
            build(name, cells)
