"""ShardStore: the regions (params and optimizer states) one rank holds, as CPU/GPU tensors.

The store is the source of truth between steps: the engine builds its model and optimizer views
from it, and a transition replaces its contents atomically (``replace``) only after every new
region verified. Nothing here touches disk.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Iterable, Iterator

import torch
import xxhash

from nereus.errors import TransitionError
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
    return outer.key == inner.key and all(
        oo <= io and io + il <= oo + ol
        for oo, ol, io, il in zip(outer.offsets, outer.lengths, inner.offsets, inner.lengths))


def _overlap(a: Region, b: Region) -> bool:
    return all(ao < bo + bl and bo < ao + al for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths))


def cover_error(region: Region, pieces: list[Region]) -> str | None:
    """Why ``pieces`` (each inside ``region``) do not tile it exactly, or None when they do.

    Exact cover = no two pieces overlap and their sizes add up to the region's: then every
    element is in exactly one piece. Counting elements alone takes an overlap plus a gap of the
    same size for a cover. Example: a [4, 8] region as rows [0, 2) and [1, 3): 16 + 16 = 32 =
    4 x 8 elements, yet row 1 comes twice and row 3 never. Pieces are swept in offset order, so
    the cost is near-linear when they are cut along dim 0."""
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


def _native_xxh3():
    """The system xxhash's ``XXH3_64bits_dispatch`` (it picks AVX2/AVX-512 at run time; the Python
    wheel is built for SSE2 only), or None where libxxhash is not installed or computes another
    value than the Python package (XXH3's output is fixed since xxhash 0.8.0): ranks with and
    without it must agree."""
    if os.environ.get("NEREUS_PY_XXHASH"):
        return None
    try:
        fn = ctypes.CDLL("libxxhash.so.0").XXH3_64bits_dispatch
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]

    probe = bytes(range(256)) * 9  # crosses XXH3's short-, mid- and long-input paths
    buf = ctypes.create_string_buffer(probe, len(probe))
    for n in (0, 3, 17, 129, 240, 241, len(probe)):
        if fn(ctypes.addressof(buf), n) != xxhash.xxh3_64_intdigest(probe[:n]):
            return None
    return fn


_XXH3 = _native_xxh3()


def _streaming_lib():
    """libxxhash's streaming XXH3 (create, reset, update, digest), or None with no libxxhash."""
    if _XXH3 is None:
        return None
    lib = ctypes.CDLL("libxxhash.so.0")
    lib.XXH3_createState.restype = ctypes.c_void_p
    lib.XXH3_64bits_reset.argtypes = [ctypes.c_void_p]
    lib.XXH3_64bits_update_dispatch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.XXH3_64bits_digest.restype, lib.XXH3_64bits_digest.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
    return lib


_XXH3_LIB = _streaming_lib()
CHECKSUM_IMPL = "libxxhash XXH3_64bits_dispatch" if _XXH3 is not None else "python xxhash (SSE2)"
"""Which XXH3 ``checksum`` runs (``NEREUS_PY_XXHASH=1`` forces the Python package)."""


_M32 = 0xFFFFFFFF
_LANES = ((0x7FEB352D, 0x2C1B3C6D, 0x297A2D39, 0x165667B1), (0x5BD1E995, 0x1B873593, 0x68E31DA4, 0x27D4EB2F))
"""Odd multipliers below 2^31 (every product of a 32-bit word stays below 2^63: no int64 overflow
on any device) and a seed, per lane of ``device_hash``."""


def device_hash(t: torch.Tensor) -> torch.Tensor:
    """A 63-bit checksum of the tensor's raw bytes computed with torch ops where the tensor lives
    (a 0-dim int64 tensor on its device): nothing but the result ever leaves the device.

    Deterministic by construction: only integer ops, and the reduction is a sum of integers below
    2^32 (exact in int64 for up to 2^31 words, whatever order the device adds them in). Per
    32-bit word w at position i and per lane: h = mix(w x P1 + (i mod 2^32) x P2 + seed), with
    mix a xor-shift-multiply bijection of 32-bit words; the lane's sum of h is taken mod 2^32 and
    the two lanes make the result. For a fixed i, w -> h is a bijection, so changing one word
    always changes both sums (a flipped bit is always caught); the position enters every word,
    so swapped or moved words change them too (up to about 2^-62). Pieces whose byte count is not
    a multiple of 4 are hashed byte by byte. The value differs from XXH3's: both ends of a
    message must use the same function (``checksum`` picks by device, and every rank of a
    transition holds its state on the same kind of device)."""
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32).to(torch.int64) & _M32 if nbytes % 4 == 0 else raw.to(torch.int64)
    pos = torch.arange(words.numel(), dtype=torch.int64, device=words.device) & _M32
    sums = []
    for p1, p2, p3, seed in _LANES:
        h = (words * p1 + pos * p2 + (seed ^ (nbytes & _M32))) & _M32
        h = h ^ (h >> 15)
        h = (h * p3) & _M32
        h = h ^ (h >> 13)
        h = (h * p1) & _M32
        h = h ^ (h >> 16)
        sums.append(h.sum() & _M32)
    return ((sums[0] << 31) ^ sums[1]) & 0x7FFFFFFFFFFFFFFF


