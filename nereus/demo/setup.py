"""The demo's job, "cluster" and cost parameters: a real GRPO run on CPU processes that stand in
for GPUs, each with a stated memory budget enforced by the executor's accounting.

The model is small enough for 2 CPU cores. The memory budget follows one rule, fixed before any
run (``budget_for``): ``k`` times the per-process model state of the plainest layout (actor params,
gradients and ZeRO-1 Adam moments, reference params, all fp32, data-parallel over the world). The
default, k = 1.5 (the state takes two thirds of "device" memory, the rest is for KV cache and
activations), and the cap schedule 32 -> 64 -> 128 are the scenario where adapting can pay, fixed
here before any run (reasons beside ``DemoConfig.budget_k`` and ``cap_schedule``): memory binds as
responses grow, so a layout fixed at step 0 stops fitting when the cap reaches 128. On 2 CPU cores
tensor parallelism never buys time (4 processes already share 2 cores), only memory: a layout
change can pay only where memory binds. k = 2 and 3 (``--budgets``) are the control where nothing
binds. The analytic cost model is pointed at these processes:
FLOP/s and decode-step time from a probe of the real model, activation bytes from
``probe_activations``, per-micro-batch and optimizer-step host overheads from ``probe.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nereus.models.spec import ModelSpec
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import (
    BatchSpec,
    ClusterSpec,
    GPUSpec,
    JobSpec,
    RolloutSpec,
    SequenceSpec,
)

if TYPE_CHECKING:  # the executor (torch) only where a run is spawned
    from nereus.executor.apply import FaultSpec

MiB = 1024**2
DEMO_MODEL = ModelSpec(name="demo-4l-128h", layers=4, hidden=128, ffn=384, heads=4, kv_heads=4, vocab=32,
                       head_dim=32, dtype_bytes=4)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    steps: int = 9
    """RL steps of a run: three at each cap of ``cap_schedule``."""
    world: int = 4
    budget_mb: float | None = None
    """Per-process device-memory budget (MiB), enforced by the executor's accounting; None:
    ``budget_k`` x the model state (``budget_for``)."""
    budget_k: float = 1.5
    """The budget as a multiple of the per-process model state (``state_bytes``). 1.5, fixed before
    any run: the state then takes two thirds of the budget, and the third left holds the KV cache,
    logits and activations of the layout chosen for the first step (every model TP 1, DP 4) up to
    cap 64 but not at cap 128: the planner predicts it out of memory there with any knobs (the
    adaptive run must switch, to actor training on TP 2, before the cap rises), and an earlier run
    of this demo measured training on TP 1 (reference on TP 2) at 0.93 of this budget at cap 64 and
    1.26-1.28 at cap 128. A layout sized for cap 128 from the start (static's, reference on TP 4)
    fits, at a price every step. At k = 2 and 3 every layout fits every cap: nothing binds, so no
    layout change can pay on 2 cores."""
    policy: str = "all"
    """One of ``POLICIES``, "all" (every one, adaptive first) or "both" (adaptive and static)."""
    recompute: bool = True
    """Full activation recomputation among the candidates of every policy but static (off: only
    layout changes relieve memory, as tests of transitions want)."""
    seed: int = 0
    prompts: int = 8
    samples: int = 4
    """GRPO group size (samples per prompt)."""
    cap_schedule: tuple[tuple[int, int], ...] = ((0, 32), (3, 64), (6, 128))
    """(first step, response-length cap), fixed before any run: the cap is raised in stages as the
    policy gets better, as in DeepScaleR (8k -> 16k -> 24k) and Skywork-OR1 (8k -> 16k -> 32k) runs,
    and it keeps rising until the layout chosen at step 0 no longer fits the budget (cap 128 at
    k = 1.5, see ``budget_k``). Three steps at each cap, set by ``make demo``'s 5 minutes, set-up
    included, for 4 policies x 2 runs on this shared 2-core machine: eight steps at each cap (24
    steps) took 10 min 19 s on a fresh clone at load 1.5-5, four (12 steps) 8 min 23 s at load 6-9
    (406 s of CPU; docs/demo.md, "Time"); a step at cap 128 costs about twice one at 64. The
    controller is told the next step's cap, so it sees the rise to 128 coming whatever the number of
    steps at each cap."""
    temperature: float = 1.0
    lr: float = 1e-3
    beta: float = 0.02
    warmup_steps: int = 12
    """Supervised warm-up steps before RL (a short SFT, so the policy starts partly right). 12, fixed
    with the three steps at each cap: memory binds only where the longest responses reach the cap,
    and three RL steps at a cap are too few to get there from the 8-step warm-up the 24-step
    schedule used (per-token accuracy 0.86, expected length 6; its policy reached cap 128 after
    about 18 RL steps). 12 steps give accuracy 0.96, expected length 22.5 (``token_accuracy``;
    16 steps: 0.98, 48), where the longest of the 32 responses reaches each cap and the mean still
    grows with the cap."""
    repeats: int = 2
    """Runs of every policy, interleaved (adaptive, static, ..., then again): a policy's spread over
    its runs, and the A/A control's (one plan run ``repeats`` times), say what a difference is worth
    on a shared machine."""
    run: int = 0
    """Which repetition this is (0-based; names its audit log, ``policy.audit_path``)."""
    out_dir: str = "out/demo"
    timeout_s: float = 600.0
    fault: FaultSpec | None = None
    """A failure injected into every layout transition (tests): each must roll back, its record say
    ``verified: False``, and the run go on in the old layout."""
    schedule: str = "sync"
    """``sync`` (the policies above) or ``one_step_off``: rollout and training on disjoint ranks, one
    step apart, a weight sync each step, re-split online (``async_run.py``)."""
    rollout_ranks: int | None = None
    """one_step_off: rollout ranks the run starts with (None: verl's 1 : 3 share of the world)."""
    force_split: tuple[tuple[int, int], ...] = ()
    """one_step_off, tests: (step, rollout ranks) re-splits made after those steps whatever a
    controller would say (no controller runs then): the mechanism, apart from the controller's
    judgement of timings on a shared machine."""
    check_sync: bool = True
    """one_step_off: after every weight sync, rank 0 compares the rollout's copy of the actor with the
    trainer's bit for bit (a gather of the actor's params, outside the timed sync)."""


ONE_STEP_OFF_DEFAULTS = {"steps": 24, "cap_schedule": ((0, 32), (8, 64), (16, 128)), "warmup_steps": 8}
"""``nereus demo --schedule one_step_off``'s schedule (its ``--steps`` still applies): the one its
committed run used (docs/demo-async.json). ``DemoConfig``'s shorter one is set by ``make demo``'s
5 minutes, which this mode is no part of; run with it (9 steps, 12-step warm-up, responses at the cap
from step 0), the 1-rank rollout pool went over budget at steps 5-7 (the KV cache of all 32
sequences on one rank) before the controller found a 2 : 2 split that fits."""


LAST_STEP = {"decision": "stay", "reason": "the last step: no later step for a switch to pay in"}
"""The record fields of the run's last step: its workers do not ask the controller (a switch decided
there would be applied, and counted, after the run's work is done)."""

POLICIES = ("adaptive", "static", "static+recompute", "model-hindsight")
"""adaptive: the online controller, free to change layout. static: one layout for the whole run, the
one a user would pick before it (``policy.static_plan``). static+recompute: the same choice with
activation recomputation allowed. model-hindsight: the best single plan for the run by the cost
model's predicted step times over the response lengths the adaptive run produced
(``policy.hindsight_plan``; "model": chosen by predicted, not measured, step times), run unchanged
(no controller decision applied), so its repetitions are also the A/A control (``AA_POLICY``)."""

AA_POLICY = "model-hindsight"
"""The A/A control: one plan run ``repeats`` times, nothing about it changed between runs or during
one; the relative spread of its tokens/s (``aa_spread``) is the noise a difference between policies
must exceed to count (``run.compare``)."""

FIXED_POLICIES = ("model-hindsight",)
"""Policies whose plan is never changed during a run (the controller observes and audits only)."""


def policies_of(cfg: DemoConfig) -> tuple[str, ...]:
    if cfg.policy == "all":
        return POLICIES
    if cfg.policy == "both":
        return ("adaptive", "static")
    return (cfg.policy,)


def state_bytes(world: int) -> float:
    """Per-process bytes of model state in the plainest layout (TP 1, data-parallel over
    ``world``, ZeRO-1), fp32: actor params 4 + grads 4 + Adam moments 8 / world bytes per param,
    reference params 4 bytes per param."""
    n = DEMO_MODEL.num_params()
    return n * (4 + 4 + 8 / world + 4)


def budget_for(cfg: DemoConfig) -> float:
    """Per-process budget (MiB): ``budget_mb`` when given, else ``budget_k`` x ``state_bytes``."""
    if cfg.budget_mb is not None:
        return cfg.budget_mb
    return cfg.budget_k * state_bytes(cfg.world) / MiB


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
    """One "node" of ``world`` CPU processes, each with ``budget_for(cfg)`` MiB of device memory."""
    gpu = GPUSpec(name="cpu-process", memory_gib=budget_for(cfg) / 1024, tflops_bf16=flops / 1e12,
                  hbm_tbps=mem_bw / 1e12, intra_node_gbps=link_gbps, inter_node_gbps=link_gbps, reserved_gib=0.0)
    return ClusterSpec(gpu=gpu, nodes=1, gpus_per_node=cfg.world)


def budget_cluster(cluster: ClusterSpec, cfg: DemoConfig) -> ClusterSpec:
    """``cluster`` (as ``prepare`` built it from the probes: FLOP/s, memory bandwidth, the probed
    link) with ``budget_for(cfg)`` MiB of device memory per process: only the budget changes."""
    return replace(cluster, gpu=replace(cluster.gpu, memory_gib=budget_for(cfg) / 1024))


def demo_params(act_replicated: float, act_sharded: float, profile: str | Path | None = None) -> CostParams:
    """Cost parameters for CPU processes: no workspace reserve, the whole budget usable by the
    KV cache, measured activation bytes; efficiencies from the CPU profile when given."""
    base = CostParams.load(profile) if profile else CostParams()
    # the "device" is a meter over live tensor bytes (executor/memory.py): no caching allocator, so
    # no fragmentation slack; and no held-out GPU-peak reserve (mem_reserve_frac, fitted on GPU
    # frameworks' peaks): the controller learns this meter's reserve from its measured peaks
    return replace(base, workspace_gib=0.0, kv_mem_util=1.0, act_bytes_replicated=act_replicated,
                   act_bytes_sharded=act_sharded, **_meter_memory(base))


def _meter_memory(base: CostParams) -> dict:
    """The memory terms of ``CostParams`` that describe a GPU allocator, neutral for the meter
    (only those this version of ``CostParams`` has)."""
    fields = set(getattr(type(base), "__dataclass_fields__", {}))
    return {k: v for k, v in (("mem_fragmentation", 1.0), ("mem_reserve_frac", 0.0)) if k in fields}
