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


def _runs(xs) -> str:
    return ", ".join(f"{x:g}" for x in xs)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_summary(summary: dict[str, dict], title: str = "summary") -> None:
    """Per policy over its runs: medians, with each run's figure where it matters."""
    rows = [("runs", lambda s: str(s.get("runs", 1))),
            ("steps completed, per run", lambda s: f"{s['steps']:g}: " + _runs(s.get("completed_steps_runs",
                                                                                     [s["completed_steps"]]))),
            ("infeasible steps (over budget), median", lambda s: f"{s['infeasible_steps']:g}"),
            ("layouts run", lambda s: str(len(s["layouts"]))),
            ("steps with recomputation, median", lambda s: f"{s['recompute_steps']:g}"),
            ("transitions (verified), per run", lambda s: _runs(s.get("transitions_runs", [s["transitions"]])) + " ("
             + _runs(s.get("verified_transitions_runs", [s["verified_transitions"]])) + ")"),
            ("time in transitions, median", lambda s: f"{s['transition_s']:.2f} s ({s['transition_fraction']:.2%})"),
            ("mean step time (completed steps), median", lambda s: f"{s['mean_step_s']:.2f} s"),
            ("response tokens/s (completed steps), median", lambda s: f"{s['tokens_per_s']:.0f}"),
            ("  per run", lambda s: ", ".join(f"{x:.0f}" for x in s.get("tokens_per_s_runs", [s["tokens_per_s"]]))),
            ("  spread (max - min) / median", lambda s: _pct(s.get("tokens_per_s_spread"))),
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


def print_comparisons(res: dict) -> None:
    """Adaptive's median tokens/s against each other policy's, judged against the A/A spread."""
    aa = res.get("aa_spread")
    title = (f"adaptive vs each policy, median tokens/s; A/A control ({res.get('aa_policy')}: one plan run "
             f"{res.get('repeats')} times) spread {_pct(aa)}: a difference inside it is a tie")
    t = Table("vs", "difference", "A/A spread", "verdict", "steps completed (adaptive; other), per run", title=title)
    for c in res.get("comparisons", []):
        a, b = c["completed_steps"]
        t.add_row(c["vs"], f"{c['diff']:+.1%}", _pct(c["aa_spread"]), c["verdict"], f"{_runs(a)}; {_runs(b)}")
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
    t = Table("budget", "policy", "layout", "steps done", "tokens/s median (spread)", "vs adaptive",
              "A/A spread", "transitions (verified)", "reward (last 5)", title="across budgets (measured)")
    for r in runs:
        vs = {c["vs"]: c for c in r.get("comparisons", [])}
        for policy, s in r["summary"].items():
            c = vs.get(policy)
            t.add_row(f"{r['budget_k']:g} x ({r['budget_mb']:.1f} MiB)", policy, r["plans"][policy],
                      f"{_runs(s['completed_steps_runs'])} of {s['steps']:g}",
                      f"{s['tokens_per_s']:.0f} ({_pct(s['tokens_per_s_spread'])})",
                      "-" if c is None else f"{-c['diff'] / (1 + c['diff']):+.1%} {c['verdict']}",
                      _pct(r.get("aa_spread")),
                      f"{_runs(s['transitions_runs'])} ({_runs(s['verified_transitions_runs'])})",
                      f"{s['mean_reward_last5']:.1f}")
    Console(width=200).print(t)


COLORS = {"adaptive": "tab:blue", "static": "tab:red", "static+recompute": "tab:orange", "model-hindsight": "tab:green"}


def plot(runs: list[dict], cfg: DemoConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(runs)
    fig, axes = plt.subplots(4, cols, figsize=(6 * cols, 11), sharex=True, squeeze=False)
    for j, run in enumerate(runs):
        ax = axes[:, j]
        for policy, recs, i in [(p, rs, i) for p, all_rs in run.get("runs", {p: [rs] for p, rs in run["records"].items()}).items()
                                for i, rs in enumerate(all_rs)]:
            c = COLORS.get(policy, "tab:gray")
            steps = [r["step"] for r in recs]
            kw = {"color": c, "label": policy if i == 0 else None, "alpha": 1.0 if i == 0 else 0.45,
                  "lw": 1.5 if i == 0 else 1.0}
            ax[0].plot(steps, [r["reward"] for r in recs], marker=".", **kw)
            ax[1].plot(steps, [r["response_len_mean"] for r in recs], **kw)
            ax[2].plot(steps, [r["step_s"] for r in recs], marker=".", **kw)
            ax[3].plot(steps, [r["peak_mem_frac"] * 100 for r in recs], marker=".", **kw)
            for r in recs:
                if r.get("transition_s"):
                    for a in ax:
                        a.axvline(r["step"] + 0.5, color=c, ls="--", alpha=0.5)
                if r["oom"]:
                    ax[3].scatter([r["step"]], [r["peak_mem_frac"] * 100], color=c, marker="x", s=60, zorder=5)
            if policy == next(iter(run["records"])) and i == 0:
                ax[1].step(steps, [r["cap"] for r in recs], where="mid", color="black", lw=1, label="cap")
        ax[3].axhline(100, color="black", lw=1)
        aa = run.get("aa_spread")
        ax[0].set_title(f"budget {run['budget_k']:g} x model state = {run['budget_mb']:.1f} MiB per process"
                        + ("" if aa is None else f"\nA/A spread of tokens/s {aa:.1%} (faint: repeat runs)"))
        ax[3].set_xlabel("RL step (dashed: transitions; x: over budget)")
        for a in ax:
            a.grid(alpha=0.3)
        ax[0].legend(fontsize=8)
    for i, label in enumerate(("mean reward (learning curve)", "mean response length", "step time (s, measured)",
                               "peak memory / budget (%)")):
        axes[i, 0].set_ylabel(label)
    fig.suptitle(f"nereus demo: GRPO on {cfg.world} gloo CPU processes, tiny model,\n{cfg.repeats} interleaved runs per "
                 f"policy (measured on a 2-core CPU)", fontsize=10 if cols == 1 else 12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _g(x) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def markdown_tables(d: dict) -> str:
    """docs/demo.md's tables from the JSON ``nereus demo --json`` wrote: per budget, every policy's
    median and spread over its runs, adaptive against it beside the A/A spread (a tie inside it);
    then the online correction factors. ``python -m nereus.demo.report DEMO.json``."""
    head = ("| budget per process | policy | starting layout (actor train, actor gen, ref) | steps completed, per run | "
            "transitions (verified), per run | response tokens/s, completed steps: median (per run) | spread | "
            "adaptive vs it | mean step s | reward, last 5 steps | host load at start / end |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for b in d["budgets"]:
        vs = {c["vs"]: c for c in b.get("comparisons", [])}
        for pol, s in b["summary"].items():
            c = vs.get(pol)
            cmp = "-" if c is None else f"{c['diff']:+.1%}: {c['verdict']}"
            load = s.get("host_load_1min")
            rows.append(f"| {b['budget_k']:g} x = {b['budget_mb']:.1f} MiB | {pol} | {b['plans'][pol]} | "
                        f"{_runs(s['completed_steps_runs'])} of {_g(s['steps'])} | "
                        f"{_runs(s['transitions_runs'])} ({_runs(s['verified_transitions_runs'])}) | "
                        f"{s['tokens_per_s']:.0f} ({', '.join(f'{x:.0f}' for x in s['tokens_per_s_runs'])}) | "
                        f"{_pct(s['tokens_per_s_spread'])} | {cmp} | {s['mean_step_s']:.2f} | "
                        f"{s['mean_reward_last5']:.1f} | {'-' if not load else ' / '.join(f'{x:.1f}' for x in load)} |")
        rows.append(f"| {b['budget_k']:g} x | A/A control | {b.get('aa_policy')}'s one plan, run {b.get('repeats')} "
                    f"times unchanged | | | | {_pct(b.get('aa_spread'))} | a difference inside this is a tie | | | |")
    pols = list(d["budgets"][0]["summary"])
    rows += ["", "| budget | model-stage | " + " | ".join(pols) + " |", "|---|---|" + "---|" * len(pols)]
    touched = total = 0
    for b in d["budgets"]:
        for ms in b["factors"][pols[0]]:
            cells = []
            for pol in pols:
                f = b["factors"].get(pol, {}).get(ms)
                if f is None:
                    cells.append("-")
                    continue
                cells.append(f"{f['min']:.2f} / {f['median']:.2f} / {f['max']:.2f}")
                touched += f["at_clamp_steps"]
                total += f["steps"]
            rows.append(f"| {b['budget_k']:g} x | {ms} | " + " | ".join(cells) + " |")
    rows += ["", f"{touched} of the {total:,} step-factors touched the clamp {d['clamp']}; wall {d['wall_s'] / 60:.1f} min."]
    return "\n".join(rows)


if __name__ == "__main__":
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m nereus.demo.report DEMO.json")
    print(markdown_tables(json.loads(Path(sys.argv[1]).read_text())))
