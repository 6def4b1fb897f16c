"""ShardStore: the regions (params and optimizer states) one rank holds, as CPU/GPU tensors.

The store is the source of truth between steps: the engine builds its model and optimizer views
from it, and a transition replaces its contents atomically (``replace``) only after every new
region verified. Nothing here touches disk.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

from nereus.errors import TransitionError
from nereus.executor.reshard.checksum import (CHECKSUM_IMPL, SourceSums, checksum, checksums_of,  # noqa: F401 - re-exported
                                              device_hash)
from nereus.planner.transition.types import Region

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def region_slices(outer: Region, inner: Region) -> tuple[slice, ...]:
    """Index of ``inner`` inside a tensor that holds ``outer`` (both absolute coordinates).

    Example: outer rows [128, 256) x cols [0, 128), inner rows [192, 256) -> (slice(64, 128), slice(0, 128)).
    """
    out = []
    for oo, ol, io, il in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths):
        lo = io - oo
        if lo < 0 or lo + il > ol:
            raise TransitionError(f"{inner.tensor}/{inner.kind}: region {inner.offsets}+{inner.lengths} is not "
                                  f"inside {outer.offsets}+{outer.lengths}")
        out.append(slice(lo, lo + il))
    return tuple(out)


def narrowed(t: torch.Tensor, outer: Region, inner: Region) -> torch.Tensor:
    """The part of ``t`` (holding ``outer``) that holds ``inner``, which lies inside it (see
    ``contains``): ``narrow`` on the dims where they differ, the same view as indexing with
    ``region_slices`` at a fraction of its cost."""
    for d, (oo, ol, io, il) in enumerate(zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths)):
        if (oo, ol) != (io, il):
            if io < oo or io + il > oo + ol:
                raise TransitionError(f"{inner.tensor}/{inner.kind}: region {inner.offsets}+{inner.lengths} is not "
                                      f"inside {outer.offsets}+{outer.lengths}")
            t = t.narrow(d, io - oo, il)
    return t


def contains(outer: Region, inner: Region) -> bool:
    if outer.key != inner.key:
        return False
    for oo, ol, io, il in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths):
        if io < oo or io + il > oo + ol:
            return False
    return True


def _overlap(a: Region, b: Region) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths))


def cover_error(region: Region, pieces: list[Region]) -> str | None:
    """Why ``pieces`` (each inside ``region``) do not tile it exactly, or None when they do.

    Exact cover = no two pieces overlap and their sizes add up to the region's: then every
    element is in exactly one piece. Counting elements alone takes an overlap plus a gap of the
    same size for a cover. Example: a [4, 8] region as rows [0, 2) and [1, 3): 16 + 16 = 32 =
    4 x 8 elements, yet row 1 comes twice and row 3 never. Pieces are swept in offset order, so
    the cost is near-linear when they are cut along dim 0; pieces cut along one dim alone (the
    usual case) are checked in one sweep along it."""
    if len(pieces) == 1 and pieces[0].offsets == region.offsets and pieces[0].lengths == region.lengths:
        return None
    tiled = _tiles_along_one_dim(region, pieces)
    if tiled is not None:
        return None if tiled else _cover_why(region, pieces)
    return _cover_why(region, pieces)


def _tiles_along_one_dim(region: Region, pieces: list[Region]) -> bool | None:
    """True when ``pieces`` span ``region`` whole on every dim but one and tile that dim exactly
    (sorted along it, each starts where the last ended, the last ends at the region's end); False
    when they are cut that way and do not; None when they are cut along more than one dim."""
    cut = None
    for p in pieces:
        for k, (ro, rl, po, pl) in enumerate(zip(region.offsets, region.lengths, p.offsets, p.lengths)):
            if ro != po or rl != pl:
                if cut is None:
                    cut = k
                elif cut != k:
                    return None
    if cut is None:  # every piece is the whole region: a cover only if there is one
        return len(pieces) == 1
    at = region.offsets[cut]
    for o, n in sorted((p.offsets[cut], p.lengths[cut]) for p in pieces):
        if o != at:
            return False
        at += n
    return at == region.offsets[cut] + region.lengths[cut]


def _cover_why(region: Region, pieces: list[Region]) -> str | None:
    order = sorted(pieces, key=lambda r: r.offsets)
    for i, a in enumerate(order):
        end0 = a.offsets[0] + a.lengths[0] if a.offsets else 0
        for b in order[i + 1:]:
            if b.offsets and b.offsets[0] >= end0:
                break
            if _overlap(a, b):
                return (f"pieces at {a.offsets}+{a.lengths} and {b.offsets}+{b.lengths} overlap in "
                        f"{region.tensor}/{region.kind} at {region.offsets}+{region.lengths}")
    filled = sum(p.numel for p in pieces)
    if filled != region.numel:
        return (f"the plan fills {filled} of the {region.numel} elements of {region.tensor}/{region.kind} at "
                f"{region.offsets}+{region.lengths}")
    return None

class ShardStore:
    """Regions held by one rank, keyed by Region (at most one region per (model, tensor, kind))."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._data: dict[Region, torch.Tensor] = {}
        self._keyed: dict[tuple[str, str, str], list[Region]] | None = {}
        """The held regions per (model, tensor, kind); None after ``replace`` until first read."""
        self.step: dict[str, int] = {}
        """Adam step count per model; carried across transitions."""

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Region]:
        return iter(sorted(self._data))

    def items(self) -> Iterator[tuple[Region, torch.Tensor]]:
        for r in sorted(self._data):
            yield r, self._data[r]

    def put(self, region: Region, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != region.lengths:
            raise TransitionError(f"{region.tensor}/{region.kind}: tensor shape {tuple(tensor.shape)} != region "
                                  f"lengths {region.lengths}")
        if tensor.dtype != TORCH_DTYPES[region.dtype]:
            raise TransitionError(f"{region.tensor}/{region.kind}: tensor dtype {tensor.dtype} != the region's "
                                  f"{region.dtype} ({TORCH_DTYPES[region.dtype]})")
        if region not in self._data:
            self._by_key.setdefault(region.key, []).append(region)
        self._data[region] = tensor

    @property
    def _by_key(self) -> dict[tuple[str, str, str], list[Region]]:
        if self._keyed is None:
            self._keyed = {}
            for r in self._data:
                self._keyed.setdefault(r.key, []).append(r)
        return self._keyed

    def get(self, region: Region) -> torch.Tensor:
        try:
            return self._data[region]
        except KeyError:
            raise TransitionError(f"this rank holds no region {region.tensor}/{region.kind} at {region.offsets}"
                                  f"+{region.lengths}") from None

    def find(self, model: str, tensor: str, kind: str) -> tuple[Region, torch.Tensor] | None:
        for r in self._by_key.get((model, tensor, kind), ()):
            return r, self._data[r]
        return None

    def covering(self, region: Region) -> tuple[Region, torch.Tensor]:
        """A held region containing ``region`` (a transfer's source may be a sub-slice)."""
        for r in self._by_key.get(region.key, ()):
            if contains(r, region):
                return r, self._data[r]
        raise TransitionError(f"this rank holds nothing covering {region.tensor}/{region.kind} at "
                              f"{region.offsets}+{region.lengths}")

    def held(self, region: Region) -> torch.Tensor | None:
        """The tensor of exactly ``region``, if this rank holds it (no sub-slice), else None."""
        return self._data.get(region)

    def tensors(self) -> Iterator[torch.Tensor]:
        """The held tensors, in no particular order."""
        return iter(self._data.values())

    def read(self, region: Region) -> torch.Tensor:
        t = self._data.get(region)
        if t is not None:  # the whole held region (the common case)
            return t
        outer, t = self.covering(region)
        return narrowed(t, outer, region)

    def replace(self, regions: Iterable[tuple[Region, torch.Tensor]] | dict[Region, torch.Tensor]) -> None:
        """Commit: the new contents replace the old ones at once (old tensors are freed). A dict is
        taken as it is (the caller hands it over); the per-key index is rebuilt on first use."""
        self._data = regions if type(regions) is dict else dict(regions)
        self._keyed = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._data.values())

    def checksums(self) -> dict[Region, int]:
        return {r: checksum(t) for r, t in self.items()}
