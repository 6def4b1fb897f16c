"""Training and inference of one model-stage at micro-batch level, vectorised over steps.

The step's sequences (prompt + sampled response) are split, in order, into ``mini_batches`` (training
only), then into ``dp`` contiguous DP shards, then into micro-batches of ``micro_batch`` sequences;
each micro-batch's time comes from its own tokens and sum of squared lengths
(``kernels.microbatch_s``). With pipeline stages the 1F1B schedule (warm-up forwards, one forward /
one backward, cool-down backwards) is simulated event by event (inference: a forward-only pipeline),
with a p2p per stage boundary; the slowest DP shard ends the mini-batch, then the gradient sync
(ZeRO 0-2: an all-reduce of fp32 gradients over DP; ZeRO-3/FSDP: every micro-batch all-gathers the
parameters twice and reduce-scatters the gradients, and whatever of that the micro-batch's compute
does not hide is exposed) and the optimizer step (``ADAM_BYTES`` per parameter shard at HBM speed).

Memory per micro-batch: the activations of the micro-batches in flight (1F1B keeps up to pp on the
first stage) + logits on the last stage (+ FSDP's gathered layers): allocated memory, the
conventions in ``memory.py``; the step's peak is the largest. The caller adds the pool's resident states: a step whose sampled batch
does not fit is an OOM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nereus.models.spec import ModelSpec
from nereus.simulator.truth.corpus import Tables
from nereus.simulator.truth.kernels import microbatch_s, per_length
from nereus.simulator.truth.memory import (FRAGMENTATION, LOGITS_BYTES_INFER, LOGITS_BYTES_TRAIN, act_bytes_per_token_layer,
                                           layer_params_per_gpu, params_per_gpu)

ADAM_BYTES = 30.0
"""Bytes read + written per parameter of the shard in one Adam step (fp32 master, m, v, grad; bf16 copy)."""
HBM_STREAM_EFF = 0.8


@dataclass(frozen=True)
class StageSpec:
    model: ModelSpec
    training: bool
    value_head: bool
    tp: int
    pp: int
    dp: int
    micro_batch: int
    token_budget: int
    """Tokens per GPU per micro-batch (verl's dynamic batch size); 0 = ``micro_batch`` sequences."""
    sp: int
    zero: int
    recompute: bool
    mini_batches: int
    epochs: int
    span_inter: bool
    """The DP group spans nodes (gradient sync over the scale-out network)."""
    stage_inter: bool
    """Adjacent pipeline stages sit on different nodes."""


def _split(x: np.ndarray, parts: int) -> np.ndarray:
    """[..., n] -> [..., parts, ceil(n/parts)] contiguous, zero-padded."""
    n = x.shape[-1]
    k = -(-n // parts)
    if k * parts == n:  # nothing to pad: the same values without a copy
        return x.reshape(x.shape[:-1] + (parts, k))
    pad = np.zeros(x.shape[:-1] + (parts * k,), dtype=x.dtype)
    pad[..., :n] = x
    return pad.reshape(x.shape[:-1] + (parts, k))


def _chunks(x: np.ndarray, size: int) -> np.ndarray:
    """[..., n] -> [..., ceil(n/size), size], zero-padded."""
    n = x.shape[-1]
    k = -(-n // size)
    if k * size == n:
        return x.reshape(x.shape[:-1] + (k, size))
    pad = np.zeros(x.shape[:-1] + (k * size,), dtype=x.dtype)
    pad[..., :n] = x
    return pad.reshape(x.shape[:-1] + (k, size))


def _pack(x: np.ndarray, budget: float) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic batch size: each shard's sequences in ceil(tokens / budget) micro-batches, longest
    first dealt round-robin (balanced, as verl's partitioning aims). -> (tokens, sum_sq) [..., k]."""
    lead, n = x.shape[:-1], x.shape[-1]
    rows = -np.sort(-x.reshape(-1, n), axis=1)
    k = np.maximum(1, np.ceil(rows.sum(axis=1) / budget)).astype(np.int64)
    kmax = int(k.max())
    slot = np.arange(n)[None, :] % k[:, None]
    flat = (np.arange(len(rows))[:, None] * kmax + slot).ravel()
    size = len(rows) * kmax
    tok = np.bincount(flat, weights=rows.ravel(), minlength=size).reshape(len(rows), kmax)
    sq = np.bincount(flat, weights=(rows * rows).ravel(), minlength=size).reshape(len(rows), kmax)
    return tok.reshape(lead + (kmax,)), sq.reshape(lead + (kmax,))


def stage_times(seqs: np.ndarray, st: StageSpec, tab: Tables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step (seconds, True, peak transient bytes per GPU) for ``seqs`` [T, N] sequence lengths
    (prompt + response); the caller adds the pool's resident states and checks the capacity."""
    x = seqs.astype(np.float64)
    x = _split(x, st.mini_batches) if st.training else x[:, None, :]   # [T, M, n]
    x = _split(x, max(1, st.dp // st.sp))                               # [T, M, shards, r]
    if st.token_budget:
        tokens, sum_sq = _pack(x, st.token_budget * st.sp)              # [T, M, shards, k]
    elif st.micro_batch == 1:  # one sequence per micro-batch: its length and square (the sums of one term)
        tokens, sum_sq = x, x * x
    else:
        x = _chunks(x, st.micro_batch)                                  # [T, M, shards, m, mb]
        tokens, sum_sq = x.sum(axis=-1), (x * x).sum(axis=-1)
    m = tokens.shape[-1]

    def kernel(tok, sq):
        return microbatch_s(st.model, st.tp, st.pp, tok, sq, tab, training=st.training, recompute=st.recompute,
                            value_head=st.value_head, sp=st.sp)

    if st.micro_batch == 1 and not st.token_budget:  # a function of the length alone: once per distinct length
        fwd, bwd = per_length(lambda t: kernel(t, t * t), tokens)
    else:
        fwd, bwd = kernel(tokens, sum_sq)
    fsdp = _fsdp_exposed(st, tab, fwd + bwd) if st.zero >= 3 else 0.0
    if st.pp == 1:
        per_rank = (fwd + bwd + fsdp).sum(axis=-1)                    # [T, M, shards]
    else:
        p2p = _p2p_s(st, tab, tokens)
        flat = lambda a: a.reshape(-1, m)  # noqa: E731
        done = (_one_f_one_b(flat(fwd + fsdp), flat(bwd), flat(p2p), st.pp) if st.training
                else _forward_pipeline(flat(fwd + fsdp), flat(p2p), st.pp))
        per_rank = done.reshape(tokens.shape[:-1])
    mini = per_rank.max(axis=-1)                                        # [T, M]
    if st.training:
        mini = mini + _grad_sync_s(st, tab) + _optimizer_s(st, tab)
    total = mini.sum(axis=-1) * (st.epochs if st.training else 1)
    peak = FRAGMENTATION * _transient_bytes(st, tokens)
    return total, np.ones(len(total), dtype=bool), peak


def _psi(st: StageSpec) -> float:
    return params_per_gpu(st.model, st.tp, st.pp, st.value_head)


def _fsdp_exposed(st: StageSpec, tab: Tables, compute: np.ndarray) -> np.ndarray:
    """Per micro-batch: parameter all-gathers (forward and backward; forward only in inference)
    and the gradient reduce-scatter of ZeRO-3 that the micro-batch's compute does not hide."""
    full = _psi(st)
    gather = float(tab.allreduce_s(2 * full, st.dp, inter=st.span_inter)) / 2
    comm = gather * (2 if st.training else 1)
    if st.training:
        comm += float(tab.allreduce_s(4 * full, st.dp, inter=st.span_inter)) / 2
    return np.where(compute > 0, np.maximum(0.0, comm - compute), 0.0)


def _p2p_s(st: StageSpec, tab: Tables, tokens: np.ndarray) -> np.ndarray:
    def p2p(t):
        nbytes = np.maximum(t, 1.0) * st.model.hidden * 2 / st.tp
        return (tab.allreduce_s(nbytes, 2, inter=st.stage_inter) / 2,)

    return per_length(p2p, tokens)[0]



def _grad_sync_s(st: StageSpec, tab: Tables) -> float:
    if st.zero >= 3 or st.dp == 1:
        return 0.0
    return float(tab.allreduce_s(4 * _psi(st), st.dp, inter=st.span_inter))


def _optimizer_s(st: StageSpec, tab: Tables) -> float:
    shard = _psi(st) / (st.dp if st.zero >= 1 else 1)
    return ADAM_BYTES * shard / (HBM_STREAM_EFF * tab.hbm_bps)


def _one_f_one_b(f: np.ndarray, b: np.ndarray, p2p: np.ndarray, pp: int) -> np.ndarray:
    """Makespan of 1F1B over ``pp`` identical stages for rows of micro-batch times [X, m] (a zero
    time is an empty micro-batch); event by event, each stage's ops in the 1F1B order. Every row
    follows the same schedule, so which op can run is a per-op flag; the arithmetic of an op is
    ``max(stage free, dependency) + op time`` on the whole column of rows (columns transposed to be
    contiguous: the same numbers, read without a stride)."""
    x, m = f.shape
    ft, bt, pt = (np.ascontiguousarray(a.T) for a in (f, b, p2p))  # [m, X]
    ops = []
    for s in range(pp):
        w = min(pp - s - 1, m)
        seq = [(True, i) for i in range(w)]
        for j in range(m - w):
            seq += [(True, w + j), (False, j)]
        seq += [(False, m - w + j) for j in range(w)]
        ops.append(seq)
    zero = np.zeros(x)
    f_end: list[list[np.ndarray | None]] = [[None] * m for _ in range(pp)]
    b_end: list[list[np.ndarray | None]] = [[None] * m for _ in range(pp)]
    free = [zero] * pp
    ptr = [0] * pp
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(pp):
            seq = ops[s]
            while ptr[s] < len(seq):
                fwd, i = seq[ptr[s]]
                if fwd:
                    up = zero if s == 0 else f_end[s - 1][i]
                    if up is None:
                        break
                    dep = up if s == 0 else up + pt[i]
                else:
                    up = f_end[s][i] if s == pp - 1 else b_end[s + 1][i]
                    if up is None:
                        break
                    dep = up if s == pp - 1 else up + pt[i]
                end = np.maximum(free[s], dep)
                end += ft[i] if fwd else bt[i]
                (f_end if fwd else b_end)[s][i] = end
                free[s] = end
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")
    return np.max(np.stack(free), axis=0)


def _forward_pipeline(f: np.ndarray, p2p: np.ndarray, pp: int) -> np.ndarray:
    """Makespan of a forward-only pipeline (inference) over rows of micro-batch times [X, m]."""
    x, m = f.shape
    ft, pt = np.ascontiguousarray(f.T), np.ascontiguousarray(p2p.T)  # [m, X]: contiguous columns
    end = [np.zeros(x) for _ in range(pp)]
    for i in range(m):
        prev = np.zeros(x)
        for s in range(pp):
            e = np.maximum(end[s], prev)
            e += ft[i]
            end[s] = e
            prev = e + pt[i]
    return end[-1]


def _transient_bytes(st: StageSpec, tokens: np.ndarray) -> np.ndarray:
    """Peak transient bytes per GPU over the step's micro-batches ([T, M, dp, m] tokens -> [T])."""
    mdl = st.model
    layers = math.ceil(mdl.layers / st.pp)
    per_tok = act_bytes_per_token_layer(mdl, st.tp) / st.sp
    vocab = 1 if st.value_head else mdl.vocab / st.tp
    if st.training:
        window = min(st.pp, tokens.shape[-1])
        c = np.cumsum(tokens, axis=-1)
        c = np.concatenate([np.zeros(c.shape[:-1] + (1,)), c], axis=-1)
        inflight = (c[..., window:] - c[..., :-window]).max(axis=-1)   # pp consecutive micro-batches
        biggest = tokens.max(axis=-1)
        if st.recompute:
            act = inflight * layers * 2 * mdl.hidden / st.sp + biggest * per_tok
        else:
            act = inflight * layers * per_tok
        act = act + biggest / st.sp * vocab * LOGITS_BYTES_TRAIN
    else:
        biggest = tokens.max(axis=-1)
        act = biggest * per_tok * 2 + biggest / st.sp * vocab * LOGITS_BYTES_INFER
    if st.zero >= 3:
        act = act + 2 * 2 * layer_params_per_gpu(mdl, st.tp)
    return act.reshape(act.shape[0], -1).max(axis=1)
