"""The floors that let the option tables leave configs unpriced: the memory floor
(``cost.floors.memory_floor``) is at most the bytes the cost model prices for every config (so a
config it puts above a GPU is one the tables would have dropped after pricing it), and the tighter
per-config time floor (``pass_floor(..., comm=True)``, with which ``greedy.price_groups`` prices only
the configs whose floors can survive tightening) is at most each stage's priced time on every row.
Checked on every config of every group of the pin problems (padded batches, a MoE model, every
optional axis on) and of random jobs, as ``test_solver_bounds.py`` checks the loose floors; that the
tightened tables stay the same is ``test_solver_bounds.py``'s and ``test_solver_split.py``'s."""
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from table_pin import FULLY_ASYNC, _problem
from test_solver_bounds import FLOOR_CASES, _random_problem, _variant

from nereus.planner.cost.floors import memory_floor, pass_floor
from nereus.planner.solver import candidates
from nereus.planner.solver.candidates import (
    GEN,
    TableBuilder,
    _option_rows,
    _peak,
    _shapes,
)
from nereus.planner.solver.greedy import greedy, price_groups, tighten

MEMORY_CASES = (*FLOOR_CASES, "ppo-70b@64:fully_async", "ppo-70b@256")


def memory_violations(p) -> tuple[int, list[tuple]]:
    """(configs checked, violations) over every config the tables enumerate for problem ``p``: the
    memory floor of its first stage above the priced bytes (resident, less the optimizer when
    offloaded, + transient), for each offload setting."""
    candidates._build_tables_cached.cache_clear()
    b = TableBuilder(p)
    cs, n, bad = p.candidates, 0, []
    for unit in b.units:
        if unit.name == GEN:
            continue
        trainable, ms = len(unit.stages) == 2, unit.stages[0]
        floor = memory_floor(p.job, ms, p.job.model(ms.split("/")[0]), p.workload, p.params)
        for s in b.sizes:
            for tp, pp, dp, mb, sp, cp, ep, etp in _shapes(p, unit, s):
                for zero in (cs.zeros if trainable else cs.frozen_zeros):
                    if zero >= 3 and ep * etp > 1:
                        continue
                    for rc in (cs.recompute if trainable else (False,)):
                        cfg = b.est.config(tp, pp, dp, mb, zero, rc, sp, cp, ep, etp)
                        e = b.est(ms, cfg)
                        for off in (cs.offload if trainable else (False,)):
                            n += 1
                            priced = _peak(e, off)
                            if not floor(cfg, off) <= priced:
                                bad.append((ms, cfg, off, floor(cfg, off), priced))
    return n, bad


def tight_violations(p) -> tuple[int, list[tuple]]:
    """(rows, violations): per row of every group (before dominance), each stage's tighter floor
    above its priced time."""
    candidates._build_tables_cached.cache_clear()
    b = TableBuilder(p)
    rows, bad = 0, []
    for unit in b.units:
        if unit.name == GEN:
            continue
        model = p.job.model(unit.stages[0].split("/")[0])
        fns = [pass_floor(p.job, p.cluster, ms, model, p.workload, p.params, comm=True) for ms in unit.stages]
        for s in b.sizes:
            for _, row in _option_rows(p, unit, s, b.n_phases, b.sync_keys, b.est):
                rows += 1
                cfg = row["config"]
                bad += [(unit.name, s, cfg, fn(cfg), t) for fn, t in zip(fns, row["stage_times"]) if not fn(cfg) <= t]
    return rows, bad


@pytest.mark.parametrize("name", MEMORY_CASES)
def test_the_memory_floor_is_at_most_the_priced_memory(name):
    n, bad = memory_violations(_variant(name))
    assert n > 0 and not bad, (name, bad[:3])


@pytest.mark.parametrize("name", FLOOR_CASES)
def test_the_tighter_time_floors_are_at_most_the_priced_time(name):
    rows, bad = tight_violations(_variant(name))
    assert rows > 0 and not bad, (name, bad[:3])


@pytest.mark.parametrize("seed", range(8))
def test_the_memory_floors_hold_on_random_jobs(seed):
    p = _random_problem(random.Random(2000 + seed))
    if p is None:
        pytest.skip("the draw is not a valid job")
    n, bad = memory_violations(p)
    assert n > 0 and not bad, (seed, bad[:3])
    rows, bad = tight_violations(p)
    assert rows > 0 and not bad, (seed, bad[:3])


