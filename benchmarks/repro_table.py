"""The reproduction's tables (SIMULATED), printed from the JSON ``simulate_repro.py --json`` wrote:
the README's (published figures' row first), then ``docs/repro.md``'s mean step seconds of every
policy and the runs not made, with the reason.

    .venv/bin/python benchmarks/repro_table.py benchmarks/results/simulate_repro.json
"""
from __future__ import annotations

import json
import sys


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(d: dict) -> str:
    pub = d["published"]
    rows = ["| job | trace (steps, GPUs) | policy | latency vs static-naive | vs static | vs hindsight | "
            "oracle vs static | transitions | transition share | throughput x verl-like | x OpenRLHF-like | "
            "OOM crashes |", "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| published (8B PPO, real GPUs) | 1,000 steps to 1,024 GPUs | adaptive | | "
            f"{pub['latency_reduction_vs_static'] * 100:.1f}% | | | {pub['transitions']} | "
            f"{pub['transition_overhead'] * 100:.3f}% | {pub['vs_verl'][0]:.2f}-{pub['vs_verl'][1]:.2f} | "
            f"{pub['vs_openrlhf'][0]:.2f}-{pub['vs_openrlhf'][1]:.2f} | |"]
    for r in d["runs"]:
        steps = f"{r['steps']:,}" if r["steps"] == r["of_steps"] else f"{r['steps']:,} of {r['of_steps']:,}"
        for pol, b in r["by_policy"].items():
            rows.append(f"| {r['job']} | {r['trace']} ({steps}, {r['gpus']}) | {pol} | "
                        f"{_pct(b['latency_reduction_vs_static_naive'])} | {_pct(b['latency_reduction_vs_static'])} | "
                        f"{_pct(b['latency_reduction_vs_hindsight'])} | {_pct(r['oracle_reduction_vs_static'])} | "
                        f"{b['transitions']} | {b['transition_overhead'] * 100:.3f}% | {_x(b['throughput_vs_verl'])} | "
                        f"{_x(b['throughput_vs_openrlhf'])} | {b['ooms']} |")
    return "\n".join(rows)


def step_table(d: dict) -> str:
    pols = list(d["runs"][0]["policies"]) if d["runs"] else []
    rows = ["| job | trace | " + " | ".join(pols) + " |", "|---|---|" + "---|" * len(pols)]
    for r in d["runs"]:
        cells = []
        for pol in pols:
            x = r["policies"].get(pol)
            if x is None:
                cells.append("not run")
                continue
            extra = [f"{x['ooms']} OOM"] if x["ooms"] else []
            extra += [f"{x['dropped_steps']} dropped"] if x["dropped_steps"] else []
            cells.append(f"{x['mean_step_s']:.1f}" + (f" ({', '.join(extra)})" if extra else ""))
        rows.append(f"| {r['job']} | {r['trace']} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += [f"- not run: {s['job']} / {s['trace']}: {s['why']}" for s in d.get("skipped", [])]
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: repro_table.py SIMULATE_REPRO.json")
    data = json.loads(open(sys.argv[1]).read())
    print(table(data))
    print()
    print(step_table(data))
