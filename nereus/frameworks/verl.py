"""verl: a plan as Hydra overrides of verl's PPO trainer (one colocated pool; Megatron or FSDP engine).

What verl 0.9.1 can express, and why (file names are inside the verl wheel):

- One resource pool, ``trainer.nnodes x trainer.n_gpus_per_node``, holds the actor, its vLLM
  rollout, the reference model and the critic (``trainer/ppo/v1/trainer_base.py``,
  ``_init_resource_pool_mgr``). The reward model runs on that pool or on its own
  (``reward.reward_model.enable_resource_pool``) as a vLLM server with its own TP / PP.
- Rollout TP and PP are free (``actor_rollout_ref.rollout.*_parallel_size``).
- Megatron engine (``model_engine=megatron``): the roles on the pool share one process per GPU
  and so one Megatron parallel state (``workers/engine/megatron/transformer_impl.py``,
  ``_init_device_mesh`` returns early once it exists): actor, ref and critic need one TP x PP.
  ZeRO-1 is ``use_distributed_optimizer``; no ZeRO-3.
- FSDP engine (the default ``dp``): ZeRO-3, no TP, no PP (``ulysses_sequence_parallel_size``
  splits sequences, not weights; emitted as 1).
- Micro-batches, recomputation and optimizer offload are per model.
- Mixture-of-experts models (``trainer/config/_generated_ppo_megatron_trainer.yaml``): Megatron's
  expert layout is ``<role>.megatron.expert_model_parallel_size`` / ``expert_tensor_parallel_size``
  (the latter emitted always for a MoE model, since its default ``null`` means "= TP" to Megatron,
  not Nereus's etp 1). Like TP x PP it belongs to the one Megatron parallel state, so the MoE models
  among actor, ref and critic share one (ep, etp) (the ref's keys default to the actor's by
  ``oc.select``). The FSDP engine (strategy ``fsdp`` / ``fsdp2``) has no expert parallelism: every
  rank holds every expert, sharded by ZeRO-3 (``fsdp_config.turbo_config.distributed.expert_parallel_size``
  is the ``fsdp_turbo`` strategy's, which needs the ``fsdp_turbo`` package outside verl).
- Rollout expert parallelism: ``actor_rollout_ref.rollout.expert_parallel_size`` (vLLM's
  ``enable_expert_parallel`` when > 1, ``vllm_async_server.py``; SGLang's ``ep_size``), which
  ``workers/config/rollout.py`` requires to equal tensor_model_parallel_size x data_parallel_size
  (data_parallel_size 1 as emitted): ep 1 or the rollout's TP. The reward model's vLLM servers
  likewise (``reward.reward_model.rollout.expert_parallel_size``).
"""
from __future__ import annotations

from dataclasses import replace

from nereus.errors import InfeasibleError, SpecError
from nereus.frameworks.common import (GEN, TRAINABLE_UNITS, Emission, closest, engine_notes, flag, gpu_range,
                                      generation_memory_fraction, nodes_and_gpus, offloaded, overlap, same_gpus,
                                      micro_batch_tokens, packs_tokens, stage_memory_fraction, units,
                                      with_expert_layout)
from nereus.planner.cost.model import controller_transfer_s
from nereus.planner.plan import Plan

VERSION = "0.9.1"
ENGINES = ("megatron", "fsdp")
COMMAND = ("python3", "-m", "verl.trainer.main_ppo")
VLLM = "0.24.0"
"""The vLLM release verl 0.9.1 pins (its ``vllm`` extra)."""
ROLLOUT_NAME = {"vllm": "vllm", "vllm-v0": "vllm", "sglang": "sglang", "tensorrt-llm": "trtllm"}
"""The job's generation engine -> ``actor_rollout_ref.rollout.name`` (verl 0.9.1's rollout registry:
vllm, sglang, trtllm); an engine verl lacks (``static``) runs on vLLM, with a note."""
SHARED = ("actor/training", "ref/inference", "critic/training")
"""Built in one process per GPU: one Megatron parallel state."""
ROLE_PREFIX = {"actor/training": "actor_rollout_ref.actor", "ref/inference": "actor_rollout_ref.ref",
               "critic/training": "critic"}


