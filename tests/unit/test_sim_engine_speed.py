"""The ground truth's fast paths give the reference's numbers (SIMULATED): the continuous-batching
event simulation (``engine._simulate`` against ``engine._simulate_reference``), bit for bit on the
same inputs, with KV pressure, preemptions, slot limits, empty sequences and the error case."""
import numpy as np
import pytest

from nereus.simulator.truth import engine
from nereus.simulator.truth.engine import _simulate, _simulate_reference, generation_times


def _a(n: int = 300, base: float = 0.01, slope: float = 1e-5) -> np.ndarray:
    a = base + slope * np.arange(n, dtype=float)
    a[0] = 0.0
    return a


def _prefill(tokens, prompt):
    return 1e-6 * np.asarray(tokens, float) + 1e-9 * np.asarray(tokens, float) * np.asarray(prompt, float)


def _case(rng: np.random.Generator):
    r, s = int(rng.integers(1, 10)), int(rng.integers(1, 48))
    reps = np.ceil(np.exp(rng.normal(np.log(rng.uniform(20, 400)), 0.8, (r, s)))).astype(np.int64)
    reps[rng.random((r, s)) < rng.uniform(0, 0.3)] = 0
    prompt = rng.integers(1, 200, r).astype(float)
    need = float((prompt[:, None] + reps).max())
    kv = float(rng.uniform(1.05 * need, need * max(0.25 * s, 1.1)))
    kv = 16 * np.floor(kv / 16) + 16
    return reps, prompt, kv, int(rng.integers(1, 64))


def _both(*args):
    out = []
    for fn in (_simulate_reference, _simulate):
        try:
            out.append(fn(*args))
        except ValueError as e:
            out.append(str(e))
    return out


def test_fast_event_simulation_equals_the_reference_bit_for_bit():
    rng = np.random.default_rng(7)
    pressured = preempting = 0
    for _ in range(150):
        reps, prompt, kv, max_seqs = _case(rng)
        ref, fast = _both(reps, prompt, _a(), 1e-7, kv, _prefill, max_seqs)
        if isinstance(ref, str):
            assert fast == ref
            continue
        assert np.array_equal(ref[0], fast[0]) and np.array_equal(ref[1], fast[1])
        pressured += 1
        preempting += int(ref[1].sum() > 0)
    assert pressured > 100 and preempting > 40  # the cases exercise preemption, not only the easy path


def test_fast_event_simulation_on_a_realistic_replica_batch():
    """An 8B-like engine replica: 256 sequences of a few thousand tokens, a KV budget that forces
    preemptions, many replicas in lockstep."""
    rng = np.random.default_rng(3)
    reps = np.clip(np.ceil(np.exp(rng.normal(np.log(1500), 0.6, (24, 256)))), 1, 20480).astype(np.int64)
    prompt = np.full(24, 1024.0)
    a = _a(257, 0.012, 2e-5)
    ref = _simulate_reference(reps, prompt, a, 2e-9, 357_104.0, _prefill, 256)
    fast = _simulate(reps, prompt, a, 2e-9, 357_104.0, _prefill, 256)
    assert ref[1].min() > 0  # every replica preempts
    assert np.array_equal(ref[0], fast[0]) and np.array_equal(ref[1], fast[1])


def test_fast_event_simulation_with_slot_limits_and_no_kv_pressure():
    rng = np.random.default_rng(11)
    reps = rng.integers(1, 500, size=(5, 40))
    for max_seqs in (1, 3, 16, 40):
        ref, fast = _both(reps, np.full(5, 64.0), _a(), 1e-8, 1e9, _prefill, max_seqs)
        assert np.array_equal(ref[0], fast[0]) and np.array_equal(ref[1], fast[1])
        assert fast[1].sum() == 0


def test_fast_event_simulation_refuses_what_does_not_fit_like_the_reference():
    reps = np.array([[100, 5000, 20]])
    ref, fast = _both(reps, np.array([100.0]), _a(), 1e-8, 4096.0, _prefill, 8)
    assert isinstance(ref, str) and fast == ref


def test_fractional_prompts_take_the_reference_path():
    reps = np.random.default_rng(2).integers(50, 400, size=(3, 30))
    prompt = np.array([10.5, 20.25, 7.0])
    ref = _simulate_reference(reps, prompt, _a(), 1e-7, 3000.0, _prefill, 16)
    fast = _simulate(reps, prompt, _a(), 1e-7, 3000.0, _prefill, 16)
    assert np.array_equal(ref[0], fast[0]) and np.array_equal(ref[1], fast[1])


def test_generation_times_unchanged_by_the_fast_path(monkeypatch):
    rng = np.random.default_rng(5)
    lengths = np.clip(np.ceil(np.exp(rng.normal(np.log(900), 0.7, (6, 512)))), 1, 8192).astype(np.int32)
    prompt = np.full(6, 512.0)
    args = (lengths, prompt, 4, _a(257), 1e-8, 60_000.0, _prefill, 256)
    fast = generation_times(*args)
    monkeypatch.setattr(engine, "_simulate", _simulate_reference)
    ref = generation_times(*args)
    assert fast[1].sum() > 0
    assert np.array_equal(fast[0], ref[0]) and np.array_equal(fast[1], ref[1])


def test_a_wrong_victim_would_be_caught():
    """Preempting the oldest instead of the newest admission changes the clock: the equality tests
    above can tell a wrong optimisation from a right one."""
    rng = np.random.default_rng(3)
    reps = np.clip(np.ceil(np.exp(rng.normal(np.log(1500), 0.6, (4, 64)))), 1, 20480).astype(np.int64)
    prompt = np.full(4, 1024.0)
    ref = _simulate_reference(reps, prompt, _a(), 2e-9, 60_000.0, _prefill, 64)
    orig_argmax = np.argmax

    def oldest(x, axis=None, **kw):  # the victim rule's argmax turned into "oldest running"
        if axis == 1 and np.issubdtype(np.asarray(x).dtype, np.integer):
            return np.argmin(np.where(np.asarray(x) < 0, np.iinfo(np.int64).max, x), axis=1)
        return orig_argmax(x, axis=axis, **kw)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine.np, "argmax", oldest)
        wrong = _simulate(reps, prompt, _a(), 2e-9, 60_000.0, _prefill, 64)
    assert ref[1].sum() > 0 and not np.array_equal(ref[0], wrong[0])
