"""The host arena: regions carved from one buffer, freed buffers reused, never while viewed."""
import torch

from nereus.executor import arena
from nereus.executor.store import TORCH_DTYPES
from nereus.planner.transition.types import Region


def _regions(n=3):
    return [Region("actor", f"t{i}", "param", (0, 0), (64 + i, 33), "fp32") for i in range(n)] + \
        [Region("actor", "h", "param", (0,), (1000,), "bf16")]


def test_regions_are_disjoint_aligned_views_of_one_buffer_per_dtype():
    arena.release_cached()
    out = arena.empty_regions(_regions(), TORCH_DTYPES, torch.device("cpu"))
    for r, t in out.items():
        assert tuple(t.shape) == r.lengths and t.dtype == TORCH_DTYPES[r.dtype] and t.is_contiguous()
        assert t.data_ptr() % arena.ALIGN == 0
    fp32 = [out[r] for r in out if r.dtype == "fp32"]
    assert len({t.untyped_storage().data_ptr() for t in fp32}) == 1
    for i, t in enumerate(fp32):  # writes to one region do not touch another
        t.fill_(float(i))
    for i, t in enumerate(fp32):
        assert bool((t == float(i)).all())


def test_a_freed_buffer_is_reused_and_a_viewed_one_never():
    arena.release_cached()
    a = arena.scratch([1 << 20], torch.float32, torch.device("cpu"))[0]
    ptr = a.data_ptr()
    view = a[10:20]
    del a
    b = arena.scratch([1 << 20], torch.float32, torch.device("cpu"))[0]
    assert b.data_ptr() != ptr  # the first buffer is still viewed: not handed out again
    view.fill_(7.0)
    b.fill_(1.0)
    assert bool((view == 7.0).all())
    del view
    assert arena.cached_bytes() >= 4 << 20
    c = arena.scratch([1 << 20], torch.float32, torch.device("cpu"))[0]
    assert c.data_ptr() == ptr  # now free: reused
    del b, c
    assert arena.release_cached() > 0 and arena.cached_bytes() == 0


def test_cache_limit_unmaps_free_buffers_beyond_it():
    arena.release_cached()
    old = arena.cache_limit()
    try:
        arena.set_cache_limit(0)
        a = arena.scratch([1 << 20], torch.float32, torch.device("cpu"))[0]
        del a
        b = arena.scratch([3 << 19], torch.float32, torch.device("cpu"))[0]  # 6 MiB: does not fit in 4 MiB
        assert arena.cached_bytes() == 0  # taking it unmapped the free 4 MiB buffer
        del b
    finally:
        arena.set_cache_limit(old)
        arena.release_cached()


def test_mostly_dead_flags_a_small_survivor_of_a_big_buffer():
    arena.release_cached()
    regions = [Region("actor", f"t{i}", "param", (0, 0), (1024, 1024), "fp32") for i in range(4)]  # 4 x 4 MiB
    out = arena.empty_regions(regions, TORCH_DTYPES, torch.device("cpu"))
    survivor = out[regions[0]]
    assert arena.mostly_dead([survivor]) == [True]  # 4 MiB kept of a 16 MiB buffer: 12 MiB would be wasted
    assert arena.mostly_dead([survivor], min_waste=64 << 20) == [False]
    assert arena.mostly_dead([out[r] for r in regions]) == [False] * 4  # all kept: nothing wasted
    assert arena.mostly_dead([torch.zeros(10)]) == [False]  # not from an arena
    del out, survivor
    arena.release_cached()
