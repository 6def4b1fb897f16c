"""Checksums of transition pieces and store regions: XXH3-64 on the host, ``device_hash`` on a GPU.

``checksum`` (one tensor), ``checksums_of`` (one message's pieces, hashed where they live, only
8 bytes each read back), ``SourceSums`` (the sender's side: every piece hashed from its source
region, once per transition however many peers get it). Strided tensors are hashed through a
bounded buffer (``HASH_CHUNK_BYTES`` on the host; ``DEVICE_HASH_CHUNK_BYTES`` on the device):
the same value as hashing their contiguous copy, without making one.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Iterator

import torch
import xxhash


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


DEVICE_HASH_CHUNK_BYTES = 16 << 20
"""``device_hash`` works through a tensor this many bytes at a time."""
DEVICE_HASH_WORKSPACE_FACTOR = 10
"""Bytes of device memory one ``device_hash`` takes at most, per byte of chunk: the chunk's
int64 words and positions, the lane's hash and one shift temporary (4 x 2 bytes per input byte),
plus the chunk's contiguous copy of a strided tensor and any carried bytes."""


def device_hash_workspace_bytes(chunk_bytes: int | None = None) -> int:
    """The most device memory one ``device_hash`` call allocates besides its input, whatever the
    size of the piece: what a transition's memory plan adds per rank while a checksum runs (the
    executor hashes one piece at a time, so one workspace per rank). 160 MiB at the default chunk."""
    return DEVICE_HASH_WORKSPACE_FACTOR * (chunk_bytes or DEVICE_HASH_CHUNK_BYTES)


def device_hash(t: torch.Tensor, chunk_bytes: int | None = None) -> torch.Tensor:
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
    transition holds its state on the same kind of device).

    Computed over the tensor's row-major bytes ``chunk_bytes`` (default ``DEVICE_HASH_CHUNK_BYTES``)
    at a time, with in-place integer ops: the lanes' sums are additive over chunks, so every chunk
    size gives the same value, and the memory taken is bounded (``device_hash_workspace_bytes``)
    instead of about 12x the piece."""
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    word = nbytes % 4 == 0
    chunk = max(4, chunk_bytes or DEVICE_HASH_CHUNK_BYTES)
    limit = max(1, (chunk if word else chunk // 4) // t.element_size())  # byte mode: 8 bytes per input byte
    pieces = _flat_slices(t.reshape(-1), limit) if t.is_contiguous() else dense_chunks(t, limit)
    sums = [torch.zeros((), dtype=torch.int64, device=t.device) for _ in _LANES]
    pos0, carry = 0, None
    for c in pieces:
        raw = c.contiguous().reshape(-1).view(torch.uint8)
        if carry is not None:
            raw, carry = torch.cat((carry, raw)), None
        if word:
            cut = raw.numel() - raw.numel() % 4
            if cut < raw.numel():  # a strided chunk of 2-byte elements ending mid-word: its tail goes on
                carry, raw = raw[cut:].clone(), raw[:cut]
            units = raw.view(torch.int32).to(torch.int64).bitwise_and_(_M32)
        else:
            units = raw.to(torch.int64)
        n = units.numel()
        pos = torch.arange(pos0, pos0 + n, dtype=torch.int64, device=t.device).bitwise_and_(_M32)
        pos0 += n
        for k, (p1, p2, p3, seed) in enumerate(_LANES):
            h = units * p1
            h.add_(pos, alpha=p2).add_(seed ^ (nbytes & _M32)).bitwise_and_(_M32)
            h.bitwise_xor_(h >> 15)
            h.mul_(p3).bitwise_and_(_M32)
            h.bitwise_xor_(h >> 13)
            h.mul_(p1).bitwise_and_(_M32)
            h.bitwise_xor_(h >> 16)
            sums[k] = (sums[k] + h.sum()) & _M32
            del h
        del units, pos, raw
    return ((sums[0] << 31) ^ sums[1]) & 0x7FFFFFFFFFFFFFFF


def _flat_slices(flat: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    for lo in range(0, max(1, flat.numel()), limit):
        yield flat[lo:lo + limit]


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
    if parts and not on_host(parts[0]):
        return _host_ints([device_hash(p) for p in parts])
    return host_sums(parts)


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


def host_sums(parts: list[torch.Tensor]) -> list[int]:
    """``checksum`` of each CPU tensor (host XXH3), with the per-call work cut to the bone for the
    common case, a contiguous piece: one libxxhash call on its memory. Same values as ``checksum``."""
    fn = _XXH3
    if fn is None:
        return [checksum(p) for p in parts]
    return [fn(p.data_ptr(), p.nbytes) & _MASK if p.is_contiguous() else checksum(p) for p in parts]


_MASK = 0x7FFFFFFFFFFFFFFF


def on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s checksums are host XXH3 (a CPU tensor, ``NEREUS_DEVICE_CHECKSUM`` unset)."""
    return t.is_cpu and not DEVICE_HASH_ON_CPU


class SourceSums:
    """Checksums of the source pieces of one transition (views of this rank's old regions, in
    canonical order, see ``apply``); a piece going to several peers is checksummed once."""

    def __init__(self, store) -> None:  # a ShardStore (not imported: the store imports this module)
        self.sources = {t.untyped_storage().data_ptr() for t in store.tensors()}
        self.memo: dict[tuple, int] = {}
        self._by_id: dict[int, tuple[torch.Tensor, int]] = {}
        """id(view) -> (the view, kept alive so its id is not reused, its checksum): the same view
        object sent to several peers or also copied locally is looked up without a key."""

    def made_for_message(self, buf: torch.Tensor) -> bool:
        """A packed bucket or a contiguous copy, not a view of a source region."""
        return buf.untyped_storage().data_ptr() not in self.sources

    def __call__(self, piece: torch.Tensor) -> int:
        """Checksum of ``piece``, a view of a source region, read from that region itself (never
        from a copy made for a message: a fault in packing must not be checked against itself)."""
        return self.message(piece, [piece])[0]

    def message(self, buf: torch.Tensor, parts: list[torch.Tensor]) -> list[int]:
        """The checksums of the pieces one outgoing message carries, in order, each hashed from
        its source region (``buf``, their packed copy, is not read: the receiver's hash of what
        landed is compared with the source, so packing is checked too). On a device: hashed
        there, 8 bytes per piece read back at once."""
        by_id = self._by_id
        out: list[int | None] = []
        todo: list[int] = []
        for i, p in enumerate(parts):
            hit = by_id.get(id(p))
            if hit is None:
                value = self.memo.get((p.data_ptr(), p.shape, p.stride(), p.dtype))
                if value is None:
                    todo.append(i)
                else:
                    by_id[id(p)] = (p, value)
                out.append(value)
            else:
                out.append(hit[1])
        if todo:
            fresh = [parts[i] for i in todo]
            values = host_sums(fresh) if on_host(buf) else _host_ints([device_hash(p) for p in fresh])
            for i, p, value in zip(todo, fresh, values):
                out[i] = value
                self.memo[(p.data_ptr(), p.shape, p.stride(), p.dtype)] = value
                by_id[id(p)] = (p, value)
        return out  # type: ignore[return-value]

    def many(self, parts: list[torch.Tensor]) -> list[int]:
        """The checksums of source pieces not sent in one message (local copies), together."""
        return self.message(parts[0], parts) if parts else []
