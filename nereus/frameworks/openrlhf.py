"""OpenRLHF: a plan as command-line flags of ``openrlhf.cli.train_ppo_ray`` (vLLM engines + DeepSpeed models on Ray).

What OpenRLHF 0.11.2 can express, and why (``openrlhf/cli/train_ppo_ray.py`` in the wheel):

- Each model gets ``--<model>.num_nodes x --<model>.num_gpus_per_node`` GPUs of its own; Ray
  picks which. Only the actor with the reference model (``--train.colocate_actor_ref``), the
  critic with the reward model (``--train.colocate_critic_reward``), or every model together with
  the vLLM engines (``--train.colocate_all``, all the same size) share GPUs.
- Generation: ``--vllm.num_engines`` engines of ``--vllm.tensor_parallel_size`` GPUs; no
  pipeline parallelism.
- Training and scoring run on DeepSpeed: one ZeRO stage (``--ds.zero_stage``) and one AutoTP size
  (``--ds.tensor_parallel_size``) for every model, no pipeline parallelism; AutoTP training works
  with ZeRO stages 0-2 (deepspeed.ai/tutorials/autotp-training).
- One training micro-batch (``--train.micro_batch_size``) and one scoring micro-batch
  (``--rollout.micro_batch_size``) for all models; ``--actor.gradient_checkpointing_enable``
  also switches the critic's; ``--ds.adam_offload`` offloads every optimizer.
- No expert parallelism: the DeepSpeed models are Hugging Face modules (``--ds.experts_implementation``
  picks the expert kernel only, ``eager`` / ``grouped_mm`` / ...), so every rank holds every expert,
  sharded only by ZeRO; ``create_vllm_engines`` (``trainer/ray/vllm_engine.py``) passes vLLM no
  ``enable_expert_parallel``, so the engines split experts by tensor parallelism.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from nereus.frameworks.common import (GEN, TRAINABLE_UNITS, Emission, closest, engine_notes, generation_memory_fraction,
                                      gpu_range, micro_batch_tokens, nodes_and_gpus, offloaded, overlap, packs_tokens,
                                      same_gpus, units, with_expert_layout)
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig

VERSION = "0.11.2"
VLLM = "0.29.0"
"""The vLLM release OpenRLHF 0.11.2 pins (its ``vllm`` extra); its rollouts run on vLLM only."""
COMMAND = ("python3", "-m", "openrlhf.cli.train_ppo_ray")
DEEPSPEED = ("actor/training", "ref/inference", "critic/training", "reward/inference")
PAIRS = (frozenset({"actor/training", "ref/inference"}), frozenset({"critic/training", "reward/inference"}))
FLAG_OF = {"actor/training": "actor", "ref/inference": "ref", "critic/training": "critic",
           "reward/inference": "reward"}
MAX_PINNED = 4
"""Re-solves per placement that pin the values OpenRLHF shares between models."""


# ---- what OpenRLHF cannot express ----------------------------------------------------------
def placement_gaps(plan: Plan) -> list[str]:
    u = units(plan)
    if all(same_gpus(s, u[GEN]) for s in u.values()):
        return []  # --train.colocate_all
    out = []
    with_gen = [n for n in u if n != GEN and overlap(u[n], u[GEN])]
    if with_gen:
        out.append(f"actor/generation ({gpu_range(u[GEN])}) shares GPUs with "
                   + ", ".join(f"{n} ({gpu_range(u[n])})" for n in with_gen)
                   + ": OpenRLHF gives the vLLM engines GPUs of their own unless --train.colocate_all puts every "
                     "model on the same GPUs")
    names = [n for n in u if n != GEN]
    for a, b in itertools.combinations(names, 2):
        if not overlap(u[a], u[b]):
            continue
        if frozenset({a, b}) in PAIRS:
            if not same_gpus(u[a], u[b]):
                out.append(f"{a} ({gpu_range(u[a])}) and {b} ({gpu_range(u[b])}) share only some GPUs: colocating "
                           f"them (--train.colocate_{'actor_ref' if 'actor/training' in (a, b) else 'critic_reward'}) "
                           f"needs the same GPUs for both")
        else:
            out.append(f"{a} ({gpu_range(u[a])}) and {b} ({gpu_range(u[b])}) share GPUs: OpenRLHF colocates only "
                       f"actor with ref, critic with reward, or everything")
    return out


def _distinct(stages: list[StagePlacement], attr: str) -> bool:
    return len({getattr(s.config, attr) for s in stages}) > 1


def _listing(stages: list[StagePlacement], attr: str, word: str) -> str:
    return ", ".join(f"{s.name} {word}{getattr(s.config, attr)}" for s in stages)


def parallel_gaps(plan: Plan) -> list[str]:
    u = units(plan)
    ds = [u[n] for n in DEEPSPEED if n in u]
    train = [u[n] for n in TRAINABLE_UNITS if n in u]
    scoring = [plan.stage(s.name.replace("training", "inference")) if s.name in TRAINABLE_UNITS else s for s in ds]
    out = expert_gaps(plan)
    if u[GEN].config.pp > 1:
        out.append(f"actor/generation uses pp {u[GEN].config.pp}: OpenRLHF's vLLM engines take a tensor-parallel "
                   f"size only (--vllm.tensor_parallel_size)")
    piped = [s for s in ds if s.config.pp > 1]
    if piped:
        out.append(f"{_listing(piped, 'pp', 'pp')}: OpenRLHF trains and scores with DeepSpeed, without pipeline "
                   f"parallelism")
    out += [f"{s.name} uses Ulysses sequence parallelism {s.config.sp}: OpenRLHF splits sequences with ring "
            f"attention (--ds.ring_attn_size) instead" for s in ds if getattr(s.config, "sp", 1) > 1]
    if _distinct(ds, "tp"):
        out.append(f"--ds.tensor_parallel_size is one value for every DeepSpeed model; the plan uses "
                   f"{_listing(ds, 'tp', 'tp')}")
    if _distinct(ds, "cp"):
        out.append(f"--ds.ring_attn_size is one value for every DeepSpeed model; the plan uses "
                   f"{_listing(ds, 'cp', 'cp')}")
    out += [f"{s.name} uses tp {s.config.tp} with ZeRO-3: DeepSpeed AutoTP training works with ZeRO stages 0-2"
            for s in train if s.config.tp > 1 and s.config.zero > 2]
    if _distinct(train, "micro_batch"):
        out.append(f"--train.micro_batch_size is one value for actor and critic; the plan uses "
                   f"{_listing(train, 'micro_batch', 'mb')}")
    if _distinct(scoring, "micro_batch"):
        out.append(f"--rollout.micro_batch_size is one value for every model's scoring pass; the plan uses "
                   f"{_listing(scoring, 'micro_batch', 'mb')}")
    if _distinct(train, "zero"):
        out.append(f"--ds.zero_stage is one value for actor and critic; the plan uses {_listing(train, 'zero', 'ZeRO-')}")
    if _distinct(train, "recompute"):
        out.append("--actor.gradient_checkpointing_enable also switches the critic's; the plan recomputes only "
                   + ", ".join(s.name for s in train if s.config.recompute))
    off = offloaded(plan)
    if len({s.name in off for s in train}) > 1:
        out.append("--ds.adam_offload offloads every optimizer; the plan offloads only "
                   + ", ".join(s.name for s in train if s.name in off))
    return out


def expert_gaps(plan: Plan) -> list[str]:
    """The expert layouts of ``plan`` OpenRLHF cannot express (none for a dense job: ep = etp = 1)."""
    u = units(plan)
    out = []
    g = u[GEN].config
    if g.ep * g.etp > 1:
        out.append(f"actor/generation uses ep {g.ep}: OpenRLHF's vLLM engines run without expert parallelism "
                   f"(create_vllm_engines passes no enable_expert_parallel); experts are split by "
                   f"--vllm.tensor_parallel_size")
    ds = [u[n] for n in DEEPSPEED if n in u and u[n].config.ep * u[n].config.etp > 1]
    if ds:
        out.append(", ".join(f"{s.name} ep{s.config.ep} etp{s.config.etp}" for s in ds)
                   + ": OpenRLHF trains and scores Hugging Face modules with DeepSpeed, without expert parallelism "
                     "(--ds.experts_implementation picks the expert kernel only); every rank holds every expert, "
                     "sharded only by ZeRO")
    return out


def repair(problem, plan: Plan) -> list[tuple[str, Plan]]:
    """``common.Repair``: the plan with every expert layout at ep = etp = 1 (what OpenRLHF runs)."""
    lay = {s.name: (1, 1) for s in plan.stages if s.config.ep * s.config.etp > 1}
    return [("experts unsharded", with_expert_layout(plan, lay))] if lay else []


def gaps(plan: Plan) -> list[str]:
    """Everything of ``plan`` that OpenRLHF cannot express, one sentence each."""
    return placement_gaps(plan) + parallel_gaps(plan)


# ---- the closest plan OpenRLHF can express ---------------------------------------------------
def _buddy_sizes(cluster) -> list[int]:
    n, base = cluster.num_gpus, (1 if cluster.nodes == 1 else cluster.gpus_per_node)
    sizes, s = {n}, base
    while s <= n:
        sizes.add(s)
        s *= 2
    return sorted(sizes)


def paired_placements(job, cluster) -> list[tuple[str, Plan]]:
    """Pools for vLLM, actor(+ref) and critic(+reward) that together fill the cluster (or as much of
    it as buddy-sized pools can), as skeleton plans for ``PlanConstraints.fixed_placement``."""
    roles = set(job.roles)
    groups = [(GEN,), ("actor/training", "ref/inference")]
    if "critic" in roles:
        groups.append(("critic/training",) + (("reward/inference",) if "reward" in roles else ()))
    elif "reward" in roles:
        groups.append(("reward/inference",))
    sizes, n = _buddy_sizes(cluster), cluster.num_gpus
    combos = [c for c in itertools.product(sizes, repeat=len(groups)) if sum(c) <= n]
    if not combos:
        return []
    top = max(sum(c) for c in combos)
    out = []
    for combo in combos:
        if sum(combo) != top:
            continue
        stages, offset = [], 0
        for pool, (size, group) in enumerate(sorted(zip(combo, groups), key=lambda x: -x[0])):
            if size != n and offset % size:
                break
            stages += [StagePlacement(name=name, config=ParallelConfig(dp=size), pool=pool, first_gpu=offset,
                                      gpus=size) for name in group]
            offset += size
        else:
            label = "GPUs " + ", ".join(f"{'+'.join('vllm' if x == GEN else x.split('/')[0] for x in g)} {s}"
                                        for s, g in zip(combo, groups))
            out.append((label, Plan(stages=tuple(stages))))
    return out


def candidates(base) -> list[tuple[str, object]]:
    """``base`` (a PlanProblem) restricted to placements OpenRLHF expresses, without pipeline
    parallelism or Ulysses: everything colocated, every model apart, and the paired pools."""
    from nereus.planner.solver import PlanConstraints

    cs = replace(base.candidates, max_pp=1, sps=(1,))  # no PP; no Ulysses (OpenRLHF has ring attention)
    out = [("colocate_all", replace(base, constraints=PlanConstraints(placement="colocated"), candidates=cs)),
           ("apart", replace(base, constraints=PlanConstraints(placement="disaggregated"), candidates=cs))]
    out += [(label, replace(base, constraints=PlanConstraints(fixed_placement=skeleton), candidates=cs))
            for label, skeleton in paired_placements(base.job, base.cluster)]
    return out


def equalize(problem, plan: Plan) -> list[tuple[str, object]]:
    """Re-solves with one DeepSpeed TP, micro-batch, ZeRO stage, recompute and offload for every
    model, drawn from the values the plan chose (the actor's first; tp 1 and ZeRO <= 2 added as
    fall-backs), skipping AutoTP with ZeRO-3, at most MAX_PINNED of them."""
    u = units(plan)
    actor = u["actor/training"]
    ds = [u[n] for n in DEEPSPEED if n in u]
    train = [u[n] for n in TRAINABLE_UNITS if n in u]
    off = offloaded(plan)

    def values(stages, get, first):
        seen = [first] + [get(s) for s in stages]
        return list(dict.fromkeys(seen))

    # AutoTP needs ZeRO <= 2: keep tp 1 and a ZeRO stage <= 2 in reach of a plan that chose tp > 1 with ZeRO-3
    tps = values(ds, lambda s: s.config.tp, actor.config.tp) + [1]
    mbs = values(ds, lambda s: s.config.micro_batch, actor.config.micro_batch)
    zeros = values(train, lambda s: s.config.zero, actor.config.zero) + [z for z in problem.candidates.zeros if z <= 2]
    if any(s.config.ep * s.config.etp > 1 for s in plan.stages) and 3 in problem.candidates.zeros:
        zeros = [3] + zeros  # without expert parallelism a MoE model's experts are sharded by ZeRO-3 only (tp 1)
    tps, zeros = list(dict.fromkeys(tps)), list(dict.fromkeys(zeros))
    rcs = values(train, lambda s: s.config.recompute, actor.config.recompute)
    offs = values(train, lambda s: s.name in off, actor.name in off)
    out = []
    combos = itertools.product(tps, mbs, zeros, rcs, offs)
    if zeros[0] == 3 and any(s.config.ep * s.config.etp > 1 for s in plan.stages):
        combos = itertools.chain(itertools.product([1], mbs, [3], rcs, offs), combos)
    seen = set()
    for tp, mb, zero, rc, of in combos:
        if (tp, mb, zero, rc, of) in seen:
            continue
        seen.add((tp, mb, zero, rc, of))
        if tp > 1 and zero > 2:
            continue
        pins = tuple((s.name, tp, 1) for s in ds)
        p = replace(problem, constraints=replace(problem.constraints, fixed_tp_pp=pins),
                    candidates=replace(problem.candidates, micro_batches=(mb,), zeros=(zero,), recompute=(rc,),
                                       offload=(of,)))
        out.append((f"tp{tp} mb{mb} ZeRO-{zero}{' recompute' if rc else ''}{' offload' if of else ''} for all", p))
        if len(out) == MAX_PINNED:
            break
    return out


def choose(problem, optimum: Plan, solve):
    """(plan, gaps of the optimum, tried): the optimum when OpenRLHF expresses it, else the closest."""
    found = gaps(optimum)
    if not found:
        return optimum, (), ()
    c = closest(candidates(problem), solve, gaps, equalize, "OpenRLHF", repair)
    return c.solution.plan, tuple(found), c.tried


# ---- flags ---------------------------------------------------------------------------------
def variant(plan: Plan) -> str:
    u = units(plan)
    if all(same_gpus(s, u[GEN]) for s in u.values()):
        return "colocate_all"
    return "paired" if any(a in u and b in u and same_gpus(u[a], u[b]) for a, b in map(tuple, PAIRS)) else "apart"


def flags(problem, plan: Plan, *, dynamic_bsz: bool = False) -> tuple[str, ...]:
    """``train_ppo_ray`` arguments for ``plan``: every flag exists in OpenRLHF's argparse definitions."""
    job, cluster, w = problem.job, problem.cluster, problem.workload
    u = units(plan)
    g, actor = u[GEN], u["actor/training"]
    b = job.batch
    out: list[str] = []
    for name in DEEPSPEED:
        if name in u:
            nodes, per_node = nodes_and_gpus(u[name].gpus, cluster)
            out += [f"--{FLAG_OF[name]}.num_nodes", str(nodes), f"--{FLAG_OF[name]}.num_gpus_per_node", str(per_node)]
    v = variant(plan)
    if v == "colocate_all":
        out.append("--train.colocate_all")
    else:
        for pair, word in zip(PAIRS, ("actor_ref", "critic_reward")):
            a, c = sorted(pair)
            if a in u and c in u and same_gpus(u[a], u[c]):
                out.append(f"--train.colocate_{word}")
    out += ["--vllm.num_engines", str(g.config.dp), "--vllm.tensor_parallel_size", str(g.config.tp),
            "--vllm.gpu_memory_utilization", f"{generation_memory_fraction(job, cluster, plan, w, problem.params):.2f}",
            "--ds.zero_stage", str(actor.config.zero), "--ds.tensor_parallel_size", str(actor.config.tp)]
    if job.rollout.enforce_eager:  # priced without CUDA graphs: keep vLLM the same
        out.append("--vllm.enforce_eager")
    if actor.config.cp > 1:  # OpenRLHF's ring attention is context parallelism
        out += ["--ds.ring_attn_size", str(actor.config.cp)]
    a_inf = plan.stage("actor/inference")
    if dynamic_bsz or packs_tokens(plan):
        def per_gpu(s) -> str:  # OpenRLHF packs max_tokens_per_gpu x AutoTP size tokens into a micro-batch
            return str(-(-micro_batch_tokens(s.config, w) // s.config.tp))

        out += ["--train.dynamic_batch_enable", "--ds.packing_samples",
                "--train.max_tokens_per_gpu", per_gpu(actor), "--rollout.max_tokens_per_gpu", per_gpu(a_inf)]
    else:
        out += ["--train.micro_batch_size", str(actor.config.micro_batch),
                "--rollout.micro_batch_size", str(a_inf.config.micro_batch)]
    if actor.config.recompute:
        out.append("--actor.gradient_checkpointing_enable")
    if actor.name in offloaded(plan):
        out.append("--ds.adam_offload")
    out += ["--rollout.batch_size", str(b.prompts), "--rollout.n_samples_per_prompt", str(b.samples_per_prompt),
            "--train.batch_size", str(max(1, b.sequences // b.mini_batches)), "--train.max_epochs", str(b.ppo_epochs),
            "--data.max_len", str(w.seq_len_max), "--rollout.max_new_tokens", str(w.response_len_max),
            "--algo.advantage.estimator", "gae" if job.algorithm == "ppo" else "group_norm"]
    if job.algorithm == "grpo":
        out.append("--algo.kl.use_loss")
    return tuple(out)


def emit(problem, optimum: Plan, solve, *, dynamic_bsz: bool = False) -> Emission:
    """The OpenRLHF launch command for the optimum, or for the closest plan OpenRLHF can express."""
    plan, plan_gaps, tried = choose(problem, optimum, solve)
    reward = ("--reward.model_name_or_path" if "reward" in problem.job.roles
              else "--reward.remote_url (rule-based reward)")
    notes = ("Ray picks which GPUs each model gets; the plan's pool sizes are kept.",
             f"Add --actor.model_name_or_path, {'--critic.model_name_or_path, ' if 'critic' in problem.job.roles else ''}"
             f"{reward} and --data.prompt_dataset as arguments (\"$@\" passes them on); submit with "
             "`ray job submit -- bash <this file>`.",
             *engine_notes(problem.job, "OpenRLHF", VLLM, ("vllm",)))
    return Emission(framework="openrlhf", version=VERSION, variant=variant(plan), command=COMMAND,
                    args=flags(problem, plan, dynamic_bsz=dynamic_bsz), plan=plan, optimum=optimum, gaps=plan_gaps,
                    notes=notes, tried=tried)
