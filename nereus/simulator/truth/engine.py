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


def closed_form(lengths: np.ndarray, prompt: np.ndarray, dp: int, a: np.ndarray, beta: float,
                prefill) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seconds [T, dp] of each replica as if all its sequences ran at once, their KV peak in tokens
    [T, dp], their count [T, dp]) for ``lengths`` [T, N]: what depends neither on the KV budget nor
    on the slots, so engines that differ only in those share it. Each step's row is computed on its
    own (a subset of the steps gives the same numbers)."""
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
    peak = np.where(srt > 0, active * (p + srt), 0.0).max(axis=-1)
    return dec + pre, peak, count


def generation_times(lengths: np.ndarray, prompt: np.ndarray, dp: int, a: np.ndarray, beta: float,
                     kv_tokens: float, prefill, max_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Per step (seconds of the slowest replica, preemptions summed over replicas).

    ``lengths`` [T, N]; ``prompt`` [T] prompt tokens; ``a``/``beta`` decode coefficients;
    ``kv_tokens`` the replica's KV budget in tokens; ``prefill(tokens[R], prompt[R])`` -> seconds."""
    total, peak, count = closed_form(lengths, prompt, dp, a, beta, prefill)
    pressured = (peak > kv_tokens) | (count > max_seqs)
    preempted = np.zeros(total.shape)
    if pressured.any():
        idx = np.nonzero(pressured)
        reps = split_replicas(lengths, dp)
        pt, pp_ = _simulate(reps[idx], np.asarray(prompt, float)[idx[0]], a, beta, kv_tokens, prefill, max_seqs)
        total[idx] = pt
        preempted[idx] = pp_
    return total.max(axis=1), preempted.sum(axis=1)


def covers(kv_tokens, held: np.ndarray, asked: np.ndarray) -> np.ndarray:
    """Whether a replica's event simulation (``_simulate(..., demand=True)``: ``held``, ``asked``) is
    also its run under a KV budget of ``kv_tokens``, bit for bit: the budget holds the most KV tokens
    the run held (so nothing is preempted and every decode runs to its next finish) and leaves room,
    after vLLM's watermark and a token of margin for rounding, for every admission the slots and the
    queue allowed (so KV room limits none). Then no decision depends on the budget: engines that
    differ only in it (the same model, TP, PP and DP on pools holding different resident states)
    share the run. A run under a budget it does not cover was shaped by that budget."""
    return (kv_tokens >= held) & (kv_tokens * (1 - WATERMARK) >= asked + 1.0)


_NEVER = np.iinfo(np.int64).max // 4
"""Finish tick of a sequence that is not running."""


