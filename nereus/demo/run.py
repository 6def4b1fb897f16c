"""``nereus demo``: a real GRPO run on ``world`` gloo processes that re-plans its parallelism online,
then the same run under the static policy, side by side.

Set-up in the parent process: a short supervised warm-up of the policy, a probe of the real model's
activation bytes and speed (so the cost model describes these processes), the initial plan (the
fastest for short responses). Then each policy runs on freshly spawned ranks (``worker.py``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from nereus.demo.setup import DEMO_MODEL, DemoConfig, demo_cluster, demo_job, demo_params
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


def prepare(cfg: DemoConfig, log=print):
    """Warm-up, probes, job/cluster/params and the initial plan (parent process)."""
    from nereus.demo.policy import initial_plan

    task = CountingTask()
    t0 = time.perf_counter()
    full = sft_warmup(DEMO_MODEL, task, seed=cfg.seed, steps=cfg.warmup_steps)
    acc = token_accuracy(DEMO_MODEL, full, task)
    longest = max(c for _, c in cfg.cap_schedule)
    rep, shard = probe_activations(DEMO_MODEL, full, task.prompt_len + longest)
    flops, decode_s = measure_speed(full)
    log(f"warm-up: {cfg.warmup_steps} supervised steps -> per-token accuracy {acc:.2f} "
        f"(expected response length about {acc / max(1e-6, 1 - acc):.1f}); {time.perf_counter() - t0:.1f} s")
    log(f"probe: activations {rep / 1024:.1f} KiB replicated + {shard / 1024:.1f} KiB TP-split per token per layer; "
        f"training {flops / 1e9:.1f} GFLOP/s per process; decode step {decode_s * 1e3:.1f} ms")
    job = demo_job(cfg)
    base = demo_params(rep, shard)
    params = replace(base, decode_step_overhead_s=decode_s)
    # the world's processes share this machine's cores: each gets a fraction of the measured speed
    share = min(1.0, len(os.sched_getaffinity(0)) / cfg.world)
    params = replace(params, decode_step_overhead_s=decode_s / share)
    cluster = demo_cluster(cfg, flops=flops * share / base.mfu_train)
    plan = initial_plan(job, cluster, params, cfg)
    return full, job, cluster, params, plan, {"warmup_accuracy": acc, "act_replicated": rep, "act_sharded": shard,
                                              "gflops": flops / 1e9, "decode_step_s": decode_s}


def run_policy(cfg: DemoConfig, policy: str, full, job, cluster, params, plan) -> list[dict]:
    from nereus.demo.worker import rank_main
    from nereus.executor.launch import launch

    out = launch(rank_main, cfg.world, cfg, full, job, cluster, params, plan, policy, timeout_s=cfg.timeout_s,
                 pg_timeout_s=120.0)
    return out[0]


def summarize(records: list[dict], budget_mb: float) -> dict:
    ok = [r for r in records if not r["oom"]]
    trans = [r for r in records if r.get("transition_s")]
    total = sum(r["step_s"] for r in records) + sum(r.get("transition_s", 0.0) for r in records)
    t_s = sum(r.get("transition_s", 0.0) for r in records)
    return {"steps": len(records), "completed_steps": len(ok),
            "mean_step_s": sum(r["step_s"] for r in ok) / len(ok) if ok else float("nan"),
            "transition_s": t_s, "transition_fraction": t_s / total if total else 0.0,
            "trained_tokens_per_s": sum(r["response_len_mean"] * r["sequences"] for r in ok) / total if total else 0.0,
            "transitions": len(trans), "verified_transitions": sum(1 for r in trans if r.get("verified")),
            "infeasible_steps": sum(1 for r in records if r["oom"]),
            "peak_mem_frac": max(r["peak_mem_frac"] for r in records),
            "transition_peak_mem_frac": max((r.get("transition_peak_mem_frac", 0.0) for r in trans), default=None),
            "final_response_len_mean": records[-1]["response_len_mean"], "final_reward": records[-1]["reward"],
            "budget_mb": budget_mb}


def run_demo(cfg: DemoConfig, log=print) -> dict:
    from nereus.demo.report import plot, print_records, print_summary

    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    full, job, cluster, params, plan, probe = prepare(cfg, log)
    policies = ("adaptive", "static") if cfg.policy == "both" else (cfg.policy,)
    results: dict[str, list[dict]] = {}
    for policy in policies:
        log(f"\n== {policy} run: {cfg.steps} GRPO steps on {cfg.world} gloo processes, budget {cfg.budget_mb:g} MB "
            f"per process ==")
        t0 = time.perf_counter()
        results[policy] = run_policy(cfg, policy, full, job, cluster, params, plan)
        print_records(results[policy], cfg)
        log(f"{policy} run took {time.perf_counter() - t0:.1f} s wall")
    summary = {p: summarize(r, cfg.budget_mb) for p, r in results.items()}
    print_summary(summary)
    png = plot(results, cfg, Path(cfg.out_dir) / "demo.png")
    out = {"steps": cfg.steps, "initial_plan": plan.to_dict(), "probe": probe, "summary": summary,
           "records": results, "plot": str(png)}
    (Path(cfg.out_dir) / "demo-run.json").write_text(json.dumps(out, indent=2, default=str))
    log(f"\nplot: {png}\nper-step records: {Path(cfg.out_dir) / 'demo-run.json'}\n"
        f"audit logs: {', '.join(str(Path(cfg.out_dir) / f'audit-{p}.jsonl') for p in results)}")
    return out
