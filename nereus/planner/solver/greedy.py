"""Greedy baseline (and CP-SAT hint): a few pool templates, each filled by local search; and
``tighten``, bound pruning iterated to its fixpoint.

Per template: start every unit at its most memory-frugal option of the slot's size, then apply the
best single-unit option change that keeps memory feasible and lowers the step time, until none
does (each unit's options are scored at once, with numpy, against the others' current choices).
Fast and usually good; it proves nothing (its gap is reported against no bound).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np

from nereus.planner.cost.floors import generation_floor, pass_floor
from nereus.planner.solver.assignment import Assignment, objective
from nereus.planner.solver.candidates import (
    ACTOR,
    GEN,
    TableBuilder,
    Tables,
    _shapes,
    expert_layouts,
    layouts,
)
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.solver.structure import Skeleton, greedy_templates

BOUND_SLACK = 1e-9
"""Relative slack of the bound test: ties are kept."""


def _step(t: Tables, ms, sync):
    """``schedules.step_time`` on numpy columns (the same float operations in the same order)."""
    if not t.schedule.is_async:
        total = 0
        for x in ms:
            total = total + x
        return total + sync
    trainer = 0
    for x in ms[1:]:
        trainer = trainer + x
    return np.maximum(ms[0], trainer) + sync / (t.schedule.sync_every if t.schedule.kind == "fully_async" else 1)


def _prune_pass(t: Tables, upper: float, rest: int | None = None) -> Tables:
    """One pass of the bound pruning, per unit with numpy: drop options whose own phase durations, the
    fastest other units of each phase (and their least GPU-seconds over N) and the cheapest weight
    sync already exceed ``upper`` (``tests/unit/test_solver_tighten.py`` holds a plain-loop reference).
    ``rest``: an async sub-problem's trainer GPUs (N - r, ``split.py``): every unit but the rollout
    runs on them, so the GPU-seconds of a trainer phase spread over ``rest`` GPUs, not N."""
    g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
    n, N, P = len(t.units), t.num_gpus, t.n_phases
    dur = [np.array([o.durations for o in opts], dtype=float).reshape(len(opts), P) for opts in t.options]
    size = [np.array([o.size for o in opts], dtype=float) for opts in t.options]
    fastest = [[float(d[:, ph].min()) if len(d) else 0.0 for d in dur] for ph in range(P)]
    area = [[float((d[:, ph] * s).min()) if len(d) else 0.0 for d, s in zip(dur, size)] for ph in range(P)]
    min_sync = min((min(o.sync) for o in t.options[g]), default=0.0)
    sync_for_size = {s: min((t.sync_s(o, s, col) for o in t.options[g] for col in (False, True)), default=0.0)
                     for s in t.sizes}
    limit = upper * (1 + BOUND_SLACK)
    out = []
    for u, opts in enumerate(t.options):
        if not opts:
            out.append(opts)
            continue
        others = [v for v in range(n) if v != u]
        lbs = []
        for ph in range(P):
            spread = sum(area[ph][v] for v in others)
            gpus = N if rest is None or ph == 0 else rest
            col = np.maximum(dur[u][:, ph], (dur[u][:, ph] * size[u] + spread) / gpus)
            lbs.append(np.maximum(col, max(fastest[ph][v] for v in others)) if others else col)
        if u == g:
            sync = np.array([min(o.sync) for o in opts])
        elif u == tr:
            sync = np.array([sync_for_size[o.size] for o in opts])
        else:
            sync = min_sync
        keep = _step(t, lbs, sync) <= limit
        out.append(opts if keep.all() else tuple(o for o, k in zip(opts, keep) if k))
    return replace(t, options=tuple(out))


def tighten(t: Tables, upper: float, rest: int | None = None) -> Tables:
    """``_prune_pass`` repeated until nothing more goes: each pass's fastest options and least
    GPU-seconds are taken over the options still left, which any plan that can tie or beat
    ``upper`` only uses, so every pass is exact and the fixpoint keeps every such plan.
    ``rest``: see ``_prune_pass`` (only for the tables of one rollout size, ``split.tables_for``)."""
    if not math.isfinite(upper):
        return t
    while True:
        before = sum(len(o) for o in t.options)
        t = _prune_pass(t, upper, rest)
        after = sum(len(o) for o in t.options)
        if after == before or any(not o for o in t.options):
            return t


def group_floor(b: TableBuilder, u: int, size: int) -> tuple[float, ...]:
    """Per phase, at most the duration of every option of unit ``u`` on ``size`` GPUs (inf: it has
    none), without pricing them: the least floor (``cost.floors``) over the group's configs, a
    training or inference unit's shapes (``candidates._shapes``; ZeRO and recomputation only add to
    it) or generation's layouts (any KV level up to the largest). A priced group's: its fastest."""
    if (u, size) in b.priced and ((u, size) not in b.partial or b.context in b.partial[u, size]):
        return b.fastest(u, size)  # (a partial group priced for other contexts keeps its floor)
    if (u, size) not in b.floors:
        p, unit = b.problem, b.units[u]
        model, low = p.job.model(unit.stages[0].split("/")[0]), [math.inf] * b.n_phases
        fns = _floor_fns(b, u)
        if unit.name == GEN:
            fn = fns[0][0]
            cfgs = [b.est.config(tp, pp, size // (tp * pp), 1, 1, False, 1, 1, ep, 1) for tp, pp in layouts(p, unit, size)
                    for ep, _ in expert_layouts(model, tp, size // (tp * pp), "generation")]
            low = [0.0] * b.n_phases
            low[unit.phases[0]] = min((fn(c) for c in cfgs), default=math.inf)
        else:
            config, shaped = b.est.config, False
            alone = len({ph for _, ph in fns}) == len(fns)  # (each stage in a phase of its own: no sums)
            for tp, pp, dp, mb, sp, cp, ep, etp in _shapes(p, unit, size):
                cfg, shaped = config(tp, pp, dp, mb, 1, False, sp, cp, ep, etp), True
                if alone:
                    for fn, ph in fns:
                        low[ph] = min(low[ph], fn(cfg))
                    continue
                durs = [0.0] * b.n_phases
                for fn, ph in fns:
                    durs[ph] += fn(cfg)
                low = [min(x, y) if ph in unit.phases else x for ph, (x, y) in enumerate(zip(low, durs))]
            for ph in range(b.n_phases):
                if ph not in unit.phases:
                    low[ph] = 0.0 if shaped else math.inf
        b.floors[u, size] = tuple(low)
    return b.floors[u, size]


def _floor_fns(b: TableBuilder, u: int, comm: bool = False) -> list[tuple]:
    """(floor function, phase) of each of unit ``u``'s stages (``cost.floors``; ``comm``: the tighter
    per-config ones), made once per builder."""
    fns = b.floor_fns.get((u, comm))
    if fns is None:
        p, unit = b.problem, b.units[u]
        model = p.job.model(unit.stages[0].split("/")[0])
        if unit.name == GEN:
            fns = [(generation_floor(p.job, p.cluster, model, p.workload, p.params, max(p.candidates.kv_fractions)),
                    unit.phases[0])]
        else:
            fns = [(pass_floor(p.job, p.cluster, ms, model, p.workload, p.params, comm=comm), ph)
                   for ms, ph in zip(unit.stages, unit.phases)]
        b.floor_fns[u, comm] = fns
    return fns


def skeleton_bound(t: Tables | TableBuilder, sk: Skeleton, floors: bool = False) -> float:
    """A lower bound on the step time of any fill of ``sk``: every unit at its fastest option of its
    slot's size in every phase, every slot's covering units summed, the cheapest weight sync.
    ``floors`` (a ``TableBuilder``): a group not yet priced counts at its floor (``group_floor``) and
    the weight sync at 0 unless generation's group is priced, so the bound stays below the priced one."""
    a = Assignment(slot_size=sk.slot_size, slot_parent=sk.slot_parent, unit_slot=sk.unit_slot, unit_option=())
    fast = []
    for u in range(len(t.units)):
        size = sk.slot_size[sk.unit_slot[u]]
        if floors:
            fast.append(group_floor(t, u, size))
            continue
        ds = [o.durations for o in t.group(u, size)]
        if not ds:
            return math.inf
        fast.append([min(d[ph] for d in ds) for ph in range(t.n_phases)])
    if any(math.inf in f for f in fast):
        return math.inf
    ms = [0.0] * t.n_phases
    for k in set(sk.unit_slot):
        cov = [u for u in range(len(t.units)) if a.covers(u, k)]
        for ph in range(t.n_phases):
            ms[ph] = max(ms[ph], sum(fast[u][ph] for u in cov))
    g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
    if floors and (g, sk.slot_size[sk.unit_slot[g]]) not in t.priced:
        return float(_step(t, ms, 0.0))
    gs = t.group(g, sk.slot_size[sk.unit_slot[g]])
    sync = min(t.sync_s(o, sk.slot_size[sk.unit_slot[tr]], a.overlap(g, tr)) for o in gs)
    return float(_step(t, ms, sync))


