"""An oracle for the plan solver that shares none of its search code.

The oracle does not import ``nereus.planner.solver.candidates`` or ``brute``. It enumerates
``ParallelConfig`` objects itself (tp, pp, dp, micro-batch, ZeRO stage, recompute) on every aligned
GPU block. It gets each config's figures straight from the cost model
(``nereus.planner.cost.model.estimate``) and runs its own exact branch-and-bound over
(block, config) per decision unit. It scores every complete plan it reaches with
``nereus.planner.solver.evaluate_plan``, so the check's own arithmetic decides feasibility and
step time. The test then compares that optimum with the objective of CP-SAT's ``solve`` (one
worker, seed 0). The cases are the 8B PPO job at 8 and 16 GPUs with the default options, plus
longer responses where memory binds, 70B PPO on 64 GPUs, and small memory-bound instances.

The search space is the one the solver documents (README "Formulation"), written out here from
that description and not from the solver's code:

* decision units: generation; every trainable model's training + inference (inference runs in the
  training layout); every frozen model's inference;
* pools: aligned buddy blocks, meaning sub-node powers of two on a single node, node multiples
  2**k on several nodes, and the whole cluster. Blocks of this kind are nested or disjoint, so
  any choice of one block per unit is a valid placement;
* tp in ``tps`` with the TP group inside a node, pp dividing the layers up to ``max_pp``,
  dp = pool / (tp * pp);
* micro-batches, Ulysses degrees, ZeRO stages and recompute from the problem's ``CandidateSettings``;
* mixture-of-experts models only (``_expert_layouts``): expert parallelism ep (powers of two
  dividing the experts, at most 64) and expert-TP etp (1 or tp) with ep * etp dividing tp * dp
  (Megatron's expert layout), never with ZeRO-3; generation: ep 1 or tp (vLLM), etp 1;
* generation's KV budget: the ``kv_fractions`` of the budget on an empty GPU
  (``usable * kv_mem_util - weights - workspace``); no optimizer offload (the default).

The oracle enumerates some options that the solver's tables leave out, so it can catch an option
the tables drop by mistake. None of these can beat the solver's own options:

* every KV level, including those above the peak KV demand;
* every micro-batch, even one above a DP rank's share of the sequences;
* recompute settings on frozen units too (the cost model ignores them for inference, so the
  duplicates collapse); frozen units get ``CandidateSettings.frozen_zeros``, the solver's own ZeRO
  stages for them, since ZeRO-3 shards a frozen model's weights and so can win;
* no memory rounding to KiB.

Under these rules the two spaces coincide, and the test asserts both CP-SAT's objective <= the
oracle's best (+1e-6 relative) and equality. The ZeRO stages outside the default ``(1, 3)`` get a
test of their own, with both sides allowed ZeRO 0-3. If ``CandidateSettings`` gains an axis the
oracle does not enumerate, only "<=" is asserted and ``test_oracle_enumerates_every_candidate_axis``
fails.

The only pruning is exact: a (unit, pool size) option is dropped when another option of the same
unit and size is no worse on every axis (each phase duration, resident bytes, transient bytes,
and weight-sync seconds for every (actor pool size, colocated) pair). The branch-and-bound cuts
a partial plan only when a valid lower bound on evaluate_plan's step time reaches the incumbent:
the phase makespans so far, the fastest possible remaining units, GPU-seconds / N, and the
cheapest weight sync. The oracle's arithmetic at every leaf must equal evaluate_plan's.
"""
from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import dataclass, fields, replace

import pytest

from nereus.errors import SpecError
from nereus.models.spec import ModelSpec
from nereus.planner.cost.model import estimate, weight_sync_s
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.solver import CandidateSettings, PlanProblem, evaluate_plan, solve
from nereus.planner.specs import (GPU_PRESETS, TRAINABLE, BatchSpec, ClusterSpec, GiB, JobSpec, ParallelConfig,
                                  SequenceSpec, load_cluster, load_job)

GEN = "actor/generation"
ALL_ZEROS = (0, 1, 2, 3)


