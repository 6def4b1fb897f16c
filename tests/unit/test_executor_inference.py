"""Inference passes (log-probs, logits, values) run in micro-batches of the stage's micro-batch, as
the cost model prices them (one fixed host cost per micro-batch, one micro-batch of logits alive at
a time) and as verl's ``log_prob_micro_batch_size_per_gpu`` does; the results do not depend on it."""
import pytest
import torch

from nereus.demo.setup import DEMO_MODEL
from nereus.executor.engine import Engine
from nereus.executor.memory import MemoryMeter
from nereus.executor.store import ShardStore
from nereus.planner.plan import StagePlacement
from nereus.planner.specs import ParallelConfig

IDS = torch.randint(1, DEMO_MODEL.vocab, (7, 9), generator=torch.Generator().manual_seed(3))


def engine(micro_batch: int) -> Engine:
    place = StagePlacement(name="ref/inference", config=ParallelConfig(tp=1, pp=1, dp=1, micro_batch=micro_batch),
                           pool=0, first_gpu=0, gpus=1)
    eng = Engine(0, 1, DEMO_MODEL, place, ShardStore(), role="ref", trainable=False)
    eng.init_state(0)
    return eng


def counted(eng: Engine) -> list[int]:
    rows: list[int] = []
    forward = eng._pipe_forward

    def spy(ids, cache=None):
        rows.append(ids.shape[0])
        return forward(ids, cache)

    eng._pipe_forward = spy
    return rows


@pytest.mark.parametrize("mb, passes", [(1, [1] * 7), (3, [3, 3, 1]), (8, [7])])
def test_logprobs_run_one_forward_per_micro_batch_of_the_placement(mb, passes):
    eng = engine(mb)
    rows = counted(eng)
    got = eng.logprobs(IDS)
    assert rows == passes
    want = engine(7).logprobs(IDS)
    assert got.shape == (7, 8) and torch.allclose(got, want, atol=1e-5, rtol=0)


def test_an_explicit_micro_batch_overrides_the_placement_and_bounds_the_logits_alive():
    """The actor's engine holds its training placement; the caller passes actor/inference's
    micro-batch. The meter sees one micro-batch of logits (+ log-softmax) at a time."""
    peaks = {}
    for mb in (1, 7):
        eng = engine(4)
        eng.meter = MemoryMeter(None)
        rows = counted(eng)
        out = eng.logprobs(IDS, micro_batch=mb)
        assert rows == ([1] * 7 if mb == 1 else [7])
        peaks[mb] = eng.meter.peak
        assert torch.isfinite(out).all()
    assert peaks[1] * 7 == peaks[7] == 2 * 7 * 9 * DEMO_MODEL.vocab * 4


def test_logits_are_the_same_in_any_micro_batch():
    a, b = engine(2), engine(7)
    rows = counted(a)
    assert rows == [] and torch.allclose(a.logits(IDS), b.logits(IDS), atol=1e-5, rtol=0)
    assert rows == [2, 2, 2, 1]
