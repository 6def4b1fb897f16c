"""The demo's output: per-step table, side-by-side summary, and a PNG of response length, step
time, memory and transitions over the run."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from nereus.demo.setup import DemoConfig


def print_records(records: list[dict], cfg: DemoConfig) -> None:
    t = Table("step", "cap", "len mean", "len max", "reward", "plan (actor train, actor gen, ref)", "step s",
              "mem peak / budget", "decision", title=None, show_lines=False)
    for r in records:
        mem = f"{r['peak_mem_bytes'] / 2**20:5.1f} / {cfg.budget_mb:g} MB"
        if r["oom"]:
            mem = f"[red]{mem} OOM ({r['oom_phase']})[/]"
        dec = r.get("decision", "")
        if dec == "switch" and r.get("transition_s"):
            dec = (f"[bold]switch -> {r.get('next_plan', '')}[/] ({r['transition_s'] * 1e3:.0f} ms, "
                   f"{'verified' if r.get('verified') else 'NOT verified'}) {r.get('reason', '')}")
        elif r.get("reason"):
            dec = f"{dec}: {r['reason']}"
        t.add_row(str(r["step"]), str(r["cap"]), f"{r['response_len_mean']:.1f}", str(r["response_len_max"]), f"{r['reward']:.1f}",
                  r["plan"], f"{r['step_s']:.2f}", mem, dec[:110])
    Console(width=220).print(t)


def print_summary(summary: dict[str, dict]) -> None:
    rows = [("steps (completed)", lambda s: f"{s['steps']} ({s['completed_steps']})"),
            ("infeasible steps (over budget)", lambda s: str(s["infeasible_steps"])),
            ("transitions (verified)", lambda s: f"{s['transitions']} ({s['verified_transitions']})"),
            ("time in transitions", lambda s: f"{s['transition_s']:.2f} s ({s['transition_fraction']:.2%})"),
            ("mean step time (completed steps)", lambda s: f"{s['mean_step_s']:.2f} s"),
            ("response tokens trained per second", lambda s: f"{s['trained_tokens_per_s']:.0f}"),
            ("peak memory / budget", lambda s: f"{s['peak_mem_frac']:.0%}"),
            ("  during transitions (old state kept)", lambda s: "-" if s.get("transition_peak_mem_frac") is None
             else f"{s['transition_peak_mem_frac']:.0%}"),
            ("final mean response length", lambda s: f"{s['final_response_len_mean']:.1f}"),
            ("final mean reward", lambda s: f"{s['final_reward']:.1f}")]
    t = Table("measured in this run", *summary.keys(), title="summary")
    for name, fmt in rows:
        t.add_row(name, *(fmt(s) for s in summary.values()))
    Console(width=160).print(t)


def plot(results: dict[str, list[dict]], cfg: DemoConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    colors = {"adaptive": "tab:blue", "static": "tab:red"}
    for policy, recs in results.items():
        c = colors.get(policy, "tab:gray")
        steps = [r["step"] for r in recs]
        axes[0].plot(steps, [r["response_len_mean"] for r in recs], color=c, label=f"{policy}: mean")
        axes[0].plot(steps, [r["response_len_max"] for r in recs], color=c, ls=":", label=f"{policy}: max")
        if policy == next(iter(results)):
            axes[0].step(steps, [r["cap"] for r in recs], where="mid", color="black", lw=1, label="cap")
        axes[1].plot(steps, [r["step_s"] for r in recs], color=c, marker=".", label=policy)
        axes[2].plot(steps, [r["peak_mem_frac"] * 100 for r in recs], color=c, marker=".", label=policy)
        for r in recs:
            if r.get("transition_s"):
                for ax in axes:
                    ax.axvline(r["step"] + 0.5, color=c, ls="--", alpha=0.6)
                axes[1].annotate(r.get("next_plan", "switch"), (r["step"] + 0.5, r["step_s"]), fontsize=7,
                                 rotation=90, va="bottom", color=c)
            if r["oom"]:
                axes[2].scatter([r["step"]], [r["peak_mem_frac"] * 100], color=c, marker="x", s=60, zorder=5)
    axes[2].axhline(100, color="black", lw=1)
    axes[0].set_ylabel("response length (tokens)")
    axes[1].set_ylabel("step time (s, measured)")
    axes[2].set_ylabel("peak memory / budget (%)")
    axes[2].set_xlabel("RL step (dashed: transitions; x: step over budget)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"nereus demo (measured on CPU, {cfg.world} gloo processes, {cfg.budget_mb:g} MB budget each)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
