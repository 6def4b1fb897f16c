"""OpenRLHF's asynchronous trainer: an async plan as flags of ``openrlhf.cli.train_ppo_ray`` with ``--train.async_enable``.

What OpenRLHF 0.11.2 expresses, and why (``cli/train_ppo_ray.py``, ``trainer/ppo_trainer_async.py``):

- ``--train.async_enable``: a generator actor produces whole batches on the vLLM engines while a
  training actor trains the one before. ``--train.async_queue_size N`` (default 1) is the number
  of slots: the generator takes one per batch and the trainer frees it when it takes that batch,
  so the generator runs at most N batches ahead. N = 1 is ``one_step_off`` (staleness 1).
- The weights go to vLLM after every training step: there is no sync interval (``sync_every`` > 1
  is a gap). Without ``--train.partial_rollout_enable`` the broadcast waits for the batch being
  generated (a lock); with it vLLM pauses and resumes, in-flight samples continue under the new
  weights.
- The vLLM engines are on GPUs of their own; ``--train.colocate_all`` then colocates only the
  DeepSpeed models (the CLI warns so), so a trainer pool holding actor, ref, critic and reward
  model is expressible; other placements and the parallel limits are the synchronous ones
  (``openrlhf.gaps``).
- No stream: the generator makes whole batches (``GenerateSamplesActor.fit``), so the batch tail a
  ``fully_async`` plan does not pay stays. A ``fully_async`` plan is therefore emitted as its closest
  OpenRLHF plan, ``one_step_off`` within the same staleness bound (re-solved), with
  ``--train.async_queue_size`` = the bound and ``--train.partial_rollout_enable``; the gaps name
  what is lost.
"""
from __future__ import annotations

from dataclasses import replace

from nereus.frameworks import openrlhf
from nereus.frameworks.asynchronous import job_for, schedule_of, split_skeletons
from nereus.frameworks.common import GEN, Emission, closest, overlap, same_gpus, units
from nereus.planner.plan import Plan
from nereus.planner.schedules import ScheduleSpec

COLOCATE_FLAGS = ("--train.colocate_actor_ref", "--train.colocate_critic_reward")


def deepspeed_together(plan: Plan) -> bool:
    """Every DeepSpeed model on the same GPUs, none of them on the rollout's."""
    u = units(plan)
    ds = [u[n] for n in openrlhf.DEEPSPEED if n in u]
    return all(same_gpus(s, ds[0]) for s in ds) and not any(overlap(s, u[GEN]) for s in ds)


def gaps(plan: Plan) -> list[str]:
    """What OpenRLHF's async trainer cannot express of a ``one_step_off`` plan."""
    place = [] if deepspeed_together(plan) else openrlhf.placement_gaps(plan)
    return place + openrlhf.parallel_gaps(plan)


def schedule_gaps(s: ScheduleSpec) -> list[str]:
    if s.kind != "fully_async":
        return []
    out = ["fully_async streams prompts across batches; OpenRLHF's async generator makes whole batches "
           "(trainer/ppo_trainer_async.py, GenerateSamplesActor), so the batch tail stays: emitted as one_step_off "
           f"within the staleness bound {s.bound} (--train.async_queue_size {s.bound})"]
    if s.sync_every > 1:
        out.append(f"sync_every {s.sync_every}: OpenRLHF broadcasts the weights to vLLM after every training step "
                   f"(no sync interval)")
    return out


def candidates(base, near: Plan) -> list[tuple[str, object]]:
    """``base`` (a one_step_off PlanProblem) on placements OpenRLHF's async trainer expresses,
    without PP or Ulysses: a rollout pool and one trainer pool for every DeepSpeed model
    (``--train.colocate_all``), every model apart, and the paired pools."""
    from nereus.planner.solver import PlanConstraints

    cs = replace(base.candidates, max_pp=1, sps=(1,))
    out = [(f"colocate_all (DeepSpeed), {label}", replace(base, constraints=PlanConstraints(fixed_placement=skel),
                                                          candidates=cs))
           for label, skel in split_skeletons(base.job, base.cluster, near, reward_apart=False)[:2]]
    out.append(("apart", replace(base, constraints=PlanConstraints(placement="disaggregated"), candidates=cs)))
    out += [(label, replace(base, constraints=PlanConstraints(fixed_placement=skel), candidates=cs))
            for label, skel in openrlhf.paired_placements(base.job, base.cluster)]
    return out


def flags(problem, plan: Plan, s: ScheduleSpec, *, dynamic_bsz: bool = False) -> tuple[str, ...]:
    """``train_ppo_ray`` arguments for the one_step_off ``plan``, with the async flags."""
    out = list(openrlhf.flags(problem, plan, dynamic_bsz=dynamic_bsz))
    ds = frozenset(n for n in openrlhf.DEEPSPEED if n in units(plan))
    if deepspeed_together(plan) and not any(ds <= pair for pair in openrlhf.PAIRS):
        out = [f for f in out if f not in COLOCATE_FLAGS]
        out.append("--train.colocate_all")  # with --train.async_enable: the DeepSpeed models only
    out += ["--train.async_enable", "--train.async_queue_size", str(s.bound if s.kind == "fully_async" else 1)]
    if s.kind == "fully_async":
        out.append("--train.partial_rollout_enable")
    return tuple(out)


def variant(plan: Plan) -> str:
    return "async, " + ("DeepSpeed models colocated" if deepspeed_together(plan) else openrlhf.variant(plan))


def emit(problem, optimum: Plan, solve, *, dynamic_bsz: bool = False) -> Emission:
    """The OpenRLHF async launch for ``optimum`` (an async plan), or for the closest plan it can express."""
    s = schedule_of(optimum)
    target = ScheduleSpec(kind="one_step_off", staleness=s.bound)
    problem = replace(problem, job=job_for(problem.job, target))
    sched_gaps = schedule_gaps(s)
    found = gaps(optimum) if not sched_gaps else []
    if not sched_gaps and not found:
        plan, tried = optimum, ()
    else:
        c = closest(candidates(problem, optimum), solve, gaps, openrlhf.equalize, "OpenRLHF (async)",
                    openrlhf.repair)
        plan, tried = c.solution.plan, c.tried
        found = sched_gaps + gaps(optimum)
    notes = ("Ray picks which GPUs each model gets; the plan's pool sizes are kept (the vLLM engines apart).",
             *_notes(problem))
    return Emission(framework="openrlhf", version=openrlhf.VERSION, variant=variant(plan), command=openrlhf.COMMAND,
                    args=flags(problem, plan, s, dynamic_bsz=dynamic_bsz), plan=plan, optimum=optimum,
                    gaps=tuple(found), notes=notes, tried=tried)


def _notes(problem) -> tuple[str, ...]:
    from nereus.frameworks.common import engine_notes

    reward = ("--reward.model_name_or_path" if "reward" in problem.job.roles
              else "--reward.remote_url (rule-based reward)")
    return (f"Add --actor.model_name_or_path, {'--critic.model_name_or_path, ' if 'critic' in problem.job.roles else ''}"
            f"{reward} and --data.prompt_dataset as arguments (\"$@\" passes them on); submit with "
            "`ray job submit -- bash <this file>`.",
            *engine_notes(problem.job, "OpenRLHF", openrlhf.VLLM, ("vllm",)))
