"""The README's two tables of the main job, rendered from the JSON ``nereus demo --json`` wrote
(MEASURED: a real GRPO run on gloo processes; nothing here is simulated).

    .venv/bin/python benchmarks/demo_tables.py docs/demo.json
"""
from __future__ import annotations

import json
import sys


def _load(x) -> str:
    return " / ".join(f"{v:.1f}" for v in x) if x else "–"


def tables(d: dict) -> str:
    head = ("| budget per process | policy | starting layout (actor train, actor gen, ref) | steps completed | "
            "over budget | transitions (verified) | response tokens/s, completed steps | mean step s | "
            "reward, last 5 steps | host load at start / end |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for b in d["budgets"]:
        for pol, s in b["summary"].items():
            rows.append(f"| {b['budget_k']:g} x = {b['budget_mb']:.1f} MiB | {pol} | {b['plans'][pol]} | "
                        f"{s['completed_steps']}/{s['steps']} | {s['infeasible_steps']} | "
                        f"{s['transitions']} ({s['verified_transitions']}) | {s['tokens_per_s']:.0f} | "
                        f"{s['mean_step_s']:.2f} | {s['mean_reward_last5']:.1f} | {_load(s.get('host_load_1min'))} |")
    pols = list(d["budgets"][0]["summary"])
    rows += ["", "| budget | model-stage | " + " | ".join(pols) + " |", "|---|---|" + "---|" * len(pols)]
    touched = total = 0
    for b in d["budgets"]:
        for ms in b["factors"][pols[0]]:
            cells = []
            for pol in pols:
                f = b["factors"][pol][ms]
                cells.append(f"{f['min']:.2f} / {f['median']:.2f} / {f['max']:.2f}")
                touched += f["at_clamp_steps"]
                total += f["steps"]
            rows.append(f"| {b['budget_k']:g} x | {ms} | " + " | ".join(cells) + " |")
    rows += ["", f"{touched} of the {total:,} step-factors touched the clamp {d['clamp']}; "
                 f"wall {d['wall_s'] / 60:.1f} min."]
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: demo_tables.py DEMO.json")
    print(tables(json.loads(open(sys.argv[1]).read())))