def _simulate(reps: np.ndarray, prompt: np.ndarray, a: np.ndarray, beta: float, kv: float,
              prefill, max_seqs: int, demand: bool = False) -> tuple[np.ndarray, ...]:
    """Event simulation of R replicas ([R, S] lengths, zero = no sequence); see module docstring.

    The same process, events and arithmetic as ``_simulate_reference`` (identical clocks and
    preemption counts; the replicas advance event by event in lockstep as there), with per-replica
    bookkeeping instead of recomputing the whole [R, S] state at every event:

    - the waiting queue is the stack of preempted sequences (the latest on top) followed by the
      never-admitted ones in dispatch order, and an admission takes a prefix of it: fresh admissions
      are a count (``ptr``) found in closed form from the KV room and the free slots;
    - a running sequence decodes one token per iteration, so it finishes at a fixed decode tick
      (``fin``); the next finish is the row's minimum, kept with its argument and updated on each
      admission, preemption and finish; a sequence's generated tokens are ``gbase + tick - atick``;
    - a row's preemption rounds run one after another inside one pass of the loop: in the
      reference, the admission passes between them admit nothing (the row is out of KV, and its
      latest victim needs p + generated + 1 tokens of room, more than freeing it leaves past the
      watermark), so the rows not pressed no longer wait through them; each round still counts as
      one event toward ``MAX_EVENTS``;
    - KV tokens held, running counts and queue pointers are integers kept per replica (exact).

    Needs whole-number prompt lengths (the truth's); otherwise the reference runs. ``demand``:
    also return, per replica, the most KV tokens held (after admissions and after each decode) and
    the most KV room an admission would have needed to take all the slots and the queue allowed
    (``covers``); None for both on the reference path."""
    p_in = np.asarray(prompt, dtype=np.float64)
    if not np.array_equal(p_in, np.round(p_in)):
        out = _simulate_reference(reps, p_in, a, beta, kv, prefill, max_seqs)
        return out + (None, None) if demand else out
    r0, s = reps.shape
    clock_out = np.zeros(r0)
    pre_out = np.zeros(r0)
    held_out = np.zeros(r0, dtype=np.int64)
    asked_out = np.zeros(r0)
    # valid sequences first, in dispatch order (a zero is no sequence; only the relative order matters)
    valid = reps > 0
    order = np.argsort(~valid, axis=1, kind="stable")
    nvalid = valid.sum(axis=1).astype(np.int64)
    keep = np.nonzero(nvalid > 0)[0]          # replicas with nothing to do end at clock 0
    row_id = keep
    L = np.take_along_axis(reps.astype(np.int64), order, axis=1)[keep]
    nvalid = nvalid[keep]
    pf = p_in[keep]                            # prompt tokens, float (the reference's arithmetic)
    pi = pf.astype(np.int64)
    r = len(keep)
    fin = np.full((r, s), _NEVER, dtype=np.int64)   # decode tick at which a running sequence is done
    adm = np.full((r, s), -1, dtype=np.int64)       # admission order of a running sequence, else -1
    gbase = np.zeros((r, s), dtype=np.int64)        # tokens generated before the current admission
    atick = np.zeros((r, s), dtype=np.int64)        # decode tick of the current admission
    stack = np.zeros((r, s), dtype=np.int64)        # preempted sequences, the latest on top
    psize = np.zeros(r, dtype=np.int64)
    ptr = np.zeros(r, dtype=np.int64)               # next never-admitted sequence
    tick = np.zeros(r, dtype=np.int64)
    used = np.zeros(r, dtype=np.int64)              # KV tokens held: prompt + generated of the running
    nrun = np.zeros(r, dtype=np.int64)
    ndone = np.zeros(r, dtype=np.int64)
    mn = np.full(r, _NEVER, dtype=np.int64)         # earliest finish among the running, and its sequence
    am = np.zeros(r, dtype=np.int64)
    clock = np.zeros(r)
    preempted = np.zeros(r)
    held = np.zeros(r, dtype=np.int64)              # the most KV tokens held (``demand``)
    asked = np.zeros(r)                             # the largest KV room an admission needed
    room_base = kv * (1 - WATERMARK)
    amax = len(a) - 1

    def admit(rr, seq, f):
        """Sequences ``seq`` of rows ``rr`` start running at their row's tick, finishing at ``f``."""
        fin[rr, seq] = f
        atick[rr, seq] = tick[rr]
        adm[rr, seq] = it * s + seq
        np.minimum.at(mn, rr, f)
        at = f == mn[rr]
        am[rr[at]] = seq[at]

    def refresh(rows):
        """Earliest finish of ``rows`` from scratch."""
        if 2 * len(rows) > len(fin):  # most rows: one pass over the whole state, no copy
            am[:] = fin.argmin(axis=1)
            mn[:] = fin[np.arange(len(fin)), am]
        elif len(rows):
            sub = fin[rows]
            k = sub.argmin(axis=1)
            am[rows] = k
            mn[rows] = sub[np.arange(len(rows)), k]

    it = 0  # the reference's event count: an admission pass and each round of preemptions are one
    while it < MAX_EVENTS:
        alive = ndone < nvalid
        n_alive = int(alive.sum())
        if n_alive < r and (n_alive == 0 or 4 * n_alive < 3 * r):  # drop finished replicas (clocks final)
            gone = ~alive
            clock_out[row_id[gone]] = clock[gone]
            pre_out[row_id[gone]] = preempted[gone]
            held_out[row_id[gone]], asked_out[row_id[gone]] = held[gone], asked[gone]
            (row_id, L, nvalid, pf, pi, fin, adm, gbase, atick, stack, psize, ptr, tick, used, nrun, ndone, mn, am,
             clock, preempted, held, asked) = (
                x[alive] for x in (row_id, L, nvalid, pf, pi, fin, adm, gbase, atick, stack, psize, ptr, tick, used,
                                   nrun, ndone, mn, am, clock, preempted, held, asked))
            r, alive = n_alive, alive[alive]
        if r == 0:
            return (clock_out, pre_out, held_out, asked_out) if demand else (clock_out, pre_out)
        # ---- admissions: a prefix of (preempted stack, latest first) + (never admitted, in order)
        slots = max_seqs - nrun
        room = room_base - used.astype(np.float64) - nrun
        took = np.zeros(r, dtype=np.int64)        # from the stack
        cum = np.zeros(r)                         # their KV need (prompt + generated + 1 each)
        tokens = np.zeros(r, dtype=np.int64)      # tokens prefilled (prompt + generated)
        whole = psize == 0
        sr = np.nonzero(psize > 0)[0]
        if len(sr):
            first = pf[sr] + gbase[sr, stack[sr, psize[sr] - 1]] + 1
            sr = sr[(first <= room[sr]) & (slots[sr] >= 1)]   # rows that admit at least the top one
        if len(sr):
            # each admission needs at least p + 1 of the room, so no more than room / (p + 1) (+ 1 for rounding) fit
            fit = np.floor(room[sr] / (pf[sr] + 1)).astype(np.int64) + 1
            k = int(np.minimum(np.minimum(psize[sr], slots[sr]), fit).max())
            pos = psize[sr, None] - 1 - np.arange(k)[None, :]
            inside = pos >= 0
            idx = stack[sr[:, None], np.maximum(pos, 0)]
            g = gbase[sr[:, None], idx]
            need = np.where(inside, pf[sr, None] + g + 1, 0.0)
            c = np.cumsum(need, axis=1)
            rank = np.arange(1, k + 1)[None, :]
            ok = inside & (c <= room[sr, None]) & (rank <= slots[sr, None])
            n_ok = ok.sum(axis=1)
            took[sr] = n_ok
            cum[sr] = c[np.arange(len(sr)), n_ok - 1]
            tokens[sr] = np.where(ok, pi[sr, None] + g, 0).sum(axis=1)
            whole[sr] = n_ok == psize[sr]
            rr = np.repeat(sr, n_ok)
            seq = idx[ok]
            admit(rr, seq, tick[rr] + L[rr, seq] - gbase[rr, seq])
            psize[sr] -= n_ok
        # fresh sequences after a wholly admitted stack: the largest j with cum + j (p + 1) <= room
        step_need = pf + 1
        j = np.floor((room - cum) / step_need)
        j = np.where(cum + (j + 1) * step_need <= room, j + 1, j)
        j = np.where((j > 0) & (cum + j * step_need > room), j - 1, j)
        j = np.minimum(np.maximum(j, 0).astype(np.int64), np.minimum(slots - took, nvalid - ptr))
        if demand:  # the room every sequence the slots and the queue allow would need
            j_slots = np.where(whole, np.maximum(np.minimum(slots - took, nvalid - ptr), 0), 0)
            asked = np.maximum(asked, used + nrun + cum + j_slots * step_need)
        j = np.where(whole, np.maximum(j, 0), 0)
        fresh = np.nonzero(j)[0]
        if len(fresh):
            cnt = j[fresh]
            rr = np.repeat(fresh, cnt)
            seq = np.repeat(ptr[fresh] - np.cumsum(cnt) + cnt, cnt) + np.arange(int(cnt.sum()))
            gbase[rr, seq] = 0
            admit(rr, seq, tick[rr] + L[rr, seq])
            ptr += j
            tokens += j * pi
        has = np.nonzero(tokens > 0)[0]
        if len(has):
            clock[has] += prefill(tokens[has].astype(float), pf[has])
            used += tokens
            nrun += took + j
        if (alive & (nrun == 0)).any():
            raise ValueError("generation: a sequence does not fit in the KV budget on its own")
        # ---- preemption when the next iteration has no KV slot for every running sequence
        if demand:
            held = np.maximum(held, used + nrun)
        used_f = used.astype(np.float64)
        free = kv - used_f
        short = np.nonzero(free < nrun)[0]
        while len(short):  # the reference's preemption rounds, one event each (see the docstring)
            vc = np.argmax(adm[short], axis=1)
            gen = gbase[short, vc] + tick[short] - atick[short, vc]
            gbase[short, vc] = gen
            fin[short, vc] = _NEVER
            adm[short, vc] = -1
            stack[short, psize[short]] = vc
            psize[short] += 1
            used[short] -= pi[short] + gen
            nrun[short] -= 1
            preempted[short] += 1
            refresh(short[am[short] == vc])
            it += 1
            if it >= MAX_EVENTS:
                break
            if (nrun[short] == 0).any():
                raise ValueError("generation: a sequence does not fit in the KV budget on its own")
            short = short[kv - used[short].astype(np.float64) < nrun[short]]
        if it >= MAX_EVENTS:
            break
        used_f = used.astype(np.float64)
        free = kv - used_f
        # ---- decode to the next event: a finish, or the KV budget full
        to_finish = mn - tick
        to_full = np.floor(free / np.maximum(nrun, 1)).astype(np.int64)
        step = np.where(alive, np.maximum(1, np.minimum(to_finish, to_full)), 0)
        clock += step * a[np.minimum(nrun, amax)] + beta * (step * used_f + nrun * step * (step - 1) / 2)
        tick += step
        used += nrun * step
        if demand:
            held = np.maximum(held, used)
        ended = np.nonzero(alive & (step == to_finish))[0]
        while len(ended):  # every sequence whose finish tick is reached (ties: one more round each)
            ec = am[ended]
            used[ended] -= pi[ended] + L[ended, ec]
            nrun[ended] -= 1
            ndone[ended] += 1
            fin[ended, ec] = _NEVER
            adm[ended, ec] = -1
            refresh(ended)
            ended = ended[mn[ended] <= tick[ended]]
        it += 1
    raise ValueError(f"generation: event simulation did not finish in {MAX_EVENTS} events")


def _simulate_reference(reps: np.ndarray, prompt: np.ndarray, a: np.ndarray, beta: float, kv: float,
                        prefill, max_seqs: int) -> tuple[np.ndarray, np.ndarray]:
    """Event simulation of R replicas ([R, S] lengths, zero = no sequence); see module docstring.

    The reference: every event recomputes the whole [R, S] state (queue order by argsort, KV held by
    sums). ``_simulate`` gives the same numbers from per-row bookkeeping; tests compare the two."""
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
