"""Per-model-stage times and memory of a whole plan, composed into a step time.

Used by the controller (with the planner's CostParams, then corrected by online calibration) and by
the simulator's ground truth (with different CostParams). The plan solver has its own objective;
this is the plain composition of the analytic cost model that both sides can afford every step
(about 0.5 ms per plan and workload, cached by callers).

Step time = sum over phases of the phase makespan (max over GPUs of the summed durations of the
model-stages running on that GPU in that phase) + the actor's weight sync from training to
generation layout; for an asynchronous schedule max(rollout, trainer) + the sync that cannot
overlap (``planner.schedules``). Memory per GPU = residents of every model homed on that GPU (pools nest: a
generation pool spans the actor's and the critic's) + the running stage's transient; generation's
KV budget is what the inference engine may take after those residents.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Mapping

from nereus.planner.cost.model import engine_memory_util, estimate, offloaded, params_per_gpu, weight_sync_s
from nereus.planner.cost.params import CostParams
from nereus.planner.plan import HOME_STAGE, Plan, StagePlacement
from nereus.planner.schedules import ScheduleSpec, step_time
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

GiB = 1024**3


def job_for(job: JobSpec, plan: Plan) -> JobSpec:
    """``job`` with the schedule ``plan`` was made for: the plan's recorded schedule (an ``auto`` job's
    plan says which it is), else the job's own (``auto`` with nothing recorded: sync)."""
    rec = dict(plan.extras).get("schedule")
    kind = rec.get("kind") if isinstance(rec, dict) else (job.schedule.kind if job.schedule.kind != "auto" else "sync")
    if kind == job.schedule.kind:
        return job
    if kind not in job.schedule.candidates():
        return replace(job, schedule=ScheduleSpec.from_value(rec))
    return job.with_schedule(kind)


def overlap_kind(job: JobSpec, plan: Plan) -> str | None:
    """The calibration key of ``plan``'s step composition when its stages overlap (an asynchronous
    schedule: ``"step/one_step_off"``, ``"step/fully_async"``), else None. Stage factors correct
    each stage; how far the rollout and the trainer really overlap (a streaming rollout's tail, the
    waits at a sync) only the logged step shows (``StepMetrics.step_s``): a factor per layout run
    (the median of its last 15 pairs of steps, observed / the composition of its corrected stages),
    and for a layout never run the median of the last 15 pairs over the layouts of that schedule.
    SIMULATED GRPO-8B on 128 H100s (r1zero_linear; measured ad hoc, docs/notes-round.md): the
    planner's uncorrected fully-async step was 0.50-0.65x the truth's, a gap stage factors cannot
    express."""
    kind = job_for(job, plan).schedule.kind
    return f"step/{kind}" if kind in ("one_step_off", "fully_async") else None


def as_batch(job: JobSpec, plan: Plan) -> Plan:
    """``plan`` with a fully-asynchronous schedule recorded as one-step-off (the same stages and
    pools, the rollout generating each batch on its own), else ``plan`` itself. What a loop logs as a
    step's generation time is the latency of that step's batch, its longest response included
    (``StepMetrics.stage_times``; the simulator's truth logs the batch's engine run the same way),
    while the planner prices a streaming rollout by its batch's share of an engine kept full, with
    no tail of its own: the two differ by 3-5x (SIMULATED GRPO-8B on 128 H100s, r1zero_linear,
    measured ad hoc with ``evaluate_times`` on the run's plans, docs/notes-round.md), so a generation
    factor is learned on the batch-latency prediction of the same config and applied to the
    streaming one. Learned on the streaming one, it carried that gap (a factor of about 3) onto
    every fully-async plan (``tests/unit/test_controller_async_calibration.py`` checks the factor)."""
    sched = job_for(job, plan).schedule
    if sched.kind != "fully_async":
        return plan
    extras = dict(plan.extras)
    extras["schedule"] = {"kind": "one_step_off", "staleness": sched.bound}
    return replace(plan, extras=tuple(extras.items()))


def workload_key(w: Workload) -> tuple:
    return (w.sequences, w.prompt_len, w.response_len_mean, w.response_len_max, w.response_len_p90,
            w.samples_per_prompt, w.response_len_prompt_corr)


@dataclass(frozen=True, slots=True)
class PlanTimes:
    """Per-model-stage times and memory of one plan on one workload, composed into a step time."""

    stage_s: Mapping[str, float]
    weight_sync_s: float
    step_s: float
    feasible: bool
    peak_mem_gib: Mapping[str, float]
    """Peak memory per GPU while each model-stage runs (GiB)."""
    violations: tuple[str, ...] = field(default=())


def _segments(plan: Plan) -> list[tuple[int, int]]:
    """Maximal GPU ranges [a, b) on which every stage's pool either covers all GPUs or none:
    pools nest (a generation pool over the actor's and the critic's), so sums are taken per
    segment, i.e. per GPU, never per pool id."""
    cuts = sorted({g for s in plan.stages for g in (s.first_gpu, s.first_gpu + s.gpus)})
    return list(zip(cuts, cuts[1:]))


def _covers(s, seg: tuple[int, int]) -> bool:
    return s.first_gpu <= seg[0] and seg[1] <= s.first_gpu + s.gpus


def phase_makespans(job: JobSpec, plan: Plan, stage_s: Mapping[str, float]) -> list[float]:
    """Each phase's makespan: the largest, over GPUs, of the summed times of that phase's stages
    running on the GPU."""
    segs = _segments(plan)
    out = []
    for phase in job.phases():
        stages = [plan.stage(ms) for ms in phase]
        out.append(max((sum(stage_s[s.name] for s in stages if _covers(s, seg)) for seg in segs), default=0.0))
    return out