# ---- what verl cannot express ----------------------------------------------------------------
def placement_gaps(plan: Plan) -> list[str]:
    u = units(plan)
    g = u[GEN]
    out = [f"{name} on {gpu_range(u[name])} but actor/generation on {gpu_range(g)}: verl runs the actor, its "
           f"rollout, the reference model and the critic on one resource pool (trainer.nnodes x trainer.n_gpus_per_node)"
           for name in SHARED if name in u and not same_gpus(u[name], g)]
    r = u.get("reward/inference")
    if r is not None and not same_gpus(r, g) and overlap(r, g):
        out.append(f"reward/inference on {gpu_range(r)} overlaps the main pool ({gpu_range(g)}) without being it: verl "
                   f"puts the reward model on the main pool or on a pool of its own (reward.reward_model.enable_resource_pool)")
    return out


def _is_moe(s, job) -> bool:
    """Whether the model of ``s`` is a mixture of experts (without the job: whether its plan uses an
    expert layout)."""
    return job.model(s.role).is_moe if job is not None else s.config.ep * s.config.etp > 1


def _experts(s) -> str:
    return f"{s.name} ep{s.config.ep} etp{s.config.etp}"


def vllm_expert_layouts(s) -> list[tuple[int, int]]:
    """(ep, etp) a verl vLLM server of ``s``'s TP runs. Generation (priced with vLLM semantics):
    ep 1 (experts split by TP) or tp. A Megatron-priced scoring stage on vLLM (the reward model):
    (1, tp) for vLLM's TP-split experts, (tp, 1) for its expert parallelism."""
    tp = s.config.tp
    if s.stage == "generation":
        return sorted({(1, 1), (tp, 1)})
    return sorted({(1, tp), (tp, 1)})


def expert_gaps(plan: Plan, engine: str, job=None) -> list[str]:
    """The expert layouts of ``plan`` that verl with ``engine`` cannot express (none for a dense job)."""
    u = units(plan)
    shared = [u[n] for n in SHARED if n in u and _is_moe(u[n], job)]
    out = []
    if engine == "megatron":
        if len({(s.config.ep, s.config.etp) for s in shared}) > 1:
            out.append(f"{', '.join(_experts(s) for s in shared)}: verl's Megatron engine builds actor, ref and critic "
                       f"in one process per GPU with one Megatron parallel state, so their experts share one "
                       f"expert_model_parallel_size x expert_tensor_parallel_size")
    else:
        out += [f"{_experts(s)}: verl's FSDP engine (strategy fsdp/fsdp2) has no expert parallelism; every rank holds "
                f"every expert, sharded by ZeRO-3 (turbo_config.distributed.expert_parallel_size belongs to the "
                f"fsdp_turbo strategy, which needs the fsdp_turbo package outside verl)"
                for s in shared if s.config.ep * s.config.etp > 1]
    for name, key in ((GEN, "actor_rollout_ref.rollout"), ("reward/inference", "reward.reward_model.rollout")):
        s = u.get(name)
        if s is None or not _is_moe(s, job) or (s.config.ep, s.config.etp) in vllm_expert_layouts(s):
            continue
        out.append(f"{_experts(s)} at tp{s.config.tp}: verl's vLLM servers run experts split by tensor parallelism "
                   f"or expert-parallel over one server's TP group ({key}.expert_parallel_size must equal "
                   f"tensor_model_parallel_size x data_parallel_size, workers/config/rollout.py)")
    return out


