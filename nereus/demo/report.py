"""The demo's output: per-step table, side-by-side summary per budget, the online correction
factors, a table across budgets, and a PNG: learning curve (reward per step), response length, step
time and memory per policy, one column per budget."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from nereus.demo.setup import DemoConfig


def print_records(records: list[dict], cfg: DemoConfig) -> None:
    t = Table("step", "cap", "len mean", "len max", "reward", "plan (actor train, actor gen, ref)", "step s",
              "mem peak / budget", "decision", title=None, show_lines=False)
    for r in records:
        mem = f"{r['peak_mem_bytes'] / 2**20:5.1f} / {cfg.budget_mb:.1f} MiB"
        if r["oom"]:
            mem = f"[red]{mem} OOM ({r['oom_phase']})[/]"
        dec = r.get("decision", "")
        if dec == "switch" and r.get("transition_s"):
            dec = (f"[bold]switch -> {r.get('next_plan', '')}[/] ({r['transition_s'] * 1e3:.0f} ms, "
                   f"{'verified' if r.get('verified') else 'NOT verified'}) {r.get('reason', '')}")
        elif r.get("reason"):
            dec = f"{dec}: {r['reason']}"
        t.add_row(str(r["step"]), str(r["cap"]), f"{r['response_len_mean']:.1f}", str(r["response_len_max"]), f"{r['reward']:.1f}",
                  r["plan"] + (" rc" if r.get("recompute") else ""), f"{r['step_s']:.2f}", mem, dec[:110])
    Console(width=220).print(t)


def print_summary(summary: dict[str, dict], title: str = "summary") -> None:
    rows = [("steps (completed)", lambda s: f"{s['steps']} ({s['completed_steps']})"),
            ("infeasible steps (over budget)", lambda s: str(s["infeasible_steps"])),
            ("layouts run", lambda s: str(len(s["layouts"]))),
            ("steps with recomputation", lambda s: str(s["recompute_steps"])),
            ("transitions (verified)", lambda s: f"{s['transitions']} ({s['verified_transitions']})"),
            ("time in transitions", lambda s: f"{s['transition_s']:.2f} s ({s['transition_fraction']:.2%})"),
            ("mean step time (completed steps)", lambda s: f"{s['mean_step_s']:.2f} s"),
            ("response tokens/s (completed steps)", lambda s: f"{s['tokens_per_s']:.0f}"),
            ("  time lost in over-budget steps", lambda s: f"{s['lost_s']:.1f} s"),
            ("peak memory / budget", lambda s: f"{s['peak_mem_frac']:.0%}"),
            ("  during transitions (old state kept)", lambda s: "-" if s.get("transition_peak_mem_frac") is None
             else f"{s['transition_peak_mem_frac']:.0%}"),
            ("final mean response length", lambda s: f"{s['final_response_len_mean']:.1f}"),
            ("mean reward, last 5 steps", lambda s: f"{s['mean_reward_last5']:.1f}"),
            ("host load (1 min) at start / end", lambda s: "-" if "host_load_1min" not in s
             else "{:.1f} / {:.1f}".format(*s["host_load_1min"]))]
    t = Table("measured in this run", *summary.keys(), title=title)
    for name, fmt in rows:
        t.add_row(name, *(fmt(s) for s in summary.values()))
    Console(width=160).print(t)


def print_factors(factors: dict[str, dict]) -> None:
    """Online correction factors (measured / predicted stage time) per policy and model-stage."""
    t = Table("policy", "model-stage", "min", "median", "max", "steps at clamp", title="online correction factors")
    for policy, per in factors.items():
        for ms, f in per.items():
            t.add_row(policy, ms, f"{f['min']:.2f}", f"{f['median']:.2f}", f"{f['max']:.2f}",
                      f"{f['at_clamp_steps']} of {f['steps']}")
    Console(width=160).print(t)


def print_overview(runs: list[dict]) -> None:
    t = Table("budget", "policy", "layout", "steps done", "over budget", "tokens/s (completed)", "mean step s",
              "transitions", "reward (last 5)", title="across budgets (measured)")
    for r in runs:
        for policy, s in r["summary"].items():
            t.add_row(f"{r['budget_k']:g} x ({r['budget_mb']:.1f} MiB)", policy, r["plans"][policy],
                      f"{s['completed_steps']}/{s['steps']}", str(s["infeasible_steps"]), f"{s['tokens_per_s']:.0f}",
                      f"{s['mean_step_s']:.2f}", str(s["transitions"]), f"{s['mean_reward_last5']:.1f}")
    Console(width=200).print(t)


COLORS = {"adaptive": "tab:blue", "static": "tab:red", "static+recompute": "tab:orange", "hindsight": "tab:green"}


def plot(runs: list[dict], cfg: DemoConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(runs)
    fig, axes = plt.subplots(4, cols, figsize=(6 * cols, 11), sharex=True, squeeze=False)
    for j, run in enumerate(runs):
        ax = axes[:, j]
        for policy, recs in run["records"].items():
            c = COLORS.get(policy, "tab:gray")
            steps = [r["step"] for r in recs]
            ax[0].plot(steps, [r["reward"] for r in recs], color=c, marker=".", label=policy)
            ax[1].plot(steps, [r["response_len_mean"] for r in recs], color=c, label=policy)
            ax[2].plot(steps, [r["step_s"] for r in recs], color=c, marker=".", label=policy)
            ax[3].plot(steps, [r["peak_mem_frac"] * 100 for r in recs], color=c, marker=".", label=policy)
            for r in recs:
                if r.get("transition_s"):
                    for a in ax:
                        a.axvline(r["step"] + 0.5, color=c, ls="--", alpha=0.5)
                if r["oom"]:
                    ax[3].scatter([r["step"]], [r["peak_mem_frac"] * 100], color=c, marker="x", s=60, zorder=5)
            if policy == next(iter(run["records"])):
                ax[1].step(steps, [r["cap"] for r in recs], where="mid", color="black", lw=1, label="cap")
        ax[3].axhline(100, color="black", lw=1)
        ax[0].set_title(f"budget {run['budget_k']:g} x model state = {run['budget_mb']:.1f} MiB per process")
        ax[3].set_xlabel("RL step (dashed: transitions; x: over budget)")
        for a in ax:
            a.grid(alpha=0.3)
        ax[0].legend(fontsize=8)
    for i, label in enumerate(("mean reward (learning curve)", "mean response length", "step time (s, measured)",
                               "peak memory / budget (%)")):
        axes[i, 0].set_ylabel(label)
    fig.suptitle(f"nereus demo: GRPO on {cfg.world} gloo CPU processes, tiny model (measured on a 2-core CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
