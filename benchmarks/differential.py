"""Differential check (SIMULATED): the planner's cost model (``nereus.planner.cost.model.estimate``)
against the simulator's ground truth (``nereus.simulator.truth``, which shares no code with it) on
random model-stage configurations, as an error distribution per stage kind.

Each configuration: a random model (Llama-3.1-8B, Qwen2.5-32B, Llama-3.1-70B), GPU type (A100-80GB,
H100, H200), pool of 8-256 GPUs, model-stage (generation, inference or training of the actor /
critic / reference), parallel config (tp, pp, dp, micro-batch, ZeRO stage, recomputation) and
workload (mean response 500-16,000 tokens, cap 1.2-4x the mean, 256-2,048 sequences). The stage runs
on its own pool holding only its own model's state (training: the model's training states;
inference: the weights the pass reads, as the planner's stage estimate counts them; generation: an
engine on otherwise empty GPUs).
The ground truth's time is its mean over 8 sampled steps. Reported: planner / truth time ratios per
stage kind, how often the two disagree on "fits in memory", how often they order two
generation TPs of the same workload the same way, and the memory gap: planner / truth peak memory
per GPU of the training and inference configurations (the planner's predicted peak without the
plans' reserve, and with it; generation engines take their memory fraction up front on both sides,
so their footprint is set, not predicted). ``--before PATH`` carries an earlier run's memory gap into
the JSON beside this one (e.g. the truth's conventions before issue 32).

    .venv/bin/python benchmarks/differential.py --json benchmarks/results/differential.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.errors import NereusError  # noqa: E402
from nereus.models.inventory import check_tp  # noqa: E402
from nereus.models.spec import preset  # noqa: E402
from nereus.planner.cost.estimates import reserve_bytes  # noqa: E402
from nereus.planner.cost.model import estimate  # noqa: E402
from nereus.planner.cost.params import CostParams  # noqa: E402
from nereus.planner.plan import StagePlacement  # noqa: E402
from nereus.planner.specs import GPU_PRESETS, BatchSpec, ClusterSpec, JobSpec, ParallelConfig, SequenceSpec  # noqa: E402
from nereus.simulator.trace import constant_trace  # noqa: E402
from nereus.simulator.truth.machine import GroundTruth  # noqa: E402
from nereus.simulator.truth.memory import capacity_bytes, params_per_gpu, state_bytes  # noqa: E402

MODELS = ("llama-3.1-8b", "qwen2.5-32b", "llama-3.1-70b")
GPUS = ("a100-80gb", "h100-80gb", "h200")
STAGES = ("actor/generation", "actor/inference", "ref/inference", "actor/training", "critic/training")


def _job(model: str, prompts: int, samples: int, mean: float, cap: int) -> JobSpec:
    m = preset(model)
    return JobSpec(algorithm="ppo", models=(("actor", m), ("critic", m), ("ref", m)),
                   batch=BatchSpec(prompts=prompts, samples_per_prompt=samples, mini_batches=2),
                   sequence=SequenceSpec(prompt_len=1024, response_len_mean=mean, response_len_max=cap))


def _config(rng, job: JobSpec, ms: str, gpus: int, gpn: int) -> ParallelConfig | None:
    model = job.model(ms.split("/")[0])
    for _ in range(20):
        tp = int(rng.choice([1, 2, 4, 8]))
        pp = int(rng.choice([1, 1, 2, 4])) if not ms.endswith("generation") else 1
        if tp > gpn or gpus % (tp * pp):
            continue
        try:
            check_tp(model, tp)
        except NereusError:
            continue
        training = ms.endswith("training")
        return ParallelConfig(tp=tp, pp=pp, dp=gpus // (tp * pp), micro_batch=int(rng.choice([1, 2, 4])),
                              zero=int(rng.choice([1, 3])) if training else 1,
                              recompute=bool(rng.random() < 0.5) if training else False)
    return None


def sample(rng, n: int) -> list[dict]:
    out = []
    while len(out) < n:
        model, gpu, ms = str(rng.choice(MODELS)), str(rng.choice(GPUS)), str(rng.choice(STAGES))
        gpus = int(rng.choice([8, 16, 32, 64, 128, 256]))
        mean = float(np.exp(rng.uniform(np.log(500), np.log(16000))))
        cap = int(min(32768, 1024 * math.ceil(mean * rng.uniform(1.2, 4.0) / 1024)))
        prompts = int(rng.choice([64, 128, 256, 512]))
        job = _job(model, prompts, 4, mean, cap)
        cfg = _config(rng, job, ms, gpus, 8)
        if cfg is not None:
            out.append({"model": model, "gpu": gpu, "stage": ms, "gpus": gpus, "mean": round(mean, 1), "cap": cap,
                        "prompts": prompts, "cfg": cfg, "job": job})
    return out


def evaluate(case: dict, params: CostParams, steps: int = 8) -> dict:
    job, ms, cfg = case["job"], case["stage"], case["cfg"]
    cluster = ClusterSpec(gpu=GPU_PRESETS[case["gpu"]], nodes=max(1, case["gpus"] // 8))
    w = job.workload()
    est = estimate(job, cluster, ms, cfg, w, params)
    role = ms.split("/")[0]
    s = StagePlacement(name=ms, config=cfg, pool=0, first_gpu=0, gpus=cfg.gpus)
    resident = 0.0
    if not ms.endswith("generation"):
        psi = params_per_gpu(job.model(role), cfg.tp, cfg.pp, value_head=role == "critic")
        # the stage's own state, as the planner's estimate counts it: a training stage holds its model's
        # training states, an inference pass the weights it reads (an actor's training states sit on
        # its home pool; a plan, not a stage estimate, adds them)
        resident = state_bytes(psi, cfg.dp, cfg.zero, ms.endswith("training") and role in ("actor", "critic"))
    gt = GroundTruth(job, cluster, constant_trace(w, cluster.num_gpus, steps), seed=0)
    t, peak = gt.stage_times(s, np.arange(steps), resident)
    capacity = capacity_bytes(cluster.gpu.memory_gib)
    truth_fits = bool(np.all(np.isfinite(t)) and np.all(peak <= capacity))
    truth_s = float(np.mean(t)) if np.all(np.isfinite(t)) else math.inf
    return {"model": case["model"], "gpu": case["gpu"], "stage": ms, "kind": ms.split("/")[1], "gpus": case["gpus"],
            "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "micro_batch": cfg.micro_batch, "zero": cfg.zero,
            "recompute": cfg.recompute, "mean": case["mean"], "cap": case["cap"], "sequences": w.sequences,
            "planner_s": est.time_s, "truth_s": truth_s, "planner_fits": bool(est.fits), "truth_fits": truth_fits,
            "planner_mem_gib": est.mem_bytes / 2**30, "truth_mem_gib": float(np.max(peak)) / 2**30,
            "planner_mem_model_gib": (est.mem_bytes - reserve_bytes(est)) / 2**30,
            "planner_capacity_gib": est.capacity_bytes / 2**30, "truth_capacity_gib": capacity / 2**30}


def summarise(rows: list[dict]) -> dict:
    out = {}
    for kind in ("generation", "inference", "training"):
        rs = [r for r in rows if r["kind"] == kind]
        both = [r for r in rs if math.isfinite(r["planner_s"]) and math.isfinite(r["truth_s"]) and r["truth_s"] > 0]
        ratio = np.array([r["planner_s"] / r["truth_s"] for r in both])
        fit_dis = [r for r in rs if r["planner_fits"] != r["truth_fits"]]
        out[kind] = {"configs": len(rs), "compared": len(both),
                     "ratio_p10": float(np.percentile(ratio, 10)), "ratio_median": float(np.median(ratio)),
                     "ratio_p90": float(np.percentile(ratio, 90)),
                     "abs_log_error_median": float(np.median(np.abs(np.log(ratio)))),
                     "within_20pct": float(np.mean(np.abs(ratio - 1) <= 0.2)),
                     "fits_disagree": len(fit_dis),
                     "planner_fits_truth_ooms": sum(1 for r in fit_dis if r["planner_fits"])}
    return out


def memory_gap(rows: list[dict]) -> dict:
    """Planner / truth peak memory per GPU, per stage kind (training, inference) and over both: the
    planner's model (no reserve) and its plans' figure (with ``mem_reserve_frac``)."""
    out = {}
    for kind in ("training", "inference", "all"):
        rs = [r for r in rows if r["kind"] != "generation" and (kind == "all" or r["kind"] == kind)
              and r["truth_mem_gib"] > 0]
        if not rs:
            continue
        d = {"configs": len(rs)}
        for name, col in (("model", "planner_mem_model_gib"), ("with_reserve", "planner_mem_gib")):
            ratio = np.array([r[col] / r["truth_mem_gib"] for r in rs if col in r])
            if len(ratio):
                d[name] = {"median": float(np.median(ratio)), "p10": float(np.percentile(ratio, 10)),
                           "p90": float(np.percentile(ratio, 90)), "min": float(ratio.min()), "max": float(ratio.max())}
        out[kind] = d
    return out


def tp_ranking(rng, params: CostParams, n: int = 40) -> dict:
    """Pairs of generation TPs on the same job, GPUs and workload: does the planner order them like
    the ground truth?"""
    agree = total = 0
    examples = []
    while total < n:
        case = sample(rng, 1)[0]
        if not case["stage"].endswith("generation"):
            continue
        job, gpus = case["job"], case["gpus"]
        tps = [tp for tp in (1, 2, 4, 8) if job.model("actor").heads % tp == 0]
        a, b = rng.choice(tps, size=2, replace=False)
        r = []
        for tp in (int(a), int(b)):
            c = dict(case, cfg=ParallelConfig(tp=tp, dp=gpus // tp))
            r.append(evaluate(c, params, steps=4))
        if not all(math.isfinite(x["planner_s"]) and math.isfinite(x["truth_s"]) for x in r):
            continue
        same = (r[0]["planner_s"] < r[1]["planner_s"]) == (r[0]["truth_s"] < r[1]["truth_s"])
        agree += same
        total += 1
        if not same and len(examples) < 5:
            examples.append({k: r[0][k] for k in ("model", "gpu", "gpus", "mean", "cap")} |
                            {"tps": [int(a), int(b)], "planner_s": [x["planner_s"] for x in r],
                             "truth_s": [x["truth_s"] for x in r]})
    return {"pairs": total, "same_order": agree, "share_same_order": agree / total, "disagreements": examples}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=240)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows and the summary as JSON")
    ap.add_argument("--before", help="an earlier run's JSON: its memory gap is carried into this one as memory_gap_before")
    ap.add_argument("--before-label", default="before", help="what the earlier run was (written beside its gap)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    params = CostParams()
    rows = [evaluate(c, params) for c in sample(rng, args.configs)]
    summary = summarise(rows)
    gap = memory_gap(rows)
    ranking = tp_ranking(rng, params)
    print(f"SIMULATED differential: planner cost model vs ground truth, {len(rows)} random configurations "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'stage kind':11} {'n':>4} {'planner/truth p10':>18} {'median':>7} {'p90':>6} {'|log err| med':>14} "
          f"{'within 20%':>10} {'fit disagree':>12} {'planner fits, truth OOM':>24}")
    for kind, s in summary.items():
        print(f"{kind:11} {s['configs']:>4} {s['ratio_p10']:>18.2f} {s['ratio_median']:>7.2f} {s['ratio_p90']:>6.2f} "
              f"{s['abs_log_error_median']:>14.2f} {s['within_20pct']:>10.0%} {s['fits_disagree']:>12} "
              f"{s['planner_fits_truth_ooms']:>24}")
    print(f"generation TP pairs ordered alike: {ranking['same_order']}/{ranking['pairs']} "
          f"({ranking['share_same_order']:.0%})")
    print("memory, planner / truth peak per GPU (model = no reserve; plan = with mem_reserve_frac):")
    for kind, g in gap.items():
        print(f"  {kind:10} n={g['configs']:>3}  model median {g['model']['median']:.2f} "
              f"(p10 {g['model']['p10']:.2f}, p90 {g['model']['p90']:.2f}, range {g['model']['min']:.2f}-{g['model']['max']:.2f})"
              f"  plan median {g['with_reserve']['median']:.2f} (range {g['with_reserve']['min']:.2f}-{g['with_reserve']['max']:.2f})")
    out = {"label": "SIMULATED", "seed": args.seed, "summary": summary, "memory_gap": gap,
           "generation_tp_ranking": ranking}
    if args.before:
        prev = json.loads(Path(args.before).read_text())
        out["memory_gap_before"] = {"what": args.before_label, "summary": prev.get("summary"),
                                    "memory_gap": prev.get("memory_gap") or memory_gap(prev["rows"])}
    out["rows"] = rows
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