def compose_step(job: JobSpec, plan: Plan, stage_s: Mapping[str, float], sync_s: float) -> float:
    """Step time from the phase makespans and the weight sync under the plan's schedule: their sum
    for ``sync``; max(rollout, trainer) + the sync that cannot overlap for an asynchronous one
    (``planner.schedules.step_time``)."""
    return step_time(job_for(job, plan).schedule, phase_makespans(job, plan, stage_s), sync_s)


def evaluate_times(job: JobSpec, cluster: ClusterSpec, plan: Plan, w: Workload, params: CostParams,
                   memo: dict | None = None) -> PlanTimes:
    """Time and memory of every model-stage of ``plan`` on ``w`` under ``params`` (noiseless).
    Memory is counted per GPU: the residents of every model homed on a GPU (pools nest) plus the
    running stage's transient. ``memo``: a dict the caller keeps for one job and one set of
    parameters, where stage estimates are shared between plans that hold a model-stage in the same
    configuration (the controller re-scores a library of plans that differ in a few stages), and in
    the same schedule (a job with ``schedule: auto`` holds plans of several). A training stage in the
    plan's "offload" extra keeps its optimizer state on the host (``cost.model.offloaded``), as the
    solver's own check prices it (``solver.check``)."""
    job = job_for(job, plan)
    usable = cluster.gpu.usable_bytes
    segs = _segments(plan)
    resident = {seg: 0.0 for seg in segs}
    est = {}
    wkey = workload_key(w) if memo is not None else None

    def stage_estimate(name: str, cfg: ParallelConfig, budget: float | None = None):
        if memo is None:
            return estimate(job, cluster, name, cfg, w, params, kv_budget_bytes=budget)
        key = (name, cfg, wkey, budget, cluster, job.schedule)  # a streaming rollout prices generation apart
        e = memo.get(key)
        if e is None:
            if len(memo) > 50000:
                memo.clear()
            e = memo[key] = estimate(job, cluster, name, cfg, w, params, kv_budget_bytes=budget)
        return e

    off = set(dict(plan.extras).get("offload") or ())  # training stages whose optimizer state is on the host
    for s in plan.stages:
        if s.stage != "generation":
            est[s.name] = e = stage_estimate(s.name, s.config)
            if s.name in off:
                est[s.name] = e = offloaded(e, params)
            if HOME_STAGE.get(s.role) == s.name:
                for seg in segs:
                    if _covers(s, seg):
                        resident[seg] += e.resident_bytes

    def most_resident(s) -> float:
        return max((r for seg, r in resident.items() if _covers(s, seg)), default=0.0)

    gen = plan.stage("actor/generation")
    shared = shares_training_weights(job, plan)
    gen_fixed = est_fixed_gen_bytes(job, cluster, gen.config, params, shared)
    budget = usable * engine_memory_util(job, params) - most_resident(gen) - gen_fixed
    est[gen.name] = stage_estimate(gen.name, gen.config, budget)
    violations = []
    peak = {}
    for s in plan.stages:
        e = est[s.name]
        mem = most_resident(s) + e.transient_bytes
        if shared and s is gen:  # generation reads the training shards: no copy of its own
            mem -= e.mem_breakdown.get("weights", 0.0)
        peak[s.name] = mem / GiB
        if mem > usable or not math.isfinite(e.time_s):
            violations.append(f"{s.name} {s.config.label()} needs {mem / GiB:.1f} GiB per GPU > {usable / GiB:.1f} GiB"
                              + (f" ({e.notes[0]})" if e.notes else ""))
    stage_s = {ms: e.time_s for ms, e in est.items()}
    train = plan.stage("actor/training")
    sync = weight_sync_s(job.model("actor"), train.config, gen.config, cluster, train.pool == gen.pool, params)
    step = compose_step(job, plan, stage_s, sync) if not violations else math.inf
    return PlanTimes(stage_s, sync, step, not violations, peak, tuple(violations))


def est_fixed_gen_bytes(job: JobSpec, cluster: ClusterSpec, cfg: ParallelConfig, params: CostParams,
                        shared: bool = False) -> float:
    """Generation weights + workspace per GPU (what the engine holds besides the KV cache); the
    weights in the model's dtype (``generation.estimate_generation`` counts them so), none when
    generation reads the training shards (``shares_training_weights``)."""
    model = job.model("actor")
    weights = 0.0 if shared else model.dtype_bytes * params_per_gpu(model, cfg.tp, cfg.pp)
    return weights + params.workspace_gib * GiB


def shares_training_weights(job: JobSpec, plan: Plan) -> bool:
    """Whether ``plan``'s generation runs on the actor's training shards instead of a copy of its
    own: a static-batch engine (Hugging Face ``generate`` on the training model, Nereus's reference
    executor: ``demo.worker``) on the GPUs and in the layout (TP, PP, DP) of actor training. A
    paged engine (vLLM, SGLang) always holds its own copy."""
    return job.rollout.engine == "static" and same_layout(plan.stage("actor/generation"), plan.home("actor"))


def same_layout(a: StagePlacement, b: StagePlacement) -> bool:
    """The same GPUs and the same TP, PP and DP: one stage can run on the other's shards."""
    return ((a.first_gpu, a.gpus, a.config.tp, a.config.pp, a.config.dp)
            == (b.first_gpu, b.gpus, b.config.tp, b.config.pp, b.config.dp))


