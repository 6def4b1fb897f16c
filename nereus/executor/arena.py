"""Arenas: the memory a transition allocates, as a few flat host buffers that are reused.

A transition materialises the rank's new regions (and, for a while, staging buffers) in fresh
memory. On a GPU, PyTorch's caching allocator hands back memory freed by the previous transition
or step without asking the driver. On the host, large ``torch.empty`` calls go to ``mmap`` and
every 4 KiB page is faulted in and zeroed on first touch, inside the receive that fills it; on
this project's 2-core VM that costs more than the transfer itself (see
``benchmarks/reshard_vs_dcp.py``, ``nereus_first_s``). This module is the host's caching
allocator for transitions:

- ``empty_regions(regions, dtypes, device, major)`` carves every region out of one flat buffer
  per dtype (each region 64-byte aligned, dense, in storage order; ``empty_tensors``: the same as
  a list); on CUDA it is plain ``torch.empty`` per region. ``staging`` carves a transport's
  staging buffers the same way (``pack`` and ``unpack`` fill and scatter them).
- Host buffers are anonymous mappings (2 MiB multiples; transparent huge pages on request,
  ``use_huge_pages``), kept after their last tensor dies: the next ``empty_regions`` or
  ``scratch`` call reuses a free one of a fitting size (between the request and twice it)
  instead of faulting in new pages.
- A buffer counts as free only when no tensor views it any more (its Python reference count is
  back to the registry's own), so a reused buffer never aliases live data.
- ``apply.reserve_arena`` reserves a transition's buffers at start (carved once, pages touched
  by ``prefault_free``), so even the first transition of a process reuses warm memory.
- Free buffers are kept up to ``cache_limit()`` bytes (default 1 GiB, ``set_cache_limit``); the
  oldest free ones beyond that are unmapped. ``release_cached()`` unmaps every free buffer, like
  ``torch.cuda.empty_cache``. ``cached_bytes()`` is what is held but unused.
"""
from __future__ import annotations

import mmap
import sys
import threading
from collections import defaultdict

import torch

from nereus.planner.transition.types import Region

ALIGN = 64
"""Byte alignment of each region inside an arena."""

HUGE_PAGE = 2 << 20

_lock = threading.Lock()
_blocks: list[mmap.mmap] = []
"""Every host buffer handed out and not yet unmapped, oldest first."""
_start: dict[int, int] = {}
"""id of a mapped buffer -> its start address (to find the buffer a tensor lives in)."""
_limit = [1 << 30]
_huge = [False]


def _free(blocks: list[mmap.mmap]) -> list[mmap.mmap]:
    """The buffers of ``blocks`` that nothing but the list references (no tensor views them)."""
    return [m for m in blocks if sys.getrefcount(m) <= _BASE_REFS]


_BASE_REFS = [sys.getrefcount(m) for m in [mmap.mmap(-1, 1)]][0]
"""References to a buffer held by a list alone, counted the way ``_free`` counts them (a list
comprehension: the list's entry, the loop variable, ``getrefcount``'s argument)."""


def use_huge_pages(on: bool) -> None:
    """Advise new host buffers for transparent huge pages (off by default). On this project's VM
    they make a reused arena faster but the first touch of a new one about 3x slower (the kernel
    compacts memory on the fault), and a job pays that first touch on its first transition."""
    _huge[0] = bool(on)


def set_cache_limit(nbytes: int) -> None:
    """Most bytes of free buffers kept for reuse (0: unmap a buffer as soon as it is free)."""
    if nbytes < 0:
        raise ValueError(f"cache limit must be >= 0 bytes, got {nbytes}")
    _limit[0] = nbytes


def cache_limit() -> int:
    return _limit[0]


def cached_bytes() -> int:
    """Bytes of host buffers that are kept but hold no live tensor."""
    with _lock:
        return sum(len(m) for m in _free(_blocks))