@dataclass(frozen=True)
class _Opt:
    size: int
    config: ParallelConfig
    kv_budget: float | None
    durations: tuple[float, ...]
    """Seconds per phase."""
    resident: float
    transient: float
    sync: tuple[float, ...] = ()
    """Generation only: weight-sync seconds per (actor pool size, colocated) key."""

    def axes(self) -> tuple:
        return (*self.durations, self.resident, self.transient, *self.sync)


def _units(job) -> list[tuple[str, ...]]:
    out = [(GEN,)]
    for role in job.roles:
        out.append((f"{role}/training", f"{role}/inference") if role in TRAINABLE else (f"{role}/inference",))
    return out


def _sizes(cluster) -> list[int]:
    n = cluster.num_gpus
    step = 1 if cluster.nodes == 1 else cluster.gpus_per_node
    out, s = {n}, step
    while s <= n:
        out.add(s)
        s *= 2
    return sorted(out)


def _blocks(cluster, size: int) -> list[tuple[int, int]]:
    n = cluster.num_gpus
    if size == n:
        return [(0, n)]
    return [(f, size) for f in range(0, n - size + 1, size)]


def _pareto(opts: list[_Opt]) -> list[_Opt]:
    opts = sorted(opts, key=_Opt.axes)
    kept: list[_Opt] = []
    for o in opts:
        a = o.axes()
        if not any(all(y <= x for x, y in zip(a, k.axes())) for k in kept):
            kept.append(o)
    return kept


def _layouts(problem: PlanProblem, role: str, size: int, cs: CandidateSettings) -> list[tuple[int, int]]:
    model = problem.job.model(role)
    gpn = problem.cluster.gpus_per_node
    pps = [p for p in range(1, min(cs.max_pp, model.layers) + 1) if model.layers % p == 0]
    return [(tp, pp) for tp in cs.tps for pp in pps
            if size % (tp * pp) == 0 and tp <= gpn and (problem.cluster.nodes == 1 or gpn % tp == 0)]


def _expert_layouts(model, tp: int, dp: int, generation: bool) -> list[dict]:
    """ParallelConfig keyword sets of the expert layouts (module docstring); [{}] for a dense model."""
    if not model.experts:
        return [{}]
    if generation:
        return [{}] + ([{"ep": tp}] if tp > 1 and model.experts % tp == 0 else [])
    out = []
    for etp in sorted({1, tp}):
        for ep in (1, 2, 4, 8, 16, 32, 64):
            if ep <= model.experts and model.experts % ep == 0 and (tp * dp) % (ep * etp) == 0 \
                    and model.expert_ffn % etp == 0:
                out.append({"ep": ep, "etp": etp})
    return out


