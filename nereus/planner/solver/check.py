"""Independent plan checker: recomputes every time and memory figure of a Plan from
``nereus.planner.cost.model`` GPU by GPU, without the solver's option tables or constraint code.

Used by the tests (every solver plan must pass), the controller and the simulator (is the current
plan still feasible for the next workload, and how fast is it).
"""
from __future__ import annotations

import dataclasses
import math

from nereus.errors import SpecError
from nereus.planner.cost.model import estimate, weight_sync_s
from nereus.planner.cost.model import offloaded as with_offload
from nereus.planner.cost.plan_times import job_for
from nereus.planner.plan import HOME_STAGE, Plan
from nereus.planner.schedules import step_time
from nereus.planner.solver.problem import PlanEvaluation, PlanProblem
from nereus.planner.specs import GiB

GEN = "actor/generation"


def _layout_violations(problem: PlanProblem, plan: Plan) -> list[str]:
    c, out = problem.cluster, []
    names = {s.name for s in plan.stages}
    for ms in problem.job.model_stages():
        if ms not in names:
            out.append(f"{ms}: missing from the plan")
    for s in plan.stages:
        cfg = s.config
        if cfg.tp * cfg.pp * cfg.dp != s.gpus:
            out.append(f"{s.name}: tp*pp*dp = {cfg.tp * cfg.pp * cfg.dp} != pool GPUs {s.gpus}")
        if s.first_gpu + s.gpus > c.num_gpus:
            out.append(f"{s.name}: GPUs [{s.first_gpu}, {s.first_gpu + s.gpus}) beyond the cluster's {c.num_gpus}")
        for pp_rank in range(cfg.pp):
            for dp_rank in range(cfg.dp):
                lo, hi = s.gpu_of(0, pp_rank, dp_rank), s.gpu_of(cfg.tp - 1, pp_rank, dp_rank)
                if c.node_of(lo) != c.node_of(hi):
                    out.append(f"{s.name}: TP group on GPUs {lo}..{hi} spans nodes")
                    break
    for role in ("actor", "critic"):
        if f"{role}/training" in names and f"{role}/inference" in names:
            a, b = plan.stage(f"{role}/training"), plan.stage(f"{role}/inference")
            if (a.first_gpu, a.gpus, a.config.tp, a.config.pp, a.config.dp) != \
               (b.first_gpu, b.gpus, b.config.tp, b.config.pp, b.config.dp):
                out.append(f"{role}/inference must run in the layout of {role}/training")
    return out


def _estimates(problem: PlanProblem, plan: Plan) -> dict:
    """Cost-model estimates per model-stage; a training stage listed in the plan's "offload" extra
    keeps its optimizer state in host memory and pays the transfer (cost.offload_s)."""
    extras = dict(plan.extras)
    kv_gib = extras.get("generation_kv_budget_gib")
    offloaded = set(extras.get("offload") or ())
    ests = {}
    for s in plan.stages:
        kv = kv_gib * GiB if (s.name == GEN and kv_gib is not None) else None
        e = estimate(problem.job, problem.cluster, s.name, s.config, problem.workload, problem.params,
                     kv_budget_bytes=kv)
        if s.name in offloaded:
            e = with_offload(e, problem.params)
        ests[s.name] = e
    return ests


def _on_cluster(s, n: int) -> range:
    """The stage's GPUs that exist (GPUs past the cluster are reported as a violation)."""
    return range(s.first_gpu, min(s.first_gpu + s.gpus, n))


def evaluate_plan(problem: PlanProblem, plan: Plan) -> PlanEvaluation:
    """Step time, memory per GPU and violations of ``plan`` for ``problem``'s workload, under the
    schedule the plan was made for (``plan_times.job_for``)."""
    problem = dataclasses.replace(problem, job=job_for(problem.job, plan))
    c = problem.cluster
    violations = _layout_violations(problem, plan)
    try:
        ests = _estimates(problem, plan)
    except SpecError as e:
        return PlanEvaluation(step_time_s=math.inf, feasible=False, violations=(*violations, str(e)),
                              stage_time_s=(), stage_mem_gib=(), phase_makespan_s=(), weight_sync_s=math.inf,
                              peak_mem_gib=math.inf, capacity_gib=c.gpu.usable_bytes / GiB)
    n = c.num_gpus
    resident = [0.0] * n
    for role in problem.job.roles:
        home = plan.stage(HOME_STAGE[role])
        for g in _on_cluster(home, n):
            resident[g] += ests[home.name].resident_bytes
    transient = [0.0] * n
    for s in plan.stages:
        for g in _on_cluster(s, n):
            transient[g] = max(transient[g], ests[s.name].transient_bytes)
    per_gpu = [r + t for r, t in zip(resident, transient)]
    cap = c.gpu.usable_bytes
    over = [g for g in range(n) if per_gpu[g] > cap * (1 + 1e-9)]
    if over:
        g = max(over, key=lambda i: per_gpu[i])
        violations.append(f"GPU {g}: {per_gpu[g] / GiB:.2f} GiB > {cap / GiB:.2f} GiB usable "
                          f"({len(over)} GPUs over capacity)")
    for s in plan.stages:
        if not math.isfinite(ests[s.name].time_s):
            violations.append(f"{s.name}: {'; '.join(ests[s.name].notes) or 'infinite time'}")
    makespans = []
    for phase in problem.job.phases():
        load = [0.0] * n
        for ms in phase:
            s = plan.stage(ms)
            for g in _on_cluster(s, n):
                load[g] += ests[ms].time_s
        makespans.append(max(load))
    train, gen = plan.stage("actor/training"), plan.stage(GEN)
    colocated = bool(set(train.gpu_ids()) & set(gen.gpu_ids()))
    schedule = problem.job.schedule
    if schedule.is_async:  # the rollout pool is its own: no trainer-side model-stage on its GPUs
        shared = [s.name for s in plan.stages if s.name != GEN and set(s.gpu_ids()) & set(gen.gpu_ids())]
        if shared:
            violations.append(f"{schedule.kind}: the rollout pool (GPUs {gen.first_gpu}-{gen.first_gpu + gen.gpus - 1}) "
                              f"is shared with {', '.join(shared)}")
    sync = weight_sync_s(problem.job.model("actor"), train.config, gen.config, c, colocated, problem.params)
    stage_mem = tuple((s.name, max((resident[g] + ests[s.name].transient_bytes for g in _on_cluster(s, n)),
                                   default=math.inf) / GiB) for s in plan.stages)
    return PlanEvaluation(step_time_s=step_time(schedule, makespans, sync), feasible=not violations, violations=tuple(violations),
                          stage_time_s=tuple((s.name, ests[s.name].time_s) for s in plan.stages),
                          stage_mem_gib=stage_mem, phase_makespan_s=tuple(makespans), weight_sync_s=sync,
                          peak_mem_gib=max(per_gpu) / GiB, capacity_gib=cap / GiB)