def repair(engine: str, job):
    """``common.Repair`` for verl with ``engine``: the expert layouts verl runs. Megatron: each
    (ep, etp) one of the shared MoE models chose, for all of them; FSDP: none (ep = etp = 1);
    generation / reward servers: the nearest vLLM layout."""
    def fix(problem, plan: Plan) -> list[tuple[str, Plan]]:
        u = units(plan)
        shared = [n for n in SHARED if n in u and _is_moe(u[n], job)]
        servers = {}
        for name in (GEN, "reward/inference"):
            s = u.get(name)
            if s is not None and _is_moe(s, job) and (s.config.ep, s.config.etp) not in vllm_expert_layouts(s):
                servers[name] = vllm_expert_layouts(s)[-1 if s.config.ep > 1 else 0]
        if engine == "megatron":
            own = list(dict.fromkeys((u[n].config.ep, u[n].config.etp) for n in shared))
            fixes = [(f"experts at ep{ep} etp{etp} for {', '.join(x.split('/')[0] for x in shared)}",
                      {n: (ep, etp) for n in shared}) for ep, etp in own] if len(own) > 1 else [("", {})]
        else:  # FSDP shards every model it builds (the ref too) over all ranks
            fixes = [("experts unsharded (ZeRO-3)", {n: (1, 1) for n in shared})]
        out = []
        for label, lay in fixes:
            lay = dict(lay, **servers)
            if not lay or all((u[n].config.ep, u[n].config.etp) == v for n, v in lay.items()):
                continue
            try:
                p = with_expert_layout(with_expert_layout(plan, {n: v for n, v in lay.items() if n in SHARED},
                                                          zero=3 if engine == "fsdp" else None),
                                       {n: v for n, v in lay.items() if n not in SHARED})
            except SpecError:  # a layout one model-stage's tp x dp cannot hold
                continue
            out.append((label or "vLLM expert layout", p))
        return out
    return fix


def engine_gaps(plan: Plan, engine: str, job=None) -> list[str]:
    u = units(plan)
    shared = [u[n] for n in SHARED if n in u]
    out = expert_gaps(plan, engine, job)
    if engine == "megatron":
        layouts = {(s.config.tp, s.config.pp) for s in shared}
        if len(layouts) > 1:
            used = ", ".join(f"{s.name} tp{s.config.tp} pp{s.config.pp}" for s in shared)
            out.append(f"{used}: verl's Megatron engine builds actor, ref and critic in one process per GPU with one "
                       f"Megatron parallel state, so they share one TP x PP")
        out += [f"{s.name} uses ZeRO-{s.config.zero}: verl's Megatron engine shards only the optimizer state "
                f"(use_distributed_optimizer, ZeRO-1)" for s in shared if s.name in TRAINABLE_UNITS and s.config.zero > 1]
        out += [f"{s.name} uses Ulysses sequence parallelism {_sp(s)}: verl's Megatron engine splits sequences by "
                f"context parallelism instead" for s in shared if _sp(s) > 1]
        if len({_cp(s) for s in shared}) > 1:
            used = ", ".join(f"{s.name} cp{_cp(s)}" for s in shared)
            out.append(f"{used}: verl's Megatron engine has one context_parallel_size for actor, ref and critic")
    else:
        for s in shared:
            if _cp(s) > 1:
                out.append(f"{s.name} uses context parallelism {_cp(s)}: verl's FSDP engine splits sequences with "
                           f"Ulysses (ulysses_sequence_parallel_size) instead")
            if s.config.tp > 1:
                out.append(f"{s.name} uses tp {s.config.tp}: verl's FSDP engine has no tensor parallelism "
                           f"(ulysses_sequence_parallel_size splits sequences, not weights)")
            if s.config.pp > 1:
                out.append(f"{s.name} uses pp {s.config.pp}: verl's FSDP engine has no pipeline parallelism")
            if s.name in TRAINABLE_UNITS and s.config.zero != 3:
                out.append(f"{s.name} uses ZeRO-{s.config.zero}: verl's FSDP engine shards parameters, gradients "
                           f"and optimizer state (ZeRO-3)")
    return out


def _sp(s) -> int:
    return getattr(s.config, "sp", 1)


def _cp(s) -> int:
    return s.config.cp


def gaps(plan: Plan, engine: str, job=None) -> list[str]:
    """Everything of ``plan`` that verl with ``engine`` cannot express, one sentence each (``job``
    tells MoE models from dense ones; without it a model counts as MoE where its plan has ep * etp > 1)."""
    return placement_gaps(plan) + engine_gaps(plan, engine, job)


