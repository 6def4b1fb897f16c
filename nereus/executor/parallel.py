"""Process groups of one placement and Megatron's communication primitives with autograd.

Megatron's f and g: ``copy_to_tp`` is the identity forward and an all-reduce backward (before a
column-parallel linear); ``reduce_from_tp`` is an all-reduce forward and the identity backward
(after a row-parallel linear). ``gather_from_tp`` concatenates vocab-parallel logits.

``new_group`` must be called by every rank of the world in the same order, also by ranks outside
the pool; ``PlacementGroups`` therefore creates every TP, DP and pool group of the placement on
every rank, in a fixed order (and, for a tied embedding split over pipeline stages, the groups
of its first- and last-stage copies), and caches them by member tuple.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.executor.layout import Coords
from nereus.planner.plan import StagePlacement

_GROUPS: dict[tuple[int, ...], object] = {}
_SIDE: dict[tuple[int, ...], object] = {}
_REBUILDS = [0]


def group_of(ranks: tuple[int, ...]):
    """A process group for ``ranks`` (None for a single rank; the default group for the world).
    Collective: every rank must call it with the same tuples in the same order."""
    if len(ranks) == 1:
        return None
    if len(ranks) == dist.get_world_size() and ranks == tuple(range(len(ranks))):
        return dist.group.WORLD
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def side_group(ranks: tuple[int, ...]):
    """A gloo group over ``ranks`` for host-side control (the commit vote and Adam step counts)
    next to NCCL data groups: a collective on it needs no CUDA stream, cannot queue behind a
    stuck NCCL kernel, and survives an NCCL abort. Collective like ``group_of``."""
    if ranks not in _SIDE:
        _SIDE[ranks] = dist.new_group(list(ranks), backend="gloo")
    return _SIDE[ranks]


_ON_REBUILD: list = []
"""Weak references to what must rebuild its groups after ``abort_and_rebuild`` (every ``Engine`` of
the process), in registration order: the same order on every rank, since new groups are made
collectively."""


def on_rebuild(obj) -> None:
    """Call ``obj.rebind_groups()`` after every rebuild of the process groups (held weakly)."""
    _ON_REBUILD.append(weakref.ref(obj))


def _rebind_all() -> int:
    alive = [r() for r in _ON_REBUILD]
    _ON_REBUILD[:] = [weakref.ref(o) for o in alive if o is not None]
    for o in alive:
        if o is not None:
            o.rebind_groups()
    return sum(o is not None for o in alive)


def abort_data_groups() -> int:
    """Abort this process's NCCL communicators now (local, waits for no peer; queued kernels are
    cancelled), the moment this rank decides to roll back: the default group's and every
    ``group_of`` group's NCCL backend. The gloo side groups stay up for the vote. Returns how many
    communicators were aborted."""
    if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
        return 0
    n = 0
    for g in (dist.group.WORLD, *_GROUPS.values()):
        try:
            g._get_backend(torch.device("cuda")).abort()
            n += 1
        except Exception:  # noqa: BLE001 - already aborted, or no NCCL backend on this group
            pass
    return n


def abort_and_rebuild(rebuild: bool, timeout_s: float) -> bool:
    """After a failed transition on NCCL: abort every communicator of this process (local, does not
    wait for peers), then, if ``rebuild`` and every rank of the world agrees within ``timeout_s``
    (``vote.agree_on_rebuild``, through the rendezvous store captured at init: a second, bounded
    agreement, since the rebuild is collective and would block on a dead peer), re-create the
    default process group from that store under a fresh prefix, with the device bound (eager
    NCCL init) and the process-group timeout this process joined with. Group objects made before
    (``group_of``, ``side_group``, every ``Engine``'s ``PlacementGroups``) are dropped, and every
    Engine registered with ``on_rebuild`` rebinds. Returns whether the groups were rebuilt; False
    means they are gone: this process can run no collective again."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    from nereus.executor.launch import joined_timeout_s, rendezvous_store
    from nereus.executor.reshard.vote import agree_on_rebuild

    store = rendezvous_store() or c10d._get_default_store()
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    c10d._abort_process_group()  # every group, the default one included
    _GROUPS.clear()
    _SIDE.clear()
    if not rebuild:
        return False
    _REBUILDS[0] += 1
    if not agree_on_rebuild(store, world, _REBUILDS[0], timeout_s):
        return False
    dist.init_process_group(backend, store=dist.PrefixStore(f"nereus-rebuild-{_REBUILDS[0]}", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=joined_timeout_s() or max(60.0, timeout_s)),
                            device_id=device)
    _rebind_all()
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementGroups:
    """This rank's coordinates, groups and pipeline neighbours in one placement."""

    coords: Coords | None
    tp: int
    pp: int
    dp: int
    tp_group: object
    dp_group: object
    pool_group: object
    prev_rank: int | None
    next_rank: int | None
    embed_group: object = None
    """This rank's copy of a tied embedding and its twin on the other end of the pipeline (first
    and last stage, same TP and DP rank); their gradients are summed. None unless tied and pp > 1."""

    @classmethod
    def build(cls, placement: StagePlacement, rank: int, tied: bool = False) -> "PlacementGroups":
        """Collective over the world; ``tied``: the model ties its LM head to the embedding."""
        c, gpu = placement.config, placement.gpu_of
        mine = {"tp": None, "dp": None, "embed": None}
        for p in range(c.pp):
            for d in range(c.dp):
                ranks = tuple(gpu(t, p, d) for t in range(c.tp))
                g = group_of(ranks)
                if rank in ranks:
                    mine["tp"] = g
        for p in range(c.pp):
            for t in range(c.tp):
                ranks = tuple(gpu(t, p, d) for d in range(c.dp))
                g = group_of(ranks)
                if rank in ranks:
                    mine["dp"] = g
        if tied and c.pp > 1:
            for d in range(c.dp):
                for t in range(c.tp):
                    ranks = (gpu(t, 0, d), gpu(t, c.pp - 1, d))
                    g = group_of(ranks)
                    if rank in ranks:
                        mine["embed"] = g
        pool = group_of(tuple(placement.gpu_ids()))
        co = Coords.of(placement, rank)
        prev_rank = next_rank = None
        if co is not None and co.pp_rank > 0:
            prev_rank = gpu(co.tp_rank, co.pp_rank - 1, co.dp_rank)
        if co is not None and co.pp_rank < c.pp - 1:
            next_rank = gpu(co.tp_rank, co.pp_rank + 1, co.dp_rank)
        return cls(coords=co, tp=c.tp, pp=c.pp, dp=c.dp, tp_group=mine["tp"], dp_group=mine["dp"],
                   pool_group=pool if co is not None else None, prev_rank=prev_rank, next_rank=next_rank,
                   embed_group=mine["embed"])

    @property
    def first_stage(self) -> bool:
        return self.coords is not None and self.coords.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.coords is not None and self.coords.pp_rank == self.pp - 1


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate the last dim over the TP group (vocab-parallel logits -> full logits)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        lo = ctx.rank * ctx.width
        return g[..., lo:lo + ctx.width].contiguous(), None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherFromTP.apply(x, group)
