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
        ("code", """# checks: proven optimal (the objective meets the solver's bound), every model-stage within usable memory
usable_gib = load_cluster(EX / "cluster-h100-4n.yaml").gpu.usable_bytes / 2**30
assert sol.status == "OPTIMAL" and abs(sol.objective - sol.bound) <= 1e-6 * sol.objective, (sol.objective, sol.bound)
assert (df["mem_gib"] <= usable_gib + 1e-9).all() and (df["time_s"] > 0).all()"""),
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
        ("code", """# checks: every cluster has an optimal plan; more GPUs are never slower, nor is a faster GPU at the same size
assert (whatif["status"] == "OPTIMAL").all()
st = whatif.pivot(index="gpus", columns="gpu", values="step_s")
assert (st.diff().dropna() <= 1e-9 * st.max().max()).all().all(), st
assert ((st["h200"] <= st["h100-80gb"] * (1 + 1e-9)) & (st["h100-80gb"] <= st["a100-80gb"] * (1 + 1e-9))).all(), st"""),
        ("md", "## Memory breakdown of the chosen plan (per GPU, GiB)"),
        ("code", """from nereus.planner.cost.model import estimate
parts = []
for s in sol.plan.stages:
    e = estimate(job8, load_cluster(EX / "cluster-h100-4n.yaml"), s.name, s.config)
    parts.append({"model-stage": s.name, **{k: v / 2**30 for k, v in e.mem_breakdown.items()}})
mem = pd.DataFrame(parts).set_index("model-stage").fillna(0)
ax = mem.plot.barh(stacked=True, figsize=(8, 4)); ax.set_xlabel("GiB per GPU (standalone)")
mem.round(2)"""),
        ("code", """# checks: no negative part; training holds gradients and Adam state, generation a KV cache, inference neither
assert (mem.values >= 0).all()
assert (mem.loc[["actor/training", "critic/training"], ["grads", "optimizer"]] > 0).all().all()
assert mem.loc["actor/generation", "kv_cache"] > 0
assert (mem.loc[[n for n in mem.index if n.endswith("/inference")], ["grads", "optimizer", "kv_cache"]] == 0).all().all()"""),
        ("md", "## The other examples: 70B PPO on 16 nodes, 7B GRPO on one node"),
        ("code", """others = {}
for j, c in (("ppo-70b", "cluster-h100-16n"), ("grpo-7b", "cluster-h100-1n")):
    s, d = plan_table(load_job(EX / f"{j}.yaml"), load_cluster(EX / f"{c}.yaml"))
    others[j] = s
    print(f"{j} on {c}: {s.status}, step {s.objective:.1f} s (solve {s.wall_s:.2f} s)")
    display(d)
# checks: both proven optimal; GRPO has no critic or reward model to place
assert all(s.status == "OPTIMAL" for s in others.values())
assert {st.name.split("/")[0] for st in others["grpo-7b"].plan.stages} == {"actor", "ref"}"""),
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
        ("code", """# checks: an optimal plan at every length, and the predicted step time rises with the response length
assert (sweep["status"] == "OPTIMAL").all()
assert sweep["step_s"].is_monotonic_increasing and sweep["step_s"].iloc[-1] > 10 * sweep["step_s"].iloc[0], sweep["step_s"]"""),
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
        ("code", """# checks: the checker agrees with the solver where each plan was chosen, and no fixed plan beats the optimum
# at any length; the plan for the shortest responses runs out of memory at longer ones; a fixed plan's
# peak memory never falls as responses grow
t = g.pivot(index="response mean", columns="plan chosen at", values="step_s")
pk = g.pivot(index="response mean", columns="plan chosen at", values="peak GiB")
best = sweep.set_index("mean")["step_s"]
for m in means:
    assert abs(t.loc[m, m] - best[m]) <= 1e-6 * best[m], (m, t.loc[m, m], best[m])
    assert (t.loc[m].dropna() >= best[m] * (1 - 1e-9)).all(), t.loc[m]
assert t[means[0]].isna().any()
assert (pk.diff().dropna() >= -1e-9).all().all(), pk"""),
        ("code", """fig, axes = plt.subplots(1, 2, figsize=(12, 4))
g.pivot(index="response mean", columns="plan chosen at", values="step_s").plot(ax=axes[0], marker="o", logx=True, logy=True)
axes[0].set_ylabel("predicted step time (s); gaps = out of memory")
g.pivot(index="response mean", columns="plan chosen at", values="peak GiB").plot(ax=axes[1], marker="o", logx=True)
axes[1].axhline(cluster.gpu.usable_bytes / 2**30, color="black", lw=1); axes[1].set_ylabel("peak GiB per GPU")
fig.suptitle("fixed plans vs response length (model prediction)");"""),
    ],
    "03_transition_cost_vs_savings.ipynb": [
        ("md", """# Transition cost vs savings

For real plan pairs (the optimal plans at neighbouring mean response lengths, under a fixed 32k cap),
what the transition costs (scheduled makespan of the transition graph), what it saves per step, and
after how many steps it pays for itself (an older plan that no longer fits in memory forces the
switch: saving infinite, break-even 0); then how the scale-out bandwidth changes that decision. Data: `examples/ppo-8b.yaml`
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
        ("code", """# checks: a transition that moves bytes takes time (makespan >= its lower bound > 0), one between equal
# layouts none; an older plan that still fits is never faster than the new optimum (saving >= 0), one
# that does not fit forces the switch (saving infinite, break-even 0)
moved, fits = pairs["GB moved"] > 0, pairs["old plan fits"]
assert moved.any() and (pairs.loc[moved, "lower_bound_s"] > 0).all()
assert (pairs["makespan_s"] >= pairs["lower_bound_s"] * (1 - 1e-9)).all() and (pairs.loc[~moved, "makespan_s"] == 0).all()
assert (pairs.loc[fits, "saving_per_step_s"] >= -1e-9).all() and (pairs.loc[~fits, "saving_per_step_s"] == float("inf")).all()
print(f"older plan still fits in {int(fits.sum())} of {len(pairs)} pairs")"""),
        ("md", "## How bandwidth changes the decision\nThe pair with the largest transfer, on clusters whose scale-out bandwidth is 0.5 to 100 GB/s per GPU; a controller with 20 steps left switches only when the break-even is below 20."),
        ("code", """big = pairs.sort_values("GB moved").iloc[-1]
a, b = int(big["from (mean)"]), int(big["to (mean)"])
rows = []
for gbps in (0.5, 2, 5, 12.5, 25, 50, 100):
    c = ClusterSpec.from_dict({"gpu": "h100-80gb", "nodes": 4, "inter_node_gbps": gbps})
    t = plan_transition(job, c, plans[a], plans[b])
    w = workload(b)
    old = evaluate_plan(PlanProblem(job=job, cluster=c, workload=w), plans[a])
    new = evaluate_plan(PlanProblem(job=job, cluster=c, workload=w), plans[b])
    saving = old.step_time_s - new.step_time_s if old.feasible else float("inf")  # out of memory: a forced switch
    rows.append({"inter_node_GBps": gbps, "makespan_s": t.makespan_s, "lower_bound_s": t.lower_bound_s,
                 "old plan fits": old.feasible, "saving_per_step_s": saving,
                 "break_even_steps": t.makespan_s / saving if saving > 0 else float("nan")})
bw = pd.DataFrame(rows)
bw["switch with 20 steps left"] = bw["break_even_steps"] < 20
print(f"plans optimal at mean {a} -> {b}")
ax = bw.plot(x="inter_node_GBps", y="break_even_steps", marker="o", logx=True)
ax.set_ylabel("steps to repay the transition"); ax.set_title("break-even vs scale-out bandwidth (model prediction)")
bw.round(3)"""),
        ("code", """# checks: more scale-out bandwidth, a faster transition (makespan and bound fall); where the older plan
# fits, an earlier break-even; where it does not, a forced switch at any bandwidth
assert (bw["makespan_s"].diff().dropna() < 0).all() and (bw["lower_bound_s"].diff().dropna() < 0).all()
assert (bw["makespan_s"] >= bw["lower_bound_s"] * (1 - 1e-9)).all()
fit = bw[bw["old plan fits"] & (bw["saving_per_step_s"] > 0)]
assert (fit["break_even_steps"].diff().dropna() < 0).all(), bw
assert (bw.loc[~bw["old plan fits"], "break_even_steps"] == 0).all() and bw.loc[~bw["old plan fits"], "switch with 20 steps left"].all()"""),
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
        ("code", """# checks: each ratio is the estimate over the measurement, finite and positive; the held-out errors are
# finite, the ones the profile states, and calibration cut them in both parts
import math
assert ((table["ratio"] - table["estimate"] / table["measured"]).abs() <= 1e-12 * table["ratio"].abs()).all()
assert all(math.isfinite(x) and x > 0 for x in [*table["ratio"], *table["ratio_uncalibrated"]])
assert all(math.isfinite(v) for v in prof.heldout_mape.values())
assert (summary["MAPE calibrated"] - pd.Series(prof.heldout_mape)).abs().max() < 1e-9, summary
assert (summary["MAPE calibrated"] < summary["MAPE analytic"]).all(), summary"""),
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
