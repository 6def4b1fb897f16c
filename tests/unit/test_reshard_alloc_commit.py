"""The transition's allocation plan kept on the recipe (``arena.layout_of`` / ``carve``) and the
commit handing its dict to the store (``ShardStore.replace``): same tensors, same lookups."""
from __future__ import annotations

from itertools import pairwise

import torch

from nereus.executor.arena import carve, empty_tensors, layout_of
from nereus.executor.store import TORCH_DTYPES, ShardStore
from nereus.planner.transition.types import Region

REGIONS = [Region("actor", "w", "param", (0, 0), (6, 5), "fp32"),
           Region("actor", "w", "exp_avg", (0, 0), (6, 5), "fp32"),
           Region("actor", "b", "param", (3,), (7,), "bf16"),
           Region("actor", "o", "param", (0, 2), (4, 3), "bf16")]
MAJOR = {("actor", "o"): 1}


def test_carve_of_a_kept_layout_matches_empty_tensors():
    made = carve(layout_of(REGIONS, TORCH_DTYPES, MAJOR), len(REGIONS), torch.device("cpu"))
    want = empty_tensors(REGIONS, TORCH_DTYPES, torch.device("cpu"), MAJOR)
    for r, a, b in zip(REGIONS, made, want):
        assert a.shape == b.shape == torch.Size(r.lengths)
        assert a.dtype == b.dtype == TORCH_DTYPES[r.dtype]
        assert a.stride() == b.stride()
        assert a.data_ptr() % 64 == 0
    assert made[3].stride() == (1, 4)  # dim 1 outermost in memory
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in made)
    assert all(end <= nxt for (_, end), (nxt, _) in pairwise(spans))  # no two regions overlap


def test_replace_takes_the_dict_and_rebuilds_the_index_on_use():
    store = ShardStore("cpu")
    store.put(REGIONS[0], torch.zeros(6, 5))
    new = {r: torch.full(r.lengths, float(i), dtype=TORCH_DTYPES[r.dtype]) for i, r in enumerate(REGIONS)}
    store.replace(new)
    assert store.held(REGIONS[2]) is new[REGIONS[2]]
    inner = Region("actor", "b", "param", (5,), (2,), "bf16")
    outer, t = store.covering(inner)
    assert outer == REGIONS[2] and t is new[REGIONS[2]]
    assert store.find("actor", "o", "param")[0] == REGIONS[3]
    extra = Region("actor", "c", "param", (0,), (2,), "fp32")
    store.put(extra, torch.ones(2))
    assert store.find("actor", "c", "param")[0] == extra and len(store) == 5
    store.replace([(REGIONS[0], new[REGIONS[0]])])  # pairs still work
    assert store.find("actor", "b", "param") is None and len(store) == 1
