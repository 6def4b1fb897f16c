"""Expert parallelism emitted (issue 30, item 4): verl's Megatron ``expert_model_parallel_size`` /
``expert_tensor_parallel_size`` (actor, ref) and the rollout's ``expert_parallel_size``, every key
checked against verl 0.9.1's generated configs read as data from the wheel (as test_frameworks.py
does), with verl's own rules on their values; what verl's FSDP engine and OpenRLHF cannot express of
an expert layout is named, and the closest plan they can express is feasible and has none of it."""
import re
import sys
from dataclasses import replace

import pytest
import yaml

from nereus.frameworks import emit, openrlhf, verl, verl_async
from nereus.frameworks.common import with_expert_layout
from nereus.planner.solver import PlanProblem, evaluate_plan, solve
from nereus.planner.specs import ParallelConfig as P, load_cluster, load_job

from test_frameworks import (JOB8, MEGATRON_PLAN, check_openrlhf_flags, make_plan, no_solve, openrlhf_flags,
                             verl_config)
from test_frameworks_async import async_config, async_plan

MOE = "examples/grpo-qwen3-30b-a3b.yaml"
FOUR_NODES = "examples/cluster-h100-4n.yaml"
EP_PLAN = {"actor/generation": (P(tp=4, dp=8, ep=4), 0, 32),
           "actor/training": (P(tp=2, dp=16, ep=8), 0, 32),
           "ref/inference": (P(tp=2, dp=16, ep=8, micro_batch=2), 0, 32)}
ETP_PLAN = {"actor/generation": (P(tp=2, dp=16), 0, 32),
            "actor/training": (P(tp=2, pp=2, dp=8, ep=4, etp=2), 0, 32),
            "ref/inference": (P(tp=2, pp=2, dp=8, ep=4, etp=2), 0, 32)}


def moe_problem():
    job = load_job(MOE)
    return PlanProblem(job=job, cluster=load_cluster(FOUR_NODES), workload=job.workload())


def solver(q):
    return solve(q, backend="cpsat", time_limit_s=30, workers=1, seed=0)


def _kv(args):
    return dict(a.split("=", 1) for a in args)


def _check_types(kv, cfg):
    for k, v in kv.items():  # the value has the type of verl's default where it has one
        default = cfg[k]
        if default is not None and not (isinstance(default, str) and default.startswith("${")) and default != "???":
            got = yaml.safe_load(v)
            assert type(got) is type(default) or (isinstance(default, float) and isinstance(got, int)), (k, v, default)


