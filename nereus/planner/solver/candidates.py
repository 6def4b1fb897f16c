"""Decision units, pool sizes and option tables: everything every backend optimises over.

A *unit* is one decision: trainable models run training and inference in one layout
(``actor/training`` also covers ``actor/inference``); generation, ref and reward inference are
units of their own. An *option* is one (pool size, parallel config, KV level) of a unit with its
per-phase durations, resident and transient bytes per GPU, all from ``nereus.planner.cost.model``.
Options are pruned by memory (alone on an empty GPU) and then by dominance, so the solvers see
only configurations that could be optimal.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from nereus.errors import SpecError
from nereus.models.inventory import check_tp
from nereus.planner.cost.floors import memory_floor
from nereus.planner.cost.model import engine_memory_util, estimate, offloaded, offloaded_memory, weight_sync_s
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.specs import TRAINABLE, ParallelConfig

KIB = 1024
GEN = "actor/generation"
ACTOR = "actor/training"


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    name: str
    """Home model-stage of the unit, e.g. ``actor/training``."""
    stages: tuple[str, ...]
    """Model-stages that run in this unit's layout."""
    phases: tuple[int, ...]
    """Phase index of each of ``stages``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    unit: int
    size: int
    config: ParallelConfig
    durations: tuple[float, ...]
    """Seconds per phase (0 where the unit does not run)."""
    stage_times: tuple[float, ...]
    """Seconds of each of the unit's model-stages."""
    resident_kib: int
    """Rounded up so every backend sees the same integers and stays conservative."""
    transient_kib: int
    kv_budget_bytes: float | None = None
    offload: bool = False
    """Optimizer state kept in host memory (trainable units only)."""
    sync: tuple[float, ...] = ()
    """Generation only: weight sync seconds for (train pool size, colocated) pairs, see Tables."""

    @property
    def label(self) -> str:
        c = self.config
        extra = f" mb{c.micro_batch}" + (f" z{c.zero}" if c.zero != 1 else "") + (" rc" if c.recompute else "") + \
            (f" sp{c.sp}" if c.sp > 1 else "") + (f" cp{c.cp}" if c.cp > 1 else "") + \
            (" off" if self.offload else "")
        kv = "" if self.kv_budget_bytes is None else f" kv{self.kv_budget_bytes / 1024**3:.1f}G"
        return f"{c.label()}{extra}{kv}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Tables:
    units: tuple[Unit, ...]
    sizes: tuple[int, ...]
    """Allowed pool sizes, ascending."""
    options: tuple[tuple[Option, ...], ...]
    """Per unit, every surviving option over all sizes."""
    capacity_kib: int
    num_gpus: int
    n_phases: int
    sync_keys: tuple[tuple[int, bool], ...]
    """(train pool size, colocated) pairs indexing Option.sync."""
    schedule: ScheduleSpec = ScheduleSpec()
    """The job's schedule (decided, never ``auto``): how phase makespans compose into a step."""

    def unit_index(self, name: str) -> int:
        for i, u in enumerate(self.units):
            if u.name == name:
                return i
        raise SpecError(f"no decision unit {name!r}; units: {[u.name for u in self.units]}")

    def sync_s(self, gen: Option, train_size: int, colocated: bool) -> float:
        return gen.sync[self.sync_keys.index((train_size, colocated))]

    def group(self, u: int, size: int) -> tuple[Option, ...]:
        """Unit ``u``'s options on ``size`` GPUs."""
        return tuple(o for o in self.options[u] if o.size == size)


def make_units(problem: PlanProblem) -> tuple[Unit, ...]:
    phases = problem.job.phases()
    where = {ms: i for i, ph in enumerate(phases) for ms in ph}
    units = [Unit(name=GEN, stages=(GEN,), phases=(where[GEN],))]
    for role in problem.job.roles:
        if role in TRAINABLE:
            stages = (f"{role}/training", f"{role}/inference")
        else:
            stages = (f"{role}/inference",)
        units.append(Unit(name=stages[0], stages=stages, phases=tuple(where[s] for s in stages)))
    return tuple(units)


