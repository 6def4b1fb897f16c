"""The continuous-batching event simulation's fast path against the loop it replaced (SIMULATED):
``engine._simulate`` gives bit for bit the clocks, preemption counts and ``demand`` figures (the most
KV held, the most KV room asked) of the previous lockstep loop (``_simulate_v1`` below, kept verbatim
as the reference of this change), and the clocks and preemptions of ``engine._simulate_reference``,
on random inputs: KV pressure with preemption cascades, slot limits with more sequences than slots,
empty sequences, the refusal of a sequence that does not fit, and the event limit."""
import numpy as np
import pytest
from test_sim_engine_speed import _a, _prefill

from nereus.simulator.truth import engine
from nereus.simulator.truth.engine import _simulate


def _case(rng: np.random.Generator):
    """A random batch of replicas: lengths, prompts, a KV budget from loose to barely fitting the
    longest sequence, and slots from 1 to more than the sequences."""
    r, s = int(rng.integers(1, 12)), int(rng.integers(1, 96))
    reps = np.ceil(np.exp(rng.normal(np.log(rng.uniform(5, 600)), rng.uniform(0.2, 1.2), (r, s)))).astype(np.int64)
    reps[rng.random((r, s)) < rng.uniform(0, 0.3)] = 0
    prompt = np.round(np.exp(rng.uniform(0, np.log(300), r)))  # short prompts: preemption cascades
    need = float((prompt[:, None] + reps).max())
    kv = float(rng.uniform(0.9 * need, need * max(0.4 * s, 1.1)))
    if rng.random() < 0.5:
        kv = 16 * np.floor(kv / 16) + 16
    return reps, prompt, kv, int(rng.integers(1, 2 * s + 2))


def _run(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except ValueError as e:
        return str(e)


def _same(x, y) -> bool:
    if isinstance(x, str) or isinstance(y, str):
        return x == y
    return all(np.array_equal(u, v) and u.dtype == v.dtype for u, v in zip(x, y))


def test_fast_path_equals_the_previous_loop_and_the_reference_on_random_inputs():
    rng = np.random.default_rng(2029)
    seen = {"preempting": 0, "slot_bound": 0, "refused": 0}
    for _ in range(300):
        reps, prompt, kv, max_seqs = _case(rng)
        args = (reps, prompt, _a(), float(rng.uniform(1e-9, 1e-6)), kv, _prefill, max_seqs)
        new = _run(_simulate, *args, demand=True)
        assert _same(new, _run(_simulate_v1, *args, demand=True))
        ref = _run(engine._simulate_reference, *args)
        assert _same(new if isinstance(new, str) else new[:2], ref)
        assert _same(_run(_simulate, *args), ref)
        if isinstance(new, str):
            seen["refused"] += 1
            continue
        seen["preempting"] += int(new[1].sum() > 0)
        seen["slot_bound"] += int((reps > 0).sum(axis=1).max() > max_seqs)
    assert seen["preempting"] > 60 and seen["slot_bound"] > 60 and seen["refused"] > 5, seen


def test_fast_path_on_realistic_replica_batches():
    """8B-like replicas: many sequences of a few thousand tokens, a KV budget that forces preemption
    cascades (64 slots), and more sequences than slots with a loose budget (slot-limited, no preemption)."""
    rng = np.random.default_rng(5)
    a = _a(257, 0.012, 2e-5)
    reps = np.clip(np.ceil(np.exp(rng.normal(np.log(1500), 0.7, (40, 64)))), 1, 20480).astype(np.int64)
    prompt = rng.integers(200, 1500, 40).astype(float)
    new = _simulate(reps, prompt, a, 2e-9, 60_000.0, _prefill, 256, demand=True)
    assert new[1].min() > 0 and _same(new, _simulate_v1(reps, prompt, a, 2e-9, 60_000.0, _prefill, 256, demand=True))
    reps = np.clip(np.ceil(np.exp(rng.normal(np.log(900), 0.8, (6, 700)))), 1, 8192).astype(np.int64)
    prompt = np.full(6, 512.0)
    new = _simulate(reps, prompt, a, 2e-9, 1e9, _prefill, 64, demand=True)
    assert new[1].sum() == 0 and _same(new, _simulate_v1(reps, prompt, a, 2e-9, 1e9, _prefill, 64, demand=True))


@pytest.mark.parametrize("limit", [1, 2, 3, 5, 8, 13, 40])
def test_the_event_limit_counts_as_before(monkeypatch, limit):
    """Preemption rounds still count one event each: the same runs finish or hit the limit."""
    monkeypatch.setattr(engine, "MAX_EVENTS", limit)
    rng = np.random.default_rng(limit)
    for _ in range(40):
        reps, prompt, kv, max_seqs = _case(rng)
        args = (reps, prompt, _a(), 1e-7, kv, _prefill, max_seqs)
        assert _same(_run(_simulate, *args, demand=True), _run(_simulate_v1, *args, demand=True))


def _simulate_v1(reps: np.ndarray, prompt: np.ndarray, a: np.ndarray, beta: float, kv: float,
              prefill, max_seqs: int, demand: bool = False) -> tuple[np.ndarray, ...]:
    """The lockstep event loop before this change (one preemption round per iteration), verbatim."""
    p_in = np.asarray(prompt, dtype=np.float64)
    if not np.array_equal(p_in, np.round(p_in)):
        out = engine._simulate_reference(reps, p_in, a, beta, kv, prefill, max_seqs)
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
    fin = np.full((r, s), engine._NEVER, dtype=np.int64)   # decode tick at which a running sequence is done
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
    mn = np.full(r, engine._NEVER, dtype=np.int64)         # earliest finish among the running, and its sequence
    am = np.zeros(r, dtype=np.int64)
    clock = np.zeros(r)
    preempted = np.zeros(r)
    held = np.zeros(r, dtype=np.int64)              # the most KV tokens held (``demand``)
    asked = np.zeros(r)                             # the largest KV room an admission needed
    room_base = kv * (1 - engine.WATERMARK)
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

    for it in range(engine.MAX_EVENTS):
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
            k = int(min(psize[sr].max(), slots[sr].max()))
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
        if len(short):
            vc = np.argmax(adm[short], axis=1)
            gen = gbase[short, vc] + tick[short] - atick[short, vc]
            gbase[short, vc] = gen
            fin[short, vc] = engine._NEVER
            adm[short, vc] = -1
            stack[short, psize[short]] = vc
            psize[short] += 1
            used[short] -= pi[short] + gen
            nrun[short] -= 1
            preempted[short] += 1
            refresh(short[am[short] == vc])
            continue
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
            fin[ended, ec] = engine._NEVER
            adm[ended, ec] = -1
            refresh(ended)
            ended = ended[mn[ended] <= tick[ended]]
    raise ValueError(f"generation: event simulation did not finish in {engine.MAX_EVENTS} events")
