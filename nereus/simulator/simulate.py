"""Replay a trace through policies against the ground truth, and summarise (all results SIMULATED).

Per step of an online policy: the plan decided after the previous step runs the step in the ground
truth (``truth.machine.GroundTruth``); the policy sees only what a training loop logs (per-stage
seconds, the sampled responses' mean and longest, the trainer's cap, peak memory, the GPUs granted
next, and whether the step ran out of memory) and the lengths' within-prompt correlation a loop
measures from its batch (``_metrics``), and decides the next plan; a layout change blocks the job
for its ground-truth transition time.

A step that runs out of memory is a crash, as on a real cluster: the time until the failure plus a
restart (relaunch, checkpoint read, engine start) is lost, the policy is told (``oom``), and the
step is retried on the plan it picks (at most ``MAX_ATTEMPTS`` tries; then the step's batch is
dropped). Nothing about a crash is free, and a dropped step is reported, never priced away.

Offline policies (``hindsight``, ``oracle``) run last, over the plans the others used plus their own
candidates (``oracle.py``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import numpy as np

from nereus.errors import NereusError, SpecError
from nereus.planner.cost.params import CostParams
from nereus.planner.online.adapters import prompt_length_correlation
from nereus.planner.online.audit import AuditLog
from nereus.planner.online.controller import StepMetrics
from nereus.planner.online.plan_cache import FREE, PlanCache, scale_plan
from nereus.planner.plan import Plan
from nereus.planner.solver.problem import CandidateSettings
from nereus.planner.specs import ClusterSpec, JobSpec, Workload
from nereus.simulator import oracle as offline
from nereus.simulator import shared_cache
from nereus.planner.online.admission import AdmissionConstants
from nereus.simulator.policies import (COST_RULE, OFFLINE, ONLINE, POLICIES, RESTART_MODE,
                                      make_controller, naive_fix, naive_plan, rescale_naive, solve_grid)
from nereus.simulator.async_policies import (ASYNC_ONLINE, ASYNC_POLICIES, idle_summary, is_async,
                                             make_async_controller, mark, policy_job, split_family, sync_job)
from nereus.simulator.schedules import TransitionSchedules
from nereus.simulator.trace import Trace
from nereus.simulator.truth.machine import GroundTruth, Observation
from nereus.simulator.truth.timeline import idle_at, schedule_of

SYNC_ON_ASYNC = ("static", "verl", "verl-offload", "openrlhf", "openrlhf-colocate", "static-naive")
"""Today's policies that plan synchronous steps also on an asynchronous job (the sync baselines)."""
SIM_CANDIDATES = CandidateSettings(kv_fractions=(1.0, 0.5, 0.25, 0.1), frozen_zeros=(1, 3), offload=(False, True))
"""The solver's option set in simulation: four generation KV-budget levels instead of seven (the
generation options dominate the solver's table building; every solve of a 1,000-step run pays it),
frozen models replicated or ZeRO-3-sharded (what verl's FSDP reference does, open to every policy),
and the trained models' optimizer state on the GPU or offloaded to the host between updates (verl's
``optimizer_offload``: open to Nereus's policies and ``verl-offload``; ``verl`` and the OpenRLHF-like
rules hold it off in their ``LayoutRule``)."""
MAX_ATTEMPTS = 4
"""Tries of one step before its batch is dropped (a user gives up on a step after a few crashes)."""
LABEL = "SIMULATED"


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    policy: str
    step_s: tuple[float, ...]
    """Per step, the seconds of the run that completed (nan when the step was dropped)."""
    transition_s: tuple[float, ...]
    """Per step, the live transition paid before it."""
    restart_s: tuple[float, ...] = ()
    """Per step, seconds lost to crashes (work until the OOM + restart) and relaunches."""
    ooms: tuple[int, ...] = ()
    restarts: tuple[int, ...] = ()
    dropped: tuple[bool, ...] = ()
    plans: tuple[Plan, ...] = field(default=(), repr=False)
    """Distinct plans used (for the offline policies' candidate set)."""
    plan_index: tuple[int, ...] = field(default=(), repr=False)
    """Per step, the index into ``plans`` of the plan the step completed on (-1: dropped)."""
    wall_s: float = 0.0
    solves: int = 0
    overhead_ms: tuple[float, ...] = field(default=(), repr=False)
    """Controller seconds per decision without a re-solve, in ms."""
    note: str = ""
    """Why the policy did not run at all (its layout rule has no feasible plan), else empty."""
    idle: tuple[tuple[float, float, float, float], ...] = field(default=(), repr=False)
    """Per step run on an asynchronous plan: (rollout idle, trainer idle, sync, step) seconds."""

    def __post_init__(self) -> None:
        n = len(self.step_s)
        for name in ("restart_s", "ooms", "restarts", "dropped"):
            if not getattr(self, name):
                object.__setattr__(self, name, (False,) * n if name == "dropped" else (0,) * n)

    @property
    def completed(self) -> int:
        return sum(1 for d in self.dropped if not d)

    @property
    def total_s(self) -> float:
        return float(np.nansum(self.step_s)) + sum(self.transition_s) + sum(self.restart_s)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` record of the CLI contract (plus diagnostics). ``mean_step_s`` is wall time per
        completed step (transitions and restarts included)."""
        n, total, trans = len(self.step_s), self.total_s, sum(self.transition_s)
        done = max(1, self.completed)
        ov = sorted(self.overhead_ms) or [0.0]
        return {"label": LABEL, "steps": n, "completed_steps": self.completed,
                "mean_step_s": total / done if self.completed else math.nan,
                "total_s": total, "transition_s": trans, "transition_overhead": trans / total if total else 0.0,
                "transitions": sum(1 for t in self.transition_s if t > 0),
                "infeasible_steps": sum(1 for o, d in zip(self.ooms, self.dropped) if o or d),
                "ooms": int(sum(self.ooms)), "restarts": int(sum(self.restarts)), "restart_s": float(sum(self.restart_s)),
                "dropped_steps": n - self.completed,
                "mean_compute_step_s": float(np.nanmean(self.step_s)) if self.completed else math.nan,
                "wall_s": self.wall_s, "solves": self.solves,
                "controller_overhead_ms_median": ov[len(ov) // 2], "controller_overhead_ms_p99": ov[int(0.99 * (len(ov) - 1))],
                "controller_overhead_ms_max": ov[-1], **({"not_run": self.note} if self.note else {}),
                **idle_summary(self.idle, len(self.idle))}


def _metrics(trace: Trace, i: int, obs: Observation, base_prompt: int, gt, samples: int, *,
             retry: bool = False) -> StepMetrics:
    """What a training loop logs after step ``i`` (no p90: verl does not log one), and what a loop
    integrated with Nereus measures from its batch: the lengths' within-prompt correlation
    (``adapters.prompt_length_correlation``; None where the world samples no lengths)."""
    r = trace.rows[i]
    nxt = r if retry else trace.rows[min(i + 1, len(trace.rows) - 1)]
    lengths = getattr(gt, "lengths", None)
    corr = None if lengths is None else prompt_length_correlation(lengths(i), samples_per_prompt=samples)
    return StepMetrics(step=r.step, response_len_mean=obs.response_len_mean, response_len_max=obs.response_len_max,
                       prompt_len=base_prompt if r.prompt_len_mean is None else round(r.prompt_len_mean),
                       stage_times=dict(obs.stage_s) if obs.feasible else {}, peak_mem_gib=obs.peak_mem_gib,
                       gpus_available=nxt.gpus, response_len_cap=nxt.cap, oom=not obs.feasible,
                       oom_stage=obs.oom_stage, step_s=obs.step_s if obs.feasible else None,
                       response_len_prompt_corr=corr)


class _Run:
    """Per-step bookkeeping shared by the online and scripted loops."""

    def __init__(self, n: int) -> None:
        self.step_s = [math.nan] * n
        self.trans = [0.0] * n
        self.restart = [0.0] * n
        self.ooms = [0] * n
        self.restarts = [0] * n
        self.dropped = [False] * n
        self.index = [-1] * n
        self.plans: dict[tuple, int] = {}
        self.plan_list: list[Plan] = []
        self.idle: list[tuple[float, float, float, float]] = []

    def use(self, plan: Plan, gt: GroundTruth | None = None, i: int = 0) -> int:
        if gt is not None and is_async(plan):
            self.idle.append(idle_at(gt, plan, i))
        k = (plan.key(), schedule_of(plan))
        if k not in self.plans:
            self.plans[k] = len(self.plan_list)
            self.plan_list.append(plan)
        return self.plans[k]

    def result(self, name: str, t0: float, solves: int = 0, overhead: Iterable[float] = ()) -> PolicyResult:
        return PolicyResult(policy=name, step_s=tuple(self.step_s), transition_s=tuple(self.trans),
                            restart_s=tuple(self.restart), ooms=tuple(self.ooms), restarts=tuple(self.restarts),
                            dropped=tuple(self.dropped), plans=tuple(self.plan_list), plan_index=tuple(self.index),
                            wall_s=time.perf_counter() - t0, solves=solves, overhead_ms=tuple(overhead),
                            idle=tuple(self.idle))


def run_online(name: str, job: JobSpec, cluster: ClusterSpec, trace: Trace, gt: GroundTruth, plans: PlanCache, *,
               params: CostParams | None = None, horizon: int = 200, margin: float = 0.25, seed: int = 0,
               audit: AuditLog | None = None, tick: Callable[[], None] | None = None,
               admission: AdmissionConstants | None = None) -> PolicyResult:
    t0 = time.perf_counter()
    solves0 = plans.solves
    base, n_samples = job.workload(), job.batch.samples_per_prompt
    extra = {} if name in ASYNC_ONLINE else {"admission": admission}
    make = make_async_controller if name in ASYNC_ONLINE else make_controller
    ctl = make(name, job, cluster, trace.workload(0, base), trace.rows[0].gpus, total_steps=len(trace),
               plans=plans, horizon=horizon, margin=margin, audit=audit, seed=seed, params=params, **extra)
    runtime = mark(name)
    plan, run, overhead = runtime(ctl.plan), _Run(len(trace)), []
    for i, row in enumerate(trace.rows):
        for attempt in range(MAX_ATTEMPTS):
            obs = gt.observe(plan, i) if plan.num_gpus <= row.gpus else None
            if obs is not None and obs.feasible:
                run.step_s[i], run.index[i] = obs.step_s, run.use(plan, gt, i)
                break
            if obs is None:  # no plan fits the granted GPUs: nothing to run
                run.dropped[i] = True
                break
            run.ooms[i] += 1
            run.restarts[i] += 1
            run.restart[i] += obs.lost_s + gt.restart_s(plan)
            d = ctl.step(_metrics(trace, i, obs, base.prompt_len, gt, n_samples, retry=True))
            if not d.feasible and d.plan is plan:  # the policy has nothing else to run: the batch is lost
                run.dropped[i] = True
                break
            plan = runtime(d.plan)  # relaunched from the checkpoint in the new layout: the restart is the transition
        else:
            run.dropped[i] = True
        if tick:
            tick()
        if i == len(trace.rows) - 1:
            break
        if obs is None:
            continue
        d = ctl.step(_metrics(trace, i, obs, base.prompt_len, gt, n_samples))
        if not d.resolved:
            overhead.append(d.overhead_s * 1e3)
        if d.action == "switch":
            nxt = runtime(d.plan)
            t = gt.switch_restart_s(plan, nxt) if name in RESTART_MODE else gt.transition_s(plan, nxt)
            if t > 0:
                ctl.report_transition(t)
                t += gt.refill_s(nxt, i + 1)  # a new async pipeline first waits for its first batch
            run.trans[i + 1] = t
            plan = nxt
    ctl.close()
    return run.result(name, t0, plans.solves - solves0, overhead)


def run_naive(job: JobSpec, trace: Trace, gt: GroundTruth, tick: Callable[[], None] | None = None) -> PolicyResult:
    """static-naive (``policies.naive_plan``): a fixed example layout; OOM = crash, restart, user fix."""
    t0 = time.perf_counter()
    plan, run = naive_plan(job, trace.rows[0].gpus), _Run(len(trace))
    for i, row in enumerate(trace.rows):
        if row.gpus != plan.num_gpus:  # a framework without live resharding relaunches on the new GPUs
            plan = rescale_naive(plan, row.gpus)
            run.restarts[i] += 1
            run.restart[i] += gt.restart_s(plan)
        for _ in range(MAX_ATTEMPTS):
            obs = gt.observe(plan, i)
            if obs.feasible:
                run.step_s[i], run.index[i] = obs.step_s, run.use(plan)
                break
            run.ooms[i] += 1
            run.restarts[i] += 1
            run.restart[i] += obs.lost_s + gt.restart_s(plan)
            fixed = naive_fix(job, plan, obs.oom_stage)
            if fixed is None:
                break
            plan = fixed
        else:
            run.dropped[i] = True
        if not obs.feasible:
            run.dropped[i] = True
        if tick:
            tick()
    return run.result("static-naive", t0)


def offline_picks(job: JobSpec, trace: Trace, plans: PlanCache, params: CostParams, samples: int = 4) -> list[Plan]:
    """The solver's plans for ``samples`` evenly spaced steps and every step where the GPU count
    changes (planner parameters, on the solver's workload grid): the offline policies' extra
    candidates. They do not depend on any policy's run, so ``simulate`` may solve them beside the
    online policies."""
    base = job.workload()
    gpus = [r.gpus for r in trace.rows]
    picks = {round(j * (len(trace) - 1) / max(1, samples - 1)) for j in range(samples)}
    picks |= {i for i in range(1, len(trace)) if gpus[i] != gpus[i - 1]}
    out = (plans.best(FREE, solve_grid(trace.workload(i, base)), gpus[i], params) for i in sorted(picks))
    return [p for p in out if p is not None]


def offline_candidates(job: JobSpec, results: Iterable[PolicyResult], picked: Iterable[Plan],
                       gpus_per_node: int) -> tuple[list[Plan], list[int], dict[int, set[int]]]:
    """(candidates, indices of the extra ones, steps each candidate was run on by some policy):
    every plan a policy ran, then ``picked`` (``offline_picks``), then each of those with every
    other generation TP."""
    cands: dict[tuple, Plan] = {}
    used: dict[int, set[int]] = {}
    for r in results:
        if r.policy == "static-naive" or r.note:
            continue  # relaunch-only plans (ZeRO-3 everywhere): no live transition reaches them
        for k, p in enumerate(r.plans):
            if schedule_of(p)[3]:
                continue  # verl's dynamic runtime is not a plan another policy can switch to
            key = (p.key(), schedule_of(p))
            if key not in cands:
                cands[key] = p
            j = list(cands).index(key)
            used.setdefault(j, set()).update(i for i, x in enumerate(r.plan_index) if x == k)
    n_used = len(cands)
    for p in picked:
        cands.setdefault((p.key(), schedule_of(p)), p)
    for p in list(cands.values()):
        for q in offline.gen_tp_variants(p, job.model("actor").heads, gpus_per_node):
            cands.setdefault((q.key(), schedule_of(q)), q)
    out = list(cands.values())
    return out, list(range(n_used, len(out))), used


def run_offline(job: JobSpec, trace: Trace, gt: GroundTruth, plans: PlanCache, results: list[PolicyResult],
                which: Iterable[str], params: CostParams, picked: list[Plan] | None = None,
                picked_s: float = 0.0, workers: int = 1) -> dict[str, PolicyResult]:
    """The offline policies over the online ones' ``results``; ``picked``: ``offline_picks`` solved
    already (``picked_s`` seconds, counted in their wall time), else solved here; ``workers``:
    processes that score the candidates."""
    t0 = time.perf_counter() - picked_s
    which = list(which)
    if picked is None:
        picked = offline_picks(job, trace, plans, params)
    cands, extra, used = offline_candidates(job, results, picked, plans.cluster.gpus_per_node)
    gpus = np.array([r.gpus for r in trace.rows])
    counts = sorted(set(gpus.tolist()))
    changes = {(int(a), int(b)) for a, b in zip(gpus[:-1], gpus[1:]) if a != b}
    if "hindsight" in which or "hindsight-split" in which:
        n0 = len(cands)
        cands = offline.complete_families(cands, counts, scale_plan)
        extra = extra + list(range(n0, len(cands)))
    steps = offline.usable_steps(cands, gpus, used)
    times = offline.step_time_matrix(gt, cands, steps, len(trace), workers=workers)
    # every plan change a policy made is an edge of the graph, also one made by a crash and restart
    # (priced as a live transition): each policy's sequence of plans is then a path the DP can take
    for r in results:
        if r.policy == "static-naive" or r.note:
            continue
        seq = [r.plans[k] for k in r.plan_index if k >= 0]
        for a, b in zip(seq, seq[1:]):
            if a is not b:
                gt.transition_s(a, b)
    out = {}
    if "hindsight" in which:  # first: the edges it prices join the oracle's graph, so oracle <= hindsight
        path, _ = offline.hindsight(gt, cands, times, changes)
        out["hindsight"] = _path_result("hindsight", path, cands, len(trace), t0)
    if "hindsight-split" in which:  # the best single (schedule, rollout share), async candidates only
        mask = np.array([is_async(p) for p in cands])
        path, _ = offline.hindsight(gt, cands, np.where(mask[None, :], times, np.inf), changes, key=split_family)
        out["hindsight-split"] = _path_result("hindsight-split", path, cands, len(trace), t0, gt)
    if "oracle" in which:
        budget = 32 if trace.max_gpus <= 128 else 12  # pricing a 1,024-GPU layout change is slow
        path = offline.dp_path(times, offline.edge_matrix(gt, cands, extra, edge_budget=budget))
        out["oracle"] = _path_result("oracle", path, cands, len(trace), t0)
    return {k: out[k] for k in which}


def _not_run(name: str, n: int, why: str) -> PolicyResult:
    return PolicyResult(policy=name, step_s=(math.nan,) * n, transition_s=(0.0,) * n, dropped=(True,) * n, note=why)


def _path_result(name: str, path, cands: list[Plan], n: int, t0: float, gt: GroundTruth | None = None) -> PolicyResult:
    if path is None:
        nan = (math.nan,) * n
        return PolicyResult(policy=name, step_s=nan, transition_s=(0.0,) * n, dropped=(True,) * n,
                            wall_s=time.perf_counter() - t0)
    used = sorted(set(path.plan_index))
    pos = {k: j for j, k in enumerate(used)}
    return PolicyResult(policy=name, step_s=path.step_s, transition_s=path.transition_s,
                        plans=tuple(cands[k] for k in used), plan_index=tuple(pos[k] for k in path.plan_index),
                        wall_s=time.perf_counter() - t0, idle=tuple(
                            idle_at(gt, cands[k], i) for i, k in enumerate(path.plan_index) if gt and is_async(cands[k])))


def simulate(job: JobSpec, cluster: ClusterSpec, trace: Trace, policies: Iterable[str] = POLICIES, *,
             gt: GroundTruth | None = None, params: CostParams | None = None, horizon: int = 200,
             margin: float = 0.25, seed: int = 0, time_limit_s: float = 5.0, audit_path: str | None = None,
             progress: bool = False, workers: int = 1,
             admission: AdmissionConstants | None = None) -> dict[str, PolicyResult]:
    """Run ``policies`` over ``trace``; results in the order asked. ``audit_path`` logs the adaptive
    controller's decisions (or the first online policy's when adaptive is not run). ``workers`` > 1
    runs the online policies in that many forked processes (each with its own plan cache; no audit
    log or progress bar then); the offline policies run after them in this process. ``admission``:
    the admission rules' constants of every online policy (default: ``AdmissionConstants(margin=margin)``)."""
    policies = list(dict.fromkeys(policies))
    known = POLICIES + COST_RULE + ASYNC_POLICIES
    bad = [p for p in policies if p not in known]
    if bad:
        raise SpecError(f"unknown policy {bad}; choose from {', '.join(known)} or all")
    admission = admission if admission is not None else AdmissionConstants(margin=margin)
    if job.schedule.kind == "sync" and set(policies) & set(ASYNC_POLICIES):
        raise SpecError(f"{sorted(set(policies) & set(ASYNC_POLICIES))} need an asynchronous job (--schedule)")
    if trace.max_gpus > cluster.num_gpus:
        raise SpecError(f"trace {trace.name} asks for {trace.max_gpus} GPUs; cluster has {cluster.num_gpus}")
    gt = gt or GroundTruth(job, cluster, trace, seed=seed, schedule_fn=TransitionSchedules(job, cluster))
    plans = PlanCache(job, cluster, time_limit_s=time_limit_s, seed=seed, candidates=SIM_CANDIDATES, deterministic=True)
    caches = {}  # an async job: sync policies plan synchronous steps, verl's baselines their own schedule

    def cache_for(name: str) -> tuple[JobSpec, PlanCache]:
        j = sync_job(job) if name in SYNC_ON_ASYNC else policy_job(name, job)
        if j is job:
            return job, plans
        key = j.schedule.to_dict().__repr__()
        if key not in caches:
            caches[key] = PlanCache(j, cluster, time_limit_s=time_limit_s, seed=seed, candidates=SIM_CANDIDATES,
                                    deterministic=True)
        return j, caches[key]

    online = [p for p in policies if p in ONLINE + ASYNC_ONLINE]
    audited = "adaptive" if "adaptive" in online else (online[0] if online else None)
    runs = len(trace) * (len(online) + ("static-naive" in policies))
    bar = _bar(progress, runs, trace.name)
    out: dict[str, PolicyResult] = {}
    wanted = [p for p in policies if p in OFFLINE + ("hindsight-split",)]
    picked = None
    if workers > 1 and len(online) > 1 and not audit_path and bar is None and job.schedule.kind == "sync":
        tasks = online + ([_PICKS] if wanted else [])  # the offline candidates' solves run beside them
        done = _run_forked(tasks, workers, job, cluster, trace, gt, plans, dict(
            params=params, horizon=horizon, margin=margin, seed=seed, admission=admission))
        picked = done.pop(_PICKS, None)
        out.update(done)
        online = []
    try:
        if "static-naive" in policies:
            out["static-naive"] = run_naive(sync_job(job), trace, gt, tick=bar.update if bar else None)
        for name in online:
            audit = AuditLog(audit_path) if audit_path and name == audited else None
            if bar is not None:
                bar.set_postfix_str(name)
            try:
                j, pc = cache_for(name)
                out[name] = run_online(name, j, cluster, trace, gt, pc, params=params, horizon=horizon,
                                       margin=margin, seed=seed, audit=audit, tick=bar.update if bar else None,
                                       admission=admission)
            except NereusError as e:  # the policy cannot even start (its layout rule has no feasible plan)
                out[name] = _not_run(name, len(trace), str(e))
            finally:
                if audit is not None:
                    audit.close()
    finally:
        if bar is not None:
            bar.close()
    if wanted:
        picked_plans, picked_s = picked if picked is not None else (None, 0.0)
        out.update(run_offline(job, trace, gt, plans, list(out.values()), wanted, params or CostParams(),
                               picked_plans, picked_s, workers=workers))
    return {p: out[p] for p in policies}


_FORKED: tuple = ()
"""What the forked workers of ``_run_forked`` inherit (set just before the fork)."""


def _run_forked(names: list[str], workers: int, job, cluster, trace, gt, plans, kw) -> dict[str, PolicyResult]:
    """The online policies in ``workers`` forked processes, each taking the costliest policy left in
    one queue when it is free (adaptive with adaptive-restart: one truth cache serves both); they
    share solves, bounds and layout-change prices (``shared_cache``) and hand their truth work back."""
    import multiprocessing as mp

    global _FORKED
    # rough seconds of each on the 1,000-step, 1,024-GPU benchmark (benchmarks/simulate_speed.py)
    cost = {"adaptive": 6.0, "adaptive-restart": 3.0, "always": 5.0, "static": 0.7, "openrlhf": 0.7, "verl": 0.7,
            "verl-offload": 0.7,
            _PICKS: 1.0}
    pair = [n for n in ("adaptive", "adaptive-restart") if n in names]
    units = [[n] for n in names if n not in pair] + ([pair] if pair else [])
    units.sort(key=lambda u: -sum(cost.get(n, 1.0) for n in u))
    gt.sample_all()  # every worker reads the same lengths: sampled once, before the fork
    ctx, n = mp.get_context("fork"), min(workers, len(units))
    manager = ctx.Manager()
    todo = manager.Queue()
    for unit in units + [None] * n:  # a None ends each worker
        todo.put(unit)
    _FORKED, done = (job, cluster, trace, gt, plans, kw, manager.dict(), todo), {}
    try:
        with ctx.Pool(n) as pool:
            for rs, priced, stages, engines in pool.imap_unordered(_forked_worker, range(n)):
                done.update(rs)
                gt.prices.merge(priced)  # the offline policies re-price the online ones' switches otherwise
                gt.merge_stage_results(stages)  # and re-run the model-stages the online policies ran
                gt.merge_engine_results(engines)  # and the engine runs other KV budgets of theirs share
    finally:
        _FORKED = ()
        manager.shutdown()
    return {n: done[n] for n in names}


_PICKS = "offline picks"
"""The task of ``_run_forked`` that solves the offline policies' extra candidates (``offline_picks``);
its result is (plans, seconds)."""


def _forked_worker(_: int) -> tuple[list[tuple[str, Any]], dict[tuple, float], dict, dict]:
    """One forked process: policies from the queue until it is empty -> (each policy's result, and
    the truth's layout-change prices, model-stage blocks and engine runs of this process)."""
    job, cluster, trace, gt, plans, kw, store, todo = _FORKED
    shared_cache.share(plans, gt.prices, store)
    out: list[tuple[str, Any]] = []
    for names in iter(todo.get, None):
        for name in names:
            if name == _PICKS:
                t0 = time.perf_counter()
                picked = offline_picks(job, trace, plans, kw["params"] or CostParams())
                out.append((name, (picked, time.perf_counter() - t0)))
                continue
            try:
                out.append((name, run_online(name, job, cluster, trace, gt, plans, **kw)))
            except NereusError as e:
                out.append((name, _not_run(name, len(trace), str(e))))
    return out, gt.prices.priced(), gt.stage_results(), gt.engine_results()


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulate {desc}", unit="step", leave=False)