def _options(problem: PlanProblem, stages: tuple[str, ...], size: int, sync_keys, cs: CandidateSettings,
             zeros: tuple[int, ...]) -> list[_Opt]:
    """Every config of ``stages`` (one decision unit) on a pool of ``size`` GPUs that fits an empty GPU."""
    job, cluster, w, p = problem.job, problem.cluster, problem.workload, problem.params
    phases = job.phases()
    where = {ms: i for i, ph in enumerate(phases) for ms in ph}
    cap = cluster.gpu.usable_bytes
    role = stages[0].split("/")[0]
    out: list[_Opt] = []
    for tp, pp in _layouts(problem, role, size, cs):
        dp = size // (tp * pp)
        for xl in (_expert_layouts(job.model(role), tp, dp, True) if stages[0] == GEN else ()):
            cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, **xl)
            try:
                base = estimate(job, cluster, GEN, cfg, w, p)
            except SpecError:  # tp the model does not accept
                continue
            full = cap * p.kv_mem_util - base.mem_breakdown["weights"] - base.mem_breakdown["workspace"]
            sync = tuple(weight_sync_s(job.model("actor"), ParallelConfig(dp=ts), cfg, cluster, col, p)
                         for ts, col in sync_keys)
            for f in cs.kv_fractions:
                e = estimate(job, cluster, GEN, cfg, w, p, kv_budget_bytes=full * f)
                if e.mem_bytes > cap or not math.isfinite(e.time_s):
                    continue
                durs = [0.0] * len(phases)
                durs[where[GEN]] = e.time_s
                out.append(_Opt(size=size, config=cfg, kv_budget=full * f, durations=tuple(durs),
                                resident=e.resident_bytes, transient=e.transient_bytes, sync=sync))
        if stages[0] == GEN:
            continue
        try:
            estimate(job, cluster, stages[0], ParallelConfig(tp=tp, pp=pp, dp=dp), w, p)
        except SpecError:  # tp the model does not accept
            continue
        heads = job.model(role).heads
        # sequence splits: Ulysses sp (heads split too) or context parallelism cp, never both
        seq_splits = [{"sp": sp} for sp in cs.sps if dp % sp == 0 and heads % (sp * tp) == 0]
        seq_splits += [{"cp": cp} for cp in cs.cps if cp != 1 and dp % cp == 0]
        for mb, split, xl in ((mb, x, y) for mb in cs.micro_batches for x in seq_splits
                              for y in _expert_layouts(job.model(role), tp, dp, False)):
            for zero in (zeros if len(stages) == 2 else tuple(cs.frozen_zeros)):
                if zero >= 3 and xl.get("ep", 1) * xl.get("etp", 1) > 1:
                    continue
                for rc in cs.recompute:
                    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, micro_batch=mb, zero=zero, recompute=rc, **split, **xl)
                    ests = [estimate(job, cluster, ms, cfg, w, p) for ms in stages]
                    resident = ests[0].resident_bytes  # the home stage holds the model's state
                    transient = max(e.transient_bytes for e in ests)
                    if resident + transient > cap or not all(math.isfinite(e.time_s) for e in ests):
                        continue
                    durs = [0.0] * len(phases)
                    for ms, e in zip(stages, ests):
                        durs[where[ms]] += e.time_s
                    out.append(_Opt(size=size, config=cfg, kv_budget=None, durations=tuple(durs),
                                    resident=resident, transient=transient))
    return out


def _plan(units, chosen) -> Plan:
    """A Plan from one (block, option) per unit: one pool id per distinct block."""
    blocks = sorted({blk for blk, _ in chosen}, key=lambda b: (b[0], -b[1]))
    pool = {b: i for i, b in enumerate(blocks)}
    stages, kv = [], None
    for stage_names, (blk, o) in zip(units, chosen):
        for ms in stage_names:
            stages.append(StagePlacement(name=ms, config=o.config, pool=pool[blk], first_gpu=blk[0], gpus=blk[1]))
        if o.kv_budget is not None:
            kv = o.kv_budget
    return Plan(stages=tuple(stages), extras=(("generation_kv_budget_gib", kv / GiB),))


@dataclass
class OracleResult:
    step_time_s: float
    plan: Plan | None
    leaves: int
    nodes: int
    mismatches: list


ORACLE_AXES = {"tps", "max_pp", "micro_batches", "zeros", "frozen_zeros", "recompute", "sps", "cps", "offload",
               "kv_fractions"}
"""CandidateSettings fields the oracle enumerates (offload only at its default, off)."""


def spaces_coincide(cs: CandidateSettings) -> bool:
    """Whether the oracle's space is the solver's (plus options that cannot win, see the docstring)."""
    return {f.name for f in fields(CandidateSettings)} <= ORACLE_AXES and tuple(cs.offload) == (False,)


