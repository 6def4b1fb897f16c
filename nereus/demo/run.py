"""``nereus demo``: a real GRPO run on ``world`` gloo processes that re-plans its parallelism online,
beside the same run under three single-layout baselines (static, static+recompute, model-hindsight),
at one memory budget or several (``run_demo(..., budgets=...)``), every policy ``repeats`` times,
interleaved, with an A/A control (model-hindsight's one plan, run unchanged each time) whose spread
of tokens/s decides which differences count (``compare``).

Set-up in the parent process: a short supervised warm-up of the policy, probes of the real model's
activation bytes and speed and of the world's host overheads (so the cost model describes these
processes), then per budget: each policy's plan (``policy.py``) and its runs (``worker.py``), every
run a fresh run state on the same ``world`` ranks the probes ran on (``executor.launch.Ranks``:
spawn, torch import and rendezvous paid once, not once per run). Adaptive runs first:
model-hindsight is chosen from its first run's response lengths.

Throughput is counted on identical work: response tokens of the steps that completed, divided by
the time of those steps (and of the transitions the policy paid for); a step aborted over budget
adds neither tokens nor time (its time is reported on its own, as lost).
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from nereus.demo.setup import (
    AA_POLICY,
    DEMO_MODEL,
    DemoConfig,
    MiB,
    budget_cluster,
    budget_for,
    demo_cluster,
    demo_job,
    demo_params,
    policies_of,
    state_bytes,
)
from nereus.demo.task import CountingTask
from nereus.demo.warmup import forward, probe_activations, sft_warmup, token_accuracy


def measure_speed(full: dict[str, torch.Tensor], seqs: int = 8, length: int = 64) -> tuple[float, float]:
    """(training FLOP/s, seconds per decode step of ``seqs`` sequences) of this machine at TP=1."""
    torch.set_num_threads(1)
    w = {k: v.clone().requires_grad_(True) for k, v in full.items()}
    ids = torch.randint(1, DEMO_MODEL.vocab, (seqs, length), generator=torch.Generator().manual_seed(0))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        forward(DEMO_MODEL, w, ids).float().logsumexp(-1).mean().backward()
        best = min(best, time.perf_counter() - t0)
    flops = 6 * DEMO_MODEL.matmul_params() * seqs * length / best
    with torch.no_grad():
        one = ids[:, :1]
        t0 = time.perf_counter()
        for _ in range(8):
            forward(DEMO_MODEL, full, one)
        decode = (time.perf_counter() - t0) / 8
    return flops, decode


def prepare(cfg: DemoConfig, log=print, ranks=None):
    """Warm-up, probes (on ``ranks``, an ``executor.launch.Ranks``, when given), job/cluster/params
    and the initial plan (parent process)."""
    from nereus.demo.policy import initial_plan

    # one thread, as every rank runs: a second intra-op thread on 2 shared cores made the warm-up's
    # 8 small steps take 4-23 s of CPU under load against 0.3 s on one
    torch.set_num_threads(1)
    task = CountingTask()
    t0 = time.perf_counter()
    full = sft_warmup(DEMO_MODEL, task, seed=cfg.seed, steps=cfg.warmup_steps)
    acc = token_accuracy(DEMO_MODEL, full, task)
    log(f"warm-up: {cfg.warmup_steps} supervised steps -> per-token accuracy {acc:.2f} "
        f"(expected response length about {acc / max(1e-6, 1 - acc):.1f}); {time.perf_counter() - t0:.1f} s")
    from nereus.demo.probe import probe_world

    t0 = time.perf_counter()
    longest = max(c for _, c in cfg.cap_schedule)
    rep, shard = probe_activations(DEMO_MODEL, full, task.prompt_len + longest)
    flops, decode_s = measure_speed(full)
    host = probe_world(full, cfg.world, cfg.prompts * cfg.samples, task.prompt_len + cfg.cap_schedule[0][1],
                       ranks=ranks)
    log(f"probe ({time.perf_counter() - t0:.1f} s): activations {rep / 1024:.1f} KiB replicated + {shard / 1024:.1f} KiB "
        f"TP-split per token per layer; training {flops / 1e9:.1f} GFLOP/s in one process; on {cfg.world} processes: "
        f"{host['micro_batch_overhead_s'] * 1e3:.1f} ms per training micro-batch pass, "
        f"{host['infer_pass_overhead_s'] * 1e3:.1f} ms per log-prob micro-batch + "
        f"{host['infer_call_overhead_s'] * 1e3:.1f} ms per log-prob call, "
        f"{host['optimizer_step_overhead_s'] * 1e3:.0f} ms per optimizer step, "
        f"{host['allreduce_latency_s'] * 1e3:.2f} ms per collective step, "
        f"{(host['link_bytes_per_s'] or 0) / 1e6:.0f} MB/s all-reduce bandwidth, {host['decode_step_s'] * 1e3:.1f} ms per "
        f"decode step")
    job = demo_job(cfg)
    cluster, params, modelled = cost_inputs(cfg, rep, shard, flops, host, task.prompt_len)
    plan = initial_plan(job, cluster, params, cfg)
    return full, job, cluster, params, plan, {"warmup_accuracy": acc, "act_replicated": rep, "act_sharded": shard,
                                              "gflops": flops / 1e9, "decode_step_s": decode_s,
                                              "cpu_share": min(1.0, len(os.sched_getaffinity(0)) / cfg.world),
                                              "host": host, "link_gbps": cluster.gpu.intra_node_gbps,
                                              "decode_step_modelled_s": modelled,
                                              "decode_step_overhead_s": params.decode_step_overhead_s}


def cost_inputs(cfg: DemoConfig, rep: float, shard: float, flops: float, host: dict, prompt_len: int):
    """(cluster, params, modelled decode step) from the probes: activation bytes, one process's
    training FLOP/s, the world's host costs (``probe.probe_world``) and the probed link. Every plan
    and transition price of the run is made on this cluster (``setup.budget_cluster`` changes only
    its memory per budget)."""
    base = demo_params(rep, shard)
    # the world's processes share this machine's cores: each gets a fraction of the measured speed
    share = min(1.0, len(os.sched_getaffinity(0)) / cfg.world)
    params = replace(base, decode_step_overhead_s=host["decode_step_s"],
                     micro_batch_overhead_s=host["micro_batch_overhead_s"],
                     infer_pass_overhead_s=host["infer_pass_overhead_s"],
                     infer_call_overhead_s=host["infer_call_overhead_s"],
                     optimizer_step_overhead_s=host["optimizer_step_overhead_s"],
                     allreduce_latency_s=host["allreduce_latency_s"])
    link = host["link_bytes_per_s"]  # measured, as achieved: the cost model multiplies by intra_link_eff
    cluster = demo_cluster(cfg, flops=flops * share / base.mfu_train,
                           **({"link_gbps": link / base.intra_link_eff / 1e9} if link else {}))
    params, modelled = _decode_overhead(params, cluster, host, prompt_len)
    return cluster, params, modelled


def _decode_overhead(params, cluster, host: dict, prompt_len: int):
    """(params whose ``decode_step_overhead_s`` is the probe's measured decode step less what the
    cost model already charges for that step, the modelled part). The probe decoded
    ``decode_steps`` tokens for ``rows`` sequences per replica (DP over the world) from ``prompt_len``-token
    prompts; the model's own step (weights and KV read, FLOPs, TP collectives, the per-sequence
    overhead) at that batch and mean context is taken off, so the step is not counted twice (it was:
    generation came out about 2x slower than the runs measured)."""
    from nereus.planner.cost.model import decode_iteration_s

    t = host["timings"]
    rows, steps = t["micro_batches"], t["decode_steps"]
    bare = replace(params, decode_step_overhead_s=0.0)
    modelled = decode_iteration_s(DEMO_MODEL, 1, 1, rows, prompt_len + steps / 2, cluster, bare, engine="static")
    return replace(params, decode_step_overhead_s=max(0.0, host["decode_step_s"] - modelled)), modelled


def run_policy(cfg: DemoConfig, policy: str, full, job, cluster, params, plan, ranks=None) -> list[dict]:
    """One run of ``policy`` on ``ranks`` (the demo's kept ``Ranks``: fresh run state, the same
    processes) or, without, on freshly spawned ranks."""
    from nereus.demo.worker import rank_main
    from nereus.executor.launch import Ranks

    cfg = replace(cfg, budget_mb=budget_for(cfg))
    own = ranks is None
    ranks = Ranks(cfg.world, pg_timeout_s=120.0) if own else ranks
    try:
        out = ranks.run(rank_main, cfg, full, job, cluster, params, plan, policy, timeout_s=cfg.timeout_s)
    finally:
        if own:
            ranks.close()
    return None if out is None else out[0]  # None: a torchrun rank other than 0 (rank 0 reports)


def summarize(records: list[dict], budget_mb: float) -> dict:
    """Measured figures of one run. Throughput on identical work: response tokens of completed steps
    / (time of completed steps + transitions); ``wall_tokens_per_s`` divides the same tokens by all
    the run's time (over-budget steps included), shown only beside it."""
    ok = [r for r in records if not r["oom"]]
    trans = [r for r in records if r.get("transition_s")]
    t_s = sum(r.get("transition_s", 0.0) for r in records)
    ok_s = sum(r["step_s"] for r in ok)
    total = sum(r["step_s"] for r in records) + t_s
    tokens = sum(r["response_len_mean"] * r["sequences"] for r in ok)
    return {"steps": len(records), "completed_steps": len(ok),
            "mean_step_s": ok_s / len(ok) if ok else float("nan"),
            "completed_s": ok_s, "lost_s": sum(r["step_s"] for r in records if r["oom"]),
            "transition_s": t_s, "transition_fraction": t_s / total if total else 0.0,
            "completed_tokens": tokens,
            "tokens_per_s": tokens / (ok_s + t_s) if ok else 0.0,
            "wall_tokens_per_s": tokens / total if total else 0.0,
            "transitions": len(trans), "verified_transitions": sum(1 for r in trans if r.get("verified")),
            "infeasible_steps": sum(1 for r in records if r["oom"]),
            "peak_mem_frac": max(r["peak_mem_frac"] for r in records),
            "transition_peak_mem_frac": max((r.get("transition_peak_mem_frac", 0.0) for r in trans), default=None),
            "layouts": sorted({r["plan"] for r in records}),
            "recompute_steps": sum(1 for r in records if r.get("recompute")),
            "final_response_len_mean": records[-1]["response_len_mean"], "final_reward": records[-1]["reward"],
            "mean_reward_last5": statistics.fmean(r["reward"] for r in records[-5:]),
            "budget_mb": budget_mb}