def pool_sizes(cluster) -> tuple[int, ...]:
    """Buddy sizes: node multiples 2^k (sub-node powers of two on a single node), plus the whole cluster."""
    n, base = cluster.num_gpus, (1 if cluster.nodes == 1 else cluster.gpus_per_node)
    sizes, s = set(), base
    while s <= n:
        sizes.add(s)
        s *= 2
    sizes.add(n)
    return tuple(sorted(sizes))


def split_sizes(cluster) -> tuple[int, ...]:
    """Complements of the node-multiple buddy sizes (N - s for s dividing N): with them an async
    plan's rollout and trainer pools split the cluster at more than the halves (6 : 2 nodes, not only
    4 : 4 or 2 : 6 with two nodes idle); the larger pool sits at GPU 0, the other after it, aligned."""
    n, node = cluster.num_gpus, cluster.gpus_per_node
    return tuple(sorted({n - s for s in pool_sizes(cluster) if node <= s < n and n % s == 0 and (n - s) % node == 0}))


def _tp_ok(problem: PlanProblem, model, tp: int, size: int) -> bool:
    c = problem.cluster
    try:
        check_tp(model, tp)
    except SpecError:
        return False
    return tp <= c.gpus_per_node and size % tp == 0 and (c.nodes == 1 or c.gpus_per_node % tp == 0)


def _pinned(problem: PlanProblem, unit: Unit) -> tuple[int, int] | None:
    for ms, tp, pp in problem.constraints.fixed_tp_pp:
        if ms in unit.stages:
            return int(tp), int(pp)
    return None


def layouts(problem: PlanProblem, unit: Unit, size: int) -> list[tuple[int, int]]:
    """(tp, pp) pairs of ``unit`` that tile a pool of ``size`` GPUs."""
    model = problem.job.model(unit.name.split("/")[0])
    cs = problem.candidates
    pps = [p for p in range(1, min(cs.max_pp, model.layers) + 1) if model.layers % p == 0]
    out = [(tp, pp) for tp in cs.tps for pp in pps
           if size % (tp * pp) == 0 and _tp_ok(problem, model, tp, size)]
    pin = _pinned(problem, unit)
    return [x for x in out if pin is None or x == pin]


MAX_EP = 64
"""Largest expert-parallel degree the option tables try (DeepSeek-V3 trains at EP 64, Fedus et al.'s
and Megatron's published runs stay at or below it); more only adds all-to-all across nodes."""


def expert_layouts(model, tp: int, dp: int, stage: str) -> list[tuple[int, int]]:
    """(ep, etp) pairs of a model-stage: (1, 1) for a dense model. Generation (vLLM): ep in {1, tp},
    etp 1. Training and inference (Megatron): ep a power of two dividing the experts, at most
    ``MAX_EP``; etp 1 or tp; ep * etp dividing tp * dp (Megatron's expert layout over a stage's
    tp x dp ranks)."""
    if not model.is_moe:
        return [(1, 1)]
    if stage == "generation":
        return [(1, 1)] + ([(tp, 1)] if tp > 1 and model.experts % tp == 0 else [])
    eps, e = [], 1
    while e <= min(model.experts, MAX_EP):
        if model.experts % e == 0:
            eps.append(e)
        e *= 2
    etps = sorted({1, tp})
    return [(ep, etp) for etp in etps for ep in eps
            if (tp * dp) % (ep * etp) == 0 and model.expert_ffn % etp == 0]


UNIT_FACTORS = (("generation", 1.0), ("inference", 1.0), ("training", 1.0))
ESTIMATE_CACHE_MAX = 150_000
SYNC = ScheduleSpec()
_estimates: dict[tuple, object] = {}
_prefixes: dict[tuple, int] = {}
_prefix_ids = itertools.count()


