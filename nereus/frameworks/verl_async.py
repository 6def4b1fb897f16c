"""verl's asynchronous trainers: an async plan as Hydra overrides of verl 0.9.1's one-step-off or fully-async launcher.

``one_step_off``: ``python3 -m verl.experimental.one_step_off_policy.main_ppo``; ``fully_async``:
``python3 -m verl.experimental.fully_async_policy.fully_async_main``; each with ``--config-name``
one of the YAML files in its ``config/`` folder (``*_ppo_trainer`` over verl's ``ppo_trainer``,
``*_ppo_megatron_trainer`` over ``ppo_megatron_trainer``, i.e. the Megatron engine). Every key is
one of those configs' (the test reads them from the wheel as data).

What verl 0.9.1 expresses, and why (file names inside the wheel):

- Two pools. The rollout (standalone vLLM replicas of ``tensor_model_parallel_size x
  pipeline_model_parallel_size`` GPUs) on ``rollout.nnodes x rollout.n_gpus_per_node``
  (``workers/rollout/llm_server.py``: replicas = those GPUs / the replica size); actor, reference
  model and critic on ``trainer.nnodes x trainer.n_gpus_per_node`` (``experimental/separation/
  utils.py``, ``create_resource_pool_manager``), each pool the same number of GPUs on each of its
  nodes (one placement group per node, ``STRICT_PACK``). ``actor_rollout_ref.hybrid_engine=false``
  (both trainers assert it). The engines' limits are the synchronous trainer's (``verl.engine_gaps``:
  Megatron one TP x PP for actor, ref and critic; FSDP ZeRO-3 without TP / PP).
- The weight sync is NCCL (``actor_rollout_ref.rollout.checkpoint_engine.backend=nccl``, the
  configs' default, emitted): what the plan prices between disjoint pools.
- A reward model: fully_async only on a pool of its own (``fully_async_rollouter.py`` asserts
  ``reward.reward_model.enable_resource_pool``); the one-step-off trainer maps no resource pool to
  it (``create_resource_pool_manager`` lists only the training roles), so a job with a reward model
  has no one-step-off launch.

How the schedule maps (read from ``fully_async_rollouter.py`` / ``fully_async_trainer.py``):

- ``one_step_off``: verl's one-step-off trainer generates batch k+1 (weights after step k-1) while
  training batch k: staleness 1, one weight sync per step. There is no knob; a larger bound is
  met, not used. ``data.train_batch_size`` is the job's prompts.
- ``fully_async``: the rollouter streams one prompt at a time (``data.gen_batch_size=1``,
  ``data.train_batch_size=0``, both asserted); the trainer takes ``require_batches x
  ppo_mini_batch_size`` prompts per local step and syncs weights every
  ``trigger_parameter_sync_step`` local steps. One local step = one Nereus step:
  ``require_batches`` = the job's mini-batches (``ppo_mini_batch_size`` = prompts / mini-batches,
  as in the synchronous launch), so ``trigger_parameter_sync_step`` = ``sync_every``. Between two
  syncs the rollouter generates at most ``(1 + staleness_threshold) x trigger_parameter_sync_step x
  require_batches x ppo_mini_batch_size`` prompts, counting the ones still in flight or queued at
  the sync (``set_max_required_samples``, ``reset_staleness``), i.e. ``(1 + staleness_threshold) x
  sync_every`` batches; the plan keeps at most ``1 + staleness`` batches in flight
  (``planner/cost/generation.py``), so ``staleness_threshold = (1 + staleness) / sync_every - 1``,
  rounded down to 1e-4 (staleness 1, sync_every 1 -> 1.0, "basically one_step_off" in verl's
  docs; staleness 2, sync_every 2 -> 0.5). ``partial_rollout=true``: in-flight responses resume
  under the new weights, as the plan prices them. ``concurrent_samples_per_replica`` (prompts
  each replica runs at once; verl's default 16) is set to the in-flight prompts per replica the
  plan allows, ``ceil(prompts x (1 + staleness) / replicas)``, so verl does not cap the stream below
  what was priced. ``use_dynamic_resource_scheduling=false``: the plan's pools are fixed.
"""
from __future__ import annotations

import math
from dataclasses import replace

from nereus.errors import SpecError
from nereus.frameworks import verl
from nereus.frameworks.asynchronous import job_for, schedule_of, shape_gap, split_skeletons
from nereus.frameworks.common import (GEN, Emission, gpu_range, nodes_and_gpus, overlap, same_gpus,
                                      units)
from nereus.planner.plan import Plan

MODULES = {"one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
           "fully_async": "verl.experimental.fully_async_policy.fully_async_main"}
CONFIG_DIRS = {"one_step_off": "experimental/one_step_off_policy/config",
               "fully_async": "experimental/fully_async_policy/config"}
