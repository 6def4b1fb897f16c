"""Full activation recomputation in the executor (ParallelConfig.recompute): the same losses and
updated parameters as without it, and less activation memory counted by the meter."""
import pytest
import torch

from nereus.executor.launch import launch


def _train(rank, world, recompute):
    from nereus.demo.setup import DEMO_MODEL
    from nereus.demo.worker import _fill
    from nereus.executor import model as M
    from nereus.executor.engine import Engine
    from nereus.executor.memory import MemoryMeter
    from nereus.executor.optim import AdamW
    from nereus.executor.store import ShardStore
    from nereus.planner.plan import StagePlacement
    from nereus.planner.specs import ParallelConfig

    full = {n: t for (n, _), t in M.init_full(DEMO_MODEL, 0).items()}
    place = StagePlacement(name="actor/training", pool=0, first_gpu=0, gpus=world,
                           config=ParallelConfig(tp=2, dp=1, micro_batch=2, zero=1, recompute=recompute))
    store = ShardStore()
    eng = Engine(rank, world, DEMO_MODEL, place, store, role="actor", trainable=True, optim=AdamW(lr=1e-2))
    _fill(eng, full)
    eng.meter = MemoryMeter(None)
    eng.meter.reset()
    ids = torch.randint(1, DEMO_MODEL.vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    losses = [eng.train_step(ids), eng.train_step(ids)]
    params = {(r.tensor, r.offsets): t.detach().clone() for r, t in store.items() if r.kind == "param"}
    return losses, eng.meter.peak_transient, params


@pytest.mark.dist
def test_recompute_gives_the_same_step_with_less_activation_memory():
    plain = launch(_train, 2, False, timeout_s=120)
    rc = launch(_train, 2, True, timeout_s=120)
    for a, b in zip(plain, rc):
        assert a[0] == pytest.approx(b[0], rel=1e-6)
        assert a[2].keys() == b[2].keys()
        for k in a[2]:
            torch.testing.assert_close(a[2][k], b[2][k], rtol=1e-5, atol=1e-6)
        assert 0 < b[1] < 0.6 * a[1], (a[1], b[1])  # block inputs + one block rerun, not every block
