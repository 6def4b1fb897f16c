"""The policies the simulator compares. No policy sees the ground truth's internals: online ones
get only what a training loop logs (stage times, lengths, peak memory, OOMs), offline ones only
ground-truth step and transition times.

All online policies are the same ``Controller`` (same forecast, calibration, caching and
admission logic); they differ only in which layouts they may choose (``LayoutRule``) and whether
they weigh transition cost:

- ``adaptive``: any layout, cost-aware admission (Nereus).
- ``adaptive-restart``: the same in restart mode (``Controller(transition_mode="restart")``): every
  switch is a checkpoint save + relaunch, priced so by the controller and charged so by the truth.
- ``always``: any layout, switches to the best plan for the next step every step (ignores cost).
- ``static``: the solver's plan for the first step, its TP/PP and pools kept, DP scaling with the
  GPUs; the controller still re-tunes micro-batch, recomputation, ZeRO stage and KV budget.
- ``verl``: every model-stage colocated on all GPUs (hybrid engine), FSDP training (TP1 PP1),
  rollout with a fixed TP; knobs re-tuned by the controller.
- ``openrlhf``: disaggregated fixed pools per model (chosen once by the solver for the first
  step, then only scaled with the GPUs), DeepSpeed-style TP1 PP1 training, fixed rollout TP.

Scripted: ``static-naive`` is what a user does by hand (``NaiveUser``): the layout of the
framework's examples for the actor's size, fixed micro-batches; an OOM crashes the job, which
restarts from its checkpoint after the user halves the failing stage's micro-batch (or, at 1,
doubles its TP); a new GPU count is taken by a restart with DP scaled.

Offline (``oracle.py``): ``hindsight`` (the best single layout for the whole trace) and ``oracle``
(the best plan sequence).
"""
from __future__ import annotations

from dataclasses import replace

from nereus.errors import SpecError
from nereus.planner.online.controller import Controller
from nereus.planner.cost.params import CostParams
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache, static_rule
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

POLICIES = ("static-naive", "static", "hindsight", "adaptive", "adaptive-restart", "always", "oracle", "verl",
            "openrlhf")
ONLINE = ("static", "adaptive", "adaptive-restart", "always", "verl", "openrlhf")
RESTART_MODE = ("adaptive-restart",)
"""Policies that switch plans by checkpoint and relaunch (a framework without live resharding)."""
SCRIPTED = ("static-naive",)
SOLVE_BUCKET_RATIO = 1.5
"""Workload buckets the simulated controllers ask the solver on: a plan is solved for the bucket's
mean response length, so a step's forecast mean is within a factor sqrt(1.5) (-18% .. +22%) of the
length its candidates were solved for; every candidate is then scored at the exact forecast (within
the 4% scoring buckets). Measured effect: see nereus/simulator/README.md."""
OFFLINE = ("hindsight", "oracle")


def rollout_tp(job: JobSpec) -> int:
    """The rollout TP a verl/OpenRLHF user picks for this actor size (their examples: TP2 for 7-8B,
    TP4 for 30B-class, TP8 for 70B)."""
    n = job.model("actor").num_params()
    return 2 if n < 20e9 else 4 if n < 40e9 else 8


def framework_tp_pp(job: JobSpec) -> tuple[tuple[str, int, int], ...]:
    """FSDP / DeepSpeed ZeRO-3 training (TP1 PP1), rollout engine with a fixed TP. Frozen models
    (reference, reward) run TP1 up to 20B parameters and at the rollout TP above: the frameworks
    shard them with FSDP / ZeRO-3, which the planner's model does not shard for a frozen model, so
    the baseline gets the nearest layout it can express (Megatron-backed examples use the rollout
    TP for the reference of 30-70B models)."""
    fixed = [("actor/generation", rollout_tp(job), 1)]
    for role in job.roles:
        if role in ("actor", "critic"):
            fixed.append((f"{role}/training", 1, 1))
        else:
            big = job.model(role).num_params() >= 20e9
            fixed.append((f"{role}/inference", rollout_tp(job) if big else 1, 1))
    return tuple(fixed)


