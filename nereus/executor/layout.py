"""Which slices of which tensors one rank holds under one model-stage placement.

This mirrors the planner's EMU construction (``nereus.planner.emu.holdings``) from the same tensor
inventory, so the executor can index its shard store without importing the solver. It computes no
plan: it only answers "what does rank r hold in placement P", which the engine needs to rebuild
the model from the store. A test checks it equals the planner's holdings.

Worked example (tiny-4l-128h, tp=2, dp=2, zero=1): ``layers.0.mlp.up_proj.weight`` is [256, 128]
split on dim 0, so TP rank 1 holds rows [128, 256); its ZeRO-1 optimizer state is split again on
dim 0 over DP, so DP rank 1 of that TP rank holds ``exp_avg`` rows [192, 256).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.models.inventory import TensorInfo, split_range, stage_tensors, storage_dims, tp_shard
from nereus.models.spec import ModelSpec
from nereus.planner.plan import StagePlacement
from nereus.planner.transition_types import Region

OPT_KINDS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True, kw_only=True)
class Coords:
    """Position of one rank inside a placement (Megatron order: tp fastest, then dp, then pp)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int

    @classmethod
    def of(cls, placement: StagePlacement, gpu: int) -> "Coords | None":
        """None when ``gpu`` is not in the placement's pool (it then holds nothing)."""
        local = gpu - placement.first_gpu
        if not 0 <= local < placement.gpus:
            return None
        c = placement.config
        return cls(tp_rank=local % c.tp, dp_rank=(local // c.tp) % c.dp, pp_rank=local // (c.tp * c.dp))


def param_region(role: str, t: TensorInfo, tp: int, tp_rank: int, kind: str = "param",
                 dtype: str = "fp32") -> Region:
    """The TP shard of ``t`` (whole tensor when replicated) as an absolute region."""
    dim, off, n = tp_shard(t, tp, tp_rank)
    offsets = [0] * len(t.shape)
    lengths = list(t.shape)
    if dim >= 0:
        offsets[dim], lengths[dim] = off, n
    return Region(role, t.name, kind, tuple(offsets), tuple(lengths), dtype)


def zero_split(r: Region, kind: str, dp: int, dp_rank: int) -> Region | None:
    """Rows ``split_range(rows, dp, dp_rank)`` of the TP shard ``r`` (ZeRO-1 on dim 0); None if empty."""
    off, n = split_range(r.lengths[0], dp, dp_rank)
    if n == 0:
        return None
    return Region(r.model, r.tensor, kind, (r.offsets[0] + off,) + r.offsets[1:], (n,) + r.lengths[1:], r.dtype)


def rank_regions(model: ModelSpec, placement: StagePlacement, gpu: int, role: str = "actor",
                 trainable: bool = True, dtype: str = "fp32") -> tuple[Region, ...]:
    """Every region (params, and Adam moments when trainable) ``gpu`` holds in ``placement``."""
    co = Coords.of(placement, gpu)
    if co is None:
        return ()
    c = placement.config
    out: list[Region] = []
    for t in stage_tensors(model, c.pp, co.pp_rank):
        p = param_region(role, t, c.tp, co.tp_rank, dtype=dtype)
        out.append(p)
        if not trainable:
            continue
        for kind in OPT_KINDS:
            r = (zero_split(p, kind, c.dp, co.dp_rank) if c.zero >= 1 and c.dp > 1
                 else Region(role, t.name, kind, p.offsets, p.lengths, dtype))
            if r is not None:
                out.append(r)
    return tuple(out)


def in_storage_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s values in a fresh dense tensor whose memory has ``dim`` outermost (the storage
    convention of ``nereus.models.inventory.storage_dims``); ``dim`` 0 is a plain contiguous copy."""
    return t.movedim(dim, 0).clone(memory_format=torch.contiguous_format).movedim(0, dim)


def stored(model: ModelSpec, r: Region, t: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t`` (the values of region ``r``) laid out as the store keeps it."""
    return in_storage_order(t, storage_dims(model).get(r.tensor, 0))
