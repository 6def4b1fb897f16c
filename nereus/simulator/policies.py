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
- ``gamma`` / ``gamma-restart``: any layout, the published paper's admission rule instead of the
  cost rules (``AdmissionRules._admit_gamma``: re-plan at a 30% length change, switch when transition
  cost / saving per step <= gamma x H), live or in restart mode; not part of ``all``.
- ``always-restart``: ``always`` in restart mode (every switch a checkpoint and relaunch); not
  part of ``all``.
- ``verl``: verl's FSDP backend (``verl_rule``): every model-stage colocated on all GPUs (hybrid
  engine), actor/critic/reference/reward ZeRO-3 (FSDP) at TP1 PP1, rollout with a fixed TP; knobs
  (micro-batch, recompute, KV budget) re-tuned by the controller. ``verl-offload``: the same with
  ``fsdp_config.optimizer_offload`` open to the solver (on in verl's 32-70B examples). The verl-like
  baseline is the better of the two (``benchmarks/simulate_repro.py``).
- ``openrlhf``: OpenRLHF with its models apart (``openrlhf_rule``): disaggregated pools per model
  (chosen once by the solver for the first step, then only scaled with the GPUs), DeepSpeed ZeRO-3
  at TP1 PP1 for every model, fixed rollout TP. ``openrlhf-colocate``: OpenRLHF's
  ``--colocate_all_models`` (everything on all GPUs, vLLM asleep while DeepSpeed runs), otherwise the
  same rule. The OpenRLHF-like baseline is the better of the two (``benchmarks/simulate_repro.py``).

Scripted: ``static-naive`` is what a user does by hand (``NaiveUser``): the layout of the
framework's examples for the actor's size, fixed micro-batches; an OOM crashes the job, which
restarts from its checkpoint after the user halves the failing stage's micro-batch (or, at 1,
doubles its TP); a new GPU count is taken by a restart with DP scaled.