class _Estimator:
    """``estimate`` for one problem, memoised across problems that differ only in their stage
    factors (the online controller's calibration), constraints or current plan: a stage factor
    multiplies every time term of its stage (``cost.model._finish``) and nothing else, so the
    unscaled estimate is cached and scaled here. Same numbers as ``estimate`` up to float rounding.
    Only generation reads the job's schedule (a dedicated rollout pool, streaming), so inference and
    training are priced on the job with a sync schedule and shared by every schedule (``auto``
    solves each of them; ``test_solver_split`` checks the two agree)."""

    def __init__(self, problem: PlanProblem) -> None:
        p = problem.params
        self.j, self.c, self.w, self.p = problem.job, problem.cluster, problem.workload, p
        self.j_sync = problem.job if problem.job.schedule == SYNC else replace(problem.job, schedule=SYNC)
        self.unit = replace(p, stage_factor=UNIT_FACTORS)
        self.prefix, self.prefix_sync = self._prefix(self.j), self._prefix(self.j_sync)
        self.memo: dict = {}  # estimate's shared terms, for this problem's (job, cluster, workload, unit params)
        self.factors = {ms: p.factor(ms.partition("/")[2]) for ms in problem.job.model_stages()}
        self.configs: dict[tuple, ParallelConfig] = {}
        self.memory_floors = {ms: memory_floor(self.j, ms, self.j.model(ms.split("/")[0]), self.w, p)
                              for ms in problem.job.model_stages()}  # (bytes each config needs at least)

    def config(self, *key: int | bool) -> ParallelConfig:
        """ParallelConfig(tp, pp, dp, micro_batch, zero, recompute, sp, cp, ep, etp), one object per
        config for the whole build (units of equal models enumerate the same ones)."""
        c = self.configs.get(key)
        if c is None:
            tp, pp, dp, mb, zero, rc, sp, cp, ep, etp = key
            c = self.configs[key] = ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, recompute=rc,
                                                   sp=sp, cp=cp, ep=ep, etp=etp)
        return c

    def _prefix(self, job) -> int:
        key = (job, self.c, self.w, self.unit)
        if key not in _prefixes:
            if len(_prefixes) > 4096:
                _prefixes.clear()
                _estimates.clear()
            _prefixes[key] = next(_prefix_ids)  # never reused, even after a clear
        return _prefixes[key]

    def __call__(self, model_stage: str, cfg: ParallelConfig, kv_budget_bytes: float | None = None):
        gen = model_stage.endswith("/generation")
        key = (self.prefix if gen else self.prefix_sync, model_stage, cfg, kv_budget_bytes)
        e = _estimates.get(key)
        if e is None:
            if len(_estimates) > ESTIMATE_CACHE_MAX:
                _estimates.clear()
            e = _estimates[key] = estimate(self.j if gen else self.j_sync, self.c, model_stage, cfg, self.w, self.unit,
                                           kv_budget_bytes=kv_budget_bytes, memo=self.memo)
        f = self.factors.get(model_stage)
        if f is None:
            f = self.p.factor(model_stage.partition("/")[2])
        if f == 1.0:
            return e
        return replace(e, time_s=sum(v * f for v in e.time_breakdown.values()),
                       time_breakdown={k: v * f for k, v in e.time_breakdown.items()})


def _kib(x: float) -> int:
    return int(math.ceil(x / KIB))


def _option_rows(problem: PlanProblem, unit: Unit, size: int, n_phases: int, sync_keys: tuple,
                 est: _Estimator | None = None, keep=None) -> list[tuple[tuple, dict]]:
    """Every memory-feasible option of ``unit`` on a pool of ``size`` GPUs (before dominance) as
    (dominance axes, fields of the Option) rows: the tables build an Option only for the rows no other
    one dominates (``_undominated``). ``keep(cfg)`` (a training or inference unit): only the configs it
    keeps are priced (``TableBuilder.group``)."""
    est = est or _Estimator(problem)
    if unit.name == GEN:
        return _generation_options(problem, unit, size, n_phases, sync_keys, est)
    cap, p, cs = problem.cluster.gpu.usable_bytes, problem.params, problem.candidates
    trainable = len(unit.stages) == 2
    offloads = cs.offload if trainable else (False,)
    out: list[tuple[tuple, dict]] = []
    infer_cache: dict = {}
    memory = est.memory_floors[unit.stages[0]]
    for tp, pp, dp, mb, sp, cp, ep, etp in _shapes(problem, unit, size):
        for zero in (cs.zeros if trainable else cs.frozen_zeros):
            if zero >= 3 and ep * etp > 1:  # expert parallelism runs with Megatron's distributed optimizer
                continue
            for rc in (cs.recompute if trainable else (False,)):
                cfg = est.config(tp, pp, dp, mb, zero, rc, sp, cp, ep, etp)
                if (keep is not None and not keep(cfg)) or all(memory(cfg, off) > cap for off in offloads):
                    continue  # (or its first stage alone overfills an empty GPU, ``cost.floors.memory_floor``)
                ests = [est(unit.stages[0], cfg)]
                if trainable:  # inference ignores recompute, and ZeRO but for FSDP's all-gathers (ZeRO-3)
                    if all(_peak(ests[0], off) > cap for off in offloads):
                        continue  # training alone overfills a GPU: _option drops it whatever inference adds
                    key = (tp, pp, mb, sp, cp, zero >= 3, ep, etp)
                    if key not in infer_cache:
                        infer_cache[key] = est(unit.stages[1], cfg)
                    ests.append(infer_cache[key])
                for off in offloads:
                    row = _option(unit, cfg, ests, n_phases, cap, off, p)
                    if row is not None:
                        out.append(row)
    return out