def make_controller(name: str, job: JobSpec, cluster: ClusterSpec, w0: Workload, gpus0: int, *,
                    total_steps: int | None, plans: PlanCache, horizon: int = 200, margin: float = 0.25,
                    audit=None, seed: int = 0, params: CostParams | None = None) -> Controller:
    """A controller that behaves like policy ``name`` from its first step on."""
    base = params or CostParams()
    if name not in ONLINE:
        raise SpecError(f"unknown online policy {name!r}; choose from {ONLINE}")
    common = dict(initial_gpus=gpus0, initial_workload=w0, total_steps=total_steps, horizon=horizon, margin=margin,
                  params=base, plans=plans, build_transition=False, seed=seed, audit=audit,
                  solve_bucket_ratio=SOLVE_BUCKET_RATIO)
    if name in ("adaptive", "always"):
        return Controller(job, cluster, mode=name, rule=FREE, **common)
    if name == "adaptive-restart":  # the launch configuration is not needed to replay the run: not emitted
        return Controller(job, cluster, mode="adaptive", rule=FREE, transition_mode="restart", framework=None, **common)
    if name == "static":
        first = plans.best(FREE, w0, gpus0, base)
        if first is None:
            raise SpecError(f"static: no feasible plan for the first step on {gpus0} GPUs ({plans.last_message})")
        return Controller(job, cluster, rule=static_rule(first), initial_plan=first, **common)
    fixed = framework_tp_pp(job)
    if name == "verl":
        return Controller(job, cluster, rule=LayoutRule(name="verl", placement="colocated", fixed_tp_pp=fixed), **common)
    pools = LayoutRule(name="openrlhf-pools", placement="disaggregated", fixed_tp_pp=fixed)
    first = plans.best(pools, w0, gpus0, base)
    if first is None:
        raise SpecError(f"openrlhf: no feasible disaggregated plan for the first step on {gpus0} GPUs "
                        f"({plans.last_message})")
    rule = LayoutRule(name="openrlhf", placement="disaggregated", fixed_tp_pp=fixed, anchor=first)
    return Controller(job, cluster, rule=rule, initial_plan=first, **common)


# ---- static-naive: the user who copies the framework's example ------------------------------------
def naive_micro_batches(job: JobSpec) -> tuple[int, int]:
    """(training, log-prob) micro-batch per GPU of verl's example scripts for the actor's size:
    ppo_micro_batch_size_per_gpu 4 / log_prob_micro_batch_size_per_gpu 8 for 7-8B models, halved for
    30B-class and again for 70B-class models (memory per sequence grows with the hidden size)."""
    n = job.model("actor").num_params()
    return (4, 8) if n < 20e9 else (2, 4) if n < 40e9 else (1, 2)


def naive_plan(job: JobSpec, gpus: int) -> Plan:
    """verl's example layout on ``gpus`` GPUs: one pool (hybrid engine), rollout with the recommended
    TP, every other model-stage FSDP (ZeRO-3, TP1 PP1) with gradient checkpointing in training."""
    train_mb, infer_mb = naive_micro_batches(job)
    tp = rollout_tp(job)
    if gpus % tp:
        raise SpecError(f"static-naive: {gpus} GPUs are not a multiple of the rollout TP {tp}")
    stages = [StagePlacement(name="actor/generation", config=ParallelConfig(tp=tp, dp=gpus // tp), pool=0,
                             first_gpu=0, gpus=gpus)]
    for ms in job.model_stages():
        if ms == "actor/generation":
            continue
        training = ms.endswith("/training")
        cfg = ParallelConfig(tp=1, pp=1, dp=gpus, micro_batch=train_mb if training else infer_mb, zero=3,
                             recompute=training)
        stages.append(StagePlacement(name=ms, config=cfg, pool=0, first_gpu=0, gpus=gpus))
    return Plan(stages=tuple(stages), backend="static-naive")


def rescale_naive(plan: Plan, gpus: int) -> Plan:
    """The same settings on ``gpus`` GPUs (DP follows the GPU count)."""
    stages = tuple(replace(s, gpus=gpus, config=replace(s.config, dp=gpus // (s.config.tp * s.config.pp)))
                   for s in plan.stages)
    return replace(plan, stages=stages)


def naive_fix(job: JobSpec, plan: Plan, stage: str) -> Plan | None:
    """What the user changes after an OOM in ``stage``: halve its micro-batch (a trainable model's
    log-prob pass shares the training layout but has its own micro-batch), else double its TP
    (generation: the rollout TP); None when nothing is left to try."""
    s = plan.stage(stage)
    c = s.config
    if stage != "actor/generation" and c.micro_batch > 1:
        return _with(plan, {stage: replace(c, micro_batch=c.micro_batch // 2)})
    tp = c.tp * 2
    model = job.model(s.role)
    if tp > 8 or s.gpus % (tp * c.pp) or model.heads % tp:
        return None
    names = [stage] if s.role not in ("actor", "critic") or stage == "actor/generation" else \
        [n for n in (f"{s.role}/training", f"{s.role}/inference") if n in job.model_stages()]
    return _with(plan, {n: replace(plan.stage(n).config, tp=tp, dp=s.gpus // (tp * c.pp)) for n in names})


def _with(plan: Plan, configs: dict) -> Plan:
    return replace(plan, stages=tuple(replace(s, config=configs.get(s.name, s.config)) for s in plan.stages))