def _verl_rules(kv, cfg):
    """verl 0.9.1's own checks on the emitted values: workers/config/rollout.py (rollout EP equals
    TP x data_parallel_size) and Megatron's expert layout (ep x etp divides tp x dp)."""
    r = "actor_rollout_ref.rollout"
    ep = int(kv.get(f"{r}.expert_parallel_size", cfg[f"{r}.expert_parallel_size"]))
    dp = int(kv.get(f"{r}.data_parallel_size", cfg[f"{r}.data_parallel_size"]))
    if ep > 1:
        assert ep == int(kv[f"{r}.tensor_model_parallel_size"]) * dp
    world = int(kv["trainer.nnodes"]) * int(kv["trainer.n_gpus_per_node"])
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref"):
        m = f"{role}.megatron"
        tp, pp = int(kv[f"{m}.tensor_model_parallel_size"]), int(kv[f"{m}.pipeline_model_parallel_size"])
        e, et = int(kv[f"{m}.expert_model_parallel_size"]), int(kv[f"{m}.expert_tensor_parallel_size"])
        assert (world // pp) % (e * et) == 0 and 128 % e == 0


# ---- verl Megatron ------------------------------------------------------------------------------
@pytest.mark.parametrize("units,want", [(EP_PLAN, ("8", "1", "4")), (ETP_PLAN, ("4", "2", "1"))])
def test_emitted_ep_keys_valid_in_verl_megatron_config(units, want):
    """Must show: emitted EP keys valid in verl 0.9.1's Megatron config."""
    cfg = verl_config("megatron")
    problem = moe_problem()
    plan = make_plan(problem.job, units)
    assert verl.gaps(plan, "megatron", problem.job) == []
    em = verl.emit(problem, plan, no_solve, engine="megatron")
    assert em.gaps == () and em.plan is plan
    kv = _kv(em.args)
    assert kv.pop("model_engine") == "megatron"
    missing = [k for k in kv if k not in cfg]
    assert not missing, f"not keys of verl's generated megatron config: {missing}"
    _check_types(kv, cfg)
    ep, etp, rollout_ep = want
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref"):
        assert kv[f"{role}.megatron.expert_model_parallel_size"] == ep
        assert kv[f"{role}.megatron.expert_tensor_parallel_size"] == etp  # never verl's null (= tp to Megatron)
    assert kv["actor_rollout_ref.rollout.expert_parallel_size"] == rollout_ep
    assert sorted(k for k in kv if "expert" in k) == sorted(
        [f"actor_rollout_ref.{r}.megatron.expert_{x}_parallel_size" for r in ("actor", "ref") for x in ("model", "tensor")]
        + ["actor_rollout_ref.rollout.expert_parallel_size"])
    _verl_rules(kv, cfg)
    assert "verl" not in sys.modules
    assert "actor/training: 2 x " in em.render() and f", ep {ep}" in em.render()


def test_dense_emission_has_no_expert_keys():
    problem = PlanProblem(job=load_job(JOB8), cluster=load_cluster(FOUR_NODES), workload=load_job(JOB8).workload())
    for engine in ("megatron", "fsdp"):
        args = verl.emit(problem, make_plan(problem.job, MEGATRON_PLAN), lambda q: solver(q), engine=engine).args
        assert not [a for a in args if "expert" in a]


def test_fsdp_emits_rollout_ep_only():
    cfg = verl_config("fsdp")
    problem = moe_problem()
    plan = make_plan(problem.job, {"actor/generation": (P(tp=4, dp=8, ep=4), 0, 32),
                                   "actor/training": (P(dp=32, zero=3), 0, 32), "ref/inference": (P(dp=32, zero=3), 0, 32)})
    assert verl.gaps(plan, "fsdp", problem.job) == []
    kv = _kv(verl.emit(problem, plan, no_solve, engine="fsdp").args)
    assert all(k in cfg for k in kv)
    assert [k for k in kv if "expert" in k] == ["actor_rollout_ref.rollout.expert_parallel_size"]
    assert kv["actor_rollout_ref.rollout.expert_parallel_size"] == "4"


# ---- what verl cannot express ---------------------------------------------------------------------
def test_verl_expert_gaps():
    job = load_job(MOE)
    split = dict(EP_PLAN, **{"ref/inference": (P(tp=2, dp=16, ep=1, etp=2), 0, 32)})
    g = verl.gaps(make_plan(job, split), "megatron", job)
    assert len(g) == 1 and g[0].startswith("actor/training ep8 etp1, ref/inference ep1 etp2: verl's Megatron engine")
    assert "one Megatron parallel state" in g[0]
    # FSDP: no expert parallelism at all; the rollout's EP is fine
    f = verl.gaps(make_plan(job, EP_PLAN), "fsdp", job)
    assert sum("has no expert parallelism" in x for x in f) == 2
    assert any(x.startswith("actor/training ep8 etp1: verl's FSDP engine (strategy fsdp/fsdp2)") for x in f)
    assert not any(x.startswith("actor/generation") for x in f)
    # a rollout expert layout verl's vLLM servers do not run: ep other than 1 or tp
    bad = dict(EP_PLAN, **{"actor/generation": (P(tp=4, dp=8, ep=2), 0, 32)})
    gb = verl.gaps(make_plan(job, bad), "megatron", job)
    assert len(gb) == 1 and gb[0].startswith("actor/generation ep2 etp1 at tp4")
    assert "expert_parallel_size must equal tensor_model_parallel_size x data_parallel_size" in gb[0]
    assert verl.gaps(make_plan(job, EP_PLAN), "megatron", job) == []


def test_verl_repair_puts_shared_experts_on_one_layout():
    problem = moe_problem()
    split = make_plan(problem.job, dict(EP_PLAN, **{"ref/inference": (P(tp=2, dp=16, ep=1, etp=2), 0, 32)}))
    fixes = verl.repair("megatron", problem.job)(problem, split)
    layouts = sorted({(p.stage("actor/training").config.ep, p.stage("ref/inference").config.etp) for _, p in fixes})
    assert layouts == [(1, 2), (8, 1)]
    for _, p in fixes:
        a, r, ai = (p.stage(n).config for n in ("actor/training", "ref/inference", "actor/inference"))
        assert (a.ep, a.etp) == (r.ep, r.etp) == (ai.ep, ai.etp)
        assert verl.gaps(p, "megatron", problem.job) == []
    assert verl.repair("megatron", problem.job)(problem, make_plan(problem.job, EP_PLAN)) == []
    fsdp = verl.repair("fsdp", problem.job)(problem, make_plan(problem.job, EP_PLAN))
    assert [(s.config.ep, s.config.etp) for s in fsdp[0][1].stages if s.name != "actor/generation"] == [(1, 1)] * 3


def tiny_moe_problem():
    from test_solver_moe import _problem

    return _problem(80, 1, 8)


@pytest.mark.parametrize("case", ["qwen3-30b-a3b", "tiny-moe fsdp"])
def test_closest_verl_plan(case):
    if case == "qwen3-30b-a3b":
        problem, engine = moe_problem(), "auto"
        opt = solver(problem)
    else:  # a plan with EP everywhere, to FSDP: no EP, every expert sharded by ZeRO-3 instead
        problem, engine = tiny_moe_problem(), "fsdp"
        opt = solver(problem)
        opt = replace(opt, plan=with_expert_layout(opt.plan, {"actor/training": (8, 1), "ref/inference": (4, 1)}))
    em = emit("verl", problem, opt.plan, solver, verl_engine=engine)
    job = problem.job
    assert verl.gaps(em.plan, em.variant, job) == []
    ev = evaluate_plan(problem, em.plan)
    assert ev.feasible, ev.violations
    assert ev.step_time_s == pytest.approx(em.step_time_s, rel=1e-6) and em.step_time_s >= opt.objective - 1e-6
    kv = _kv(em.args)
    cfg = verl_config(em.variant)
    kv.pop("model_engine", None)
    assert all(k in cfg for k in kv)
    _check_types(kv, cfg)
    tr = em.plan.stage("actor/training").config
    if em.variant == "megatron":
        _verl_rules(kv, cfg)
        assert kv["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == str(tr.ep)
        assert kv["actor_rollout_ref.ref.megatron.expert_tensor_parallel_size"] == str(tr.etp)
    else:  # no EP on FSDP: the closest plan holds every expert, sharded by ZeRO-3
        assert (tr.ep, tr.etp, tr.zero) == (1, 1, 3)
        assert sum("verl's FSDP engine (strategy fsdp/fsdp2) has no expert parallelism" in g for g in em.gaps) == 2
    assert kv["actor_rollout_ref.rollout.expert_parallel_size"] == str(em.plan.stage("actor/generation").config.ep)


def test_async_moe_plan_keys_in_the_launchers_config():
    problem = moe_problem()
    units = {"actor/generation": (P(tp=4, dp=4, ep=4), 0, 16), "actor/training": (P(tp=2, dp=8, ep=8), 16, 16),
             "ref/inference": (P(tp=2, dp=8, ep=8), 16, 16)}
    plan = async_plan(problem.job, units, {"kind": "one_step_off"})
    em = emit("verl", problem, plan, no_solve, verl_engine="megatron")
    assert em.gaps == ()
    kv = _kv(em.args)
    cfg = async_config("one_step_off", "megatron")
    assert all(k in cfg for k in kv)
    assert (kv["actor_rollout_ref.actor.megatron.expert_model_parallel_size"],
            kv["actor_rollout_ref.rollout.expert_parallel_size"]) == ("8", "4")
    split = dict(units, **{"ref/inference": (P(tp=2, dp=8, ep=2), 16, 16)})
    assert any("one Megatron parallel state" in g for g in verl_async.gaps(
        async_plan(problem.job, split, {"kind": "one_step_off"}), "megatron", problem.cluster, "one_step_off",
        problem.job))


# ---- OpenRLHF: no expert parallelism ------------------------------------------------------------
def test_openrlhf_names_expert_parallelism_as_a_gap():
    job = load_job(MOE)
    g = openrlhf.gaps(make_plan(job, EP_PLAN))
    assert any(x.startswith("actor/generation uses ep 4: OpenRLHF's vLLM engines run without expert parallelism")
               for x in g)
    assert any(x.startswith("actor/training ep8 etp1, ref/inference ep8 etp1: OpenRLHF trains and scores") for x in g)
    unsharded = with_expert_layout(make_plan(job, EP_PLAN), {n: (1, 1) for n in EP_PLAN})
    assert not [x for x in openrlhf.gaps(unsharded) if "expert" in x]
    assert [r for r, _ in openrlhf.repair(None, make_plan(job, EP_PLAN))] == ["experts unsharded"]
    assert openrlhf.repair(None, unsharded) == []


def test_closest_openrlhf_plan_for_qwen3_30b_a3b_has_no_expert_layout():
    problem = moe_problem()
    opt = solver(problem)
    em = emit("openrlhf", problem, opt.plan, solver)
    assert openrlhf.gaps(em.plan) == []
    assert all((s.config.ep, s.config.etp) == (1, 1) for s in em.plan.stages)
    ev = evaluate_plan(problem, em.plan)
    assert ev.feasible, ev.violations
    assert em.step_time_s >= opt.objective - 1e-6
    check_openrlhf_flags(list(em.args), openrlhf_flags())
    assert not [a for a in em.args if re.search("expert", a)]
