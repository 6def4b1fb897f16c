"""Published asynchronous RL runs (corpus category ``async``) predicted by the planner's async step.

A row (``nereus/calibration/published/async.csv``) states the rollout : trainer split
(``rollout_gpus``, ``train_gpus``), the schedule (``one_step_off`` / ``fully_async``, with the
``staleness`` bound and ``sync_every``; ``sync`` for a streamed run without staleness) and the
source's job settings (the keys of ``rl_stages.csv``). Its prediction is what ``nereus plan``
would say about that plan:

- the job is ``predict.rl_job`` of the row with the row's schedule;
- the plan puts ``actor/generation`` alone on the first ``rollout_gpus`` GPUs (TP ``rollout_tp``)
  and every other model-stage on the next ``train_gpus`` (the source's ``tp`` / ``pp``, DP the
  rest), on nodes of ``gpus_per_node`` (default 8);
- each model-stage is ``estimate``d with the framework settings the row states
  (``predict.stage_settings``, as the RL-stage rows are), the weight sync is the cross-pool
  ``weight_sync_s``, and the step is ``plan_times.compose_step`` (``schedules.step_time``:
  max(rollout, trainer) + the sync that cannot overlap); ``evaluate_times`` checks each pool's memory.

What each ``stage`` predicts: ``step`` the steady-state step; ``generate_sequences`` the
rollout pool's generation; ``old_log_prob`` / ``ref`` / ``update_actor`` the trainer pool's
stages; ``wait_prev_gen`` and a fully-async row's ``gen`` the trainer's wait for the rollout
(rollout - trainer, when positive); ``weight_sync`` one cross-pool sync.

``speedups`` derives the second comparison: async over sync step time, predicted (this module over
``predict``'s sync pricing of the baseline row the async row names, ``sync_row``) against published.
No constant here is fitted; every async step row is held out (the corpus loader refuses one in the
fit split). The one exception is a weight sync measured on its own (``stage=weight_sync`` of a
checkpoint engine's benchmark): the fit split's bucketed ones fit ``weight_sync_tensor_s``
(``fit.weight_sync_tensor_s``); verl's checkpoint-engine ablation (``asyncsync-*``) stays held out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from nereus.fidelity.catalog import moe_preset
from nereus.fidelity.corpus import Row
from nereus.fidelity.rl_rows import controller_width, rl_job, stage_settings
from nereus.fidelity.rows import Unsupported, _int, _model
from nereus.models.spec import ModelSpec
from nereus.planner.cost.comm import weight_sync_s
from nereus.planner.cost.model import StageOptions, estimate
from nereus.planner.cost.params import CostParams
from nereus.planner.cost.plan_times import compose_step, evaluate_times, phase_makespans
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.specs import ClusterSpec, GPUSpec, ParallelConfig

GEN = "actor/generation"


@dataclass(frozen=True, slots=True)
class AsyncTimes:
    """The priced plan of one async row."""

    stage_s: Mapping[str, float]
    rollout_s: float
    trainer_s: float
    sync_s: float
    step_s: float
    violations: tuple[str, ...]


def async_plan(row: Row, gpu: GPUSpec, p: CostParams) -> AsyncTimes:
    """Build the job and the two-pool plan of ``row`` and price it (see the module docstring). The
    run happened, so its layout fit: neither the plans' reserve for the model's memory error
    (``mem_reserve_frac``) nor the allocator's reserved slack (``mem_fragmentation``, cache it frees
    before an out-of-memory error) may refuse it."""
    from dataclasses import replace as _replace

    p = _replace(p, mem_reserve_frac=0.0, mem_fragmentation=1.0)
    model, gpu = _model(row, gpu)
    kind = row.get("schedule") or ""
    if kind not in ("sync", "one_step_off", "fully_async"):
        raise Unsupported(f"schedule {kind!r} not modelled")
    job, w = rl_job(row, model)
    sched = ScheduleSpec(kind=kind, staleness=_int(row, "staleness", 0 if kind == "sync" else 1),
                         sync_every=_int(row, "sync_every", 1) if kind == "fully_async" else 1)
    job = replace(job, schedule=sched, rollout=replace(job.rollout, sleep=False))
    R, T = _int(row, "rollout_gpus"), _int(row, "train_gpus")
    per_node = _int(row, "gpus_per_node", 8)
    cluster = ClusterSpec(gpu=gpu, nodes=max(1, math.ceil((R + T) / per_node)), gpus_per_node=min(per_node, R + T))
    tp, pp, rtp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "rollout_tp", 1)
    if T % (tp * pp) or R % rtp:
        raise Unsupported(f"tp*pp = {tp * pp} does not divide {T} trainer GPUs or rollout_tp {rtp} {R} rollout GPUs")
    fsdp = "fsdp" in (row.get("actor_backend") or "fsdp")
    gen = ParallelConfig(tp=rtp, dp=R // rtp)
    cfgs: dict[str, tuple[ParallelConfig, StageOptions]] = {GEN: (gen, StageOptions(controller_width=controller_width(row)))}
    for ms in job.model_stages():
        if ms != GEN:
            cfgs[ms] = stage_settings(row, ms, tp, pp, T // (tp * pp), fsdp)
    plan = Plan(stages=tuple(StagePlacement(name=ms, config=c, pool=0 if ms == GEN else 1, first_gpu=0 if ms == GEN else R,
                                            gpus=R if ms == GEN else T) for ms, (c, _) in cfgs.items()),
                extras=(("schedule", sched.to_dict()),))
    stage_s = {ms: estimate(job, cluster, ms, c, w, p, options=o).time_s for ms, (c, o) in cfgs.items()}
    sync = weight_sync_s(model, cfgs["actor/training"][0], gen, cluster, False, p)
    spans = phase_makespans(job, plan, stage_s)
    check = evaluate_times(job, cluster, plan, w, p)  # each pool's memory on its own GPUs
    return AsyncTimes(stage_s, spans[0], sum(spans[1:]), sync, compose_step(job, plan, stage_s, sync), check.violations)


def sync_model(row: Row, gpu: GPUSpec) -> tuple[ModelSpec, GPUSpec]:
    """The model a weight-sync row moves: the catalog's, or a mixture-of-experts model's preset
    (every expert's bytes and tensors move)."""
    try:
        return _model(row, gpu)
    except Unsupported:
        model = moe_preset(row.model)
        if model is None:
            raise
        return model, gpu


def _weight_sync(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """One cross-pool sync of the row's actor (``comm.weight_sync_s``): ``checkpoint_engine=1``
    (default) a bucketed sync, 0 one broadcast per tensor; ``sync_ranks`` the broadcast group where
    it is not the two pools (a checkpoint engine staging the weights in the rollout hosts' memory);
    ``gpus_per_node`` default 8."""
    model, gpu = sync_model(row, gpu)
    R, T = _int(row, "rollout_gpus"), _int(row, "train_gpus")
    tp, rtp = _int(row, "tp", 1), _int(row, "rollout_tp", 1)
    group = _int(row, "sync_ranks", 0) or None
    per_node = _int(row, "gpus_per_node", 8)
    ranks = group or R + T
    cluster = ClusterSpec(gpu=gpu, nodes=max(1, math.ceil(ranks / per_node)), gpus_per_node=min(per_node, ranks))
    method = "per_tensor" if row.get("checkpoint_engine", "1") == "0" else "bucketed"
    return weight_sync_s(model, ParallelConfig(tp=tp, dp=T // tp), ParallelConfig(tp=rtp, dp=R // rtp), cluster, False, p,
                         method=method, group=group)


def predict_async(row: Row, gpu: GPUSpec, p: CostParams) -> float:
    """Seconds of the row's ``stage`` under its async plan."""
    stage = row.get("stage", "")
    if stage == "weight_sync":
        return _weight_sync(row, gpu, p)
    t = async_plan(row, gpu, p)
    if t.violations:
        raise Unsupported(f"the plan does not fit: {t.violations[0]}")
    if stage == "step":
        return t.step_s
    if stage == "generate_sequences":
        return t.stage_s[GEN]
    if stage in ("wait_prev_gen", "gen"):
        wait = t.rollout_s - t.trainer_s
        if wait <= 0:
            raise Unsupported(f"the model's trainer pool is the slower ({t.trainer_s:.0f} s vs rollout {t.rollout_s:.0f} s): "
                              "it predicts no wait")
        return wait
    ms = {"old_log_prob": "actor/inference", "ref": "ref/inference", "update_actor": "actor/training"}.get(stage)
    if ms is None or ms not in t.stage_s:
        raise Unsupported(f"async stage {stage!r} not modelled")
    return t.stage_s[ms]


def composition_check(rows: Iterable[Row]) -> list[dict]:
    """The step rule alone, fed the source's own measured pool timings: for every one-step-off run
    whose source gives the rollout pool's generation and the trainer's stages, ``step_time`` of
    (generate_sequences, old_log_prob + update_actor) with no sync (verl's NCCL sync, under 300 ms
    per its doc) against the published step. It checks the schedule's composition, not the cost model."""
    from nereus.planner.schedules import step_time

    runs: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.category == "async" and r.get("schedule") == "one_step_off":
            runs.setdefault((r.source, r.engine, r.get("actor_backend")), {})[r.get("stage", "")] = r
    out = []
    for (_, engine, _), st in runs.items():
        if not {"step", "generate_sequences", "old_log_prob", "update_actor"} <= st.keys():
            continue
        trainer = st["old_log_prob"].value + st["update_actor"].value
        composed = step_time(ScheduleSpec(kind="one_step_off"), [st["generate_sequences"].value, trainer], 0.0)
        rec = {"step_row": st["step"].id, "engine": engine, "rollout_s": st["generate_sequences"].value, "trainer_s": trainer,
               "composed_step_s": composed, "published_step_s": st["step"].value, "ratio": composed / st["step"].value}
        if "wait_prev_gen" in st:
            rec.update(published_wait_s=st["wait_prev_gen"].value, composed_wait_s=max(0.0, st["generate_sequences"].value - trainer))
        out.append(rec)
    return out