def price_groups(b: TableBuilder, upper: float, rollout: int | None = None, give_up=None) -> Tables | None:
    """The tables of ``b`` with every (unit, pool size) group priced that ``tighten(..., upper)`` could
    keep an option of, the others left unpriced. A group is *dead* when ``_prune_pass``'s bound over
    its floors (``group_floor``: at most each of its options' durations; a priced group's fastest),
    against the other units' fastest durations and least GPU-seconds over their groups not dead (at
    most those of every option tightening keeps) and the least weight sync of the priced generation
    options (0 while one of its live groups is not priced), already exceeds ``upper``: none of its
    options can be kept. Groups die until none does, then the live unpriced ones of generation (whose
    floors are the loosest), else of every other unit, are priced, and again. Every option
    ``tighten(build_tables(p), upper)`` keeps sits in a priced group, and tightening is monotone, so
    ``tighten(price_groups(b, upper), upper)`` is that same table (``tests/unit/test_solver_bounds.py``).
    ``rollout`` (an async sub-problem, ``split.tables_for``): only generation's group of ``rollout``
    GPUs and the others' groups of at most N - rollout are candidates, and the trainer phases'
    GPU-seconds spread over N - rollout, as ``tighten(..., rest=N - rollout)`` spreads them; then
    ``tighten(tables_for(price_groups(b, upper, r), r), upper, rest=N - r)`` is
    ``tighten(tables_for(build_tables(p), r), upper, rest=N - r)``. ``give_up(low)``, before each round
    of pricing, with the live groups' floors: True stops there and returns None (``split.py``: the
    floors already bound the whole size above the incumbent); with it, the trainer's groups are priced
    one a round (the order changes only what ``give_up`` sees, not what is priced in the end)."""
    context, outer = (upper, rollout), b.context
    b.context = context  # (group_floor: a group priced partially here keeps its fastest in this context)
    try:
        return _price_groups(b, upper, rollout, give_up, context)
    finally:
        b.context = outer


