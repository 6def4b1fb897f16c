"""The demo's job, "cluster" and cost parameters: a real GRPO run on CPU processes that stand in
for GPUs, each with a stated memory budget enforced by the executor's accounting.

The model is small enough for 2 CPU cores; the budget is set so the initial layout (the fastest
one for short responses) stops fitting as responses grow. The analytic cost model is pointed at
this hardware: FLOP/s and memory bandwidth from the CPU profile when one was measured
(``nereus calibrate``), activation bytes from a probe of the real model (``probe_activations``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nereus.models.spec import ModelSpec
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import BatchSpec, ClusterSpec, GPUSpec, JobSpec, RolloutSpec, SequenceSpec

if TYPE_CHECKING:  # the executor (torch) only where a run is spawned
    from nereus.executor.apply import FaultSpec

MiB = 1024**2
DEMO_MODEL = ModelSpec(name="demo-4l-128h", layers=4, hidden=128, ffn=384, heads=4, kv_heads=4, vocab=32,
                       head_dim=32, dtype_bytes=4)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    steps: int = 30
    world: int = 4
    budget_mb: float = 16.0
    """Per-process device-memory budget (MiB), enforced by the executor's accounting."""
    policy: str = "both"
    """"adaptive", "static" or "both" (adaptive, then the same run under static)."""
    seed: int = 0
    prompts: int = 8
    samples: int = 4
    """GRPO group size (samples per prompt)."""
    cap_schedule: tuple[tuple[int, int], ...] = ((0, 32), (10, 64), (20, 128))
    """(first step, response-length cap): the cap is raised in stages as the policy gets better, as
    in DeepScaleR (8k -> 16k -> 24k) and Skywork-OR1 (8k -> 16k -> 32k) runs."""
    temperature: float = 1.0
    lr: float = 1e-3
    beta: float = 0.02
    warmup_steps: int = 8
    """Supervised warm-up steps before RL (a short SFT, so the policy starts partly right)."""
    out_dir: str = "out/demo"
    timeout_s: float = 600.0
    fault: FaultSpec | None = None
    """A failure injected into every layout transition (tests): each must roll back, its record say
    ``verified: False``, and the run go on in the old layout."""


def cap_at(cfg: DemoConfig, step: int) -> int:
    """Response-length cap in force at ``step``."""
    cap = cfg.cap_schedule[0][1]
    for first, c in cfg.cap_schedule:
        if step >= first:
            cap = c
    return cap


def demo_job(cfg: DemoConfig) -> JobSpec:
    return JobSpec(algorithm="grpo", models=(("actor", DEMO_MODEL), ("ref", DEMO_MODEL)),
                   batch=BatchSpec(prompts=cfg.prompts, samples_per_prompt=cfg.samples, ppo_epochs=1, mini_batches=1),
                   sequence=SequenceSpec(prompt_len=4, response_len_mean=4.0, response_len_max=cap_at(cfg, 0), padded=True),
                   rollout=RolloutSpec(engine="static", sleep=False))  # the reference executor: padded, static batches


def demo_cluster(cfg: DemoConfig, flops: float = 2e10, mem_bw: float = 5e9, link_gbps: float = 1.0) -> ClusterSpec:
    """One "node" of ``world`` CPU processes, each with ``budget_mb`` of device memory."""
    gpu = GPUSpec(name="cpu-process", memory_gib=cfg.budget_mb / 1024, tflops_bf16=flops / 1e12,
                  hbm_tbps=mem_bw / 1e12, intra_node_gbps=link_gbps, inter_node_gbps=link_gbps, reserved_gib=0.0)
    return ClusterSpec(gpu=gpu, nodes=1, gpus_per_node=cfg.world)


def demo_params(act_replicated: float, act_sharded: float, profile: str | Path | None = None) -> CostParams:
    """Cost parameters for CPU processes: no workspace reserve, the whole budget usable by the
    KV cache, measured activation bytes; efficiencies from the CPU profile when given."""
    base = CostParams.load(profile) if profile else CostParams()
    return replace(base, workspace_gib=0.0, kv_mem_util=1.0, act_bytes_replicated=act_replicated,
                   act_bytes_sharded=act_sharded)
