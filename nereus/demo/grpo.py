"""GRPO pieces (Shao et al. 2024): group-normalised advantages and the clipped surrogate with a
k3 KL penalty to the reference model."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group) / (std_group + eps) for rewards laid out group after group."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.reshape(-1)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip: float = 0.2, beta: float = 0.01) -> torch.Tensor:
    """Token-level GRPO loss averaged over response tokens. Shapes: [n, T] except adv [n]."""
    ratio = torch.exp(logp - old_logp)
    a = adv.unsqueeze(1)
    surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
    log_r = ref_logp - logp
    kl = torch.exp(log_r) - log_r - 1  # k3 estimator, >= 0
    per_tok = -(surrogate - beta * kl) * mask
    return per_tok.sum() / mask.sum().clamp(min=1)
