"""Engine: one rank's view of one model under one placement (the per-rank API of the RL loop).

``Engine(rank, world, model, placement, store)`` is collective (it creates the placement's
process groups on every rank of the world). Ranks outside the placement's pool hold nothing and
return None from the compute calls. All compute calls take the *global* batch on every pool rank;
each DP rank works on its rows (``split_range``), PP stages exchange activations and gradients
point to point in micro-batches (GPipe order), and results are shared over the pool so every
pool rank returns the full result.

State lives in the ShardStore: params and Adam moments as the regions of ``layout.rank_regions``,
the step count in ``store.step``. ``precision``: ``fp32`` (params, gradients and moments fp32) or
``bf16-mixed`` (bf16 params, activations and gradients; an fp32 ``master`` copy and fp32 moments;
a step reduces the gradients in fp32, updates the master with AdamW and rounds it into the bf16
param), the kinds the planner's ``emu.kinds_of`` gives either way. Critic and reward models end
in the value head (``values``; ``train_step`` with ``returns``). ``apply_transition`` moves the
store to a new placement and rebinds the model to it; nothing is rebuilt from disk.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from nereus.errors import SpecError
from nereus.executor import model as M
from nereus.executor.apply import STAGING_BYTES, ApplyReport, FaultSpec, apply_transition
from nereus.executor.layout import OPT_KINDS, param_dtype, rank_regions, stored
from nereus.executor.memory import MemoryMeter, kv_cache_bytes
from nereus.executor.optim import AdamW, adamw_update, zero_allgather
from nereus.executor.parallel import PlacementGroups, all_reduce, on_rebuild
from nereus.executor.store import TORCH_DTYPES, ShardStore, region_slices
from nereus.executor.transport import DistTransport, Transport
from nereus.models.inventory import pp_layer_range, split_range
from nereus.models.spec import ModelSpec
from nereus.planner.plan import StagePlacement
from nereus.planner.transition.types import TransitionPlan


def warm_recompute() -> None:
    """Run full recomputation once on a toy tensor: the first backward through torch's checkpoint in
    a process imports torch.fx's symbolic-shape machinery (about a second on a CPU), which would
    otherwise land in the first training step that recomputes."""
    x = torch.zeros(1, requires_grad=True)
    torch.utils.checkpoint.CheckpointFunction.apply(lambda t: t * 2, False, x).sum().backward()


class Engine:
    def __init__(self, rank: int, world: int, model: ModelSpec, placement: StagePlacement, store: ShardStore, *,
                 role: str = "actor", trainable: bool = True, optim: AdamW | None = None,
                 precision: str = "fp32") -> None:
        if placement.config.tp > model.kv_heads:
            raise SpecError(f"executor: tp({placement.config.tp}) > kv_heads({model.kv_heads}) of {model.name} "
                            "(replicated KV shards) is not supported by the reference transformer")
        self.rank, self.world, self.model, self.store = rank, world, model, store
        self.role, self.trainable, self.optim = role, trainable, optim or AdamW()
        self.precision = precision
        self.dtype = TORCH_DTYPES[param_dtype(precision)]
        """Dtype of the params, activations and gradients (bf16 under ``bf16-mixed``)."""
        self.value_model = role in ("critic", "reward")
        """Ends in the value head (``values``) instead of the LM head."""
        self.meter: MemoryMeter | None = None
        """Optional per-rank memory accounting (KV cache, logits, saved activations)."""
        self._bind(placement)
        on_rebuild(self)  # NCCL: every Engine of the process rebinds when the groups are rebuilt

    def rebind_groups(self) -> None:
        """Make this placement's process groups again (after ``parallel.abort_and_rebuild``; called
        on every rank for every Engine, in creation order, so the collective group creation lines up)."""
        self._bind(self.placement)

    def rebind(self, placement: StagePlacement) -> None:
        """Rebuild the model views after the shared store changed layout (a transition applied
        for several models at once)."""
        for t in self.w.values():
            t.grad = None
        self._bind(placement)

    # ---- layout ----------------------------------------------------------------------------
    def _bind(self, placement: StagePlacement) -> None:
        self.placement = placement
        self.g = PlacementGroups.build(placement, self.rank, tied=self.model.tie_embeddings and not self.value_model)
        self.moe = None
        """Mixture of experts: this rank's experts and expert group (``model.ExpertShard``)."""
        if self.model.is_moe:
            self.moe = M.build_shard(self.model, placement, self.rank)  # collective: every rank, same order
        self.regions = rank_regions(self.model, placement, self.rank, self.role, self.trainable, self.precision)
        self.w: dict[str, torch.Tensor] = {}
        if self.g.coords is None or len(self.store) == 0:
            return
        for r in self.regions:
            if r.kind == "param":
                t = self.store.get(r)
                t.requires_grad_(self.trainable)
                self.w[r.tensor] = t
        first, last = pp_layer_range(self.model.layers, self.g.pp, self.g.coords.pp_rank)
        self.layers = range(first, last)
        emb = [r for r in self.regions if r.tensor == "embed.weight" and r.kind == "param"]
        self.vocab_lo = emb[0].offsets[0] if emb else 0

    @property
    def in_pool(self) -> bool:
        return self.g.coords is not None

    def init_state(self, seed: int, random_moments: bool = False) -> None:
        """Fill the store from the seed (layout-independent); moments zero unless ``random_moments``."""
        kinds = ("param",) + (OPT_KINDS if random_moments and self.trainable else ())
        full = M.init_full(self.model, seed, kinds, self.value_model) if self.in_pool else {}
        for r in self.regions:
            self.store.put(r, stored(self.model, r, M.initial_region(full, r).to(self.store.device)))
        self.store.step[self.role] = 0
        self._bind(self.placement)

    def bytes_held(self) -> int:
        """Bytes this rank holds for the model: store regions plus gradients."""
        grads = sum(t.grad.numel() * t.grad.element_size() for t in self.w.values() if t.grad is not None)
        return self.store.nbytes() + grads

    # ---- pipeline plumbing -----------------------------------------------------------------
    def _rows(self, n: int) -> tuple[int, int]:
        return split_range(n, self.g.dp, self.g.coords.dp_rank)

    def _stage(self, x: torch.Tensor, cache: M.KVCache | None) -> torch.Tensor:
        """Embedding (first stage), this stage's blocks, and the head (last stage)."""
        if self.g.first_stage:
            x = M.embed(x, self.w, self.vocab_lo, self.g.tp_group)
        recompute = self.placement.config.recompute and cache is None and torch.is_grad_enabled() and x.requires_grad
        for i in self.layers:
            if recompute:  # full recomputation: keep each block's input, rerun the block in backward
                # torch's reentrant checkpoint without its dynamo-disabling wrapper (whose first call
                # imports torch._dynamo: seconds); no RNG inside a block, so no RNG state to keep
                x = torch.utils.checkpoint.CheckpointFunction.apply(self._recomputed_block, False, x, i)
            else:
                x = M.block(x, self.w, i, self.model, self.g.tp_group, cache, self.moe)
        if not self.g.last_stage:
            return x
        if self.value_model:
            return M.value_head(x, self.w, self.model.norm_eps)
        return M.head(x, self.w, self.g.tp_group, self.model.norm_eps)

    def _recomputed_block(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Block ``i`` under full recomputation: run without autograd in the forward pass, again in
        backward, where the meter counts the one block's activations alive at a time."""
        scope = self.meter.recomputed() if self.meter is not None else contextlib.nullcontext()
        with scope:
            return M.block(x, self.w, i, self.model, self.g.tp_group, None, self.moe)

    def _pipe_forward(self, ids: torch.Tensor, cache: M.KVCache | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run this stage on one micro-batch: (stage input needing grad or None, stage output)."""
        if self.g.first_stage:
            inp, out = None, self._stage(ids, cache)
        else:
            inp = torch.empty(ids.shape + (self.model.hidden,), dtype=self.dtype, device=self.store.device)
            dist.recv(inp, self.g.prev_rank)
            inp.requires_grad_(torch.is_grad_enabled())
            out = self._stage(inp, cache)
        if not self.g.last_stage:
            dist.send(out.detach().contiguous(), self.g.next_rank)
        return inp, out

    def _share(self, shape: tuple[int, ...], lo: int, part: torch.Tensor | None, dtype) -> torch.Tensor:
        """Assemble a global result on every pool rank from the last stage's TP-rank-0 rows."""
        full = torch.zeros(shape, dtype=dtype, device=self.store.device)
        if self.g.last_stage and self.g.coords.tp_rank == 0 and part is not None:
            full[lo:lo + part.shape[0]] = part
        return all_reduce(full, self.g.pool_group)

    # ---- inference ---------------------------------------------------------------------------
    def _forward_rows(self, ids: torch.Tensor, micro_batch: int | None):
        """This rank's rows of the batch forward in micro-batches of ``micro_batch`` sequences (the
        placement's when None), as verl's ``log_prob_micro_batch_size_per_gpu`` does: one micro-batch
        of activations and logits alive at a time, which is what the cost model's memory charges.
        Yields (first row, stage output); every stage of a pipeline walks the same micro-batches."""
        self._check_moe_rows(ids.shape[0])
        lo, n = self._rows(ids.shape[0])
        mb = max(1, self.placement.config.micro_batch if micro_batch is None else micro_batch)
        for s in range(lo, lo + n, mb):
            yield s, self._pipe_forward(ids[s:min(s + mb, lo + n)])[1]

    def _check_moe_rows(self, rows: int) -> None:
        """An expert group spanning DP replicas runs one collective per MoE block per micro-batch
        on all of them, so they must walk the same micro-batches: equal rows per DP rank."""
        if self.moe is not None and self.moe.spans_dp and rows % self.g.dp:
            raise SpecError(f"executor: {rows} rows do not split evenly over dp({self.g.dp}), and the expert "
                            f"groups of {self.placement.name} span DP replicas (ep * etp > tp)")

    def _joined(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        return (torch.cat(parts) if parts else None) if self.g.last_stage else None

    @torch.no_grad()
    def logits(self, ids: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor | None:
        """Logits [B, T, vocab] of the global batch on every pool rank (fp32 tensors; bf16 values
        under ``bf16-mixed``), computed ``micro_batch`` sequences at a time (default: the placement's)."""
        self._need_head("logits", value=False)
        if not self.in_pool:
            return None
        lo, _ = self._rows(ids.shape[0])
        part = self._joined([out for _, out in self._forward_rows(ids, micro_batch) if self.g.last_stage])
        return self._share(tuple(ids.shape) + (self.model.vocab,), lo, part, torch.float32)

    @torch.no_grad()
    def values(self, ids: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor | None:
        """The value head's output [B, T] (fp32) of the global batch on every pool rank (critic, reward)."""
        self._need_head("values", value=True)
        if not self.in_pool:
            return None
        lo, _ = self._rows(ids.shape[0])
        part = self._joined([out for _, out in self._forward_rows(ids, micro_batch) if self.g.last_stage])
        return self._share(tuple(ids.shape), lo, part, torch.float32)

    def _need_head(self, call: str, value: bool) -> None:
        if value != self.value_model:
            raise SpecError(f"Engine.{call}: the {self.role} model ends in "
                            f"{'a value head' if self.value_model else 'the LM head'}")

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, micro_batch: int | None = None) -> torch.Tensor | None:
        """log p(ids[:, t+1] | ids[:, :t+1]) as [B, T-1] on every pool rank, ``micro_batch``
        sequences at a time (default: the placement's; the actor's engine holds the training
        placement, so its caller passes actor/inference's micro-batch)."""
        self._need_head("logprobs", value=False)
        if not self.in_pool:
            return None
        lo, _ = self._rows(ids.shape[0])
        parts = []
        for s, out in self._forward_rows(ids, micro_batch):
            if self.g.last_stage:
                if self.meter is not None:
                    self.meter.observe(2 * out.numel() * out.element_size())  # logits + log-softmax
                parts.append(_token_logprobs(out, ids[s:s + out.shape[0]]))
        part = self._joined(parts)
        return self._share((ids.shape[0], ids.shape[1] - 1), lo, part, torch.float32)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 stop_targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """Prompts [B, P] -> sequences [B, P + T] with a KV cache; greedy when temperature is 0,
        else Gumbel-max sampling from a generator seeded with ``seed`` over the global batch, so
        samples do not depend on the layout. With ``stop_targets`` [B, new_tokens] a sequence ends
        at its first token that differs from its target (the environment ends the episode there),
        and a replica stops decoding when all its sequences ended; T is then the longest run of any
        replica (shorter rows are padded with their last token) instead of ``new_tokens``."""
        self._need_head("generate", value=False)
        if not self.in_pool:
            return None
        B = prompts.shape[0]
        self._check_moe_rows(B)
        lo, n = self._rows(B)
        gen = torch.Generator().manual_seed(seed)
        cache, tokens, cur = M.KVCache(), [prompts[lo:lo + n]], prompts[lo:lo + n]
        c, co = self.placement.config, self.g.coords
        head_rank = self.placement.gpu_of(co.tp_rank, c.pp - 1, co.dp_rank)
        dev = self.store.device
        alive = torch.ones(n, dtype=torch.bool, device=dev)
        for k in range(new_tokens):
            _, out = self._pipe_forward(cur, cache)
            nxt = torch.empty(n, dtype=torch.int64, device=self.store.device)
            if self.g.last_stage:
                logits = out[:, -1].float()
                if temperature > 0:
                    # the host generator draws the same numbers whatever the layout or device
                    u = torch.rand((B, logits.shape[-1]), generator=gen, device="cpu")[lo:lo + n].to(dev)
                    u = u.clamp_(1e-20, 1.0)
                    logits = logits / temperature - torch.log(-torch.log(u))
                nxt = logits.argmax(-1)
                for s in range(c.pp - 1):  # every stage learns the tokens (inputs, stop decision)
                    dist.send(nxt, self.placement.gpu_of(co.tp_rank, s, co.dp_rank))
            else:
                if temperature > 0:
                    torch.rand((B, self.model.vocab), generator=gen, device="cpu")  # keep the generator in step
                dist.recv(nxt, head_rank)
            if stop_targets is not None:
                nxt = torch.where(alive, nxt, tokens[-1][:, -1])
            cur = nxt[:, None]
            tokens.append(cur)
            if self.meter is not None:
                self.meter.observe(kv_cache_bytes(cache))
            if stop_targets is not None:
                alive &= nxt == stop_targets[lo:lo + n, k]
                going = alive.any()
                if self.moe is not None and self.moe.spans_dp:  # the expert group decodes in step
                    going = all_reduce(going.to(torch.int64), self.g.pool_group) > 0
                if not bool(going):
                    break
        steps = torch.tensor([len(tokens) - 1], device=dev)
        if stop_targets is not None:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=self.g.pool_group) if self.g.pool_group else None
        width = int(steps[0])
        seq = torch.cat(tokens, 1)
        if seq.shape[1] < prompts.shape[1] + width:
            seq = torch.cat([seq, seq[:, -1:].expand(-1, prompts.shape[1] + width - seq.shape[1])], 1)
        part = seq if self.g.last_stage else None
        return self._share((B, prompts.shape[1] + width), lo, part, torch.int64)

    # ---- training ----------------------------------------------------------------------------
    def train_step(self, ids: torch.Tensor, weights: torch.Tensor | None = None,
                   before_update: Callable[[], bool] | None = None,
                   returns: torch.Tensor | None = None) -> float | None:
        """One AdamW step on loss = -sum(weights * logprobs) / (B * (T-1)) over the global batch
        (weights default to 1: plain next-token cross-entropy; RL passes advantages), or for a
        value model on loss = sum((values - returns)^2) / (2 * B * T) (``returns`` [B, T]).
        Returns the global loss on every pool rank. At pp == 1 micro-batches run forward and
        backward one at a time (gradient accumulation: one micro-batch of activations alive); at
        pp > 1 GPipe runs every forward, then every backward. ``before_update`` (collective, called
        on every pool rank) may veto the optimizer step: gradients are dropped and None is returned."""
        if self.value_model and returns is None:
            raise SpecError(f"Engine.train_step: the {self.role} model ends in a value head and needs returns [B, T]")
        if self.model.is_moe:
            raise SpecError(f"Engine.train_step: {self.model.name} is a mixture-of-experts model; the executor "
                            "runs its forward (logits, log-probs, generation) and reshards it, training it is not "
                            "implemented (no backward through the expert all-to-all)")
        if not self.in_pool:
            return None
        B, T = ids.shape
        weights = torch.ones(B, T - 1, device=self.store.device) if weights is None else weights
        lo, n = self._rows(B)
        mb = max(1, self.placement.config.micro_batch)
        chunks = [(s, min(mb, lo + n - s)) for s in range(lo, lo + n, mb)]
        kept, loss_sum = [], 0.0
        for s, m in chunks:  # GPipe: every forward, then every backward, same order on all stages
            if self.meter is not None:
                self.meter.exclude = {t.untyped_storage().data_ptr() for t in self.w.values()}
            with self.meter.saved_activations() if self.meter is not None else contextlib.nullcontext():
                inp, out = self._pipe_forward(ids[s:s + m])
                if self.g.last_stage and self.value_model:
                    out = (out.float() - returns[s:s + m]).pow(2).sum() / (2 * B * T)
                elif self.g.last_stage:
                    out = -(weights[s:s + m] * _token_logprobs(out, ids[s:s + m])).sum() / (B * (T - 1))
                if self.g.last_stage:
                    loss_sum += float(out.detach())
            kept.append((inp, out))
            if self.g.pp == 1:
                self._backward(*kept.pop())
        for inp, out in kept:
            self._backward(inp, out)
        if before_update is not None and not before_update():
            for t in self.w.values():
                t.grad = None
            return None
        self._optimizer_step()
        part = torch.tensor([[loss_sum]], device=self.store.device) if self.g.last_stage else None
        return float(self._share((1, 1), 0, part, torch.float32)[0, 0])

    def _backward(self, inp: torch.Tensor | None, out: torch.Tensor) -> None:
        if self.g.last_stage:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, self.g.next_rank)
            out.backward(grad)
        if not self.g.first_stage:
            dist.send(inp.grad.contiguous(), self.g.prev_rank)
        if self.meter is not None:
            self.meter.release_activations()

    def _reduced_grads(self, params: list) -> list[torch.Tensor]:
        """Each param region's gradient, summed over the ranks that computed parts of it: over TP
        for the q/k norms (replicated, applied to local heads), between the two copies of a tied
        embedding split over pipeline stages, and over DP; in fp32 (bf16 grads upcast first)."""
        grads = [self.w[r.tensor].grad if self.w[r.tensor].grad is not None
                 else torch.zeros(r.lengths, device=self.store.device) for r in params]
        grads = [g.float() for g in grads]
        groups = [(self.g.dp_group, range(len(params)))]
        if self.model.qk_norm:
            groups.append((self.g.tp_group, [i for i, r in enumerate(params)
                                             if r.tensor.endswith(("attn.q_norm.weight", "attn.k_norm.weight"))]))
        groups.append((self.g.embed_group, [i for i, r in enumerate(params) if r.tensor == "embed.weight"]))
        for group, idx in reversed(groups):  # the partial sums first, then DP
            if group is None or not idx:
                continue
            flat = all_reduce(torch.cat([grads[i].reshape(-1) for i in idx]), group)
            for i, g in zip(idx, torch.split(flat, [grads[i].numel() for i in idx])):
                grads[i] = g.view(params[i].lengths)
        return grads

    def _optimizer_step(self) -> None:
        """AdamW on this rank's optimizer share of every param (its ZeRO rows, or all of it):
        in fp32 on the param itself, or under ``bf16-mixed`` on the fp32 master, then rounded
        into the bf16 param; under ZeRO the DP ranks then all-gather the updated rows."""
        params = [r for r in self.regions if r.kind == "param"]
        grads = self._reduced_grads(params)
        step = self.store.step.get(self.role, 0) + 1
        self.store.step[self.role] = step
        c = self.placement.config
        zero = c.zero >= 1 and c.dp > 1
        mixed = self.precision == "bf16-mixed"
        with torch.no_grad():
            for r, g in zip(params, grads):
                p = self.w[r.tensor]
                found = self.store.find(self.role, r.tensor, "master" if mixed else "exp_avg")
                if found is not None:  # None: this DP rank's ZeRO share is empty
                    rows = region_slices(r, found[0])[0]
                    m = self.store.find(self.role, r.tensor, "exp_avg")[1]
                    v = self.store.find(self.role, r.tensor, "exp_avg_sq")[1]
                    adamw_update(found[1] if mixed else p[rows], g[rows], m, v, step, self.optim)
                    if mixed:
                        p[rows] = found[1]  # the one rounding of the master into the bf16 param
                if zero:
                    zero_allgather(p, c.dp, self.g.dp_group)
                p.grad = None

    # ---- transitions -------------------------------------------------------------------------
    def apply_transition(self, tplan: TransitionPlan, placement: StagePlacement, *,
                         transport: Transport | None = None, timeout_s: float = 60.0,
                         fault: FaultSpec | None = None, staging_bytes: int | None = STAGING_BYTES) -> ApplyReport:
        """Collective over the world: move the store to ``placement``; on failure everything rolls
        back (TransitionError) and the engine stays bound to the old placement."""
        for t in self.w.values():
            t.grad = None
        # on a rollback that rebuilt the groups (NCCL) every Engine has rebound already (parallel.on_rebuild)
        with torch.no_grad():
            report = apply_transition(self.store, tplan, self.rank, transport or DistTransport(self.rank),
                                      timeout_s=timeout_s, fault=fault, staging_bytes=staging_bytes)
        self._bind(placement)
        return report


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return lp.gather(-1, ids[:, 1:, None]).squeeze(-1)
