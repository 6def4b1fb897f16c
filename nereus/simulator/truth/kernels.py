"""Times of the ground truth's basic operations, from the corpus tables (``corpus.py``).

- decode iteration of one engine replica with ``B`` running sequences holding ``C`` KV tokens in
  total: ``A[B] + beta * C`` where ``A[B]`` = weight read x m(B) + 2 all-reduces per layer of the
  B tokens' hidden state (captured in a CUDA graph) + the engine's scheduler and sampler
  (``SCHED_BASE_S + SCHED_PER_SEQ_S x B``, an assumption: the corpus has no engine-overhead row);
  with pipeline stages the batch is split into pp micro-batches (m at B/pp) plus a p2p per stage;
- prefill of a replica: chunks of MAX_BATCHED_TOKENS at the prefill efficiency of a chunk;
- a training or inference micro-batch: FLOPs in the MPT convention (2N per token + 4 L h s^2
  per sequence forward, x3 for training, x4/3 more with recomputation) at the table's hardware
  utilisation of tokens per GPU, x the sequence-length factor, plus the TP all-reduces.
"""
from __future__ import annotations

import math

import numpy as np

from nereus.models.spec import ModelSpec
from nereus.simulator.truth.corpus import Tables
from nereus.simulator.truth.memory import MAX_BATCHED_TOKENS, kv_bytes_per_token, params_per_gpu

SCHED_BASE_S = 1.0e-3
SCHED_PER_SEQ_S = 3.0e-6
"""Engine scheduling + sampling per decode iteration (assumption, see module docstring)."""


def matmul_params(m: ModelSpec, value_head: bool = False) -> float:
    return m.layers * (2 * m.hidden * m.q_dim + 2 * m.hidden * m.kv_dim + 3 * m.hidden * m.ffn) + (
        m.hidden if value_head else m.vocab * m.hidden)


def decode_coeffs(m: ModelSpec, tp: int, pp: int, tab: Tables, max_batch: int) -> tuple[np.ndarray, float]:
    """(A[0..max_batch], beta): seconds of one decode iteration = A[B] + beta x KV tokens held."""
    b = np.arange(max_batch + 1, dtype=float)
    w_stage = 2 * params_per_gpu(m, tp, pp) / tab.hbm_bps
    per_mb = np.maximum(b / pp, 1.0)
    a = pp * w_stage * tab.decode_m(per_mb)  # the bottleneck stage runs pp micro-batches of B/pp
    if tp > 1:
        size = np.maximum(per_mb, 1.0) * m.hidden * 2
        a = a + 2 * m.layers * tab.allreduce_s(size, tp, inter=False, graph=True)
    if pp > 1:
        a = a + pp * float(tab.allreduce_s(8.0, 2, inter=False)) / 2
    a = a + SCHED_BASE_S + SCHED_PER_SEQ_S * b
    a[0] = 0.0
    beta = kv_bytes_per_token(m, tp, pp) / (tab.hbm_bps * tab.kv_eff)
    return a, beta


def prefill_s(m: ModelSpec, tp: int, pp: int, tokens: np.ndarray, prompt: float, tab: Tables) -> np.ndarray:
    """Seconds to prefill ``tokens`` (per replica) of sequences ``prompt`` long, in chunks."""
    tokens = np.asarray(tokens, dtype=float)
    chunk = float(MAX_BATCHED_TOKENS)
    full = np.floor(tokens / chunk)
    rest = tokens - full * chunk

    def one(x):
        x = np.asarray(x, dtype=float)
        flops = (2 * matmul_params(m) + 2 * m.layers * m.heads * m.head_dim * prompt) * x
        t = flops / (tp * pp * tab.peak_flops * tab.prefill_eff(np.maximum(x, 1.0)))
        if tp > 1:
            t = t + 2 * m.layers * tab.allreduce_s(np.maximum(x, 1.0) * m.hidden * 2, tp, inter=False)
        return np.where(x > 0, t, 0.0)

    return full * one(chunk) + one(rest)


def microbatch_s(m: ModelSpec, tp: int, pp: int, tokens: np.ndarray, sum_sq: np.ndarray, tab: Tables, *,
                 training: bool, recompute: bool, value_head: bool, sp: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of one micro-batch on one pipeline stage (1/pp of the layers;
    zeros where empty). ``tokens`` and ``sum_sq`` (sum of squared sequence lengths) are per
    micro-batch arrays; with Ulysses sequence parallelism ``sp`` GPUs share each sequence (tokens
    split, two all-to-alls around every attention, four in training)."""
    tokens = np.asarray(tokens, dtype=float)
    fwd_flops = 2 * matmul_params(m, value_head) * tokens + 4 * m.layers * m.hidden * np.asarray(sum_sq, float)
    seq = np.where(tokens > 0, np.asarray(sum_sq, float) / np.maximum(tokens, 1.0), 0.0)
    layers = math.ceil(m.layers / pp)

    def by_tokens(t):  # the terms that depend on the token count alone
        hfu = tab.train_hfu(np.maximum(t / (tp * sp), 1.0))
        comm = np.zeros_like(t)
        if tp > 1:
            comm = comm + 2 * layers * tab.allreduce_s(np.maximum(t / sp, 1.0) * m.hidden * 2, tp, inter=False)
        if sp > 1:
            comm = comm + 2 * layers * tab.allreduce_s(np.maximum(t / sp, 1.0) * m.hidden * 2 / tp, sp, inter=False) / 2
        return hfu, comm

    hfu, comm = per_length(by_tokens, tokens)
    eff = hfu * tab.train_seq_factor(np.maximum(seq, 1.0))
    rate = tp * sp * pp * tab.peak_flops * eff
    fwd = fwd_flops / rate
    fwd = fwd + comm
    if not training:
        return np.where(tokens > 0, fwd, 0.0), np.zeros_like(fwd)
    bwd = 2 * fwd_flops / rate + comm
    if recompute:
        bwd = bwd + fwd
    return np.where(tokens > 0, fwd, 0.0), np.where(tokens > 0, bwd, 0.0)


def per_length(fn, tokens: np.ndarray) -> tuple[np.ndarray, ...]:
    """``fn(tokens)`` for an elementwise ``fn`` (returning a tuple of arrays shaped like its input),
    evaluated once per distinct whole-number token count and looked up: the same values as
    ``fn(tokens)`` (elementwise arithmetic on the same numbers), in a fraction of the time when the
    counts repeat (a step's sequences span a few thousand lengths; blocks hold 10^5-10^6 of them).
    Falls back to ``fn(tokens)`` when the counts are not whole numbers or barely repeat."""
    t = np.asarray(tokens, dtype=np.float64)
    if t.size < 4096:
        return fn(t)
    lo, hi = float(t.min()), float(t.max())
    if hi - lo + 1 > t.size / 4 or not np.array_equal(t, np.floor(t)):
        return fn(t)
    table = np.arange(lo, hi + 1, dtype=np.float64)
    idx = (t - lo).astype(np.intp)
    return tuple(np.asarray(v)[idx] for v in fn(table))
