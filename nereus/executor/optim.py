"""AdamW on store tensors, with ZeRO-1 parameter all-gather.

The update is element-wise (torch.optim.AdamW's formula), so any row split of the optimizer
state gives the same bits as the unsplit update: that is what lets ZeRO-1 shards move between
layouts and training continue on the same trajectory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nereus.models.inventory import split_range


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamW:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, o: AdamW) -> None:
    """In place on ``p`` (a view), ``m`` and ``v``; ``step`` counts from 1."""
    p.mul_(1 - o.lr * o.weight_decay)
    m.lerp_(g, 1 - o.beta1)
    v.mul_(o.beta2).addcmul_(g, g, value=1 - o.beta2)
    bc1, bc2 = 1 - o.beta1 ** step, 1 - o.beta2 ** step
    denom = (v.sqrt() / math.sqrt(bc2)).add_(o.eps)
    p.addcdiv_(m, denom, value=-o.lr / bc1)


def zero_allgather(p: torch.Tensor, dp: int, group) -> None:
    """Every DP rank updated its ``split_range`` rows of ``p``; gather all rows so the replicas
    agree again. Shares may differ by one row, so they travel padded to the longest."""
    if group is None:
        return
    shares = [split_range(p.shape[0], dp, i) for i in range(dp)]
    mine = shares[dist.get_rank(group)]
    longest = max(n for _, n in shares)
    buf = torch.zeros((longest,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device)
    buf[: mine[1]] = p[mine[0]:mine[0] + mine[1]]
    parts = [torch.empty_like(buf) for _ in range(dp)]
    dist.all_gather(parts, buf, group=group)
    for part, (off, n) in zip(parts, shares):
        p[off:off + n] = part[:n]