def oracle(problem: PlanProblem, zeros: tuple[int, ...] | None = None, time_budget_s: float = 120.0) -> OracleResult:
    """Exact best plan of ``problem`` over the space in the module docstring, by evaluate_plan.
    ``zeros`` defaults to the problem's ZeRO stages; every trainable unit gets them, frozen ones get
    ``frozen_zeros``."""
    cs = problem.candidates
    zeros = tuple(cs.zeros) if zeros is None else zeros
    cluster = problem.cluster
    n = cluster.num_gpus
    cap = cluster.gpu.usable_bytes * (1 + 1e-9)
    units = _units(problem.job)
    n_ph = len(problem.job.phases())
    sizes = _sizes(cluster)
    sync_keys = tuple((s, col) for s in sizes for col in (False, True))
    g_idx = 0
    a_idx = next(i for i, u in enumerate(units) if u[0] == "actor/training")
    per_unit = []
    for u in units:
        cands = []
        for s in sizes:
            for o in _pareto(_options(problem, u, s, sync_keys, cs, zeros)):
                for blk in _blocks(cluster, s):
                    cands.append((blk, o))
        cands.sort(key=lambda bo: sum(bo[1].durations) * (1 + 0.01 * bo[0][1] / n))
        per_unit.append(cands)
    if any(not c for c in per_unit):
        return OracleResult(math.inf, None, 0, 0, [])
    order = [g_idx, a_idx] + [i for i in range(len(units)) if i not in (g_idx, a_idx)]
    min_dur = [[min(o.durations[ph] for _, o in per_unit[u]) for ph in range(n_ph)] for u in range(len(units))]
    min_area = [[min(o.durations[ph] * o.size for _, o in per_unit[u]) for ph in range(n_ph)]
                for u in range(len(units))]
    min_sync_all = min(min(o.sync) for _, o in per_unit[g_idx])

    res, tra = [0.0] * n, [0.0] * n
    load = [[0.0] * n for _ in range(n_ph)]
    chosen: list = [None] * len(units)
    best = {"obj": math.inf, "plan": None, "leaves": 0, "nodes": 0, "mismatch": []}
    deadline = time.perf_counter() + time_budget_s

    def sync_now() -> float:
        g, a = chosen[g_idx], chosen[a_idx]
        if g is None:
            return min_sync_all
        if a is None:
            return min(g[1].sync)
        (gf, gs), (af, asz) = g[0], a[0]
        col = gf < af + asz and af < gf + gs
        return g[1].sync[sync_keys.index((a[1].size, col))]

    def lower_bound(depth: int) -> float:
        rest = order[depth:]
        lb = sync_now()
        for ph in range(n_ph):
            row = load[ph]
            lb += max([max(row), (sum(row) + sum(min_area[u][ph] for u in rest)) / n]
                      + [min_dur[u][ph] for u in rest])
        return lb

    def leaf() -> None:
        best["leaves"] += 1
        internal = lower_bound(len(order))  # with nothing left this is the exact step time
        plan = _plan(units, chosen)
        ev = evaluate_plan(problem, plan)
        if ev.feasible and not math.isclose(ev.step_time_s, internal, rel_tol=1e-9):
            best["mismatch"].append((internal, ev.step_time_s))
        if ev.feasible and ev.step_time_s < best["obj"]:
            best["obj"], best["plan"] = ev.step_time_s, plan

    def rec(depth: int) -> None:
        if time.perf_counter() > deadline:
            raise TimeoutError("oracle exceeded its time budget")
        if depth == len(order):
            leaf()
            return
        u = order[depth]
        for blk, o in per_unit[u]:
            best["nodes"] += 1
            gpus = range(blk[0], blk[0] + blk[1])
            ok = all(res[g] + o.resident + max(tra[g], o.transient) <= cap for g in gpus)
            if not ok:  # memory only grows as units are added
                continue
            saved = [(g, res[g], tra[g], [load[ph][g] for ph in range(n_ph)]) for g in gpus]
            for g in gpus:
                res[g] += o.resident
                tra[g] = max(tra[g], o.transient)
                for ph in range(n_ph):
                    load[ph][g] += o.durations[ph]
            chosen[u] = (blk, o)
            if lower_bound(depth + 1) < best["obj"] * (1 - 1e-12):
                rec(depth + 1)
            chosen[u] = None
            for g, r0, t0, l0 in saved:
                res[g], tra[g] = r0, t0
                for ph in range(n_ph):
                    load[ph][g] = l0[ph]

    rec(0)
    return OracleResult(best["obj"], best["plan"], best["leaves"], best["nodes"], best["mismatch"])


