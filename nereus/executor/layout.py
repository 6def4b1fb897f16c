"""What one rank holds under one placement, asked of the planner's EMU code, plus the one thing
that needs torch: laying a tensor out in the store's storage order.

The rule for which regions a GPU holds lives once, in ``nereus.planner.transition.emu.gpu_regions``
(torch- and solver-free, so the executor may import it); here it is only adapted to the
executor's arguments (a trainable model carries fp32 params and Adam moments, a frozen one
params only) and guarded: ZeRO-3 (parameters sharded along DP) is planned but not executed, and
is refused with the same message in ``Engine`` and ``scenario``.

Worked example (tiny-4l-128h, tp=2, dp=2, zero=1): ``layers.0.mlp.up_proj.weight`` is [256, 128]
split on dim 0, so TP rank 1 holds rows [128, 256); its ZeRO-1 optimizer state is split again on
dim 0 over DP, so DP rank 1 of that TP rank holds ``exp_avg`` rows [192, 256).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nereus.errors import SpecError
from nereus.models.inventory import storage_dims
from nereus.models.spec import ModelSpec
from nereus.planner.plan import StagePlacement
from nereus.planner.transition.emu import dp_sharded, gpu_regions, kinds_of, rank_coords
from nereus.planner.transition.types import Region

OPT_KINDS = ("exp_avg", "exp_avg_sq")
PRECISIONS = ("fp32", "bf16-mixed")
"""``fp32``: params and Adam moments in fp32 (the planner's ``mixed_precision=False``);
``bf16-mixed``: bf16 params (and gradients), an fp32 ``master`` copy and fp32 moments (its default)."""


def state_kinds(trainable: bool, precision: str = "fp32") -> tuple[tuple[str, str], ...]:
    """(kind, dtype) pairs a rank holds per tensor shard: the planner's ``emu.kinds_of`` for a
    trainable (actor-like) or a frozen (ref-like) model at this precision."""
    if precision not in PRECISIONS:
        raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return kinds_of("actor" if trainable else "ref", mixed_precision=precision == "bf16-mixed")


def param_dtype(precision: str) -> str:
    """The dtype params (and the activations computed from them) have at ``precision``."""
    return state_kinds(False, precision)[0][1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Coords:
    """Position of one rank inside a placement (Megatron order: tp fastest, then dp, then pp)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int

    @classmethod
    def of(cls, placement: StagePlacement, gpu: int) -> "Coords | None":
        """None when ``gpu`` is not in the placement's pool (it then holds nothing)."""
        co = rank_coords(placement, gpu)
        return None if co is None else cls(tp_rank=co[0], pp_rank=co[1], dp_rank=co[2])


def check_executable(placement: StagePlacement) -> None:
    """Refuse what the executor cannot run: ZeRO-3 shards parameters along DP, which the engine's
    forward (whole TP shards on every DP rank) does not support."""
    if dp_sharded("param", placement):
        c = placement.config
        raise SpecError(f"{placement.name}: ZeRO-3 (zero={c.zero}, dp={c.dp}) shards parameters along DP; "
                            f"the executor supports ZeRO 0-2 only")


def rank_regions(model: ModelSpec, placement: StagePlacement, gpu: int, role: str = "actor",
                 trainable: bool = True, precision: str = "fp32") -> tuple[Region, ...]:
    """Every region (params, and when trainable the master copy and Adam moments of
    ``state_kinds``) ``gpu`` holds in ``placement``."""
    check_executable(placement)
    kinds = state_kinds(trainable, precision)
    co = rank_coords(placement, gpu)
    if co is None:
        return ()
    return tuple(gpu_regions(model, role, placement, co[0], co[1], co[2], kinds))


def in_storage_order(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s values in a fresh dense tensor whose memory has ``dim`` outermost (the storage
    convention of ``nereus.models.inventory.storage_dims``); ``dim`` 0 is a plain contiguous copy."""
    return t.movedim(dim, 0).clone(memory_format=torch.contiguous_format).movedim(0, dim)


def stored(model: ModelSpec, r: Region, t: torch.Tensor) -> torch.Tensor:
    """A fresh copy of ``t`` (the values of region ``r``) laid out as the store keeps it."""
    return in_storage_order(t, storage_dims(model).get(r.tensor, 0))
