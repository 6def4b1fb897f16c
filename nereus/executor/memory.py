"""MemoryMeter: per-rank accounting of device memory, standing in for GPU memory on CPU runs.

What is counted (bytes of real tensors, not estimates):
- resident: the shard store (params, Adam moments) and gradients while they exist;
- transient: the KV cache during generation, logits during log-prob passes, and the tensors
  autograd saves for backward during training (``torch.autograd.graph.saved_tensors_hooks``,
  each storage counted once).

``peak`` is the largest resident + transient seen since ``reset``. A budget is enforced by the
caller at phase boundaries (``over_budget``): on a GPU an allocation past the limit fails; here the
step is aborted at the first boundary where any rank went past it, and its update is not applied.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class MemoryMeter:
    def __init__(self, budget_bytes: float | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.resident_fn: Callable[[], int] = lambda: 0
        self.transient = 0
        self.peak = 0
        self.peak_transient = 0
        self._saved: dict[int, int] = {}
        self.exclude: set[int] = set()
        """Storages not to count as activations (the parameters, already resident)."""

    def reset(self) -> None:
        self.transient = 0
        self.peak = self.resident_fn()
        self.peak_transient = 0
        self._saved.clear()

    def observe(self, transient_bytes: int) -> None:
        """Record a transient working set of ``transient_bytes`` alive now."""
        self.transient = transient_bytes
        self.peak_transient = max(self.peak_transient, transient_bytes)
        self.peak = max(self.peak, self.resident_fn() + transient_bytes)

    def over_budget(self) -> bool:
        return self.budget_bytes is not None and self.peak > self.budget_bytes

    @contextlib.contextmanager
    def saved_activations(self) -> Iterator[None]:
        """Count the storages autograd saves for backward while the block runs (forward)."""
        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                key = t.untyped_storage().data_ptr()
                if key not in self._saved and key not in self.exclude:
                    self._saved[key] = t.untyped_storage().nbytes()
                    self.observe(sum(self._saved.values()))
            except RuntimeError:  # tensors without storage (e.g. some views of sparse)
                pass
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    @contextlib.contextmanager
    def recomputed(self) -> Iterator[None]:
        """A recomputed block (full recomputation): its first run saves nothing (no autograd); its
        rerun in backward saves the block's activations, counted on top of what the forward kept
        (the block inputs), and dropped from the count when the block ends (backward frees them
        before the next block is rerun)."""
        if not torch.is_grad_enabled():
            yield
            return
        block: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                key = t.untyped_storage().data_ptr()
                if key not in block and key not in self._saved and key not in self.exclude:
                    block[key] = t.untyped_storage().nbytes()
                    self.observe(sum(self._saved.values()) + sum(block.values()))
            except RuntimeError:
                pass
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release_activations(self) -> None:
        self._saved.clear()
        self.transient = 0


def kv_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for d in (cache.k, cache.v) for t in d.values())


# ---- which device a code path creates tensors on --------------------------------------------------
# The check behind "no CPU/CUDA mixing": ``tensors_created_on(default)`` runs a block with
# ``default`` as torch's default device and records the device of every tensor any aten op returns.
# Code that follows its ``device`` argument (the store's device) never creates a tensor on the
# default device, so with the default set to ``meta`` (a device nothing here uses on purpose) a
# single ``torch.zeros(n)`` that forgot its ``device=`` shows up as a ``meta`` tensor in the record.
# CPU-only machines check the GPU path's discipline this way: the same code puts every tensor on
# ``cuda:<local rank>`` when the store is there. What it cannot see: tensors created in C++ without
# going through the dispatcher, and host copies made on purpose (``.cpu()``, pinned buffers), which
# name their device.
class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.devices: Counter = Counter()
        self.ops_on: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.devices[t.device.type] += 1
                self.ops_on.setdefault(t.device.type, set()).add(str(func))
        return out


@contextlib.contextmanager
def tensors_created_on(default: str = "meta"):
    """Yield a record (``devices``: Counter of device types of every tensor aten ops returned;
    ``ops_on``: device type -> op names) of the block, run with ``default`` as the default device."""
    rec = _Record()
    torch.set_default_device(default)
    try:
        with rec:
            yield rec
    finally:
        torch.set_default_device(None)