def correction_factors(audit_paths, bounds: tuple[float, float] = (0.25, 4.0)) -> dict[str, dict]:
    """min / median / max over the run (or runs: ``audit_paths`` may be a list) of each model-stage's
    online correction factor (measured / predicted time, as the controller's calibration holds it
    after each step), and how many steps it sat at a bound of the clamp."""
    series: dict[str, list[float]] = {}
    paths = [audit_paths] if isinstance(audit_paths, (str, Path)) else list(audit_paths)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            cal = json.loads(line).get("calibration") or {}
            for ms, f in (cal.get("model_stage") or {}).items():
                series.setdefault(ms, []).append(float(f))
    lo, hi = bounds
    return {ms: {"min": min(v), "median": statistics.median(v), "max": max(v), "steps": len(v),
                 "at_clamp_steps": sum(1 for f in v if f <= lo * (1 + 1e-9) or f >= hi * (1 - 1e-9))}
            for ms, v in series.items()}


def rel_spread(values: list[float]) -> float | None:
    """(max - min) / median of ``values``; None with fewer than two."""
    if len(values) < 2:
        return None
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med > 0 else None


def aggregate(runs: list[dict]) -> dict:
    """One policy's summary over its repetitions: every numeric field of ``summarize`` as its
    median over the runs (the value itself where every run agrees; the fields a single run's
    summary has), ``layouts`` their union, plus the
    per-run figures (``per_run``), ``tokens_per_s_runs`` and their relative spread
    (``tokens_per_s_spread``: (max - min) / median)."""
    out: dict = {}
    for k, v in runs[0].items():
        vals = [r[k] for r in runs]
        if k == "layouts":
            out[k] = sorted({x for r in runs for x in r[k]})
        elif k == "host_load_1min":
            out[k] = (runs[0][k][0], runs[-1][k][1])
        elif all(x == v for x in vals):
            out[k] = v
        elif all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vals):
            out[k] = statistics.median(vals)
        elif all(x is None or isinstance(x, (int, float)) for x in vals) and any(x is not None for x in vals):
            out[k] = max(x for x in vals if x is not None)
        else:
            out[k] = v
    tps = [r["tokens_per_s"] for r in runs]
    out.update(runs=len(runs), tokens_per_s_runs=tps, tokens_per_s_spread=rel_spread(tps),
               completed_steps_runs=[r["completed_steps"] for r in runs],
               transitions_runs=[r["transitions"] for r in runs],
               verified_transitions_runs=[r["verified_transitions"] for r in runs], per_run=runs)
    return out