# ---- the closest plan verl can express -------------------------------------------------------
def candidates(base, engine: str) -> list[tuple[str, object]]:
    """``base`` (a PlanProblem) constrained to what verl with ``engine`` expresses: every model on
    the whole cluster; Megatron: ZeRO-0/1, no Ulysses; FSDP: ZeRO-3 with tp = pp = 1 for actor, ref
    and critic (Ulysses allowed)."""
    from nereus.planner.solver import PlanConstraints

    cs = base.candidates
    if engine == "megatron":
        zeros = tuple(z for z in cs.zeros if z <= 1) or (1,)
        return [("megatron, all models on every GPU",  # no Ulysses under Megatron (it splits by context parallelism)
                 replace(base, constraints=PlanConstraints(placement="colocated"),
                         candidates=replace(cs, zeros=zeros, sps=(1,))))]
    roles = set(base.job.roles)
    pins = tuple((n, 1, 1) for n in SHARED if n.split("/")[0] in roles)
    return [("fsdp, all models on every GPU",
             replace(base, constraints=PlanConstraints(placement="colocated", fixed_tp_pp=pins),
                     candidates=replace(cs, zeros=(3,), cps=(1,))))]


def equalize(problem, plan: Plan) -> list[tuple[str, object]]:
    """Megatron: re-solve with actor, ref and critic pinned to each TP x PP one of them chose."""
    u = units(plan)
    shared = [n for n in SHARED if n in u]
    layouts = sorted({(u[n].config.tp, u[n].config.pp) for n in shared}, key=lambda x: (x != (
        u["actor/training"].config.tp, u["actor/training"].config.pp), x))
    c = problem.constraints
    return [(f"actor, ref, critic pinned to tp{tp} pp{pp}",
             replace(problem, constraints=replace(c, fixed_tp_pp=tuple((n, tp, pp) for n in shared))))
            for tp, pp in layouts]


def choose(problem, optimum: Plan, solve, engine: str = "auto"):
    """(engine, plan, gaps of the optimum, tried): the optimum when an engine expresses it, else the
    fastest closest plan over the engines allowed."""
    job = problem.job
    return closest_over_engines(ENGINES if engine == "auto" else (engine,), optimum, job,
                                lambda p, e: gaps(p, e, job), lambda e: candidates(problem, e),
                                solve, lambda e: f"verl ({e})")


def closest_over_engines(engines, optimum: Plan, job, gaps_of, candidates_of, solve, name_of):
    """(engine, plan, gaps of the optimum, tried) over ``engines``: the first engine that expresses
    ``optimum`` as it is, else the fastest closest plan any engine expresses (``gaps_of(plan, e)``,
    ``candidates_of(e)``); the engines' errors joined when none fits. The sync and async trainers
    share it."""
    for e in engines:
        if not gaps_of(optimum, e):
            return e, optimum, (), ()
    best = None
    tried: list = []
    errors = []
    for e in engines:
        try:
            c = closest(candidates_of(e), solve, lambda p, e=e: gaps_of(p, e), equalize, name_of(e), repair(e, job))
        except InfeasibleError as err:  # the other engine may still fit
            errors.append(str(err))
            continue
        tried += c.tried
        if best is None or c.solution.objective < best[1].solution.objective:
            best = (e, c)
    if best is None:
        raise InfeasibleError("; ".join(errors))
    e, c = best
    return e, c.solution.plan, tuple(gaps_of(optimum, e)), tuple(tried)


