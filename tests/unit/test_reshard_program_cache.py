"""The compiled exchanges (``nereus.executor.reshard.program``): a plan applied again replays the
program compiled the first time, and never one compiled for another plan, another rank, other
exchanges, another bucket size or tensors with other strides. A program reused wrongly posts
another plan's messages, or the right pieces in the wrong exchanges (threads over the mock
transport, as in test_reshard_recipe_cache.py)."""
import threading
from dataclasses import replace

import pytest
from test_executor_apply_paths import _apply as _apply_on_threads
from test_reshard_recipe_cache import (
    JOB,
    TO_DP4,
    TO_TP2,
    _empty_cache,  # noqa: F401  (autouse: every test starts with no recipe)
    _stores,
)

import nereus.executor.reshard.program as program_mod
from nereus.executor.scenario import mismatches
from nereus.executor.transport import BUCKET_BYTES


@pytest.fixture
def compiled(monkeypatch):
    """Per ``program`` call: (rank, groups asked for, bucket size, the program returned, whether
    it was compiled by this call)."""
    calls: list[tuple] = []
    real_compile, real_program = program_mod._compile, program_mod.program
    fresh = threading.local()

    def counting_compile(*args):
        fresh.hit = True
        return real_compile(*args)

    def recording(rec, geo, groups, bucket_bytes, *rest):
        fresh.hit = False
        prog = real_program(rec, geo, groups, bucket_bytes, *rest)
        calls.append((rec.rank, list(groups), bucket_bytes, prog, fresh.hit))
        return prog

    monkeypatch.setattr(program_mod, "_compile", counting_compile)
    monkeypatch.setattr(program_mod, "program", recording)
    import nereus.executor.apply as apply_mod
    import nereus.executor.reshard.pieces as pieces_mod
    monkeypatch.setattr(apply_mod, "program", recording)
    monkeypatch.setattr(pieces_mod, "program", recording)  # reserve_arena's
    return calls


def _apply(stores, tplan, staging_bytes=256 << 20, bucket_bytes=BUCKET_BYTES) -> list:
    out = _apply_on_threads(stores, tplan, transport={"bucket_bytes": bucket_bytes}, timeout_s=20,
                            staging_bytes=staging_bytes)
    assert all(o is not None and not isinstance(o, Exception) for o in out), out
    for st in stores:
        assert mismatches(st, JOB, 0) == []  # every region bit-exact with the reference
    return out


def _matches(calls) -> None:
    """Each program used ran exactly the exchanges asked for."""
    for rank, groups, _, prog, _ in calls:
        assert [(x.lo, x.hi) for x in prog.exchanges] == groups


def test_the_same_plan_applied_again_replays_its_program(compiled):
    _apply(_stores(), TO_TP2)
    assert sorted(c[0] for c in compiled if c[4]) == [0, 1, 2, 3]
    first = {c[0]: c[3] for c in compiled}
    _apply(_stores(), TO_TP2)
    assert len([c for c in compiled if c[4]]) == 4  # nothing compiled the second time
    assert {c[0]: c[3] for c in compiled[4:]} == first
    _matches(compiled)


def test_another_plan_on_the_same_rank_gets_its_own_program(compiled):
    for tplan in (TO_TP2, TO_DP4, TO_TP2, TO_DP4):  # each committed bit-exact (checked in _apply)
        _apply(_stores(), tplan)
    assert len([c for c in compiled if c[4]]) == 8  # 4 ranks x 2 plans, each compiled once
    by_plan = [{c[0]: c[3] for c in compiled[k:k + 4]} for k in (0, 4)]
    assert all(by_plan[0][r] is not by_plan[1][r] for r in range(4))
    _apply(_stores(), replace(TO_TP2))  # equal content, another object: compiled again
    assert len([c for c in compiled if c[4]]) == 12
    _matches(compiled)


def test_other_exchanges_or_bucket_size_of_the_same_plan_get_their_own_program(compiled):
    one = _apply(_stores(), TO_TP2)  # the default budget: every round in one exchange
    by_round = _apply(_stores(), TO_TP2, staging_bytes=0)  # the planner's rounds one by one
    assert one[0].exchanges == 1 and by_round[0].exchanges == TO_TP2.rounds > 1
    small = _apply(_stores(), TO_TP2, bucket_bytes=1 << 10)  # other pieces packed: other messages
    assert len([c for c in compiled if c[4]]) == 12
    assert small[0].bytes_staged != one[0].bytes_staged
    _matches(compiled)
    _apply(_stores(), TO_TP2, staging_bytes=0)
    assert len([c for c in compiled if c[4]]) == 12  # each program found again under its own key


def test_tensors_with_other_strides_get_a_program_of_their_own(compiled):
    _apply(_stores(), TO_TP2)
    _apply(_stores(relayout=True), TO_TP2)  # every 2-d tensor's strides swapped: other views
    assert len([c for c in compiled if c[4]]) == 8
    _matches(compiled)


def test_reserve_arena_compiles_the_first_transitions_exchanges(compiled):
    """``reserve_arena`` at start checks the cover and compiles the exchanges, so the first
    transition replays them like a later one (the benchmark's first-over-warm goal)."""
    from nereus.executor.apply import reserve_arena

    stores = _stores()
    for rank, st in enumerate(stores):
        reserve_arena(st, TO_TP2, rank)
    assert len([c for c in compiled if c[4]]) == 4
    _apply(stores, TO_TP2)
    assert len([c for c in compiled if c[4]]) == 4  # the first transition compiled nothing
    _matches(compiled)
