"""A single-device Llama-style transformer in plain torch ops: the *fallback* subject of stage
timing when the executor's parallel reference transformer is not available.

Same block as the executor's model and the cost model's ModelSpec (RMSNorm, GQA attention with a
KV cache, SwiGLU MLP, untied LM head), so that FLOP and byte counts of the analytic model apply.
It has no tensor or pipeline parallelism; data parallelism is added by the stage timer (each rank
holds a full replica and all-reduces gradients over gloo).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nereus.models.spec import ModelSpec


class _Block(nn.Module):
    def __init__(self, m: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = m.heads, m.kv_heads, m.head_dim
        self.norm1, self.norm2 = nn.RMSNorm(m.hidden), nn.RMSNorm(m.hidden)
        self.wq = nn.Linear(m.hidden, m.q_dim, bias=False)
        self.wkv = nn.Linear(m.hidden, 2 * m.kv_dim, bias=False)
        self.wo = nn.Linear(m.q_dim, m.hidden, bias=False)
        self.w_gate_up = nn.Linear(m.hidden, 2 * m.ffn, bias=False)
        self.w_down = nn.Linear(m.ffn, m.hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                pos: int = 0) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.wq(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(y).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if cache is not None:  # write this chunk into the preallocated cache, attend to the prefix
            cache[0][:, :, pos:pos + s] = k
            cache[1][:, :, pos:pos + s] = v
            k, v = cache[0][:, :, :pos + s], cache[1][:, :, :pos + s]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.w_gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class PlainLM(nn.Module):
    """Decoder-only LM; ``forward`` returns logits; ``generate`` decodes greedily with a KV cache."""

    def __init__(self, m: ModelSpec, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.spec = m
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.blocks = nn.ModuleList(_Block(m) for _ in range(m.layers))
        self.norm = nn.RMSNorm(m.hidden)
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, caches: list | None = None, pos: int = 0) -> torch.Tensor:
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = blk(x, None if caches is None else caches[i], pos)
        return self.head(self.norm(x))

    def log_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probability of each next token (the inference stage's output)."""
        logits = self(tokens[:, :-1]).float()
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        b, p = prompt.shape
        m = self.spec
        dev, dt = prompt.device, self.head.weight.dtype
        caches = [(torch.empty(b, m.kv_heads, p + new_tokens, m.head_dim, device=dev, dtype=dt),
                   torch.empty(b, m.kv_heads, p + new_tokens, m.head_dim, device=dev, dtype=dt))
                  for _ in range(m.layers)]
        out = [prompt]
        nxt = self(prompt, caches, 0)[:, -1:].argmax(-1)
        for i in range(new_tokens - 1):
            out.append(nxt)
            nxt = self(nxt, caches, p + i)[:, -1:].argmax(-1)
        out.append(nxt)
        return torch.cat(out, 1)
