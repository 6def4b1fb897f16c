"""Hugging Face checkpoints <-> shard stores: load any (tp, pp, dp, ep, etp) layout's regions straight from
safetensors, gather a layout back into a Hugging Face state dict, write a directory that
``from_pretrained`` loads.

Each rank reads only its own regions: ``NameMap.read`` asks the safetensors file (memory-mapped,
``get_slice``) for exactly the rows and columns a region covers, fused tensors included. Params
load in the region's dtype (bf16 under ``bf16-mixed``: rounded once from the checkpoint's
values), the ``master`` copy in fp32 (the checkpoint's values, upcast when it is bf16), Adam
moments as zeros (a fresh optimizer), step 0. ``gather_state`` is collective over the world:
each distinct region of one kind is sent once, by the lowest rank holding it, to ``dst``, which
checks that the regions tile every tensor exactly and maps the result to Hugging Face names.
safetensors is imported when a file is opened; transformers is never needed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from nereus.errors import SpecError
from nereus.executor.hf.arch import config_dict
from nereus.executor.hf.names import NameMap
from nereus.executor.layout import rank_regions, stored
from nereus.executor.store import TORCH_DTYPES, ShardStore, cover_error
from nereus.models.inventory import tensor_inventory
from nereus.models.spec import ModelSpec
from nereus.planner.plan import StagePlacement
from nereus.planner.specs import TRAINABLE
from nereus.planner.transition.emu import head_of
from nereus.planner.transition.types import Region

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """Tensors by Hugging Face name, read lazily: a ``.safetensors`` file, a directory holding
    ``model.safetensors`` or a sharded ``model.safetensors.index.json``, or an in-memory dict."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor]) -> None:
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._where: dict[str, Any] = {}
        self._names: dict[tuple[ModelSpec, str], NameMap] = {}
        if isinstance(source, Mapping):
            self._dict = source
            self.shapes = {k: tuple(v.shape) for k, v in source.items()}
            return
        from safetensors import safe_open

        path = Path(source)
        files = [path]
        if path.is_dir():
            if (path / INDEX).exists():
                index = json.loads((path / INDEX).read_text())["weight_map"]
                files = [path / f for f in sorted(set(index.values()))]
            else:
                files = [path / WEIGHTS]
        self.shapes = {}
        for f in files:
            if not f.exists():
                raise SpecError(f"Hugging Face checkpoint: no {f}")
            handle = safe_open(str(f), framework="pt")
            for k in handle.keys():
                self._where[k] = handle
                self.shapes[k] = tuple(handle.get_slice(k).get_shape())

    def fetch(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        if self._dict is not None:
            return self._dict[name][index]
        return self._where[name].get_slice(name)[index]

    def whole(self, name: str) -> torch.Tensor:
        return self.fetch(name, tuple(slice(None) for _ in self.shapes[name]))

    def names_for(self, model: ModelSpec, head: str) -> NameMap:
        """The name map of this checkpoint (fused or not), checked against the model once."""
        names = self._names.get((model, head))
        if names is None:
            names = NameMap.for_keys(model, self.shapes, head)
            names.check(self.shapes, lambda: torch.equal(self.whole("lm_head.weight"),
                                                         self.whole("model.embed_tokens.weight")))
            self._names[(model, head)] = names
        return names


def load_regions(store: ShardStore, model: ModelSpec, role: str, placement: StagePlacement, rank: int,
                 source: str | Path | Mapping[str, torch.Tensor] | Checkpoint, *, precision: str = "fp32",
                 trainable: bool | None = None) -> int:
    """Fill ``store`` with this rank's regions of ``role`` in ``placement`` from a Hugging Face
    checkpoint (see the module docstring for the kinds); returns the bytes loaded."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    trainable = role in TRAINABLE if trainable is None else trainable
    regions = rank_regions(model, placement, rank, role, trainable, precision)
    if not regions:
        return 0
    names = ckpt.names_for(model, head_of(role))
    for r in regions:
        if r.kind in ("param", "master"):
            t = names.read(r.tensor, r.offsets, r.lengths, ckpt.fetch).to(TORCH_DTYPES[r.dtype])
        else:
            t = torch.zeros(r.lengths, dtype=TORCH_DTYPES[r.dtype])
        store.put(r, stored(model, r, t.to(store.device)))
    store.step[role] = 0
    return sum(r.nbytes for r in regions)


def host_group():
    """The group host tensors travel on: the default one under gloo; under NCCL (which takes only
    device tensors) the gloo side group over the world (``parallel.side_group``). Collective the
    first time, like every group."""
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
        return None
    from nereus.executor.parallel import side_group

    return side_group(tuple(range(dist.get_world_size())))


def gather_state(store: ShardStore, model: ModelSpec, role: str, placement: StagePlacement, rank: int, *,
                 kind: str = "param", dst: int = 0, fused: bool = False, precision: str = "fp32",
                 trainable: bool | None = None, fused_experts: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective over the world: ``role``'s ``kind`` regions (``param``, or ``master`` under
    ``bf16-mixed``) as a Hugging Face state dict on rank ``dst`` (None elsewhere), in the
    regions' dtype; ``fused``: Megatron-style fused QKV and gate/up names (see ``names``);
    ``fused_experts``: routed experts as transformers 5.x's 3-D ``mlp.experts.gate_up_proj`` /
    ``down_proj`` (default: the per-expert names ``save_pretrained`` writes). The
    pieces travel as host tensors on ``host_group()`` (the gloo side group under NCCL)."""
    trainable = role in TRAINABLE if trainable is None else trainable
    held = {g: [r for r in rank_regions(model, placement, g, role, trainable, precision) if r.kind == kind]
            for g in placement.gpu_ids()}
    owner: dict[Region, int] = {}
    for g in sorted(held):
        for r in held[g]:
            owner.setdefault(r, g)
    owned = {g: sorted(r for r in held[g] if owner[r] == g) for g in held}
    if not owner:
        raise SpecError(f"{role} holds no {kind!r} regions at precision {precision} in {placement.name}")
    group = host_group()
    if rank != dst:
        if owned.get(rank):
            dist.send(torch.cat([store.get(r).reshape(-1) for r in owned[rank]]).cpu(), dst, group=group)
        return None
    head = head_of(role)
    dtype = TORCH_DTYPES[next(iter(owner)).dtype]
    full = {t.name: torch.empty(t.shape, dtype=dtype) for t in tensor_inventory(model, head)}
    pieces: dict[str, list[Region]] = {name: [] for name in full}
    for g, regions in sorted(owned.items()):
        if not regions:
            continue
        if g == rank:
            flat = torch.cat([store.get(r).reshape(-1).cpu() for r in regions])
        else:
            flat = torch.empty(sum(r.numel for r in regions), dtype=dtype)
            dist.recv(flat, g, group=group)
        at = 0
        for r in regions:
            full[r.tensor][tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))] = \
                flat[at:at + r.numel].view(r.lengths)
            at += r.numel
            pieces[r.tensor].append(r)
    for name, t in full.items():
        why = cover_error(Region(role, name, kind, (0,) * t.dim(), tuple(t.shape), next(iter(owner)).dtype),
                          pieces[name])
        if why is not None:
            raise SpecError(f"gather of {role}/{kind} in {placement.name}: {why}")
    return NameMap(model=model, head=head, fused_qkv=fused, fused_gate_up=fused, fused_experts=fused_experts).to_hf(full)


def write_checkpoint(directory: str | Path, state: Mapping[str, torch.Tensor], config: Any) -> Path:
    """``config.json`` and ``model.safetensors`` in ``directory``: what ``from_pretrained`` reads."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    text = config.to_json_string() if hasattr(config, "to_json_string") else json.dumps(config_dict(config), indent=2)
    (out / "config.json").write_text(text)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / WEIGHTS), metadata={"format": "pt"})
    return out