def _problem(gpus: int, mean: float = 2048, max_len: int = 8192, **settings) -> PlanProblem:
    job = load_job("examples/ppo-8b.yaml")
    cluster = load_cluster("examples/cluster-h100-1n.yaml").with_gpus(gpus)
    return PlanProblem(job=job, cluster=cluster, workload=job.workload().with_lengths(mean=mean, max_=max_len),
                       candidates=CandidateSettings(**settings))


def _random_problem(seed: int) -> PlanProblem:
    """1-2 nodes, 2-4 small models, GPUs small enough that memory binds; default candidate settings."""
    r = random.Random(seed)
    h = r.choice([1024, 2048])
    m = ModelSpec(name=f"m{seed}", layers=r.choice([4, 8]), hidden=h, ffn=4 * h, heads=16,
                  kv_heads=r.choice([4, 8]), vocab=32000)
    roles = (("actor", "ref"), ("actor", "ref", "reward"), ("actor", "critic", "ref"),
             ("actor", "critic", "ref", "reward"))[seed % 4]
    mean = r.choice([256, 512, 1024, 2048])
    job = JobSpec(algorithm="ppo" if "critic" in roles else "grpo", models=tuple((x, m) for x in roles),
                  batch=BatchSpec(prompts=r.choice([16, 32, 64]), samples_per_prompt=2),
                  sequence=SequenceSpec(prompt_len=r.choice([128, 256]), response_len_mean=mean,
                                        response_len_max=4 * mean))
    gpu = replace(GPU_PRESETS["h100-80gb"], memory_gib=r.choice([6, 8, 12, 16]), reserved_gib=0.5)
    nodes, gpn = r.choice([(1, 4), (1, 8), (2, 4), (2, 8)])
    return PlanProblem(job=job, cluster=ClusterSpec(gpu=gpu, nodes=nodes, gpus_per_node=gpn),
                       workload=job.workload(), candidates=CandidateSettings())


def _check(problem: PlanProblem, zeros: tuple[int, ...]):
    sol = solve(problem, backend="cpsat", time_limit_s=60, workers=1, seed=0)
    orc = oracle(problem, zeros=zeros)
    if orc.plan is None:  # nothing fits anywhere in the oracle's (larger) space
        assert sol.status == "INFEASIBLE" and sol.plan is None, sol.status
        return sol, orc
    assert not orc.mismatches, orc.mismatches[:3]  # the oracle's bound arithmetic is evaluate_plan's
    ev = evaluate_plan(problem, orc.plan)
    assert ev.feasible, ev.violations
    assert ev.step_time_s == pytest.approx(orc.step_time_s, rel=1e-12)
    assert sol.status == "OPTIMAL" and sol.plan is not None, (sol.status, sol.message)
    sol_ev = evaluate_plan(problem, sol.plan)
    assert sol_ev.feasible, sol_ev.violations
    assert sol_ev.step_time_s == pytest.approx(sol.objective, rel=1e-9)
    # the solver misses nothing the oracle found ...
    assert sol.objective <= orc.step_time_s * (1 + 1e-6), (sol.objective, orc.step_time_s, orc.plan.to_dict())
    # ... and, the search spaces coinciding, finds nothing better than the exhaustive optimum
    # (were the solver's space larger, see test_oracle_enumerates_every_candidate_axis)
    if spaces_coincide(problem.candidates) and set(zeros) >= set(problem.candidates.zeros):
        assert sol.objective >= orc.step_time_s * (1 - 1e-6), (sol.objective, orc.step_time_s, sol.plan.to_dict())
    return sol, orc


def test_oracle_enumerates_every_candidate_axis():
    """A new CandidateSettings axis (or offload on by default) makes the solver's space larger than
    the oracle's: the comparisons below then only check "<=". Extend the oracle (``_options``)."""
    assert spaces_coincide(CandidateSettings()), {f.name for f in fields(CandidateSettings)} - ORACLE_AXES