Offline (``oracle.py``): ``hindsight`` (the best single layout for the whole trace) and ``oracle``
(the best plan sequence).
"""
from __future__ import annotations

import math
from dataclasses import replace

from nereus.errors import SpecError
from nereus.planner.online.admission import AdmissionConstants
from nereus.planner.online.controller import Controller
from nereus.planner.cost.params import CostParams
from nereus.planner.online.plan_cache import FREE, LayoutRule, PlanCache, static_rule
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

POLICIES = ("static-naive", "static", "hindsight", "adaptive", "adaptive-restart", "always", "oracle", "verl",
            "verl-offload", "openrlhf", "openrlhf-colocate")
"""The policies of ``all``."""
COST_RULE = ("gamma", "gamma-restart", "always-restart")
"""Policies that test the cost rule (``benchmarks/gamma_sweep.py``), run only when named."""
ONLINE = ("static", "adaptive", "adaptive-restart", "always", "verl", "verl-offload", "openrlhf",
          "openrlhf-colocate") + COST_RULE
RESTART_MODE = ("adaptive-restart", "gamma-restart", "always-restart")
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
    """FSDP / DeepSpeed training (TP1 PP1), rollout engine with a fixed TP, frozen models (reference,
    reward) TP1 up to 20B parameters and at the rollout TP above: the nearest layout for a rule that
    does not shard frozen models (the asynchronous verl baselines, ``async_policies.py``). The
    synchronous verl-like and OpenRLHF-like rules shard them instead (``fsdp_tp_pp``)."""
    fixed = [("actor/generation", rollout_tp(job), 1)]
    for role in job.roles:
        if role in ("actor", "critic"):
            fixed.append((f"{role}/training", 1, 1))
        else:
            big = job.model(role).num_params() >= 20e9
            fixed.append((f"{role}/inference", rollout_tp(job) if big else 1, 1))
    return tuple(fixed)


def fsdp_tp_pp(job: JobSpec) -> tuple[tuple[str, int, int], ...]:
    """The layouts verl's FSDP backend and OpenRLHF's DeepSpeed models are held to: the rollout at
    ``rollout_tp``, every other model-stage at TP1 PP1 (a trainable model's log-prob pass shares its
    training layout in the planner, as it does in both frameworks).

    Sources (read as data): verl 0.9.1 ``trainer/config/engine/fsdp.yaml`` (``strategy: fsdp``,
    ``fsdp_size: -1``: every model, the reference included, fully sharded over all ranks;
    ``ulysses_sequence_parallel_size`` splits sequences, not weights, so no TP or PP) and
    ``nereus/frameworks/verl.py`` (``engine_gaps``); OpenRLHF 0.11.2: AutoTP training only under
    ZeRO 0-2 (``nereus/frameworks/openrlhf.py``), and its examples train at ``--zero_stage 3``."""
    fixed = [("actor/generation", rollout_tp(job), 1)]
    for role in job.roles:
        fixed.append((f"{role}/training" if role in ("actor", "critic") else f"{role}/inference", 1, 1))
    return tuple(fixed)


def verl_rule(job: JobSpec, offload: bool = False) -> LayoutRule:
    """verl-like: verl's FSDP backend on one hybrid-engine pool. ZeRO-3 for every model, frozen ones
    too (``fsdp.yaml``: the reference is an FSDP module sharded like the actor; verl's 32B GRPO
    example ``examples/grpo_trainer/run_qwen2_5_32b_fsdp.sh`` shards it so and adds
    ``ref.fsdp_config.param_offload=True``); the reward model as verl's FSDP reward worker (0.9.1 can
    also serve it from vLLM; not modelled). ``offload``: optimizer offload
    (``fsdp_config.optimizer_offload``, on in verl's 32-70B examples) open to the solver where it
    finds it pays (the ``verl-offload`` policy): the Adam state in host memory between optimizer
    steps, so the rollout's KV cache gets its room, priced by the ground truth at measured host copy
    rates (``truth.memory.offload_copy_s``; held only around the step, as verl-project/verl#7804 has
    it: verl's default holds it through the update call, a higher peak). Not modelled: parameter offload (the 32B example
    offloads the reference's parameters), which the ground truth does not price."""
    return LayoutRule(name="verl-offload" if offload else "verl", placement="colocated",
                      fixed_tp_pp=fsdp_tp_pp(job), zeros=(3,), frozen_zeros=(3,),
                      offload=(False, True) if offload else (False,))


def openrlhf_rule(job: JobSpec, colocate: bool, anchor: Plan | None = None) -> LayoutRule:
    """OpenRLHF-like: DeepSpeed ZeRO-3 for every model at TP1 PP1 (its examples'
    ``--zero_stage 3``, e.g. ``examples/scripts/train_ppo_llama_ray_70b.sh``; the reference and reward
    run DeepSpeed's eval engine at stage 3 when training does, ``utils/deepspeed/deepspeed.py``
    ``get_ds_eval_config``), vLLM engines at a fixed TP. ``colocate``: ``--colocate_all_models``, every
    model and the engines on all GPUs; else each model on pools of its own (``anchor``: the pools
    kept). Not modelled: ``--adam_offload`` (the 70B example's: DeepSpeed's CPU Adam, which steps on
    the host, a cost the ground truth does not price) and ``--ref_reward_offload`` (parameter offload)."""
    if colocate:
        return LayoutRule(name="openrlhf-colocate", placement="colocated", fixed_tp_pp=fsdp_tp_pp(job),
                          zeros=(3,), frozen_zeros=(3,), offload=(False,))
    return LayoutRule(name="openrlhf" if anchor is not None else "openrlhf-pools", placement="disaggregated",
                      fixed_tp_pp=fsdp_tp_pp(job), anchor=anchor, zeros=(3,), frozen_zeros=(3,), offload=(False,))


def make_controller(name: str, job: JobSpec, cluster: ClusterSpec, w0: Workload, gpus0: int, *,
                    total_steps: int | None, plans: PlanCache, horizon: int = 200, margin: float = 0.25,
                    audit=None, seed: int = 0, params: CostParams | None = None,
                    admission: AdmissionConstants | None = None) -> Controller:
    """A controller that behaves like policy ``name`` from its first step on. ``admission``: the
    admission rules' constants (default: ``AdmissionConstants(margin=margin)``)."""
    base = params or CostParams()
    if name not in ONLINE:
        raise SpecError(f"unknown online policy {name!r}; choose from {ONLINE}")
    consts = admission if admission is not None else AdmissionConstants(margin=margin)
    common = dict(initial_gpus=gpus0, initial_workload=w0, total_steps=total_steps, horizon=horizon,
                  params=base, plans=plans, build_transition=False, seed=seed, audit=audit,
                  solve_bucket_ratio=SOLVE_BUCKET_RATIO, **consts.controller_kwargs())
    restart = dict(transition_mode="restart", framework=None) if name in RESTART_MODE else {}
    # restart mode: the launch configuration is not needed to replay the run, so none is emitted
    if name in ("adaptive", "adaptive-restart", "always", "always-restart"):
        return Controller(job, cluster, mode=name.removesuffix("-restart"), rule=FREE, **restart, **common)
    if name in ("gamma", "gamma-restart"):
        ctl = Controller(job, cluster, mode="adaptive", rule=FREE, explore=False, **restart, **common)
        ctl.gamma, ctl.replan_change = float(consts.gamma), float(consts.replan_change)
        return ctl
    if name == "static":
        first = plans.best(FREE, w0, gpus0, base)
        if first is None:
            raise SpecError(f"static: no feasible plan for the first step on {gpus0} GPUs ({plans.last_message})")
        return Controller(job, cluster, rule=static_rule(first), initial_plan=first, **common)
    if name in ("verl", "verl-offload"):
        return Controller(job, cluster, rule=verl_rule(job, offload=name == "verl-offload"), **common)
    if name == "openrlhf-colocate":
        return Controller(job, cluster, rule=openrlhf_rule(job, colocate=True), **common)
    first = plans.best(openrlhf_rule(job, colocate=False), w0, gpus0, base)
    if first is None:
        raise SpecError(f"openrlhf: no feasible disaggregated plan for the first step on {gpus0} GPUs "
                        f"({plans.last_message})")
    return Controller(job, cluster, rule=openrlhf_rule(job, colocate=False, anchor=first), initial_plan=first,
                      **common)


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


def solve_grid(w: Workload, ratio: float = SOLVE_BUCKET_RATIO) -> Workload:
    """``w`` on the workload grid the simulated controllers ask the solver on (mean response length
    on a log grid of ``ratio``, the p90 / mean ratio in quarters): the offline policies' extra
    candidates then share the solver's cached cost tables with the online policies' plans. A
    candidate is only a candidate: the offline policies score it with the truth's exact times."""
    r = math.log(ratio)
    mean = min(round(math.exp(round(math.log(w.response_len_mean) / r) * r), 1), 0.98 * w.response_len_max)
    q = round(4 * w.p90 / w.response_len_mean) / 4
    return replace(w, response_len_mean=mean, response_len_p90=round(min(float(w.response_len_max), q * mean), 1))