"""Inside the verl wheel: the launcher's Hydra ``config_path``."""
CONFIG_NAMES = {("one_step_off", "fsdp"): "one_step_off_ppo_trainer",
                ("one_step_off", "megatron"): "one_step_off_ppo_megatron_trainer",
                ("fully_async", "fsdp"): "fully_async_ppo_trainer",
                ("fully_async", "megatron"): "fully_async_ppo_megatron_trainer"}


def command(kind: str, engine: str) -> tuple[str, ...]:
    return ("python3", "-m", MODULES[kind], "--config-name", CONFIG_NAMES[(kind, engine)])


def staleness_threshold(staleness: int, sync_every: int) -> float:
    """verl's ``async_training.staleness_threshold`` for the plan's bound (module docstring)."""
    return math.floor(((1 + staleness) / sync_every - 1) * 1e4 + 1e-9) / 1e4


# ---- what verl's async trainers cannot express ----------------------------------------------
def placement_gaps(plan: Plan, cluster, kind: str) -> list[str]:
    u = units(plan)
    g, home = u[GEN], u["actor/training"]
    out = [f"{name} on {gpu_range(u[name])} but actor/training on {gpu_range(home)}: verl's {kind} trainer runs the "
           f"actor, the reference model and the critic on one trainer pool (trainer.nnodes x trainer.n_gpus_per_node)"
           for name in verl.SHARED if name in u and name != "actor/training" and not same_gpus(u[name], home)]
    out += [f"{name} on {gpu_range(u[name])} shares GPUs with actor/generation ({gpu_range(g)}): verl's {kind} "
            f"trainer puts the rollout on GPUs of its own (rollout.nnodes x rollout.n_gpus_per_node)"
            for name in u if name != GEN and overlap(u[name], g)]
    out += shape_gap("rollout", g, cluster, "rollout.nnodes x rollout.n_gpus_per_node")
    out += shape_gap("trainer", home, cluster, "trainer.nnodes x trainer.n_gpus_per_node")
    r = u.get("reward/inference")
    if r is not None:
        if overlap(r, home):
            out.append(f"reward/inference on {gpu_range(r)} shares GPUs with the trainer pool ({gpu_range(home)}): "
                       f"verl's {kind} trainer runs a reward model only on a pool of its own "
                       f"(reward.reward_model.enable_resource_pool)")
        out += shape_gap("reward-model", r, cluster, "reward.reward_model.nnodes x n_gpus_per_node")
    return out


def gaps(plan: Plan, engine: str, cluster, kind: str, job=None) -> list[str]:
    """Everything of the async ``plan`` that verl's ``kind`` trainer with ``engine`` cannot express
    (``job``: as ``verl.gaps``)."""
    return placement_gaps(plan, cluster, kind) + verl.engine_gaps(plan, engine, job)


# ---- the closest plan verl can express -------------------------------------------------------
def candidates(base, engine: str, near: Plan) -> list[tuple[str, object]]:
    """``base`` (a PlanProblem with its schedule decided) on launchable rollout / trainer splits
    (reward model on a pool of its own), with the engine's limits as ``verl.candidates`` sets them."""
    from nereus.planner.solver import PlanConstraints

    out = []
    for (_, constrained) in verl.candidates(base, engine):
        pins = constrained.constraints.fixed_tp_pp
        for label, skel in split_skeletons(base.job, base.cluster, near, reward_apart=True):
            out.append((f"{engine}, {label}",
                        replace(constrained, constraints=PlanConstraints(fixed_placement=skel, fixed_tp_pp=pins))))
    return out


def choose(problem, optimum: Plan, solve, engine: str, kind: str):
    """(engine, plan, gaps of the optimum, tried), as ``verl.choose`` but for the async trainers."""
    cluster, job = problem.cluster, problem.job
    return verl.closest_over_engines(verl.ENGINES if engine == "auto" else (engine,), optimum, job,
                                     lambda p, e: gaps(p, e, cluster, kind, job),
                                     lambda e: candidates(problem, e, optimum), solve,
                                     lambda e: f"verl {kind} ({e})")