DEVICE_HASH_ON_CPU = bool(os.environ.get("NEREUS_DEVICE_CHECKSUM"))
"""``NEREUS_DEVICE_CHECKSUM=1``: CPU tensors are hashed with ``device_hash`` too (tests run the
GPU path's checksum on gloo; every rank of a run must agree, so set it for the whole run)."""


def _host_ints(values: list[torch.Tensor]) -> list[int]:
    """0-dim device int64 tensors -> ints, through one pinned host buffer (8 bytes each, one
    asynchronous copy and one synchronisation for the lot)."""
    if not values:
        return []
    stacked = torch.stack(values)
    if stacked.device.type != "cuda":
        return stacked.tolist()
    host = torch.empty(stacked.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    torch.cuda.current_stream(stacked.device).synchronize()
    return host.tolist()


def checksums_of(parts: list[torch.Tensor]) -> list[int]:
    """``checksum`` of each tensor; for device tensors the hashes are computed on the device and
    only their 8 bytes each come to the host, together (one message's pieces: one copy)."""
    if parts and (parts[0].device.type != "cpu" or DEVICE_HASH_ON_CPU):
        return _host_ints([device_hash(p) for p in parts])
    return [checksum(p) for p in parts]


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 of the tensor's raw bytes in row-major order, as a non-negative int64 (CPU
    tensors); ``device_hash`` on the device for tensors elsewhere (GPU), with only its 8 bytes
    read back.

    Equal for bit-identical tensors whatever their strides; a flipped bit, swapped, moved or
    truncated bytes change it (up to a 2**-63 collision). One pass over the bytes and a small
    per-call cost: that matters because it runs on both ends of every message. Runs the system
    libxxhash where present (vectorised for this CPU: 1.8x the Python package on bytes in cache
    here), else the ``xxhash`` package; both compute the same value. A strided tensor larger
    than ``HASH_CHUNK_BYTES`` is hashed from its own memory through a buffer of that size
    (XXH3's streaming form: the same value as hashing a contiguous copy, without the copy).
    """
    flat = t.detach()
    if flat.device.type != "cpu" or DEVICE_HASH_ON_CPU:
        return _host_ints([device_hash(flat)])[0]
    n = flat.numel() * flat.element_size()
    if not flat.is_contiguous():
        if n > HASH_CHUNK_BYTES:
            return _streamed_xxh3(flat)
        flat = flat.contiguous()
    if _XXH3 is not None:
        return _XXH3(flat.data_ptr(), n) & 0x7FFFFFFFFFFFFFFF
    if n == 0:
        return xxhash.xxh3_64_intdigest(b"") & 0x7FFFFFFFFFFFFFFF
    # the bytes in place, through the buffer protocol, as uint8 (any dtype incl. bf16)
    return xxhash.xxh3_64_intdigest(_bytes_of(flat)) & 0x7FFFFFFFFFFFFFFF


HASH_CHUNK_BYTES = 4 << 20
"""A strided CPU tensor above this size is hashed chunk by chunk through a buffer of this size
(``checksum``): the memory a checksum takes is bounded whatever the piece."""


def _bytes_of(dense: torch.Tensor):
    return dense.reshape(-1).view(torch.uint8).numpy()


def dense_chunks(t: torch.Tensor, max_elems: int) -> Iterator[torch.Tensor]:
    """Views of ``t`` that cover it in row-major order, each of at most ``max_elems`` elements
    (or one row of its last dim when that is longer), in order: hashing them one after the other
    is hashing the tensor. Example: shape (1000, 300), max 64,000 -> rows [0, 213), [213, 426), ..."""
    if t.dim() <= 1 or t.numel() <= max_elems:
        if t.dim() == 1 and t.numel() > max_elems:
            for lo in range(0, t.shape[0], max_elems):
                yield t[lo:lo + max_elems]
        else:
            yield t
        return
    row = t[0].numel()
    if row == 0:
        return
    if row > max_elems:
        for i in range(t.shape[0]):
            yield from dense_chunks(t[i], max_elems)
        return
    step = max(1, max_elems // row)
    for lo in range(0, t.shape[0], step):
        yield t[lo:lo + step]


_STREAM = threading.local()
"""One XXH3 streaming state per thread (the mock transport's ranks are threads)."""


def _streamed_xxh3(t: torch.Tensor) -> int:
    """XXH3-64 of a strided CPU tensor's row-major bytes, fed in chunks through one buffer of at
    most ``HASH_CHUNK_BYTES`` (the same value as ``checksum`` of its contiguous copy)."""
    limit = max(1, HASH_CHUNK_BYTES // t.element_size())
    buf = torch.empty(min(t.numel(), limit), dtype=t.dtype)
    if _XXH3_LIB is None:
        h = xxhash.xxh3_64()
        for c in dense_chunks(t, limit):
            d = c if c.is_contiguous() else buf[:c.numel()].view(c.shape).copy_(c)
            h.update(_bytes_of(d))
        return h.intdigest() & 0x7FFFFFFFFFFFFFFF
    lib = _XXH3_LIB
    state = getattr(_STREAM, "state", None)
    if state is None:
        state = _STREAM.state = lib.XXH3_createState()
    lib.XXH3_64bits_reset(state)
    for c in dense_chunks(t, limit):
        d = c if c.is_contiguous() else buf[:c.numel()].view(c.shape).copy_(c)
        lib.XXH3_64bits_update_dispatch(state, d.data_ptr(), d.numel() * d.element_size())
    return lib.XXH3_64bits_digest(state) & 0x7FFFFFFFFFFFFFFF


class SourceSums:
    """Checksums of the source pieces of one transition (views of this rank's old regions, in
    canonical order, see ``apply``); a piece going to several peers is checksummed once."""

    def __init__(self, store: ShardStore) -> None:
        self.sources = {t.untyped_storage().data_ptr() for _, t in store.items()}
        self.memo: dict[tuple, int] = {}

    def made_for_message(self, buf: torch.Tensor) -> bool:
        """A packed bucket or a contiguous copy, not a view of a source region."""
        return buf.untyped_storage().data_ptr() not in self.sources

    def __call__(self, piece: torch.Tensor) -> int:
        """Checksum of ``piece``, a view of a source region, read from that region itself (never
        from a copy made for a message: a fault in packing must not be checked against itself)."""
        key = (piece.data_ptr(), tuple(piece.shape), piece.stride(), piece.dtype)
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = checksum(piece)
        return value

    def message(self, buf: torch.Tensor, parts: list[torch.Tensor]) -> list[int]:
        """The checksums of the pieces one outgoing message carries, in order, each hashed from
        its source region (``buf``, their packed copy, is not read: the receiver's hash of what
        landed is compared with the source, so packing is checked too). On a device: hashed
        there, 8 bytes per piece read back at once."""
        if buf.device.type != "cpu" or DEVICE_HASH_ON_CPU:
            return self._on_device(buf, parts)
        return [self(part) for part in parts]

    def _on_device(self, buf: torch.Tensor, parts: list[torch.Tensor]) -> list[int]:
        keys = [(p.data_ptr(), tuple(p.shape), p.stride(), p.dtype) for p in parts]
        todo = [i for i, k in enumerate(keys) if k not in self.memo]
        for i, value in zip(todo, _host_ints([device_hash(parts[i]) for i in todo])):
            self.memo[keys[i]] = value
        return [self.memo[k] for k in keys]


class ShardStore:
    """Regions held by one rank, keyed by Region (at most one region per (model, tensor, kind))."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._data: dict[Region, torch.Tensor] = {}
        self._by_key: dict[tuple[str, str, str], list[Region]] = {}
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

    def read(self, region: Region) -> torch.Tensor:
        t = self._data.get(region)
        if t is not None:  # the whole held region (the common case)
            return t
        outer, t = self.covering(region)
        return narrowed(t, outer, region)

    def replace(self, regions: Iterable[tuple[Region, torch.Tensor]]) -> None:
        """Commit: the new contents replace the old ones at once (old tensors are freed)."""
        self._data = dict(regions)
        self._by_key = {}
        for r in self._data:
            self._by_key.setdefault(r.key, []).append(r)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._data.values())

    def checksums(self) -> dict[Region, int]:
        return {r: checksum(t) for r, t in self.items()}