def prefault_free() -> int:
    """Touch every page of every free host buffer now (a write per 4 KiB page), so the next
    transition that reuses them does not fault them in inside its receives; returns the bytes
    touched. ``apply.reserve_arena`` calls it after carving a transition's buffers once."""
    with _lock:
        free = _free(_blocks)
        for m in free:
            page = mmap.PAGESIZE
            view = torch.frombuffer(m, dtype=torch.uint8)
            view[::page] = 0
            del view
        return sum(len(m) for m in free)


def trim_cache() -> int:
    """Unmap the oldest free buffers beyond ``cache_limit()``; returns the bytes released.
    ``apply_transition`` calls it after commit, when the old state's buffers become free."""
    with _lock:
        return _trim(_limit[0])


def release_cached() -> int:
    """Unmap every free host buffer; returns the bytes released."""
    with _lock:
        return _trim(0)


def _trim(limit: int) -> int:
    free = _free(_blocks)
    keep = sum(len(m) for m in free)
    released = 0
    for m in free:  # oldest first
        if keep <= limit:
            break
        _blocks.remove(m)
        keep -= len(m)
        released += len(m)
        _start.pop(id(m), None)
        m.close()
    return released


def _take(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor of ``nbytes`` (a reused free buffer when one fits, else a new one)."""
    size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    with _lock:
        fits = [m for m in _free(_blocks) if size <= len(m) <= 2 * size]
        if fits:
            m = min(fits, key=len)
            _blocks.remove(m)
        else:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if _huge[0] and hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
        _blocks.append(m)  # most recently used last: trimmed last
        t = (torch.frombuffer(m, dtype=torch.uint8, count=nbytes) if nbytes
             else torch.empty(0, dtype=torch.uint8, device="cpu"))
        if nbytes:
            _start[id(m)] = t.data_ptr()
        _trim(_limit[0])
    return t


MIN_WASTE = 8 << 20
"""A kept region is moved out of its arena buffer only when that frees more than this."""


def mostly_dead(tensors: list[torch.Tensor], min_waste: int | None = None) -> list[bool]:
    """For tensors that stay alive while everything else in their arena buffers is dropped (a
    transition's kept regions): True where the buffer would be mostly dead, i.e. its size minus
    the bytes of these tensors in it exceeds both those bytes and ``min_waste`` (default
    ``MIN_WASTE``)."""
    if not tensors:
        return []
    min_waste = MIN_WASTE if min_waste is None else min_waste
    with _lock:
        sizes = {_start[id(m)]: len(m) for m in _blocks if id(m) in _start}
    bases = [t.untyped_storage().data_ptr() if t.device.type == "cpu" else -1 for t in tensors]
    live: dict[int, int] = defaultdict(int)
    for t, base in zip(tensors, bases):
        live[base] += t.numel() * t.element_size()
    return [base in sizes and sizes[base] - live[base] > max(live[base], min_waste) for base in bases]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _in_order(flat: torch.Tensor, lengths: tuple[int, ...], dim: int) -> torch.Tensor:
    """``flat`` as a tensor of shape ``lengths`` whose memory has ``dim`` outermost."""
    if dim == 0:
        return flat.view(lengths)
    moved = (lengths[dim],) + lengths[:dim] + lengths[dim + 1:]
    return flat.view(moved).movedim(0, dim)


def empty_regions(regions, dtypes: dict[str, torch.dtype], device: torch.device,
                  major: dict[tuple[str, str], int] | None = None) -> dict[Region, torch.Tensor]:
    """Uninitialised tensors for ``regions`` (shape = region lengths, dtype from ``dtypes``),
    each dense with the dim ``major[(model, tensor)]`` (default 0) outermost in memory."""
    regions = list(regions)
    return dict(zip(regions, empty_tensors(regions, dtypes, device, major)))


def empty_tensors(regions: list[Region], dtypes: dict[str, torch.dtype], device: torch.device,
                  major: dict[tuple[str, str], int] | None = None) -> list[torch.Tensor]:
    """``empty_regions`` as a list in the order of ``regions`` (no dict keyed by region)."""
    return carve(layout_of(regions, dtypes, major), len(regions), device)


def layout_of(regions: list[Region], dtypes: dict[str, torch.dtype],
              major: dict[tuple[str, str], int] | None = None) -> list[tuple]:
    """How ``empty_tensors`` carves ``regions``, as data (a function of the regions alone: a caller
    that allocates the same regions again keeps it and calls ``carve``): per dtype, (torch dtype,
    the ``split_with_sizes`` sizes, each region followed by its alignment pad, and per region
    (its index, numel, lengths, dim stored outermost))."""
    major = major or {}
    by_dtype: dict[str, list[tuple]] = defaultdict(list)
    for i, r in enumerate(regions):
        by_dtype[r.dtype].append((i, r.numel, r.lengths, major.get((r.model, r.tensor), 0)))
    out = []
    for name, items in by_dtype.items():
        dtype = dtypes[name]
        size = dtype.itemsize
        sizes = []
        for _, n, _, _ in items:
            sizes += (n, _aligned(n * size) // size - n)
        out.append((dtype, sizes, items))
    return out


def carve(layout: list[tuple], count: int, device: torch.device) -> list[torch.Tensor]:
    """The ``count`` tensors of ``layout`` (``layout_of``): on the host one arena buffer per dtype,
    split once; plain ``torch.empty`` per region on CUDA."""
    out: list[torch.Tensor | None] = [None] * count
    for dtype, sizes, items in layout:
        if device.type != "cpu":
            flats = [torch.empty(n, dtype=dtype, device=device) for _, n, _, _ in items]
        else:
            flats = _take(sum(sizes) * dtype.itemsize).view(dtype).split_with_sizes(sizes)[0::2]
        for (i, _, lengths, dim), flat in zip(items, flats):
            out[i] = flat.view(lengths) if dim == 0 else _in_order(flat, lengths, dim)
    return out


def scratch(numels: list[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat uninitialised buffers of ``numels`` elements each (64-byte aligned), carved from one
    reusable host buffer by one ``split_with_sizes`` (each buffer followed by its alignment pad);
    plain ``torch.empty`` on CUDA."""
    if device.type != "cpu":
        return [torch.empty(n, dtype=dtype, device=device) for n in numels]
    size = dtype.itemsize
    sizes = []
    for n in numels:
        sizes += (n, _aligned(n * size) // size - n)
    buf = _take(sum(sizes) * size)
    if not numels:
        return []
    return list(buf.view(dtype).split_with_sizes(sizes)[0::2])


def staging(messages: list) -> list[torch.Tensor]:
    """One flat staging buffer per message that is a list of tensors (a bucket, or one strided
    tensor), in order; taken from the arena (reused memory), one host buffer per dtype."""
    need: dict[tuple[torch.dtype, torch.device], list[tuple[int, int]]] = defaultdict(list)
    for i, m in enumerate(messages):
        if type(m) is list:
            need[(m[0].dtype, m[0].device)].append((i, sum(t.numel() for t in m)))
    got: dict[int, torch.Tensor] = {}
    for (dtype, device), items in need.items():
        for (i, _), buf in zip(items, scratch([n for _, n in items], dtype, device)):
            got[i] = buf
    return [got[i] for i in sorted(got)]


def pack(tensors: list[torch.Tensor], into: torch.Tensor) -> torch.Tensor:
    """``tensors``' elements back to back in the flat buffer ``into`` (a message's staging copy)."""
    pos = 0
    for t in tensors:
        n = t.numel()
        into[pos:pos + n].view(t.shape).copy_(t)
        pos += n
    return into


def unpack(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    """The flat buffer ``flat`` scattered into ``into``, back to back (``pack``'s inverse)."""
    pos = 0
    for t in into:
        n = t.numel()
        t.copy_(flat[pos:pos + n].view(t.shape))
        pos += n
