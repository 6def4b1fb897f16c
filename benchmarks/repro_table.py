"""The reproduction's tables (SIMULATED), printed from the JSON ``simulate_repro.py --json`` wrote:
the README's (published figures' row first; every ratio on the steps both policies completed), then
``docs/repro.md``'s mean step seconds of every policy (completed steps beside them) and the runs not
made, with the reason. With several JSONs (``--compare``), ``docs/repro.md``'s sensitivity table: each
policy's mean step seconds (OOM crashes) run by run, "A -> B -> C" in the order given.

    .venv/bin/python benchmarks/repro_table.py benchmarks/results/simulate_repro.json
    .venv/bin/python benchmarks/repro_table.py --compare benchmarks/results/simulate_repro.json \
        benchmarks/results/simulate_repro_planner_truth.json benchmarks/results/simulate_repro_planner_truth_no_reserve.json
"""
from __future__ import annotations

import json
import sys


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _x(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _on(b: dict, ref: str, fmt, field: str, steps: int) -> str:
    """A ratio of ``b["vs"][ref]`` (on the steps both completed), with "[N steps]" where that is fewer
    than the run's steps, and which baseline it was for a best-of."""
    v = (b.get("vs") or {}).get(ref)
    if v is None:
        return fmt(b.get(f"legacy_{ref}")) if f"legacy_{ref}" in b else "-"  # a record written before "vs"
    if field not in v:
        return f"- ({v.get('which', '')}: no common step)"
    note = [v["which"]] if "which" in v else []
    note += [f"{v['steps_both']:,} steps"] if v["steps_both"] < steps else []
    return fmt(v[field]) + (f" ({', '.join(note)})" if note else "")


def _verl(b: dict) -> str:
    """The verl-like reference: the better of offload off and open (records before it: verl alone)."""
    return "verl-best" if "verl-best" in (b.get("vs") or {}) else "verl"


def table(d: dict) -> str:
    """Every ratio is on the steps both policies completed (count in brackets where it is fewer than
    the run's); best-of columns name the baseline that was better."""
    pub = d["published"]
    rows = ["| job | trace (steps, GPUs) | policy (completed steps) | latency vs static-naive | vs static | "
            "vs best of static, static-naive | vs hindsight | oracle vs static | transitions | transition share | "
            "throughput x verl-like (best of optimizer offload off, open) | x OpenRLHF-like (best of disaggregated, colocate-all) | OOM crashes |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| published (8B PPO, real GPUs) | 1,000 steps to 1,024 GPUs | adaptive | | "
            f"{pub['latency_reduction_vs_static'] * 100:.1f}% | | | | {pub['transitions']} | "
            f"{pub['transition_overhead'] * 100:.3f}% | {pub['vs_verl'][0]:.2f}-{pub['vs_verl'][1]:.2f} | "
            f"{pub['vs_openrlhf'][0]:.2f}-{pub['vs_openrlhf'][1]:.2f} | |"]
    for r in d["runs"]:
        n = r["steps"]
        steps = f"{n:,}" if n == r["of_steps"] else f"{n:,} of {r['of_steps']:,}"
        for pol, b in r["by_policy"].items():
            if "not_run" in b:
                rows.append(f"| {r['job']} | {r['trace']} ({steps}, {r['gpus']}) | {pol} | not run: {b['not_run'][:80]} |")
                continue
            done = r["policies"][pol]["completed_steps"]
            rows.append(f"| {r['job']} | {r['trace']} ({steps}, {r['gpus']}) | {pol} ({done:,}) | "
                        f"{_on(b, 'static-naive', _pct, 'latency_reduction', n)} | "
                        f"{_on(b, 'static', _pct, 'latency_reduction', n)} | "
                        f"{_on(b, 'static-best', _pct, 'latency_reduction', n)} | "
                        f"{_on(b, 'hindsight', _pct, 'latency_reduction', n)} | {_pct(r['oracle_reduction_vs_static'])} | "
                        f"{b['transitions']} | {b['transition_overhead'] * 100:.3f}% | "
                        f"{_on(b, _verl(b), _x, 'throughput_x', n)} | {_on(b, 'openrlhf-best', _x, 'throughput_x', n)} | "
                        f"{b['ooms']} |")
    return "\n".join(rows)


def step_table(d: dict) -> str:
    pols = list(dict.fromkeys(p for r in d["runs"] for p in r["policies"]))
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
            if "not_run" in x:
                cells.append("not run")
                continue
            cells.append(f"{x['mean_step_s']:.1f}" + (f" ({', '.join(extra)})" if extra else ""))
        rows.append(f"| {r['job']} | {r['trace']} | " + " | ".join(cells) + " |")
    rows.append("")
    rows += list(dict.fromkeys(f"- not run: {s['job']} / {s['trace']}: {s['why']}" for s in d.get("skipped", [])))
    return "\n".join(rows)


COMPARED = ("static", "hindsight", "adaptive", "always", "oracle")


def compare_table(ds: list[dict]) -> str:
    """Mean step s (OOM crashes) of ``COMPARED`` and the better verl-like, per run present in every
    JSON, "A -> B -> ..."; then the OOM crashes over every policy and run of each."""
    def cell(x: dict | None) -> str:
        if x is None or "not_run" in x:
            return "not run"
        return f"{x['mean_step_s']:.1f}" + (f" ({x['ooms']})" if x["ooms"] else "")

    def verl(pols: dict) -> dict | None:
        got = [pols[p] for p in ("verl", "verl-offload") if p in pols and "not_run" not in pols[p]]
        return min(got, key=lambda x: x["mean_step_s"], default=None)

    runs = [{(r["job"], r["trace"]): r["policies"] for r in d["runs"]} for d in ds]
    rows = ["| job / trace | " + " | ".join(COMPARED) + " | best verl-like |", "|---|" + "---|" * (len(COMPARED) + 1)]
    for key in (k for k in runs[0] if all(k in r for r in runs)):
        cells = [" -> ".join(cell(r[key].get(p)) for r in runs) for p in COMPARED]
        cells.append(" -> ".join(cell(verl(r[key])) for r in runs))
        rows.append(f"| {key[0]} / {key[1]} | " + " | ".join(cells) + " |")
    total = [sum(x["ooms"] for pols in r.values() for x in pols.values() if "ooms" in x) for r in runs]
    ad = [sum(pols["adaptive"]["ooms"] for pols in r.values() if "ooms" in pols.get("adaptive", {})) for r in runs]
    st = [sum(pols["static"]["ooms"] for pols in r.values() if "ooms" in pols.get("static", {})) for r in runs]
    rows += ["", "OOM crashes over every policy and run: " + " -> ".join(map(str, total))
             + "; adaptive's " + " -> ".join(map(str, ad)) + ", static's " + " -> ".join(map(str, st)) + "."]
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--compare":
        print(compare_table([json.loads(open(f).read()) for f in sys.argv[2:]]))
        sys.exit(0)
    if len(sys.argv) != 2:
        sys.exit("usage: repro_table.py SIMULATE_REPRO.json | --compare A.json B.json [C.json ...]")
    data = json.loads(open(sys.argv[1]).read())
    print(table(data))
    print()
    print(step_table(data))
