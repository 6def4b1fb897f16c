"""Data types shared by the transition planner (torch-free, nereus/planner) and the executor
(torch, nereus/executor). The executor receives these as data and decides nothing.

Region: a hyper-rectangle of one tensor of one model's state, like DCP's ReadItem
(offsets, lengths) in the tensor's global index space. Example: TP rank 1 of 4 of Llama-3.1-8B's
``layers.0.attn.k_proj.weight`` ([1024, 4096]) is offsets (256, 0), lengths (256, 4096).

Kinds: ``param`` (the weights), ``exp_avg`` and ``exp_avg_sq`` (Adam moments), ``master`` (fp32
copy of bf16 weights under mixed precision). Frozen models carry ``param`` only. Gradients are
not carried across steps. ZeRO-1 shards optimizer kinds along DP per tensor on dim 0 of the TP
shard (FSDP2-style ``Shard(0)``), rows split with ``split_range``.

GPU ids are global cluster indices; on the executor, GPU id == torch.distributed rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

KINDS = ("param", "master", "exp_avg", "exp_avg_sq")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, slots=True, order=True)
class Region:
    model: str
    """Role: actor, critic, ref, reward."""
    tensor: str
    """Tensor name from nereus.models.inventory."""
    kind: str
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: str = "bf16"

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.model, self.tensor, self.kind)

    @property
    def numel(self) -> int:
        n = 1
        for x in self.lengths:
            n *= x
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "tensor": self.tensor, "kind": self.kind, "offsets": list(self.offsets),
                "lengths": list(self.lengths), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Region":
        return cls(d["model"], d["tensor"], d["kind"], tuple(d["offsets"]), tuple(d["lengths"]), d.get("dtype", "bf16"))


@dataclass(frozen=True, slots=True, order=True)
class Holding:
    """A region held by one GPU."""

    gpu: int
    region: Region


@dataclass(frozen=True, slots=True, order=True)
class TransferOp:
    """Move ``region`` (absolute coordinates) from ``src_gpu`` to ``dst_gpu``; a local copy when
    they are equal. Ops run in ``round`` order; ``op_id`` is stable and identical on every rank."""

    round: int
    op_id: int
    src_gpu: int
    dst_gpu: int
    region: Region
    start_s: float = 0.0
    end_s: float = 0.0

    @property
    def is_copy(self) -> bool:
        return self.src_gpu == self.dst_gpu


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionPlan:
    """Everything the executor needs to turn the holdings of plan A into those of plan B."""

    src: tuple[Holding, ...]
    """What every GPU holds before (plan A)."""
    dst: tuple[Holding, ...]
    """What every GPU must hold after (plan B)."""
    kept: tuple[Holding, ...]
    """Destination holdings already in place (identical region on the same GPU): reused, never copied."""
    ops: tuple[TransferOp, ...]
    """Transfers and local copies, sorted by (round, op_id)."""
    bytes_moved: int
    bytes_kept: int
    makespan_s: float
    lower_bound_s: float
    peak_mem_frac: float
    scheduler: str = "greedy"
    """Which scheduler produced the schedule: 'cpsat' or 'greedy'."""
    staged_via_host: bool = False
    plan_s: float = 0.0
    stats: tuple[tuple[str, Any], ...] = field(default=())
    major: tuple[tuple[str, str, int], ...] = ()
    """(model, tensor, dim) for tensors stored with ``dim`` outermost in memory (their TP split
    dim; ``nereus.models.inventory.storage_dims``); every other tensor is row-major. A piece
    travels as the bytes of its view with that dim moved first, in row-major order, so both
    ends agree on the byte order whatever their own memory layout."""

    @property
    def rounds(self) -> int:
        return 1 + max((op.round for op in self.ops), default=-1)
