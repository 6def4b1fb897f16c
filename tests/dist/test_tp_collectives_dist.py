"""What a tensor-parallel inference pass of the executor sends, counted on 2 gloo processes: per
micro-batch two all-reduces per layer plus the vocab-parallel embedding's and head's, the count the
cost model charges (``model.TP_EDGE_COLLECTIVES``) and the demo's probe divides by."""
import pytest
import torch

from nereus.demo.probe import tp_collectives
from nereus.demo.setup import DEMO_MODEL
from nereus.executor.launch import launch
from nereus.planner.cost.model import TP_EDGE_COLLECTIVES


def _count(rank: int, world: int) -> dict[int, int]:
    import torch.distributed as dist

    from nereus.executor.engine import Engine
    from nereus.executor.store import ShardStore
    from nereus.planner.plan import StagePlacement
    from nereus.planner.specs import ParallelConfig

    place = StagePlacement(name="ref/inference", config=ParallelConfig(tp=world, pp=1, dp=1, micro_batch=1),
                           pool=0, first_gpu=0, gpus=world)
    eng = Engine(rank, world, DEMO_MODEL, place, ShardStore(), role="ref", trainable=False)
    eng.init_state(0)
    calls = [0]
    for name in ("all_reduce", "all_gather", "broadcast", "reduce_scatter"):
        real = getattr(dist, name)

        def counted(*a, _real=real, **k):
            calls[0] += 1
            return _real(*a, **k)

        setattr(dist, name, counted)
    ids = torch.randint(1, DEMO_MODEL.vocab, (3, 7), generator=torch.Generator().manual_seed(0))
    out = {}
    for mb in (1, 3):
        calls[0] = 0
        eng.logprobs(ids, mb)
        out[mb] = calls[0]
    return out


@pytest.mark.dist
def test_a_tp_forward_makes_two_collectives_per_layer_and_two_more_per_micro_batch(tmp_path):
    counts = launch(_count, 2, timeout_s=120)
    per_micro_batch = (counts[0][1] - counts[0][3]) / 2  # 3 micro-batches against 1
    assert per_micro_batch == tp_collectives(DEMO_MODEL.layers) == 2 * DEMO_MODEL.layers + TP_EDGE_COLLECTIVES
    assert counts[0] == counts[1]