# ---- overrides -------------------------------------------------------------------------------
def overrides(problem, plan: Plan, engine: str, *, dynamic_bsz: bool = False) -> tuple[tuple[str, str], ...]:
    """Hydra ``key=value`` pairs for ``plan``'s async launch: the synchronous trainer's keys
    (``verl.overrides``) with the trainer pool as ``trainer.*``, the rollout pool as ``rollout.*``
    and the schedule as ``async_training.*`` (fully_async)."""
    sched = schedule_of(plan)
    cluster, b = problem.cluster, problem.job.batch
    u = units(plan)
    g, home = u[GEN], u["actor/training"]
    t_nodes, t_per = nodes_and_gpus(home.gpus, cluster)
    r_nodes, r_per = nodes_and_gpus(g.gpus, cluster)
    out: list[tuple[str, str]] = []
    for k, v in verl.overrides(problem, plan, engine, dynamic_bsz=dynamic_bsz):
        if k == "model_engine":  # the --config-name carries the engine
            continue
        if k == "trainer.nnodes":
            v = str(t_nodes)
        elif k == "trainer.n_gpus_per_node":
            out += [(k, str(t_per)), ("rollout.nnodes", str(r_nodes)), ("rollout.n_gpus_per_node", str(r_per))]
            continue
        elif k == "data.train_batch_size" and sched.kind == "fully_async":
            out += [(k, "0"), ("data.gen_batch_size", "1")]  # the rollouter streams one prompt at a time
            continue
        out.append((k, v))
    out += [("actor_rollout_ref.hybrid_engine", "false"),
            ("actor_rollout_ref.rollout.checkpoint_engine.backend", "nccl")]
    if sched.kind == "fully_async":
        in_flight = b.prompts * (1 + sched.bound)
        out += [("async_training.staleness_threshold", f"{staleness_threshold(sched.bound, sched.sync_every)!r}"),
                ("async_training.trigger_parameter_sync_step", str(sched.sync_every)),
                ("async_training.require_batches", str(b.mini_batches)),
                ("async_training.partial_rollout", "true"),
                ("async_training.use_dynamic_resource_scheduling", "false"),
                ("async_training.concurrent_samples_per_replica", str(-(-in_flight // g.config.dp)))]
    return tuple(out)


def batch_gaps(problem, kind: str) -> list[str]:
    b = problem.job.batch
    mini = max(1, b.prompts // b.mini_batches)
    if kind == "fully_async" and mini * b.mini_batches != b.prompts:
        return [f"fully_async trains require_batches x ppo_mini_batch_size = {b.mini_batches} x {mini} = "
                f"{mini * b.mini_batches} prompts per step; the job's batch is {b.prompts}"]
    return []


def emit(problem, optimum: Plan, solve, *, engine: str = "auto", dynamic_bsz: bool = False) -> Emission:
    """The verl async launch for ``optimum`` (an async plan), or for the closest plan verl's async
    trainer can express."""
    sched = schedule_of(optimum)
    kind = sched.kind
    if kind == "one_step_off" and "reward" in problem.job.roles:
        raise SpecError("verl 0.9.1's one-step-off trainer maps no resource pool to a reward model "
                        "(experimental/separation/utils.py, create_resource_pool_manager): a job with a reward model "
                        "has no one_step_off launch in verl; plan it with --schedule fully_async or sync")
    problem = replace(problem, job=job_for(problem.job, sched))
    chosen, plan, plan_gaps, tried = choose(problem, optimum, solve, engine, kind)
    plan_gaps = plan_gaps + tuple(batch_gaps(problem, kind))
    args = tuple(f"{k}={v}" for k, v in overrides(problem, plan, chosen, dynamic_bsz=dynamic_bsz))
    roles = problem.job.roles
    paths = ["actor_rollout_ref.model.path=..."] + (["critic.model.path=..."] if "critic" in roles else []) + (
        ["reward.reward_model.model_path=..."] if "reward" in roles else []) + ["data.train_files=..."]
    notes = [f"Add your own model paths and data ({', '.join(paths)}) as arguments: \"$@\" passes them on.",
             *_sync_notes(problem)]
    notes += [f"verl {kind}: {_schedule_note(sched)}",
              "verl's async configs set algorithm.rollout_correction.bypass_mode=true: the trainer takes the "
              "rollout's log-probs, so it skips the actor's log-prob pass (actor/inference) the plan prices."]
    if kind == "fully_async":
        notes.append("Set rollout.total_rollout_steps (prompts to generate over the run; the config's default is "
                     "100) as an argument.")
    return Emission(framework="verl", version=verl.VERSION, variant=f"{kind}, {chosen}", command=command(kind, chosen),
                    args=args, plan=plan, optimum=optimum, gaps=plan_gaps, notes=tuple(notes), tried=tried)


def _sync_notes(problem) -> tuple[str, ...]:
    from nereus.frameworks.common import engine_notes

    return (engine_notes(problem.job, "verl", verl.VLLM, tuple(e for e in verl.ROLLOUT_NAME if e != "vllm-v0"))
            + (verl.driver_note(problem),))


def _schedule_note(s) -> str:
    if s.kind == "one_step_off":
        return ("staleness 1 (the rollout of step k+1 overlaps training of step k), one weight sync per step"
                + (f"; the job's bound {s.bound} is met, not used" if s.bound > 1 else "") + ".")
    return (f"staleness {s.bound}, a weight sync every {s.sync_every} steps -> trigger_parameter_sync_step="
            f"{s.sync_every}, staleness_threshold=(1 + {s.bound}) / {s.sync_every} - 1 = "
            f"{staleness_threshold(s.bound, s.sync_every)!r} (at most {1 + s.bound} batches in flight).")