def _price_groups(b: TableBuilder, upper: float, rollout: int | None, give_up, context) -> Tables | None:
    g, tr = b.unit_index(GEN), b.unit_index(ACTOR)
    n, N, P = len(b.units), b.num_gpus, b.n_phases
    limit, dead = upper * (1 + BOUND_SLACK), set()
    gpus = [N if rollout is None or ph == 0 else N - rollout for ph in range(P)]
    if rollout is not None:
        dead = {(u, s) for u in range(n) for s in b.sizes if (s != rollout if u == g else s > N - rollout)}
    while True:
        live = [(u, s) for u in range(n) for s in b.sizes if (u, s) not in dead]
        low = {k: group_floor(b, *k) for k in live}
        fastest = [[min((low[k][ph] for k in live if k[0] == u), default=math.inf) for u in range(n)] for ph in range(P)]
        area = [[min((low[k][ph] * k[1] for k in live if k[0] == u), default=math.inf) for u in range(n)]
                for ph in range(P)]
        gen = [o for k in live if k[0] == g for o in b.priced.get(k, ())]
        all_gen = all(k in b.priced for k in live if k[0] == g)
        min_sync = min((min(o.sync) for o in gen), default=0.0) if all_gen else 0.0

        terms = (area, fastest, gpus, gen, min_sync if all_gen else None)

        def bound(u: int, s: int, terms=terms):
            return _bound(b, u, s, *terms)

        died = False
        for u, s in live:
            f = low[u, s]
            if math.inf in f or bound(u, s)(f) > limit:
                dead.add((u, s))
                died = True
        if died:
            continue
        todo = [k for k in live if k not in b.priced or (k in b.partial and context not in b.partial[k])]
        todo = [k for k in todo if k[0] == g] or todo
        if not todo:
            return b.tables()
        if give_up is not None and give_up(low):
            return None
        if give_up is not None and all_gen and any(k[0] == tr for k in todo):
            # one trainer pool at a time, the cheapest weight sync first: once it is priced (and dies),
            # the sync the others leave may already put the whole size above ``upper``
            todo = [min((k for k in todo if k[0] == tr), key=lambda k: (min(
                (b.sync_s(o, k[1], False) for o in gen), default=0.0), k[1]))]
        for k in todo:
            if k[0] == g:
                b.group(*k)
            else:  # only the configs whose own floors the bound does not already put above ``upper``
                b.group(*k, keep=_keeper(b, k[0], bound(*k), limit), context=context)


