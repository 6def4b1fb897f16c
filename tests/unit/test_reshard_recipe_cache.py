"""The recipe cache (``nereus.executor.reshard.recipe``): a plan applied again reuses the
bookkeeping derived the first time, and never a recipe made for another plan, another rank, or
tensors laid out with other strides. Each case would commit wrong bytes, or derive everything
again, if the cache were wrong (threads over the mock transport, as in test_executor_merge.py)."""
from dataclasses import replace

import pytest

import nereus.executor.reshard.pieces as pieces_mod
from nereus.executor.reshard import recipe as recipe_mod
from nereus.executor.scenario import init_store, local_cluster, make_plan, mismatches, restrict, tiny_job
from nereus.executor.store import ShardStore
from nereus.models.spec import preset
from nereus.planner.transition.build import plan_transition
from test_executor_verify import _run

JOB = tiny_job(preset("tiny-4l-128h"))
A = make_plan(tp=4)
TO_TP2 = restrict(plan_transition(JOB, local_cluster(4), A, make_plan(tp=2, dp=2, zero=0), mixed_precision=True,
                                  scheduler="greedy"), "actor")
B = make_plan(tp=2, dp=2, zero=0)
B_TO_A = restrict(plan_transition(JOB, local_cluster(4), B, A, mixed_precision=True, scheduler="greedy"), "actor")
"""Every piece a TP2 shard sends is a part of it (a view at an offset: what the cached views are)."""
TO_DP4 = restrict(plan_transition(JOB, local_cluster(4), A, make_plan(dp=4, zero=0), mixed_precision=True,
                                  scheduler="greedy"), "actor")


@pytest.fixture(autouse=True)
def _empty_cache():
    recipe_mod.clear()
    yield
    recipe_mod.clear()


@pytest.fixture
def derived(monkeypatch):
    """Counts the derivations of a recipe's ops (``pieces._derive``), per rank."""
    calls: list[int] = []
    real = pieces_mod._derive

    def counting(rec, plan, store, new, rank, major):
        calls.append(rank)
        return real(rec, plan, store, new, rank, major)

    monkeypatch.setattr(pieces_mod, "_derive", counting)
    return calls


def _stores(relayout: bool = False, plan=A) -> list[ShardStore]:
    """``plan``'s stores; ``relayout``: the same values, every 2-d tensor held with its strides
    swapped (a column-major copy of a row-major one and the other way round)."""
    stores = [ShardStore() for _ in range(4)]
    for r, st in enumerate(stores):
        init_store(st, JOB, plan, r, 0, roles=("actor",), precision="bf16-mixed")
        if relayout:
            st.replace([(k, t.t().contiguous().t() if t.dim() == 2 else t) for k, t in st.items()])
    return stores


def _apply(stores, tplan) -> list:
    out = _run(tplan, stores, timeout_s=20)
    assert all(o is not None and not isinstance(o, Exception) for o in out), out
    for st in stores:
        assert mismatches(st, JOB, 0) == []
    return out


def _major(plan):
    return {(m, t): d for m, t, d in plan.major}


def test_the_same_plan_applied_again_reuses_its_recipe_and_derives_nothing(derived):
    _apply(_stores(), TO_TP2)
    assert sorted(derived) == [0, 1, 2, 3]  # one derivation per rank the first time
    first = [recipe_mod.recipe(TO_TP2, r, _major(TO_TP2)) for r in range(4)]
    assert all(rec.ops is not None and rec.cover_checked and any(k[0] == "program" for k in rec.geometry.cache)
               for rec in first)  # the exchanges compiled too (reshard.program)
    _apply(_stores(), TO_TP2)
    assert sorted(derived) == [0, 1, 2, 3]  # none the second time: the cached recipe was used
    assert [recipe_mod.recipe(TO_TP2, r, _major(TO_TP2)) for r in range(4)] == first


def test_another_plan_gets_its_own_recipe_and_each_stays_right_when_they_alternate(derived):
    for tplan in (TO_TP2, TO_DP4, TO_TP2, TO_DP4):  # each committed bit-exact (checked in _apply)
        _apply(_stores(), tplan)
    assert len(derived) == 8  # 4 ranks x 2 plans, each derived once
    assert recipe_mod.recipe(TO_TP2, 0, _major(TO_TP2)) is not recipe_mod.recipe(TO_DP4, 0, _major(TO_DP4))
    assert recipe_mod.recipe(TO_TP2, 0, _major(TO_TP2)) is not recipe_mod.recipe(TO_TP2, 1, _major(TO_TP2))
    twin = replace(TO_TP2)  # equal content, another object: a recipe of its own, derived again
    _apply(_stores(), twin)
    assert len(derived) == 12


def test_a_cached_recipe_whose_plan_is_another_object_is_not_returned():
    """The cache is keyed by ``id(plan)``; an id can be reused once a plan is gone, so a hit must
    hold the very plan asked for (a stale entry planted under this plan's id is replaced)."""
    stale = recipe_mod.Recipe(TO_DP4, 0, _major(TO_DP4))
    recipe_mod._cache[(id(TO_TP2), 0)] = stale
    got = recipe_mod.recipe(TO_TP2, 0, _major(TO_TP2))
    assert got is not stale and got.plan is TO_TP2
    assert recipe_mod.recipe(TO_TP2, 0, {}) is not got  # another storage-dim map: another recipe


def test_tensors_with_other_strides_get_views_computed_for_them(derived):
    """The second application holds the same values with every 2-d tensor's strides swapped: a
    view cached as ``as_strided`` parameters for the first layout would read the wrong elements
    (and hash them at the source, so nothing downstream would notice): the transition must still
    commit the reference's bits (``_apply`` compares every region with it)."""
    _apply(_stores(plan=B), B_TO_A)
    before = recipe_mod.recipe(B_TO_A, 1, _major(B_TO_A)).geometry
    assert any(g is not None for g in before.src)  # sub-slices of held regions: views at offsets
    _apply(_stores(relayout=True, plan=B), B_TO_A)
    after = recipe_mod.recipe(B_TO_A, 1, _major(B_TO_A)).geometry
    assert after is not before and after.strides != before.strides
    assert len(derived) == 4  # the plan-derived ops are still reused


def test_at_most_cache_size_recipes_are_kept_per_rank_least_recently_used_dropped():
    plans = [replace(TO_TP2) for _ in range(recipe_mod.CACHE_SIZE + 1)]
    other_rank = recipe_mod.recipe(plans[0], 1, {})
    got = [recipe_mod.recipe(p, 0, {}) for p in plans]
    assert len(recipe_mod._cache) == recipe_mod.CACHE_SIZE + 1  # rank 0's CACHE_SIZE and rank 1's one
    assert recipe_mod.recipe(plans[-1], 0, {}) is got[-1]  # kept
    assert recipe_mod.recipe(plans[1], 0, {}) is got[1]
    assert recipe_mod.recipe(plans[0], 1, {}) is other_rank  # another rank's recipes are not pushed out
    assert recipe_mod.recipe(plans[0], 0, {}) is not got[0]  # the oldest of rank 0 was dropped