def test_the_floors_are_tight_enough_to_matter():
    """Not a correctness property, a usefulness one. 70B PPO on 1,024 GPUs: the memory floor rules out
    most of the actor's 256-GPU training configs that do not fit before they are priced; and fully
    async, the per-config floors leave every config of that group unpriced for the rollout on 256 GPUs
    (its fastest option cannot reach greedy's 35.25 s; the loose group floor, 30.0 s, could; greedy's
    plan was 32.89 s before the cross-pool sync was priced per tensor)."""
    p = _variant("ppo-70b@1024")
    candidates._build_tables_cached.cache_clear()
    b = TableBuilder(p)
    u = b.unit_index("actor/training")
    n, skipped, cap = 0, 0, p.cluster.gpu.usable_bytes
    floor = b.est.memory_floors["actor/training"]
    for tp, pp, dp, mb, sp, cp, ep, etp in _shapes(p, b.units[u], 256):
        for zero in (1, 3):
            for rc in (False, True):
                cfg = b.est.config(tp, pp, dp, mb, zero, rc, sp, cp, ep, etp)
                e = b.est("actor/training", cfg)
                if e.resident_bytes + e.transient_bytes > cap:
                    n += 1
                    skipped += floor(cfg, False) > cap
    assert n > 0 and skipped >= 0.9 * n, (skipped, n)

    p = _problem("ppo-70b.yaml", 1024, schedule=FULLY_ASYNC)
    candidates._build_tables_cached.cache_clear()
    b = TableBuilder(p)
    h = greedy(p, b)
    assert 35.2 < h[0] < 35.3  # greedy's plan (also the optimum, 35.25 s)
    price_groups(b, h[0], rollout=256)
    assert b.priced[u, 256] == () and (u, 256) in b.partial
    assert b.group(u, 256) and (u, 256) not in b.partial  # asked in full, it is priced in full


@pytest.mark.parametrize("name", ("ppo-8b@64:one_step_off", "ppo-8b@64:fully_async", "ppo-70b@64:fully_async"))
def test_groups_priced_for_one_rollout_size_leave_the_others_exact(name):
    """A group ``price_groups`` priced for one rollout size holds only what that size can keep; priced
    for every size in turn, on one builder (either order), each size's tightened tables are still the
    full tables' (``split.solve_split_lazy`` asks the sizes one after another)."""
    from nereus.planner.solver.split import tables_for

    p = _variant(name)
    candidates._build_tables_cached.cache_clear()
    full = candidates.build_tables(p)
    h = greedy(p, full)[0]
    g, N = full.unit_index(GEN), full.num_gpus
    sizes = sorted({o.size for o in full.options[g] if o.size < N})
    for order in (sizes, sizes[::-1]):
        b = TableBuilder(p)
        greedy(p, b)
        for r in order:
            price_groups(b, h, rollout=r)
            got = tighten(tables_for(b.tables(), r), h, rest=N - r).options
            want = tighten(tables_for(full, r), h, rest=N - r).options
            if any(not o for o in want):  # nothing at this size can reach h (tightening stops there)
                assert any(not o for o in got), (order, r)
            else:
                assert got == want, (order, r)


@pytest.mark.parametrize("seed", range(4))
def test_the_floors_micro_batches_equal_the_cost_models(seed):
    """``floors.micro_batches`` repeats ``passes._micro_batches``'s arithmetic with the per-config
    part split off: the same (count, tokens, longest) on every shape of random jobs, padded or not."""
    from dataclasses import replace

    from nereus.planner.cost.floors import micro_batches
    from nereus.planner.cost.passes import _micro_batches

    p = _random_problem(random.Random(3000 + seed))
    if p is None:
        pytest.skip("the draw is not a valid job")
    checked = 0
    for padded in (False, True):
        for per_step in (1, p.job.batch.mini_batches):
            fn = micro_batches(p.workload, per_step, padded)
            for dp in (1, 2, 8):
                for tb in (0, 4096):
                    for mb in (1, 3):
                        cfg = replace(candidates.ParallelConfig(tp=1, pp=1, dp=dp, micro_batch=mb), token_budget=tb)
                        assert fn(cfg) == _micro_batches(p.workload, cfg, per_step, padded, 0), (padded, cfg)
                        checked += 1
    assert checked == 48