PPO8B_CASES = [(8, 2048, 8192), (16, 2048, 8192),
               # longer responses: memory binds, so recompute, micro-batch and KV levels change the optimum
               (8, 4096, 16384), (8, 8192, 32768), (16, 8192, 32768),
               # very long responses: the optimum shards actor training with tp 4
               (8, 16384, 65536)]


@pytest.mark.parametrize("gpus,mean,max_len", PPO8B_CASES)
def test_cpsat_objective_equals_independent_oracle_on_ppo8b_default_options(gpus, mean, max_len):
    """Default candidate settings (ZeRO 1 and 3): CP-SAT's objective equals the oracle's exhaustive
    optimum, and both plans pass evaluate_plan."""
    _check(_problem(gpus, mean, max_len), zeros=CandidateSettings().zeros)


@pytest.mark.parametrize("gpus,mean,max_len", [(8, 2048, 8192), (16, 2048, 8192), (16, 4096, 16384)])
def test_cpsat_objective_equals_independent_oracle_on_ppo8b_every_zero_stage(gpus, mean, max_len):
    """ZeRO 0-3 on both sides (at 16 GPUs with 4k responses ZeRO-2 beats ZeRO 1 and 3 in the cost
    model, so a solver that drops a requested stage is caught there)."""
    _check(_problem(gpus, mean, max_len, zeros=ALL_ZEROS), zeros=ALL_ZEROS)


@pytest.mark.parametrize("gpus,mean,max_len", [(8, 4096, 16384), (8, 8192, 32768)])
def test_cpsat_objective_equals_independent_oracle_with_sharded_frozen_models(gpus, mean, max_len):
    """Frozen models may run ZeRO-3 (``frozen_zeros`` (1, 3), as the simulator's policies do): their
    weights sharded over dp; at these lengths a ZeRO-3 reference beats the replicated one."""
    sol, orc = _check(_problem(gpus, mean, max_len, frozen_zeros=(1, 3)), zeros=CandidateSettings().zeros)
    base, _ = _check(_problem(gpus, mean, max_len), zeros=CandidateSettings().zeros)
    assert sol.objective < base.objective * (1 - 1e-6)
    assert sol.plan.stage("ref/inference").config.zero == 3


@pytest.mark.parametrize("gpus,mean,max_len", [(8, 16384, 65536)])
def test_cpsat_objective_equals_independent_oracle_with_context_parallelism(gpus, mean, max_len):
    """Context parallelism in the search (cp 2 and 4 beside Ulysses sp): very long responses, where
    splitting sequences decides what fits."""
    _check(_problem(gpus, mean, max_len, cps=(1, 2, 4)), zeros=CandidateSettings().zeros)


def test_cpsat_objective_equals_independent_oracle_on_ppo70b_64_gpus():
    """70B PPO on 8 nodes: node-multiple pools only, tp and pp above 1 everywhere in the optimum."""
    job = load_job("examples/ppo-70b.yaml")
    cluster = load_cluster("examples/cluster-h100-1n.yaml").with_gpus(64)
    _check(PlanProblem(job=job, cluster=cluster, workload=job.workload()), zeros=CandidateSettings().zeros)


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_objective_equals_independent_oracle_on_small_memory_bound_instances(seed):
    """Small models on 6-16 GiB GPUs (2-4 models, 1-2 nodes): memory binds everywhere."""
    _check(_random_problem(seed), zeros=CandidateSettings().zeros)


if __name__ == "__main__":  # timing aid: python tests/unit/test_solver_oracle.py
    for g, mean, mx in PPO8B_CASES:
        for z in (CandidateSettings().zeros, ALL_ZEROS):
            t0 = time.perf_counter()
            r = oracle(_problem(g, mean, mx, zeros=z), zeros=z)
            t1 = time.perf_counter() - t0
            s = solve(_problem(g, mean, mx, zeros=z), backend="cpsat", workers=1, seed=0)
            print(g, mean, z, r.step_time_s, s.objective, r.leaves, r.nodes, len(r.mismatches), f"oracle {t1:.2f}s",
                  file=sys.stderr)