def _bound(b: TableBuilder, u: int, s: int, area, fastest, gpus, gen, min_sync):
    """``_step`` of a unit-``u`` option on ``s`` GPUs as a function of its per-phase durations, against
    the other units' least durations (``fastest``) and GPU-seconds (``area``) over their live groups
    and the weight sync (``min_sync``: None while a generation group is not priced yet): the bound of
    ``_prune_pass``, at most the one tightening computes for every option it keeps."""
    n, P, tr = len(b.units), b.n_phases, b.unit_index(ACTOR)
    others = [v for v in range(n) if v != u]
    spread = [sum(area[ph][v] for v in others) for ph in range(P)]
    most = [max(fastest[ph][v] for v in others) if others else 0.0 for ph in range(P)]
    if min_sync is None:
        sync = 0.0
    elif u == tr:
        sync = min((b.sync_s(o, s, col) for o in gen for col in (False, True)), default=0.0)
    else:
        sync = min_sync

    def step(durations) -> float:
        lbs = []
        for ph in range(P):
            col = max(durations[ph], (durations[ph] * s + spread[ph]) / gpus[ph])
            lbs.append(max(col, most[ph]) if others else col)
        return _step(b, lbs, sync)
    return step


def _keeper(b: TableBuilder, u: int, step, limit: float):
    """``keep(cfg)`` for ``TableBuilder.group``: False when ``step`` of the config's own floors
    (``pass_floor(..., comm=True)``, at most each of its stages' priced time, whatever its offload) is
    above ``limit``: every option of it then fails ``_prune_pass`` in every round of ``tighten``. Each
    shape is first tested at ZeRO-1 without recomputation, whose floors are at most those of its other
    configs: a shape that fails there fails everywhere."""
    fns, n_phases, config = _floor_fns(b, u, comm=True), b.n_phases, b.est.config
    shapes: dict[tuple, bool] = {}

    def passes(cfg) -> bool:
        durs = [0.0] * n_phases
        for fn, ph in fns:
            durs[ph] += fn(cfg)
        return step(durs) <= limit

    def keep(cfg) -> bool:
        key = (cfg.tp, cfg.pp, cfg.dp, cfg.micro_batch, cfg.sp, cfg.cp, cfg.ep, cfg.etp)
        ok = shapes.get(key)
        if ok is None:
            ok = shapes[key] = passes(config(*key[:4], 1, False, *key[4:]))
        return ok and (cfg.zero < 3 and not cfg.recompute or passes(cfg))
    return keep


