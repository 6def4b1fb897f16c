"""Single-process helpers of the demo: the supervised warm-up (a short SFT, so RL starts from a
policy that is partly right, as real RL runs start from an SFT model) and the activation-memory
probe that tells the cost model how many bytes of activations the real model saves per token.

Both run the executor's own transformer functions (``nereus.executor.model``) at TP=1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nereus.demo.task import CountingTask
from nereus.executor import model as M
from nereus.executor.optim import AdamW, adamw_update
from nereus.models.spec import ModelSpec


def forward(model: ModelSpec, w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    x = M.embed(ids, w, 0, None)
    for i in range(model.layers):
        x = M.block(x, w, i, model, None, None)
    return M.head(x, w, None)


def sft_warmup(model: ModelSpec, task: CountingTask, *, seed: int, steps: int, lr: float = 3e-3,
               batch: int = 32, length: int = 6) -> dict[str, torch.Tensor]:
    """Full parameter tensors after ``steps`` of next-token training on short correct examples."""
    full = M.init_full(model, seed)
    w = {name: t.clone().requires_grad_(True) for (name, _), t in full.items()}
    # the executor's AdamW update (torch.optim.AdamW's formula): torch.optim's constructor imports
    # torch._dynamo, 3 s of CPU the demo's parent process otherwise never pays
    opt = AdamW(lr=lr, weight_decay=0.0)
    moments = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in w.items()}
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(1, steps + 1):
        ids = task.supervised_batch(batch, length, g)
        logits = forward(model, w, ids)
        # learn the continuation only (the prompt is given)
        P = task.prompt_len
        loss = F.cross_entropy(logits[:, P - 1:-1].reshape(-1, model.vocab), ids[:, P:].reshape(-1))
        grads = torch.autograd.grad(loss, list(w.values()))
        with torch.no_grad():
            for (k, p), gr in zip(w.items(), grads):
                adamw_update(p, gr, *moments[k], step, opt)
    return {k: v.detach() for k, v in w.items()}


@torch.no_grad()
def token_accuracy(model: ModelSpec, w: dict[str, torch.Tensor], task: CountingTask, seed: int = 123,
                   n: int = 64, length: int = 16) -> float:
    """Probability the policy assigns to the correct next token, averaged over a held-out batch."""
    ids = task.supervised_batch(n, length, torch.Generator().manual_seed(seed))
    lp = F.log_softmax(forward(model, w, ids)[:, task.prompt_len - 1:-1], -1)
    return float(lp.gather(-1, ids[:, task.prompt_len:, None]).exp().mean())


def probe_activations(model: ModelSpec, w: dict[str, torch.Tensor], seq_len: int) -> tuple[float, float]:
    """Bytes autograd saves per token per layer for one sequence of ``seq_len`` tokens, split into
    the part a TP rank would replicate (tensors of the model width: norm inputs, residual) and the
    part TP splits (heads, FFN). Parameters are excluded (they are resident state)."""
    params = {t.untyped_storage().data_ptr() for t in w.values()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (t.untyped_storage().nbytes(), t.shape[-1] == model.hidden if t.dim() else True)
        return t

    ids = torch.randint(1, model.vocab, (1, seq_len), generator=torch.Generator().manual_seed(0))
    wg = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    params = {t.untyped_storage().data_ptr() for t in wg.values()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = forward(model, wg, ids)
        loss = F.log_softmax(logits, -1).mean()
    del loss
    per = seq_len * model.layers
    replicated = sum(b for b, rep in seen.values() if rep) / per
    sharded = sum(b for b, rep in seen.values() if not rep) / per
    return replicated, sharded