def compare(summary: dict[str, dict], aa_spread: float | None, ref: str = "adaptive") -> list[dict]:
    """``ref``'s median tokens/s against every other policy's: the relative difference, and a verdict
    that counts it only beyond the A/A control's spread (inside it: "tie"; no A/A measured: "no
    A/A"). Tokens/s counts completed steps only, so the completed-step counts stand beside it."""
    if ref not in summary:
        return []
    a = summary[ref]
    out = []
    for p, s in summary.items():
        if p == ref or not s["tokens_per_s"]:
            continue
        diff = a["tokens_per_s"] / s["tokens_per_s"] - 1
        if aa_spread is None:
            verdict = "no A/A"
        elif abs(diff) <= aa_spread:
            verdict = "tie"
        else:
            verdict = f"{ref} faster" if diff > 0 else f"{ref} slower"
        out.append({"policy": ref, "vs": p, "diff": diff, "aa_spread": aa_spread, "verdict": verdict,
                    "completed_steps": (a["completed_steps_runs"], s["completed_steps_runs"])})
    return out


def _label(plan) -> str:
    from nereus.demo.worker import _layout_label

    return _layout_label(plan) + (" +recompute" if any(s.config.recompute for s in plan.stages) else "")


def run_budget(cfg: DemoConfig, prep: tuple, log=print, ranks=None) -> dict:
    """Every policy of ``cfg`` at its budget, ``cfg.repeats`` times, interleaved (every policy once,
    then again); records, summaries over the repetitions, the A/A spread and the comparisons it
    judges, factors, how each plan was chosen."""
    from nereus.demo.policy import audit_path, hindsight_plan, initial_plan, static_plan
    from nereus.demo.report import print_records

    full, job, probed, params, _, _ = prep
    budget = budget_for(cfg)
    cfg = replace(cfg, budget_mb=budget)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    cluster = budget_cluster(probed, cfg)  # the probed FLOP/s, memory bandwidth and link; this budget
    policies = policies_of(cfg)
    plans, how, loads, walls = {}, {}, {}, {}
    runs: dict[str, list[list[dict]]] = {}
    for policy in policies:
        if policy == "adaptive":
            plans[policy] = initial_plan(job, cluster, params, cfg)
            how[policy] = "fastest plan for the first step's workload; then the controller"
        elif policy in ("static", "static+recompute"):
            plans[policy], cap = static_plan(job, cluster, params, cfg, policy)
            how[policy] = (f"fastest plan sized for cap {cap} (generation on the training layout)" if cap
                           else "no plan fits even the first cap")
        elif "adaptive" not in policies:
            raise ValueError(f"the {policy} policy is chosen from the adaptive run's lengths: run adaptive first")
    for rep in range(max(1, cfg.repeats)):
        for policy in policies:
            if policy == "model-hindsight" and policy not in plans:
                if not runs.get("adaptive"):
                    raise ValueError(f"the {policy} policy is chosen from the adaptive run's lengths: run adaptive first")
                plans[policy], scored = hindsight_plan(job, cluster, params, runs["adaptive"][0],
                                                       [plans.get("static"), plans.get("static+recompute")],
                                                       cfg.recompute)
                how[policy] = {"rule": "best total predicted (cost-model, not measured) time over the first adaptive "
                                       "run's step workloads, among plans predicted to fit every step; run unchanged",
                               "candidates": [{"plan": _label(c["plan"]), "predicted_run_s": c["predicted_run_s"],
                                               "fits_every_step": c["fits_every_step"]} for c in scored]}
            if plans[policy] is None:
                if rep == 0:
                    log(f"\n== {policy}: no plan fits a {budget:.1f} MiB budget; not run ==")
                continue
            rcfg = replace(cfg, run=rep)
            log(f"\n== {policy} run {rep + 1}/{cfg.repeats}: {cfg.steps} GRPO steps on {cfg.world} gloo processes, "
                f"budget {budget:.1f} MiB per process ({cfg.budget_k:g} x model state); layout {_label(plans[policy])} ==")
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            recs = run_policy(rcfg, policy, full, job, cluster, params, plans[policy], ranks)
            if recs is None:  # a torchrun rank other than 0: rank 0 reports
                continue
            for r in recs:
                r["policy"], r["run"] = policy, rep
            runs.setdefault(policy, []).append(recs)
            loads.setdefault(policy, []).append((load0, os.getloadavg()[0]))  # other jobs' load during this run
            walls.setdefault(policy, []).append(time.perf_counter() - t0)
            print_records(recs, cfg)
            log(f"{policy} run {rep + 1} took {walls[policy][-1]:.1f} s wall")
    if not runs:
        return None
    summary = {p: aggregate([{**summarize(r, budget), "host_load_1min": loads[p][i]} for i, r in enumerate(rs)])
               for p, rs in runs.items()}
    aa = summary[AA_POLICY]["tokens_per_s_spread"] if AA_POLICY in summary else None
    factors = {p: correction_factors([audit_path(cfg, p, i) for i in range(len(rs))]) for p, rs in runs.items()}
    return {"budget_k": cfg.budget_k, "budget_mb": budget, "repeats": cfg.repeats,
            "order": "interleaved: every policy once, then again (" + ", ".join(policies) + f") x {cfg.repeats}",
            "plans": {p: _label(pl) if pl else None for p, pl in plans.items()},
            "plan_choice": how, "summary": summary, "aa_policy": AA_POLICY if AA_POLICY in summary else None,
            "aa_spread": aa, "comparisons": compare(summary, aa), "factors": factors,
            "run_wall_s": walls, "records": {p: rs[0] for p, rs in runs.items()}, "runs": runs}