def _fill(t: Tables, sk: Skeleton, max_rounds: int = 50) -> tuple[float, Assignment] | None:
    n = len(t.units)
    choices = []
    for u in range(n):
        size = sk.slot_size[sk.unit_slot[u]]
        opts = list(t.group(u, size))
        if not opts:
            return None
        choices.append(opts)
    frame = Assignment(slot_size=sk.slot_size, slot_parent=sk.slot_parent, unit_slot=sk.unit_slot, unit_option=())
    g, tr = t.unit_index(GEN), t.unit_index(ACTOR)
    if t.schedule.is_async and any(frame.overlap(g, v) for v in range(n) if v != g):
        return None  # an async plan's rollout pool is its own
    slots = sorted(set(sk.unit_slot))
    cov = np.array([[frame.covers(u, k) for u in range(n)] for k in slots], dtype=bool)  # slot x unit
    dur = [np.array([o.durations for o in opts], dtype=float) for opts in choices]
    res = [np.array([o.resident_kib for o in opts], dtype=np.int64) for opts in choices]
    tra = [np.array([o.transient_kib for o in opts], dtype=np.int64) for opts in choices]
    coloc = frame.overlap(g, tr)
    gsync = np.array([t.sync_s(o, choices[tr][0].size, coloc) for o in choices[g]], dtype=float)
    cur = [min(range(len(opts)), key=lambda i, opts=opts: (opts[i].resident_kib + opts[i].transient_kib,
                                                           sum(opts[i].durations))) for opts in choices]

    def make(idx) -> Assignment:
        return replace(frame, unit_option=tuple(choices[u][i] for u, i in enumerate(idx)))

    best_obj, ok, _, _ = objective(t, make(cur))
    if not ok:  # the most frugal options already overflow some GPU
        return None
    cap, P = t.capacity_kib, t.n_phases
    for _ in range(max_rounds):
        d_now = np.array([dur[u][cur[u]] for u in range(n)])  # unit x phase
        load = cov.astype(float) @ d_now  # slot x phase: summed durations of the covering units
        r_now = np.array([res[u][cur[u]] for u in range(n)])
        x_now = np.array([tra[u][cur[u]] for u in range(n)])
        move = None
        for u in range(n):
            inside = cov[:, u]
            rest_ms = load[~inside].max(axis=0) if (~inside).any() else np.zeros(P)
            trial = load[inside][None, :, :] - d_now[u][None, None, :] + dur[u][:, None, :]  # opt x slot x phase
            ms = np.maximum(trial.max(axis=1), rest_ms[None, :])
            sync = gsync if u == g else gsync[cur[g]]
            obj = _step(t, [ms[:, ph] for ph in range(P)], sync)
            ok = np.ones(len(choices[u]), dtype=bool)
            for row in np.flatnonzero(inside):  # memory of every slot whose GPUs u's pool covers
                others = cov[row].copy()
                others[u] = False
                r = int(r_now[others].sum()) + res[u]
                x = np.maximum(int(x_now[others].max()) if others.any() else 0, tra[u])
                ok &= r + x <= cap
            obj = np.where(ok, obj, np.inf)
            obj[cur[u]] = np.inf
            i = int(np.argmin(obj))
            if obj[i] < best_obj - 1e-12 and (move is None or obj[i] < move[0]):
                move = (float(obj[i]), u, i)
        if move is None:
            break
        _, u, i = move
        cur[u] = i
        best_obj = objective(t, make(cur))[0]
    return best_obj, make(cur)


