"""The cost model against published GPU measurements (nereus/calibration/published): per category
and split, MAPE, median ratio predicted/measured, share within 2x, median error factor, with the
fitted GPU profiles (``nereus fit-profiles``) and, side by side, the analytic defaults; plus the
Llama-3.1-8B checks on one 8 x H100 node; the ``moe`` rows' model-stage breakdowns; for the ``async`` rows also the speed-up over each
sync baseline (predicted vs published) and the step rule fed the sources' own pool timings.
Held-out rows were never read by a fit.

    .venv/bin/python benchmarks/fidelity.py [--json benchmarks/results/fidelity.json] [--plot OUT.png]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.fidelity.async_rows import composition_check  # noqa: E402
from nereus.fidelity.catalog import profile_gpu, resolve_gpu  # noqa: E402
from nereus.fidelity.predict import moe_estimates, moe_one_step_off, predict  # noqa: E402
from nereus.fidelity.report import speedup_summary, speedups  # noqa: E402
from nereus.fidelity.corpus import load_corpus  # noqa: E402
from nereus.fidelity.report import evaluate, fitted_params, params_source, scatter, summarize  # noqa: E402
from nereus.models.spec import preset  # noqa: E402
from nereus.planner.cost.model import decode_iteration_s, estimate  # noqa: E402
from nereus.planner.specs import (BatchSpec, JobSpec, ParallelConfig, SequenceSpec, Workload,  # noqa: E402
                                  load_cluster)

GOALS = {"decode": ("mape", 0.20), "collectives": ("mape", 0.25), "training": ("mape", 0.20)}


def node_checks() -> dict:
    """Llama-3.1-8B on one 8 x H100 node with the fitted H100 profile."""
    p = fitted_params("h100-80gb")
    node = load_cluster(ROOT / "examples/cluster-h100-1n.yaml")
    m = preset("llama-3.1-8b")
    per_token = {tp: decode_iteration_s(m, tp, 1, 2, 1024, node, p) for tp in (1, 2, 4, 8)}

    def gen(n, mean, cap, tp):
        job = JobSpec(algorithm="grpo", models=(("actor", m), ("ref", m)), batch=BatchSpec(prompts=max(1, n // 2), samples_per_prompt=2),
                      sequence=SequenceSpec(prompt_len=256, response_len_mean=mean, response_len_max=cap))
        w = Workload(sequences=n, prompt_len=256, response_len_mean=mean, response_len_max=cap)
        return estimate(job, node, "actor/generation", ParallelConfig(tp=tp, dp=8 // tp), w, p).time_s

    short = {tp: gen(4096, 256, 512, tp) for tp in (1, 8)}
    long = {tp: gen(8, 8192, 16384, tp) for tp in (1, 8)}
    return {"decode_ms_per_token_batch2": {f"tp{k}": v * 1e3 for k, v in per_token.items()},
            "tp4_over_tp1": per_token[4] / per_token[1],
            "short_4096x256_s": {"tp1_dp8": short[1], "tp8": short[8]},
            "long_8x8192_s": {"tp1_dp8": long[1], "tp8": long[8]},
            "holds": {"tp4_le_0.7_tp1": per_token[4] <= 0.7 * per_token[1], "short_favours_tp1_dp8": short[1] < short[8],
                      "long_favours_tp8": long[8] < long[1]}}


def moe_rows(rows) -> list[dict]:
    """The ``moe`` rows with the fitted profiles: published and predicted step, and for a colocated
    row each model-stage's time with its terms over 0.5 s (where the step's time goes)."""
    out = []
    for r in (r for r in rows if r.category == "moe"):
        pred = predict(r, fitted_params)
        rec = {"id": r.id, "model": r.model, "gpus": r.gpus, "published_s": r.value, "predicted_s": pred.predicted,
               "ratio": pred.ratio, "reason": pred.reason}
        if pred.predicted is not None and r.get("schedule") is None:  # a colocated step: the sum of its stages
            gpu, _ = resolve_gpu(r.hardware)
            ests, sync = moe_estimates(r, gpu, fitted_params(profile_gpu(gpu)))
            rec["stages"] = {ms: {"time_s": e.time_s, "config": e.config.label(),
                                  "terms_s": {k: v for k, v in e.time_breakdown.items() if v > 0.5}}
                             for ms, e in ests.items()}
            rec["weight_sync_s"] = sync
        elif pred.predicted is not None:  # one-step-off: the two pools overlap
            gpu, _ = resolve_gpu(r.hardware)
            rec["pools"] = moe_one_step_off(r, gpu, fitted_params(profile_gpu(gpu)))
        out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--plot", metavar="OUT.png")
    args = ap.parse_args()
    rows = load_corpus()
    t0 = time.perf_counter()
    out = {"corpus_rows": len(rows), "sources": len({r.source for r in rows})}
    for name in ("auto", "analytic"):
        params_for, source = params_source(name)
        preds = evaluate(rows, params_for)
        out["fitted" if name == "auto" else "analytic"] = {"params": source, "summary": summarize(preds)}
        out["fitted" if name == "auto" else "analytic"]["async_speedups"] = speedup_summary(speedups(rows, preds, params_for))
        if name == "auto" and args.plot:
            scatter(preds, args.plot, "Cost model (fitted profiles) vs published GPU measurements")
    out["seconds"] = time.perf_counter() - t0
    out["async_composition"] = composition_check(rows)
    out["llama_8b_h100_node"] = node_checks()
    out["moe_rows"] = moe_rows(rows)
    goals = {}
    for s in out["fitted"]["summary"]:
        if s["split"] == "heldout" and s["category"] in GOALS and "mape" in s:
            key, limit = GOALS[s["category"]]
            goals[s["category"]] = {"mape": s["mape"], "limit": limit, "rows": s["predicted"], "met": s["mape"] <= limit}
        if s["split"] == "heldout" and s["category"] == "rl_stages" and "within_2x" in s:
            goals["rl_stages"] = {"within_2x": s["within_2x"], "median_error": s["median_error"], "rows": s["predicted"],
                                  "met": s["within_2x"] >= 0.8 and s["median_error"] <= 1.5}
    out["goals_heldout"] = goals
    print(f"{'category':12} {'split':8} {'rows':>5} {'pred':>5} {'MAPE':>7} {'med.ratio':>9} {'within2x':>8}   analytic MAPE")
    ana = {(s["category"], s["split"]): s for s in out["analytic"]["summary"]}
    for s in out["fitted"]["summary"]:
        a = ana.get((s["category"], s["split"]), {})
        print(f"{s['category']:12} {s['split']:8} {s['rows']:5} {s['predicted']:5} "
              f"{s.get('mape', float('nan')):7.0%} {s.get('median_ratio', float('nan')):9.2f} "
              f"{s.get('within_2x', float('nan')):8.0%}   {a.get('mape', float('nan')):.0%}")
    print("held-out goals:", json.dumps(goals, indent=None, default=float))
    sp = {k: v for k, v in out["fitted"]["async_speedups"].items() if k != "rows"}
    print("async speed-ups (sync step / async step), predicted vs published:", json.dumps(sp, default=float))
    print("Llama-3.1-8B, one H100 node:", json.dumps(out["llama_8b_h100_node"]["holds"]))
    for m in out["moe_rows"]:
        stages = "; ".join(f"{ms} {x['time_s']:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in x['terms_s'].items())})"
                           for ms, x in m.get("stages", {}).items())
        got = f"{m['predicted_s']:.1f} s ({m['ratio']:.2f}x)" if m["predicted_s"] else m["reason"]
        if "pools" in m:
            stages = "one-step-off: " + ", ".join(f"{k} {v:.1f}" for k, v in m["pools"].items() if k != "step_s")
        print(f"moe {m['id']} {m['model']} {m['gpus']} GPUs: published {m['published_s']:g} s, predicted {got}; {stages}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
