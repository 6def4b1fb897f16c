"""Generation at request level: the step's sequences dispatched to DP replicas, each replica a
continuous-batching engine with a KV-block budget; the stage ends with the slowest replica.

Dispatch: the batch (a prompt's samples adjacent) is split into ``dp`` contiguous chunks, as verl
hands each rollout worker its share. A replica admits waiting sequences first come first served
while it has fewer than ``max_seqs`` running (the job's ``rollout.max_num_seqs``) and KV room for their prompt (+ what they already
generated); each decode iteration every running sequence appends one token (time
``A[running] + beta x KV tokens held``, ``kernels.decode_coeffs``); when a running sequence needs a
KV slot and none is free, the most recently admitted one is preempted (its KV freed, put back at the
head of the queue, and recomputed: prompt + generated tokens prefilled again when readmitted).

Two exact evaluations of that process, both vectorised over steps and replicas:

- no pressure (everything fits at once, the common case on many GPUs): with the lengths sorted,
  the running count is constant between consecutive finishes, so decode time is a closed-form sum
  over those segments;
- pressure: an event simulation that advances every replica to its next event (a finish, or the KV
  budget full) and applies admissions and preemptions there.
"""
from __future__ import annotations

import numpy as np

MAX_EVENTS = 200_000
WATERMARK = 0.01
"""vLLM's block-manager watermark: admissions leave this fraction of the KV blocks free."""


def split_replicas(lengths: np.ndarray, dp: int) -> np.ndarray:
    """[T, N] -> [T, dp, S] contiguous chunks, zero-padded (a zero length is no sequence)."""
    t, n = lengths.shape
    s = -(-n // dp)
    pad = np.zeros((t, dp * s), dtype=lengths.dtype)
    pad[:, :n] = lengths
    return pad.reshape(t, dp, s)


def generation_times(lengths: np.ndarray, prompt: np.ndarray, dp: int, a: np.ndarray, beta: float,
                     kv_tokens: float, prefill, max_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step (seconds of the slowest replica, preemptions summed over replicas).

    ``lengths`` [T, N]; ``prompt`` [T] prompt tokens; ``a``/``beta`` decode coefficients;
    ``kv_tokens`` the replica's KV budget in tokens; ``prefill(tokens[R], prompt[R])`` -> seconds."""
    reps = split_replicas(lengths, dp)
    t, d, s = reps.shape
    srt = np.sort(reps, axis=-1).astype(np.float64)
    prev = np.concatenate([np.zeros((t, d, 1)), srt[..., :-1]], axis=-1)
    n = srt - prev
    active = (s - np.arange(s)).astype(np.int64)  # running during segment j
    p = prompt[:, None, None].astype(np.float64)
    a_seg = a[np.minimum(active, len(a) - 1)]
    dec = (n * a_seg + beta * active * (n * p + n * (prev + srt - 1) / 2)).sum(axis=-1)
    count = (reps > 0).sum(axis=-1)
    pre = prefill((count * p[..., 0]).ravel(), np.repeat(prompt, d).astype(float)).reshape(t, d)
    total = dec + pre
    peak = np.where(srt > 0, active * (p + srt), 0.0).max(axis=-1)
    pressured = (peak > kv_tokens) | (count > max_seqs)
    preempted = np.zeros((t, d))
    if pressured.any():
        idx = np.nonzero(pressured)
        pt, pp_ = _simulate(reps[idx], np.asarray(prompt, float)[idx[0]], a, beta, kv_tokens, prefill, max_seqs)
        total[idx] = pt
        preempted[idx] = pp_
    return total.max(axis=1), preempted.sum(axis=1)


def _simulate(reps: np.ndarray, prompt: np.ndarray, a: np.ndarray, beta: float, kv: float,
              prefill, max_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Event simulation of R replicas ([R, S] lengths, zero = no sequence); see module docstring."""
    r, s = reps.shape
    rem = reps.astype(np.int64).copy()
    gen = np.zeros((r, s), dtype=np.int64)
    valid = rem > 0
    run = np.zeros((r, s), dtype=bool)
    done = ~valid
    prio = np.tile(np.arange(s, dtype=np.float64), (r, 1))
    admit_no = np.zeros((r, s), dtype=np.int64)
    clock = np.zeros(r)
    preempted = np.zeros(r)
    counter = 0
    rows = np.arange(r)
    p = prompt[:, None]
    for _ in range(MAX_EVENTS):
        live = ~done.all(axis=1)
        if not live.any():
            return clock, preempted
        # ---- admissions (first come first served, preempted sequences first)
        waiting = valid & ~run & ~done
        used = np.where(run, p + gen, 0).sum(axis=1)
        slots = max_seqs - run.sum(axis=1)
        if waiting.any():
            key = np.where(waiting, prio, np.inf)
            order = np.argsort(key, axis=1)
            need = np.take_along_axis(np.where(waiting, p + gen + 1, 0), order, axis=1)
            w_sorted = np.take_along_axis(waiting, order, axis=1)
            cum = np.cumsum(need, axis=1)
            rank = np.cumsum(w_sorted, axis=1)
            # room for the newcomers' tokens, one more token per running sequence and vLLM's 1%
            # watermark (without it an admission can be undone by a preemption one token later)
            room = kv * (1 - WATERMARK) - used - run.sum(axis=1)
            ok_sorted = w_sorted & (cum <= room[:, None]) & (rank <= slots[:, None])
            ok = np.zeros_like(ok_sorted)
            np.put_along_axis(ok, order, ok_sorted, axis=1)
            if ok.any():
                counter += 1
                tokens = np.where(ok, p + gen, 0).sum(axis=1)
                has = tokens > 0
                clock[has] += prefill(tokens[has].astype(float), prompt[has])
                run |= ok
                admit_no = np.where(ok, counter * s + np.arange(s)[None, :], admit_no)
                used = np.where(run, p + gen, 0).sum(axis=1)
        nrun = run.sum(axis=1)
        stuck = live & (nrun == 0)
        if stuck.any():
            raise ValueError("generation: a sequence does not fit in the KV budget on its own")
        # ---- preemption when the next iteration has no KV slot for every running sequence
        free = kv - used
        short = live & (free < nrun)
        if short.any():
            victim = np.argmax(np.where(run, admit_no, -1), axis=1)
            vr = rows[short]
            vc = victim[short]
            run[vr, vc] = False
            counter += 1
            prio[vr, vc] = -float(counter)
            preempted[vr] += 1
            continue
        # ---- decode to the next event: a finish, or the KV budget full
        to_finish = np.where(run, rem, np.iinfo(np.int64).max).min(axis=1)
        to_full = np.floor(free / np.maximum(nrun, 1)).astype(np.int64)
        step = np.maximum(1, np.minimum(to_finish, to_full))
        step = np.where(live, step, 0)
        clock += step * a[np.minimum(nrun, len(a) - 1)] + beta * (step * used + nrun * step * (step - 1) / 2)
        adv = np.where(run, step[:, None], 0)
        gen += adv
        rem -= adv
        fin = run & (rem <= 0)
        done |= fin
        run &= ~fin
    raise ValueError(f"generation: event simulation did not finish in {MAX_EVENTS} events")