def _nested_splits(t: Tables) -> list[Skeleton]:
    """The rollout on the whole cluster, the trainer units split over two halves inside it."""
    n, N, g = len(t.units), t.num_gpus, t.unit_index(GEN)
    if t.schedule.is_async or N // 2 not in t.sizes or N not in t.sizes or n < 3:
        return []
    trainers = [u for u in range(n) if u != g]
    first, *others = trainers
    out = []
    for r in range(len(others)):
        for pick in itertools.combinations(others, r):
            group = {first, *pick}
            out.append(Skeleton(slot_size=(N, N // 2, N // 2), slot_parent=(-1, 0, 0),
                                unit_slot=tuple(0 if u == g else (1 if u in group else 2) for u in range(n))))
    return out[:16]


def _skipped_on_floors(b: TableBuilder, sk: Skeleton, best: float, ties: bool = True) -> bool:
    """``skeleton_bound(b, sk) >= best`` (``> best`` with ``ties`` False), pricing the template's groups
    one at a time (generation's first: its floor is the loosest) and stopping once the bound over the
    others' floors reaches ``best``. With every group priced it is ``skeleton_bound`` itself, so the
    same templates are skipped as when all are priced before the test; a template it skips leaves
    the rest unpriced."""
    def beaten() -> bool:
        low = skeleton_bound(b, sk, floors=True)
        return low >= best if ties else low > best

    if beaten():
        return True
    g = b.unit_index(GEN)
    for u in [g] + [v for v in range(len(b.units)) if v != g]:
        key = (u, sk.slot_size[sk.unit_slot[u]])
        if key in b.priced and key not in b.partial:
            continue
        b.group(*key)
        if beaten():
            return True
    return False


def greedy(problem: PlanProblem, t: Tables | TableBuilder) -> tuple[float, Assignment, Skeleton] | None:
    """Best (objective, assignment, template) over the templates, or None if none fits; of templates
    whose fills tie, the first in ``greedy_templates``'s order.

    Templates are filled in the order of a lower bound on their step time (``skeleton_bound``, over
    floors on a ``TableBuilder``), so the likely best is found first, and a template whose bound
    cannot beat the best so far is skipped (one that could only tie it is skipped only if it comes
    after the best in the list: the result is the same in any order). (Filling on tables pruned by
    the best so far was tried: the fills then start elsewhere and end worse.) On a ``TableBuilder``
    the groups a template needs are priced only when the bound over their floors does not already
    skip it: the same templates are filled, with the same options, as on the full tables.

    Worked example (Llama-3.1-70B PPO on 1,024 H100s, one_step_off; rollout : trainer GPUs): in list
    order the 512 : 512 split is filled first (93.38 s), pricing every trainer group of 512 GPUs,
    then 768 : 256 gives 92.54 s. In bound order 768 : 256 (bound 90.78 s) comes first and fills to
    92.54 s; 512 : 512 (bound 92.47 s) is then ruled out as soon as generation's group of 512 is
    priced (fastest 92.89 s): its four trainer groups are never priced, the rest bound above 92.54 s."""
    best, lazy = None, isinstance(t, TableBuilder)
    templates = greedy_templates(problem, t)
    if len(templates) > 1:  # free placement: also the nested splits
        templates = templates + _nested_splits(t)
    bounds = [skeleton_bound(t, sk, floors=lazy) for sk in templates]
    for i in sorted(range(len(templates)), key=lambda i: (bounds[i], i)):
        sk = templates[i]
        if best is not None:
            ties = i > best[3]  # a later template that only ties the best cannot replace it
            if bounds[i] >= best[0] if ties else bounds[i] > best[0]:
                continue
            if lazy and _skipped_on_floors(t, sk, best[0], ties):
                continue
        r = _fill(t, sk)
        if r is not None and (best is None or r[0] < best[0] or (r[0] == best[0] and i < best[3])):
            best = (r[0], r[1], sk, i)
    return best[:3] if best is not None else None