def run_demo(cfg: DemoConfig, log=print, budgets: tuple[float, ...] | None = None) -> dict | None:
    """One run per policy at ``cfg``'s budget, or at each ``budgets`` multiple of the model state
    (audit logs then under ``out_dir/k<k>/``); a summary per budget, one across them, one PNG."""
    from nereus.demo.report import (
        plot,
        print_comparisons,
        print_factors,
        print_overview,
        print_summary,
    )

    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    from nereus.errors import SpecError
    from nereus.executor.launch import torchrun_env

    if torchrun_env() is not None and "model-hindsight" in policies_of(cfg):
        raise SpecError(f"demo under torchrun: --policy {cfg.policy} includes model-hindsight, which is chosen from the "
                        f"adaptive run's per-step lengths that only rank 0 holds; pass --policy adaptive, static, "
                        f"static+recompute or both")
    from nereus.executor.launch import Ranks

    t_start = time.perf_counter()
    runs = []
    with Ranks(cfg.world, pg_timeout_s=120.0) as ranks:  # one set of processes for the probes and every run
        prep = prepare(cfg, log, ranks)
        for k in budgets or (None,):
            bcfg = cfg if k is None else replace(cfg, budget_k=k, budget_mb=None,
                                                 out_dir=str(Path(cfg.out_dir) / f"k{k:g}"))
            res = run_budget(bcfg, prep, log, ranks)
            if res is None:  # a torchrun rank other than 0
                continue
            print_summary(res["summary"],
                          f"budget {res['budget_mb']:.1f} MiB per process ({bcfg.budget_k:g} x model state)")
            print_comparisons(res)
            print_factors(res["factors"])
            runs.append(res)
    if not runs:
        return None
    if len(runs) > 1:
        print_overview(runs)
    png = plot(runs, cfg, Path(cfg.out_dir) / "demo.png")
    probe = prep[5]
    out = {"steps": cfg.steps, "world": cfg.world, "cap_schedule": [list(c) for c in cfg.cap_schedule],
           "budget_rule": "budget = k x per-process model state of the plainest layout (fp32 actor params + grads + "
                          "ZeRO-1 Adam moments + ref params, DP over the world)",
           "model_state_mib": state_bytes(cfg.world) / MiB, "probe": probe, "clamp": [0.25, 4.0],
           "repeats": cfg.repeats, "aa_policy": AA_POLICY,
           "wall_s": time.perf_counter() - t_start, "plot": str(png),
           "budgets": [{k: v for k, v in r.items() if k not in ("records", "runs")} for r in runs]}
    (Path(cfg.out_dir) / "demo-run.json").write_text(json.dumps(
        {**out, "records": [{"budget_k": r["budget_k"], "records": r["records"], "runs": r["runs"]} for r in runs]},
        indent=1, default=str))
    log(f"\nplot: {png}\nper-step records: {Path(cfg.out_dir) / 'demo-run.json'}")
    return out