def _shapes(problem: PlanProblem, unit: Unit, size: int):
    """(tp, pp, dp, micro_batch, sp, cp, ep, etp) of every option of a training or inference unit on
    ``size`` GPUs, before its ZeRO stage and recomputation: what ``_option_rows`` prices and
    ``greedy.group_floor`` bounds."""
    j, w, cs = problem.job, problem.workload, problem.candidates
    per_rank = w.sequences / (j.batch.mini_batches if len(unit.stages) == 2 else 1)
    model = j.model(unit.stages[0].split("/")[0])
    for tp, pp in layouts(problem, unit, size):
        dp = size // (tp * pp)
        # a micro-batch larger than a DP rank's share only adds activation memory
        mbs = [mb for mb in cs.micro_batches if mb == min(cs.micro_batches) or mb <= per_rank / dp]
        splits = [(sp, 1) for sp in cs.sps if dp % sp == 0 and model.heads % (sp * tp) == 0]
        splits += [(1, cp) for cp in cs.cps if cp > 1 and dp % cp == 0]
        experts = expert_layouts(model, tp, dp, "training")
        for mb, (sp, cp), (ep, etp) in ((mb, x, y) for mb in mbs for x in splits for y in experts):
            yield tp, pp, dp, mb, sp, cp, ep, etp


def _option(unit: Unit, cfg: ParallelConfig, ests, n_phases: int, cap: float, offload: bool,
            p) -> tuple[tuple, dict] | None:
    """One option's row from its stage estimates; offload moves the optimizer state to the host
    between updates and adds its transfer time to the training stage (``cost.model.offloaded``: the
    state is back on the GPU for the update, a transient of training)."""
    if offload:
        ests = [offloaded(ests[0], p)] + list(ests[1:])
    resident = ests[0].resident_bytes
    times = [e.time_s for e in ests]
    transient = max([e.transient_bytes for e in ests])
    if resident + transient > cap or not all(map(math.isfinite, times)):
        return None
    durs = [0.0] * n_phases
    for x, ph in zip(times, unit.phases):
        durs[ph] += x
    res, tra = _kib(resident), _kib(transient)
    return (*durs, res, tra), {"config": cfg, "durations": tuple(durs), "stage_times": tuple(times),
                               "resident_kib": res, "transient_kib": tra, "offload": offload}


def _peak(e, offload: bool) -> float:
    """Resident + transient bytes of a training stage estimate (``offload``: ``offloaded_memory``)."""
    return sum(offloaded_memory(e)) if offload else e.resident_bytes + e.transient_bytes


