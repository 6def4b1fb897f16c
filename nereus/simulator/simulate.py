"""Replay a trace through policies against the ground truth, and summarise.

Per step of an online policy: the plan decided after the previous step runs the step in the ground
truth (noisy stage times); the policy sees only those observations (the metrics a training loop
logs), the GPUs granted for the next step and the next step's response cap, and decides the next
plan; a layout change blocks the job for its ground-truth transition time. A step whose plan does
not fit in memory (or needs more GPUs than granted) is an *infeasible step*: counted, and charged
the fastest usable candidate's time at that step (a lower bound, so an infeasible baseline is never
made to look slower than it could be). The oracle runs last, over every plan the others used.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from nereus.errors import SpecError
from nereus.planner.online.audit import AuditLog
from nereus.planner.online.controller import StepMetrics
from nereus.planner.cost.params import CostParams
from nereus.planner.plan import Plan
from nereus.planner.online.plan_cache import FREE, PlanCache
from nereus.planner.cost.plan_times import plan_key
from nereus.simulator.groundtruth import GroundTruth
from nereus.simulator.oracle import segments, solve_oracle
from nereus.simulator.policies import ONLINE, POLICIES, make_controller
from nereus.simulator.trace import Trace
from nereus.planner.specs import ClusterSpec, JobSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyResult:
    policy: str
    step_s: tuple[float, ...]
    """Per step seconds (infeasible steps: the charged lower bound)."""
    transition_s: tuple[float, ...]
    """Per step, the transition time paid before it."""
    infeasible: tuple[bool, ...]
    plans: tuple[Plan, ...] = field(default=(), repr=False)
    """Distinct plans used (for the oracle's candidate set)."""
    wall_s: float = 0.0
    solves: int = 0
    max_overhead_ms: float = 0.0
    mean_overhead_ms: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.step_s) + sum(self.transition_s)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` record of the CLI contract (plus a few diagnostics)."""
        n, total, trans = len(self.step_s), self.total_s, sum(self.transition_s)
        return {"steps": n, "mean_step_s": total / n, "total_s": total, "transition_s": trans,
                "transition_overhead": trans / total if total else 0.0,
                "transitions": sum(1 for t in self.transition_s if t > 0), "infeasible_steps": sum(self.infeasible),
                "mean_compute_step_s": sum(self.step_s) / n, "wall_s": self.wall_s, "solves": self.solves,
                "controller_overhead_ms_mean": self.mean_overhead_ms, "controller_overhead_ms_max": self.max_overhead_ms}


def _metrics(trace: Trace, i: int, obs, base_prompt: int) -> StepMetrics:
    r = trace.rows[i]
    nxt = trace.rows[min(i + 1, len(trace.rows) - 1)]
    return StepMetrics(step=r.step, response_len_mean=r.response_len_mean, response_len_max=r.response_len_max,
                       response_len_p90=r.response_len_p90,
                       prompt_len=base_prompt if r.prompt_len_mean is None else round(r.prompt_len_mean),
                       stage_times=dict(obs.stage_s) if obs.feasible else {}, peak_mem_gib=obs.peak_mem_gib,
                       gpus_available=nxt.gpus, response_len_cap=nxt.response_len_max, oom=not obs.feasible)


def run_online(name: str, job: JobSpec, cluster: ClusterSpec, trace: Trace, gt: GroundTruth, plans: PlanCache, *,
               params: CostParams | None = None, horizon: int = 200, margin: float = 0.25, seed: int = 0,
               audit: AuditLog | None = None, tick: Callable[[], None] | None = None) -> PolicyResult:
    t0 = time.perf_counter()
    solves0 = plans.solves
    base = job.workload()
    ctl = make_controller(name, job, cluster, trace.workload(0, base), trace.rows[0].gpus, total_steps=len(trace),
                          plans=plans, horizon=horizon, margin=margin, audit=audit, seed=seed, params=params)
    plan = ctl.plan
    used = {plan_key(plan): plan}
    step_s, trans_s, infeasible, overhead = [], [0.0], [], []
    for i, row in enumerate(trace.rows):
        obs = gt.observe(plan, trace.workload(i, base), i)
        ok = obs.feasible and plan.num_gpus <= row.gpus
        infeasible.append(not ok)
        step_s.append(obs.step_s if ok else math.nan)
        if tick:
            tick()
        if i == len(trace.rows) - 1:
            break
        d = ctl.step(_metrics(trace, i, obs if ok else _failed(obs), base.prompt_len))
        overhead.append(d.overhead_s)
        t = 0.0
        if d.action == "switch":
            t = gt.transition_s(plan, d.plan)
            if t > 0:
                ctl.report_transition(t)
            plan = d.plan
            used.setdefault(plan_key(plan), plan)
        trans_s.append(t)
    ctl.close()
    ov = [x * 1e3 for x in overhead] or [0.0]
    return PolicyResult(policy=name, step_s=tuple(step_s), transition_s=tuple(trans_s), infeasible=tuple(infeasible),
                        plans=tuple(used.values()), wall_s=time.perf_counter() - t0, solves=plans.solves - solves0,
                        max_overhead_ms=max(ov), mean_overhead_ms=sum(ov) / len(ov))


def _failed(obs):
    from nereus.simulator.groundtruth import Observation

    return Observation({}, math.inf, False, obs.peak_mem_gib, obs.violations)


def oracle_candidates(job: JobSpec, trace: Trace, gt: GroundTruth, plans: PlanCache, results: Iterable[PolicyResult],
                      samples: int = 2) -> tuple[list[Plan], list[int]]:
    """Every plan the online policies used, plus the solver's best under the *true* parameters for
    ``samples`` evenly spaced trace segments and the first segment after every GPU change; returns
    (plans, indices of the extra plans)."""
    cands = {}
    for r in results:
        for p in r.plans:
            cands.setdefault(plan_key(p), p)
    extra: list[int] = []
    segs = segments(trace)
    picks = {round(j * (len(segs) - 1) / max(1, samples - 1)) for j in range(samples)}
    picks |= {j for j in range(1, len(segs)) if trace.rows[segs[j][0]].gpus != trace.rows[segs[j - 1][0]].gpus}
    base = job.workload()
    for j in sorted(picks):
        a = segs[j][0]
        p = plans.best(FREE, trace.workload(a, base), trace.rows[a].gpus, gt.params, ("truth",))
        if p is not None and plan_key(p) not in cands:
            cands[plan_key(p)] = p
            extra.append(len(cands) - 1)
    return list(cands.values()), extra


def run_oracle(job: JobSpec, trace: Trace, gt: GroundTruth, plans: PlanCache, results: list[PolicyResult]) -> PolicyResult:
    t0 = time.perf_counter()
    solves0 = plans.solves
    cands, extra = oracle_candidates(job, trace, gt, plans, results)
    path = solve_oracle(gt, trace, job.workload(), cands, extra, edge_budget=16)
    used = {path.plan_index[0]} | set(path.plan_index)
    return PolicyResult(policy="oracle", step_s=path.step_s, transition_s=path.transition_s,
                        infeasible=(False,) * len(path.step_s), plans=tuple(cands[i] for i in sorted(used)),
                        wall_s=time.perf_counter() - t0, solves=plans.solves - solves0), path.floor_s


def charge_infeasible(r: PolicyResult, floor: tuple[float, ...]) -> PolicyResult:
    from dataclasses import replace

    return replace(r, step_s=tuple(f if bad else s for s, f, bad in zip(r.step_s, floor, r.infeasible)))


def simulate(job: JobSpec, cluster: ClusterSpec, trace: Trace, policies: Iterable[str] = POLICIES, *,
             gt: GroundTruth | None = None, params: CostParams | None = None, horizon: int = 200,
             margin: float = 0.25, seed: int = 0, time_limit_s: float = 5.0, audit_path: str | None = None,
             progress: bool = False) -> dict[str, PolicyResult]:
    """Run ``policies`` over ``trace``; results in the order asked. ``audit_path`` logs the adaptive
    controller's decisions (or the first online policy's when adaptive is not run)."""
    policies = list(dict.fromkeys(policies))
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise SpecError(f"unknown policy {bad}; choose from {', '.join(POLICIES)} or all")
    if trace.max_gpus > cluster.num_gpus:
        raise SpecError(f"trace {trace.name} asks for {trace.max_gpus} GPUs; cluster has {cluster.num_gpus}")
    gt = gt or GroundTruth(job, cluster, seed=seed)
    plans = PlanCache(job, cluster, time_limit_s=time_limit_s, seed=seed)
    online = [p for p in policies if p in ONLINE]
    audited = "adaptive" if "adaptive" in online else (online[0] if online else None)
    bar = _bar(progress, len(trace) * len(online), trace.name)
    out: dict[str, PolicyResult] = {}
    try:
        for name in online:
            audit = AuditLog(audit_path) if audit_path and name == audited else None
            if bar is not None:
                bar.set_postfix_str(name)
            try:
                out[name] = run_online(name, job, cluster, trace, gt, plans, params=params, horizon=horizon,
                                       margin=margin, seed=seed, audit=audit, tick=bar.update if bar else None)
            finally:
                if audit is not None:
                    audit.close()
    finally:
        if bar is not None:
            bar.close()
    need_floor = any(any(r.infeasible) for r in out.values())
    if "oracle" in policies or need_floor:
        oracle, floor = run_oracle(job, trace, gt, plans, list(out.values()))
        out = {k: charge_infeasible(r, floor) for k, r in out.items()}
        if "oracle" in policies:
            out["oracle"] = oracle
    return {p: out[p] for p in policies}


def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulate {desc}", unit="step", leave=False)