# ---- overrides -----------------------------------------------------------------------------
def overrides(problem, plan: Plan, engine: str, *, dynamic_bsz: bool = False) -> tuple[tuple[str, str], ...]:
    """Hydra ``key=value`` pairs of verl's PPO trainer for ``plan`` (every key exists in verl's
    generated config for ``engine``; ``model_engine`` is the config-group choice)."""
    job, cluster, w, params = problem.job, problem.cluster, problem.workload, problem.params
    u = units(plan)
    g = u[GEN]
    b = job.batch
    nodes, per_node = nodes_and_gpus(g.gpus, cluster)
    out: list[tuple[str, str]] = []
    if engine == "megatron":
        out.append(("model_engine", "megatron"))
    out += [("trainer.nnodes", str(nodes)), ("trainer.n_gpus_per_node", str(per_node)),
            ("data.train_batch_size", str(b.prompts)), ("data.max_prompt_length", str(w.prompt_len)),
            ("data.max_response_length", str(w.response_len_max)),
            ("actor_rollout_ref.rollout.n", str(b.samples_per_prompt)),
            ("actor_rollout_ref.actor.ppo_mini_batch_size", str(max(1, b.prompts // b.mini_batches))),
            ("actor_rollout_ref.actor.ppo_epochs", str(b.ppo_epochs)),
            ("algorithm.adv_estimator", "gae" if job.algorithm == "ppo" else "grpo")]
    # verl builds the reference model only when a KL term needs it
    out.append(("algorithm.use_kl_in_reward", "true") if job.algorithm == "ppo"
               else ("actor_rollout_ref.actor.use_kl_loss", "true"))
    out += [("actor_rollout_ref.rollout.name", ROLLOUT_NAME.get(job.rollout.engine, "vllm")),
            ("actor_rollout_ref.rollout.tensor_model_parallel_size", str(g.config.tp)),
            ("actor_rollout_ref.rollout.pipeline_model_parallel_size", str(g.config.pp)),
            *((("actor_rollout_ref.rollout.expert_parallel_size", str(g.config.ep)),)
              if job.model("actor").is_moe else ()),
            ("actor_rollout_ref.rollout.gpu_memory_utilization",
             f"{generation_memory_fraction(job, cluster, plan, w, params):.2f}"),
            # the plan was priced with (or without) CUDA graphs as the job says: keep verl on the same
            ("actor_rollout_ref.rollout.enforce_eager", "true" if job.rollout.enforce_eager else "false")]
    off = offloaded(plan)
    for name in SHARED:
        if name in u:
            out += _engine_keys(ROLE_PREFIX[name], u[name], engine, name in off, job.model(name.split("/")[0]).is_moe)
    out += _batch_keys(plan, engine, w, dynamic_bsz)
    if "reward/inference" in u:
        out += _reward_keys(problem, plan)
    return tuple(out)


def _engine_keys(prefix: str, s, engine: str, offload: bool, moe: bool = False) -> list[tuple[str, str]]:
    c = s.config
    trainable = s.name in TRAINABLE_UNITS
    model = "actor_rollout_ref.model" if prefix.startswith("actor_rollout_ref") else "critic.model"
    if engine == "megatron":
        out = [(f"{prefix}.megatron.tensor_model_parallel_size", str(c.tp)),
               (f"{prefix}.megatron.pipeline_model_parallel_size", str(c.pp)),
               (f"{prefix}.megatron.context_parallel_size", str(_cp(s)))]
        if moe:  # etp always: Megatron reads verl's default null as etp = tp
            out += [(f"{prefix}.megatron.expert_model_parallel_size", str(c.ep)),
                    (f"{prefix}.megatron.expert_tensor_parallel_size", str(c.etp))]
        if trainable:
            out += [(f"{prefix}.megatron.use_distributed_optimizer", flag(c.zero >= 1)),
                    (f"{prefix}.megatron.optimizer_offload", flag(offload))]
            if c.recompute:
                tc = f"{prefix}.megatron.override_transformer_config"
                out += [(f"{tc}.recompute_granularity", "full"), (f"{tc}.recompute_method", "uniform"),
                        (f"{tc}.recompute_num_layers", "1")]
        return out
    out = [(f"{prefix}.ulysses_sequence_parallel_size", str(_sp(s)))]
    if trainable:
        fsdp = f"{prefix}.fsdp_config" if prefix != "critic" else "critic.fsdp"
        out += [(f"{fsdp}.optimizer_offload", flag(offload)), (f"{model}.enable_gradient_checkpointing", flag(c.recompute))]
    return out


def _batch_keys(plan: Plan, engine: str, w, dynamic: bool) -> list[tuple[str, str]]:
    u = units(plan)
    actor, ref, critic = u["actor/training"], u.get("ref/inference"), u.get("critic/training")
    a_inf = plan.stage("actor/inference")
    if dynamic or packs_tokens(plan):
        def per_gpu(s) -> str:  # verl packs per_gpu x ulysses size tokens into a micro-batch
            return str(-(-micro_batch_tokens(s.config, w) // _sp(s)))

        out = [("actor_rollout_ref.actor.use_dynamic_bsz", "true"),
               ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", per_gpu(actor)),
               ("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "true"),
               ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", per_gpu(a_inf))]
        if ref is not None:
            out += [("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "true"),
                    ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", per_gpu(ref))]
        if critic is not None:
            out += [("critic.use_dynamic_bsz", "true"), ("critic.ppo_max_token_len_per_gpu", per_gpu(critic)),
                    ("critic.forward_max_token_len_per_gpu", per_gpu(plan.stage("critic/inference")))]
        return out
    out = [("actor_rollout_ref.actor.use_dynamic_bsz", "false"),
           ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", str(actor.config.micro_batch)),
           ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", str(a_inf.config.micro_batch))]
    if ref is not None:
        out.append(("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", str(ref.config.micro_batch)))
    if critic is not None:
        out.append(("critic.ppo_micro_batch_size_per_gpu", str(critic.config.micro_batch)))
        if engine == "fsdp":  # the Megatron critic runs its forward passes at ppo_micro_batch_size_per_gpu
            out.append(("critic.forward_micro_batch_size_per_gpu",
                        str(plan.stage("critic/inference").config.micro_batch)))
    return out


def _reward_keys(problem, plan: Plan) -> list[tuple[str, str]]:
    u = units(plan)
    r, g = u["reward/inference"], u[GEN]
    rm = "reward.reward_model"
    out = [(f"{rm}.enable", "true"), (f"{rm}.rollout.name", "vllm"),
           (f"{rm}.rollout.tensor_model_parallel_size", str(r.config.tp)),
           (f"{rm}.rollout.pipeline_model_parallel_size", str(r.config.pp)),
           *(((f"{rm}.rollout.expert_parallel_size", str(r.config.ep)),) if problem.job.model("reward").is_moe else ()),
           (f"{rm}.rollout.gpu_memory_utilization",
            f"{stage_memory_fraction(problem.job, problem.cluster, r, problem.workload, problem.params):.2f}")]
    if not same_gpus(r, g):
        nodes, per_node = nodes_and_gpus(r.gpus, problem.cluster)
        out += [(f"{rm}.enable_resource_pool", "true"), (f"{rm}.nnodes", str(nodes)),
                (f"{rm}.n_gpus_per_node", str(per_node))]
    return out


def emit(problem, optimum: Plan, solve, *, engine: str = "auto", dynamic_bsz: bool = False) -> Emission:
    """The verl launch command for the optimum, or for the closest plan verl can express."""
    chosen, plan, plan_gaps, tried = choose(problem, optimum, solve, engine)
    args = tuple(f"{k}={v}" for k, v in overrides(problem, plan, chosen, dynamic_bsz=dynamic_bsz))
    roles = problem.job.roles
    paths = ["actor_rollout_ref.model.path=..."] + (["critic.model.path=..."] if "critic" in roles else []) + (
        ["reward.reward_model.model_path=..."] if "reward" in roles else []) + ["data.train_files=..."]
    notes = (f"Add your own model paths and data ({', '.join(paths)}) as arguments: \"$@\" passes them on.",
             *engine_notes(problem.job, "verl", VLLM, tuple(e for e in ROLLOUT_NAME if e != "vllm-v0")),
             driver_note(problem))
    return Emission(framework="verl", version=VERSION, variant=chosen, command=COMMAND, args=args, plan=plan,
                    optimum=optimum, gaps=plan_gaps, notes=notes, tried=tried)


def driver_s(problem) -> tuple[float, int]:
    """(seconds, calls) per step of verl's driver moving each worker call's batch (``controller_transfer_s``:
    every sequence padded to the prompt and response caps), one call per model-stage of the job."""
    job, w, p = problem.job, problem.workload, problem.params
    stages = job.model_stages()
    width = w.prompt_len + w.response_len_max
    return sum(controller_transfer_s(ms.partition("/")[2], w.sequences, width, w.response_len_max, p)
               for ms in stages), len(stages)


def driver_note(problem) -> str:
    total, calls = driver_s(problem)
    return (f"verl's driver also moves each worker call's batch through Ray: about {total:.1f} s per step over "
            f"{calls} calls at {problem.params.controller_gbps:g} GB/s (measured, benchmarks/verl_dispatch.py), "
            f"not in the predicted step times above, the same for every plan.")