def _generation_options(problem: PlanProblem, unit: Unit, size: int, n_phases: int, sync_keys: tuple,
                        est: _Estimator) -> list[tuple[tuple, dict]]:
    """Generation at each KV budget level up to the first that holds the peak KV demand: a larger
    pool runs the same decode and takes longer to create again at every wake-up
    (``engine_wake_s``), so the smallest sufficient level dominates the ones above it."""
    j, c, p = problem.job, problem.cluster, problem.params
    model = j.model("actor")
    trains = [(ParallelConfig(dp=ts), col) for ts, col in sync_keys]
    out: list[tuple[tuple, dict]] = []
    for tp, pp, ep in ((tp, pp, ep) for tp, pp in layouts(problem, unit, size)
                       for ep, _ in expert_layouts(model, tp, size // (tp * pp), "generation")):
        cfg = ParallelConfig(tp=tp, pp=pp, dp=size // (tp * pp), **({"ep": ep} if ep > 1 else {}))
        base = est(GEN, cfg)
        full = c.gpu.usable_bytes * engine_memory_util(j, p) - base.mem_breakdown["weights"] - base.mem_breakdown["workspace"]
        demand = base.mem_breakdown["kv_cache"] if base.waves == 1 and math.isfinite(base.time_s) else math.inf
        sync = tuple(weight_sync_s(model, train, cfg, c, col, p) for train, col in trains)
        for f in sorted(problem.candidates.kv_fractions):
            budget = full * f
            e = base if f == 1.0 else est(GEN, cfg, kv_budget_bytes=budget)
            if not e.fits:
                continue
            durs = [0.0] * n_phases
            durs[unit.phases[0]] = e.time_s
            res, tra = _kib(e.resident_bytes), _kib(e.transient_bytes)
            out.append(((*durs, res, tra, *sync), {"config": cfg, "durations": tuple(durs), "stage_times": (e.time_s,),
                                                    "resident_kib": res, "transient_kib": tra,
                                                    "kv_budget_bytes": budget, "sync": sync}))
            if budget >= demand:
                break
    return out


def _axes(o: Option) -> tuple:
    return (*o.durations, o.resident_kib, o.transient_kib, *o.sync)


def _undominated(axes: list[tuple]) -> list[int]:
    """Indices (ascending) of the rows no other row is better than or equal to on every axis (time
    per phase, resident, transient, weight sync; among exact ties the first stays). In the order of (axes, index) a row
    can only be dominated by one before it, and whatever dominates a dropped row dominates what that
    one dominated, so a row goes exactly when an earlier one in that order is <= on every axis: row
    j <= row i everywhere, and not an exact tie with j after i (all pairs at once)."""
    if not axes:
        return []
    width = len(axes[0])
    if any(len(a) != width for a in axes):  # rows of one unit and size share their axes; keep the general path exact
        return _undominated_loop(axes)
    a = np.asarray(axes, dtype=float)
    n = len(axes)
    le = np.ones((n, n), dtype=bool)  # le[i, j]: row j <= row i on every axis
    for k in range(width):
        le &= a[None, :, k] <= a[:, None, k]
    later = np.triu(np.ones((n, n), dtype=bool))  # j >= i
    return np.flatnonzero(~(le & ~(le.T & later)).any(axis=1)).tolist()


def _undominated_loop(axes: list[tuple]) -> list[int]:
    order = sorted(range(len(axes)), key=lambda i: (axes[i], i))
    kept, keep_idx = [], []
    for i in order:
        a = axes[i]
        if any(all(y <= x for x, y in zip(a, b)) for b in kept):
            continue
        kept.append(a)
        keep_idx.append(i)
    return sorted(keep_idx)


def fixed_sizes(problem: PlanProblem) -> tuple[int, ...]:
    fp = problem.constraints.fixed_placement
    return tuple(sorted({s.gpus for s in fp.stages})) if fp is not None else ()


def build_tables(problem: PlanProblem) -> Tables:
    """Option tables of ``problem``, every group priced (cached: the CLI sweep and backends share them)."""
    return table_builder(problem).full()


def table_builder(problem: PlanProblem) -> TableBuilder:
    """The ``TableBuilder`` of ``problem`` (cached with what it priced). The tables do not depend on
    the current plan or the transition cost, so those are left out of the cache key."""
    problem = replace(problem, current_plan=None, transition_cost=None, amortize_steps=0.0)
    try:
        hash(problem)
    except TypeError:  # a plan with unhashable extras, or an unhashable callable
        return TableBuilder(problem)
    return _builder_cached(problem)


class TableBuilder:
    """The option tables of one problem, priced one (unit, pool size) group at a time: ``group``
    prices a group on first use (every option of it, memory and dominance pruned), ``tables`` holds
    the groups priced so far. ``build_tables`` prices every group; ``solve`` the groups greedy fills,
    then only those whose floor (``greedy.group_floor``, bounds without pricing) may still tie
    greedy's plan (``greedy.price_groups``). Otherwise it reads like its ``Tables`` with no options
    (``units``, ``sizes``, ``sync_s``, ...)."""

    def __init__(self, problem: PlanProblem) -> None:
        c = problem.cluster
        sizes = tuple(sorted(set(pool_sizes(c)) | set(fixed_sizes(problem))))
        if problem.job.schedule.is_async:  # the rollout / trainer split at any node boundary the other pool aligns to
            # (and no pool of the whole cluster: the rollout pool is its own, so neither it nor a trainer pool can be)
            sizes = tuple(sorted((set(sizes) | set(split_sizes(c))) - {c.num_gpus}))
        if problem.constraints.placement == "colocated":
            sizes = (c.num_gpus,)
        elif problem.constraints.fixed_placement is not None:
            # every unit sits on its fixed pool: options on other pool sizes could never be chosen
            sizes = fixed_sizes(problem)
        units, self.problem, self.est = make_units(problem), problem, _Estimator(problem)
        self.priced, self.floors, self._full = {}, {}, None  # (floors: greedy.group_floor's, by group)
        self.floor_fns, self.partial = {}, {}  # (greedy._floor_fns; groups priced for price_groups' contexts)
        self.context = None  # (the context of the price_groups call running, if any)
        self.frame = Tables(units=units, sizes=sizes, options=((),) * len(units), capacity_kib=int(c.gpu.usable_bytes // KIB),
                            num_gpus=c.num_gpus, n_phases=len(problem.job.phases()),
                            sync_keys=tuple((s, col) for s in sizes for col in (False, True)), schedule=problem.job.schedule)

    def __getattr__(self, name: str):
        if name == "frame":  # (not set yet)
            raise AttributeError(name)
        return getattr(self.frame, name)

    def group(self, u: int, size: int, keep=None, context=None) -> tuple[Option, ...]:
        """Unit ``u``'s options on ``size`` GPUs, priced now if they were not yet. ``keep(cfg)`` (``price_groups``
        with its ``context``): only the configs it keeps, the group *partial* (predicates by context): priced
        again for the union in another context, in full without ``keep`` (greedy's fills, ``full``)."""
        key = (u, size)
        opts, part = self.priced.get(key), self.partial.get(key)
        if opts is not None and (part is None or (keep is not None and context in part)):
            return opts
        if keep is not None:
            part = {**(part or {}), context: keep}
            fns = tuple(part.values())
            keep = fns[0] if len(fns) == 1 else (lambda cfg: any(fn(cfg) for fn in fns))
        rows = _option_rows(self.problem, self.frame.units[u], size, self.n_phases, self.sync_keys, self.est, keep)
        opts = self.priced[key] = tuple(Option(unit=u, size=size, **rows[i][1]) for i in _undominated([a for a, _ in rows]))
        self.partial.pop(key, None)
        if keep is not None:
            self.partial[key] = part
        return opts

    def fastest(self, u: int, size: int) -> tuple[float, ...]:
        """Per phase, the least duration of unit ``u``'s options on ``size`` GPUs (inf: none), priced."""
        opts = self.priced.get((u, size))
        opts = self.group(u, size) if opts is None else opts
        return tuple(min((o.durations[ph] for o in opts), default=math.inf) for ph in range(self.frame.n_phases))

    def tables(self) -> Tables:
        """The groups priced so far, each unit's in ascending pool size (the order of ``full``)."""
        f = self.frame
        return replace(f, options=tuple(tuple(o for s in f.sizes for o in self.priced.get((u, s), ())) for u in range(len(f.units))))

    def full(self) -> Tables:
        """Every group priced."""
        if self._full is None:
            for u in range(len(self.frame.units)):
                for s in self.frame.sizes:
                    self.group(u, s)
            self._full = self.tables()
        return self._full


_builder_cached = _build_tables_cached = lru_cache(maxsize=64)(TableBuilder)
"""(``_build_tables_cached``: the name benchmarks clear for a cold start, in this checkout or another.)"""
