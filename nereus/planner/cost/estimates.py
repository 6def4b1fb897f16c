"""What an estimate is: ``StageEstimate`` (time and peak memory per GPU of one model-stage under
one parallel config, each with its breakdown), ``StageOptions`` (how a framework runs the stage
beyond its parallel config) and ``finish``, which applies the stage's calibration factor.

Memory is split into ``resident`` (state that stays on the GPU for the whole step: a trainable
model's params + grads + optimizer in its training layout; a frozen model's weights) and
``transient`` (working set of the running stage: activations, logits, KV cache, the generation
copy of the actor's weights, workspace). The plan solver adds residents of every model homed on a
pool to the largest transient of the stages the pool runs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import TRAINABLE, ClusterSpec, ParallelConfig


@dataclass(frozen=True, slots=True)
class StageEstimate:
    model_stage: str
    config: ParallelConfig
    time_s: float
    time_breakdown: Mapping[str, float]
    resident_bytes: float
    transient_bytes: float
    mem_breakdown: Mapping[str, float]
    capacity_bytes: float
    waves: int = 1
    notes: tuple[str, ...] = field(default=())

    @property
    def mem_bytes(self) -> float:
        return self.resident_bytes + self.transient_bytes

    @property
    def fits(self) -> bool:
        return self.mem_bytes <= self.capacity_bytes and math.isfinite(self.time_s)

    def to_dict(self) -> dict:
        return {
            "model_stage": self.model_stage, **self.config.to_dict(), "time_s": self.time_s,
            "time_breakdown": dict(self.time_breakdown), "mem_bytes": self.mem_bytes,
            "resident_bytes": self.resident_bytes, "transient_bytes": self.transient_bytes,
            "mem_breakdown": dict(self.mem_breakdown), "capacity_bytes": self.capacity_bytes,
            "fits": self.fits, "waves": self.waves, "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class StageOptions:
    """How a training framework runs one model-stage beyond its parallel config (verl's FSDP
    worker settings). The planner's own plans use the defaults; ``nereus fidelity`` passes a
    corpus row's settings.

    - ``pad_to``: every sequence of a training / inference micro-batch is padded to this many
      tokens (verl with ``use_remove_padding=False`` pads prompts to ``max_prompt_length`` and
      responses to ``max_response_length``); 0: the tokens actually there (remove-padding / packing).
      A padded batch reaches Hugging Face's flash-attention path with its padding mask, which
      unpads it again in every layer (``_get_unpad_data``: ``nonzero`` and ``.item()``, a host-
      device synchronisation per layer; huggingface/transformers#28160, Dao-AILab/flash-attention
      #1454), so under FSDP the host's per-layer time adds to the GPU's instead of hiding under it
      (``fsdp_cpu_floor_s(synced=True)``).
    - ``param_offload``: ``none``; ``per_call`` (verl ``fsdp_config.param_offload`` of an actor or
      critic: the shard is loaded to the GPU before each call and offloaded after it); or
      ``per_micro_batch`` (PyTorch FSDP ``CPUOffload(offload_params=True)``, which verl uses for a
      reference model with ``param_offload``: the shard is copied host -> GPU for every forward).
    - ``optimizer_offload``: the Adam state lives on the host and moves to the GPU and back
      around each optimizer update call (verl ``fsdp_config.optimizer_offload``).
    - ``fp8_linear``: training runs the decoder layers' linear GEMMs in FP8 (Transformer Engine,
      torchao float8): see ``fp8_linear_s``. Memory is unchanged (weights, gradients, optimizer
      state and saved activations stay in bf16 / fp32).
    - ``grad_sync``: when data-parallel gradients are reduced in training: ``step`` (once per
      optimizer step, after the last micro-batch: Megatron, Nereus's executor, verl with
      ``use_no_sync_for_gradient_accumulation=True``) or ``micro_batch`` (every backward: PyTorch
      FSDP / DDP accumulating gradients without ``no_sync``, verl's FSDP default).
    - ``grad_reduce_bytes``: bytes per gradient element on the wire (0: the model's dtype; verl's
      FSDP ``mixed_precision.reduce_dtype`` defaults to fp32, 4).
    - ``controller_width``: > 0 when a single controller moves every worker call's batch through its
      driver process (verl's ``RayWorkerGroup``), each sequence padded to this many tokens (verl:
      ``max_prompt_length + max_response_length``): adds ``controller_transfer_s``. 0 (default): no
      driver in the data path (SPMD launchers: Megatron, NeMo RL's workers, Nereus's executor).
    """

    pad_to: int = 0
    param_offload: str = "none"
    optimizer_offload: bool = False
    fp8_linear: bool = False
    grad_sync: str = "step"
    grad_reduce_bytes: int = 0
    controller_width: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.pad_to, bool) or not isinstance(self.pad_to, int) or self.pad_to < 0:
            raise SpecError(f"stage options: pad_to must be an integer >= 0, got {self.pad_to!r}")
        if self.param_offload not in ("none", "per_call", "per_micro_batch"):
            raise SpecError(f"stage options: param_offload must be none, per_call or per_micro_batch, "
                            f"got {self.param_offload!r}")
        if not isinstance(self.optimizer_offload, bool):
            raise SpecError(f"stage options: optimizer_offload must be true or false, got {self.optimizer_offload!r}")
        if not isinstance(self.fp8_linear, bool):
            raise SpecError(f"stage options: fp8_linear must be true or false, got {self.fp8_linear!r}")
        if self.grad_sync not in ("step", "micro_batch"):
            raise SpecError(f"stage options: grad_sync must be step or micro_batch, got {self.grad_sync!r}")
        if isinstance(self.grad_reduce_bytes, bool) or self.grad_reduce_bytes not in (0, 1, 2, 4):
            raise SpecError(f"stage options: grad_reduce_bytes must be 0 (the model's dtype), 1, 2 or 4, "
                            f"got {self.grad_reduce_bytes!r}")
        if isinstance(self.controller_width, bool) or not isinstance(self.controller_width, int) \
                or self.controller_width < 0:
            raise SpecError(f"stage options: controller_width must be an integer >= 0, got {self.controller_width!r}")


NO_OPTIONS = StageOptions()


RESERVED_STAGES = ("training", "inference")
"""Stages whose predicted memory carries ``CostParams.mem_reserve_frac``: their peak is the
allocator's, which the model predicts with an error. A generation engine takes its memory fraction
up front (weights, then a KV pool of what is left), so its footprint is set, not predicted."""
RESERVE_KEYS = ("reserve_resident", "reserve_transient")


def reserve_bytes(e: "StageEstimate") -> float:
    """The reserve ``finish`` added to an estimate's memory (0 without one)."""
    return sum(e.mem_breakdown.get(k, 0.0) for k in RESERVE_KEYS)


def finish(ms: str, cfg: ParallelConfig, t: dict[str, float], stage: str, p: CostParams,
            resident: dict[str, float], transient: dict[str, float], cluster: ClusterSpec,
            waves: int = 1, notes: tuple[str, ...] = ()) -> StageEstimate:
    """The estimate of time terms ``t`` and memory terms ``resident`` / ``transient`` (dicts the
    caller built for this estimate: the reserve is added to them in place), the times scaled by the
    stage's calibration factor."""
    f = p.factor(stage)
    if f != 1.0:  # (v * 1.0 is v: the option tables price at unit factors and scale afterwards)
        t = {k: v * f for k, v in t.items()}
    if stage in RESERVED_STAGES and p.mem_reserve_frac > 0:  # the held-out memory error, kept free
        r = p.mem_reserve_frac  # (the dicts are the caller's own, built for this estimate)
        resident["reserve_resident"] = r * sum(resident.values())
        transient["reserve_transient"] = r * sum(transient.values())
    return StageEstimate(ms, cfg, sum(t.values()), t, sum(resident.values()), sum(transient.values()),
                         {**resident, **transient}, cluster.gpu.usable_bytes, waves, notes)


def memoised(memo: dict | None, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``memo`` under ``key`` when the caller passes one (``model.estimate``'s
    ``memo``: one dict per (job, cluster, workload, params) while it prices many configs)."""
    if memo is None:
        return make()
    v = memo.get(key)
    if v is None:
        v = memo[key] = make()
    return v


def trainable(role: str) -> bool:
    return role in TRAINABLE
