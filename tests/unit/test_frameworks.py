"""`nereus plan --emit verl|openrlhf`: every emitted verl key exists in verl's own generated config and
every OpenRLHF flag in its argparse definitions (both read as data from the installed wheels, never
imported); what a framework cannot express is named; the closest expressible plan is feasible, has
no gaps and is no faster than the optimum; --out is atomic; bad input exits 2 with one line."""
import ast
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nereus.errors import SpecError
from nereus.frameworks import common, emit, openrlhf, verl
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.solver import PlanProblem, evaluate_plan, solve
from nereus.planner.specs import ParallelConfig, load_cluster, load_job

JOB8, JOB7 = "examples/ppo-8b.yaml", "examples/grpo-7b.yaml"
FOUR_NODES, ONE_NODE = "examples/cluster-h100-4n.yaml", "examples/cluster-h100-1n.yaml"
ROOT = Path(__file__).resolve().parents[2]


# ---- the wheels, read as data ----------------------------------------------------------------
def _package_dir(name: str, version: str) -> Path:
    spec = importlib.util.find_spec(name)  # a top-level package: located, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} {version} is not installed (`make install` adds it with pip --no-deps)")
    installed = importlib.metadata.version(name)
    assert installed == version, f"{name} {installed} installed; the emitter's keys were checked against {version}"
    return Path(list(spec.submodule_search_locations)[0])


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        out[prefix + str(k)] = v
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
    return out


def verl_config(engine: str) -> dict:
    root = _package_dir("verl", verl.VERSION) / "trainer" / "config"
    name = "_generated_ppo_megatron_trainer.yaml" if engine == "megatron" else "_generated_ppo_trainer.yaml"
    return _flatten(yaml.safe_load((root / name).read_text()))


def openrlhf_flags() -> dict[str, bool]:
    """Every ``--flag`` of train_ppo_ray -> whether it is a store_true switch (takes no value)."""
    text = (_package_dir("openrlhf", openrlhf.VERSION) / "cli" / "train_ppo_ray.py").read_text()
    out = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--"):
            action = next((k.value.value for k in node.keywords if k.arg == "action"), None)
            out[node.args[0].value] = action == "store_true"
    assert len(out) > 100, "found almost no add_argument calls: the reader is broken"
    return out


# ---- plans by hand ---------------------------------------------------------------------------
def make_plan(job, units: dict, offload=()) -> Plan:
    """``units``: home model-stage -> (ParallelConfig, first_gpu, gpus); trainable models run their
    inference stage in their training layout."""
    pools: dict = {}
    stages = []
    for name, (cfg, first, gpus) in units.items():
        pool = pools.setdefault((first, gpus), len(pools))
        names = [name, name.replace("training", "inference")] if name.endswith("training") else [name]
        stages += [StagePlacement(name=n, config=cfg, pool=pool, first_gpu=first, gpus=gpus, time_s=1.0)
                   for n in names if n in job.model_stages()]
    return Plan(stages=tuple(stages), step_time_s=100.0, extras=(("offload", tuple(offload)),))


def problem_of(job_path, cluster_path):
    job, cluster = load_job(job_path), load_cluster(cluster_path)
    return PlanProblem(job=job, cluster=cluster, workload=job.workload())


def solver(q):
    return solve(q, backend="cpsat", time_limit_s=20, workers=1, seed=0)


def no_solve(q):
    raise AssertionError("the optimum was expressible: nothing should be re-solved")


P = ParallelConfig
MEGATRON_PLAN = {  # everything on 32 GPUs, one TP x PP for actor/ref/critic, reward on its own 8 GPUs
    "actor/generation": (P(tp=2, dp=12), 0, 24), "actor/training": (P(tp=2, pp=4, dp=3, recompute=True), 0, 24),
    "critic/training": (P(tp=2, pp=4, dp=3, micro_batch=2), 0, 24), "ref/inference": (P(tp=2, pp=4, dp=3), 0, 24),
    "reward/inference": (P(tp=2, pp=2, dp=2), 24, 8)}
FSDP_PLAN = {"actor/generation": (P(tp=4, dp=8), 0, 32), "actor/training": (P(dp=32, zero=3, micro_batch=2), 0, 32),
             "critic/training": (P(dp=32, zero=3, recompute=True), 0, 32), "ref/inference": (P(dp=32, micro_batch=4), 0, 32),
             "reward/inference": (P(dp=32), 0, 32)}


def _kv(args):
    return dict(a.split("=", 1) for a in args)


# ---- verl --------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine,units,dynamic", [("megatron", MEGATRON_PLAN, False), ("megatron", MEGATRON_PLAN, True),
                                                  ("fsdp", FSDP_PLAN, False), ("fsdp", FSDP_PLAN, True)])
def test_every_verl_override_is_a_key_of_verls_generated_config(engine, units, dynamic):
    cfg = verl_config(engine)
    job = load_job(JOB8)
    cluster = load_cluster(FOUR_NODES)
    problem = PlanProblem(job=job, cluster=cluster, workload=job.workload())
    plan = make_plan(job, units, offload=("actor/training",))
    assert verl.gaps(plan, engine) == []
    em = verl.emit(problem, plan, no_solve, engine=engine, dynamic_bsz=dynamic)
    kv = _kv(em.args)
    group = kv.pop("model_engine", None)
    assert group == ("megatron" if engine == "megatron" else None)
    if group:
        assert (_package_dir("verl", verl.VERSION) / "trainer" / "config" / "model_engine" / f"{group}.yaml").exists()
    missing = [k for k in kv if k not in cfg]
    assert not missing, f"not keys of verl's generated {engine} config: {missing}"
    for k, v in kv.items():  # the value has the type of verl's default where it has one
        default = cfg[k]
        if default is not None and not (isinstance(default, str) and default.startswith("${")) and default != "???":
            assert type(yaml.safe_load(v)) is type(default) or (isinstance(default, float) and
                                                                  isinstance(yaml.safe_load(v), int)), (k, v, default)
    assert "verl" not in sys.modules  # read as data only
    # the plan's numbers, where they land
    if engine == "megatron":
        assert kv["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"] == "4"
        assert kv["critic.megatron.tensor_model_parallel_size"] == "2"
        assert kv["actor_rollout_ref.actor.megatron.optimizer_offload"] == "true"
        assert kv["critic.megatron.optimizer_offload"] == "false"
        assert kv["actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity"] == "full"
        assert "critic.megatron.override_transformer_config.recompute_granularity" not in kv
        assert (kv["trainer.nnodes"], kv["trainer.n_gpus_per_node"]) == ("3", "8")
        assert (kv["reward.reward_model.enable_resource_pool"], kv["reward.reward_model.nnodes"],
                kv["reward.reward_model.n_gpus_per_node"]) == ("true", "1", "8")
        assert kv["reward.reward_model.rollout.pipeline_model_parallel_size"] == "2"
    else:
        assert (kv["trainer.nnodes"], kv["trainer.n_gpus_per_node"]) == ("4", "8")
        assert kv["actor_rollout_ref.model.enable_gradient_checkpointing"] == "false"
        assert kv["critic.model.enable_gradient_checkpointing"] == "true"
        assert kv["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "true"
        assert "reward.reward_model.enable_resource_pool" not in kv
    assert kv["actor_rollout_ref.rollout.tensor_model_parallel_size"] == str(units["actor/generation"][0].tp)
    if dynamic:  # micro-batch x (1024 prompt + 8192 response cap) tokens
        assert kv["actor_rollout_ref.actor.use_dynamic_bsz"] == "true"
        assert kv["critic.ppo_max_token_len_per_gpu"] == str(units["critic/training"][0].micro_batch * 9216)
        assert kv["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"] == str(units["ref/inference"][0].micro_batch * 9216)
    else:
        assert kv["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == str(units["actor/training"][0].micro_batch)
        assert kv["critic.ppo_micro_batch_size_per_gpu"] == str(units["critic/training"][0].micro_batch)
        assert kv["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"] == str(units["ref/inference"][0].micro_batch)
    util = float(kv["actor_rollout_ref.rollout.gpu_memory_utilization"])
    assert 0.05 < util < 0.98


def test_verl_grpo_has_no_critic_or_reward_keys_and_turns_on_the_kl_loss():
    cfg = verl_config("fsdp")
    problem = problem_of(JOB7, ONE_NODE)
    plan = make_plan(problem.job, {"actor/generation": (P(tp=2, dp=4), 0, 8),
                                   "actor/training": (P(dp=8, zero=3), 0, 8), "ref/inference": (P(dp=8), 0, 8)})
    kv = _kv(verl.emit(problem, plan, no_solve, engine="fsdp").args)
    assert all(k in cfg for k in kv)
    assert not [k for k in kv if k.startswith(("critic.", "reward."))]
    assert (kv["algorithm.adv_estimator"], kv["actor_rollout_ref.actor.use_kl_loss"]) == ("grpo", "true")
    assert (kv["actor_rollout_ref.rollout.n"], kv["data.train_batch_size"]) == ("8", "64")
    assert kv["actor_rollout_ref.actor.ppo_mini_batch_size"] == "32"  # 64 prompts in 2 mini-batches


def test_verl_gaps_name_what_it_cannot_express():
    job = load_job(JOB8)
    split = dict(MEGATRON_PLAN, **{"critic/training": (P(tp=4, pp=2, dp=2, zero=3), 16, 16),
                                   "reward/inference": (P(dp=16), 16, 16)})
    g = verl.gaps(make_plan(job, split), "megatron")
    text = "\n".join(g)
    assert "critic/training on GPUs 16-31 but actor/generation on GPUs 0-23" in text
    assert "reward/inference on GPUs 16-31 overlaps the main pool (GPUs 0-23)" in text
    assert "actor/training tp2 pp4, ref/inference tp2 pp4, critic/training tp4 pp2" in text
    assert "critic/training uses ZeRO-3" in text and len(g) == 4
    fsdp = verl.gaps(make_plan(job, MEGATRON_PLAN), "fsdp")
    assert "actor/training uses tp 2" in fsdp[0] and any("pp 4: verl's FSDP engine has no pipeline" in x for x in fsdp)
    assert any("actor/training uses ZeRO-1" in x for x in fsdp)
    assert verl.gaps(make_plan(job, FSDP_PLAN), "fsdp") == []
    assert verl.gaps(make_plan(job, MEGATRON_PLAN), "megatron") == []


# ---- OpenRLHF ----------------------------------------------------------------------------------
def check_openrlhf_flags(words, flags):
    for i, w in enumerate(words):
        if not w.startswith("--"):
            continue
        assert w in flags, f"{w} is not an argument of OpenRLHF {openrlhf.VERSION}'s train_ppo_ray"
        takes_value = i + 1 < len(words) and not words[i + 1].startswith("--")
        assert takes_value != flags[w], f"{w}: {'a switch given a value' if flags[w] else 'no value given'}"
    assert "openrlhf" not in sys.modules


def check_verl_keys(args, engine):
    kv = _kv(args)
    assert kv.pop("model_engine", None) == ("megatron" if engine == "megatron" else None)
    cfg = verl_config(engine)
    missing = [k for k in kv if k not in cfg]
    assert not missing, f"not keys of verl's generated {engine} config: {missing}"
    return kv


PAIRED_PLAN = {"actor/generation": (P(tp=2, dp=8), 0, 16),
               "actor/training": (P(tp=2, dp=4, micro_batch=2, recompute=True), 16, 8),
               "ref/inference": (P(tp=2, dp=4, micro_batch=2), 16, 8),
               "critic/training": (P(tp=2, dp=4, micro_batch=2, recompute=True), 24, 8),
               "reward/inference": (P(tp=2, dp=4, micro_batch=2), 24, 8)}


@pytest.mark.parametrize("dynamic", [False, True])
def test_every_openrlhf_flag_is_an_argument_of_train_ppo_ray(dynamic):
    flags = openrlhf_flags()
    problem = problem_of(JOB8, FOUR_NODES)
    plan = make_plan(problem.job, PAIRED_PLAN, offload=("actor/training", "critic/training"))
    assert openrlhf.gaps(plan) == []
    em = openrlhf.emit(problem, plan, no_solve, dynamic_bsz=dynamic)
    words = list(em.args)
    check_openrlhf_flags(words, flags)
    assert "--actor.gradient_checkpointing_enable" in words and "--ds.adam_offload" in words
    value = {w: words[i + 1] for i, w in enumerate(words[:-1]) if not words[i + 1].startswith("--")}
    assert (value["--actor.num_nodes"], value["--actor.num_gpus_per_node"]) == ("1", "8")
    assert (value["--critic.num_nodes"], value["--critic.num_gpus_per_node"]) == ("1", "8")
    assert (value["--vllm.num_engines"], value["--vllm.tensor_parallel_size"]) == ("8", "2")
    assert value["--ds.tensor_parallel_size"] == "2"
    assert "--train.colocate_actor_ref" in words and "--train.colocate_critic_reward" in words
    assert "--train.colocate_all" not in words and em.variant == "paired"
    if dynamic:  # 2 sequences x 9216 tokens over an AutoTP group of 2
        assert value["--train.max_tokens_per_gpu"] == "9216" and "--train.micro_batch_size" not in value
    else:
        assert value["--train.micro_batch_size"] == "2" and value["--rollout.micro_batch_size"] == "2"


def test_openrlhf_gaps_name_what_it_cannot_express():
    job = load_job(JOB8)
    plan = make_plan(job, {"actor/generation": (P(tp=2, dp=16), 0, 32),
                           "actor/training": (P(tp=2, pp=2, dp=4, zero=3), 0, 16),
                           "ref/inference": (P(tp=1, dp=8, micro_batch=4), 0, 8),
                           "critic/training": (P(tp=1, dp=16, recompute=True), 16, 16),
                           "reward/inference": (P(dp=16), 16, 16)}, offload=("critic/training",))
    text = "\n".join(openrlhf.gaps(plan))
    assert "actor/generation (GPUs 0-31) shares GPUs with actor/training (GPUs 0-15)" in text
    assert "ref/inference (GPUs 0-7) share only some GPUs" in text
    assert "actor/training pp2: OpenRLHF trains and scores with DeepSpeed, without pipeline parallelism" in text
    assert "--ds.tensor_parallel_size is one value" in text and "ref/inference tp1" in text
    assert "actor/training uses tp 2 with ZeRO-3" in text
    assert "--rollout.micro_batch_size is one value" in text and "ref/inference mb4" in text
    assert "--ds.zero_stage is one value" in text
    assert "the plan recomputes only critic/training" in text
    assert "the plan offloads only critic/training" in text
    assert openrlhf.gaps(make_plan(job, PAIRED_PLAN)) == []


# ---- the closest expressible plan ------------------------------------------------------------
@pytest.mark.parametrize("framework", ["verl", "openrlhf"])
def test_closest_plan_for_ppo_8b_on_4_nodes(framework):
    problem = problem_of(JOB8, FOUR_NODES)
    opt = solver(problem)
    em = emit(framework, problem, opt.plan, solver)
    if framework == "verl":
        gaps = verl.gaps(em.plan, em.variant)
        check_verl_keys(em.args, em.variant)
    else:
        gaps = openrlhf.gaps(em.plan)
        check_openrlhf_flags(list(em.args), openrlhf_flags())
        assert ("--train.colocate_all" in em.args) == (em.variant == "colocate_all")
    assert em.gaps and gaps == []  # the optimum splits pools: neither framework expresses it
    ev = evaluate_plan(problem, em.plan)
    assert ev.feasible, ev.violations
    assert ev.step_time_s == pytest.approx(em.step_time_s, rel=1e-6)
    assert em.step_time_s >= opt.objective - 1e-6
    assert any(t == pytest.approx(em.step_time_s) for _, t in em.tried if t is not None)
    text = em.render()
    assert f"the optimum: {opt.objective:.2f} s" in text and f"Predicted step time: {em.step_time_s:.2f} s" in text
    assert all(f"#   - {g}" in text for g in em.gaps)


def test_render_round_trips_to_the_arguments():
    problem = problem_of(JOB8, FOUR_NODES)
    for em in (verl.emit(problem, make_plan(problem.job, MEGATRON_PLAN), no_solve, engine="megatron"),
               openrlhf.emit(problem, make_plan(problem.job, PAIRED_PLAN), no_solve)):
        lines = em.render().splitlines()
        start = lines.index(" ".join(em.command) + " \\")
        body = lines[start + 1:]
        assert body[-1] == '    "$@"' and all(x.endswith(" \\") for x in body[:-1])
        assert tuple(w for x in body[:-1] for w in x[:-2].split()) == em.args
        assert lines[0] == "#!/usr/bin/env bash"


def test_pools_as_nodes_and_gpus_per_node():
    cluster = load_cluster(FOUR_NODES)
    assert common.nodes_and_gpus(4, cluster) == (1, 4)
    assert common.nodes_and_gpus(8, cluster) == (1, 8)
    assert common.nodes_and_gpus(24, cluster) == (3, 8)
    with pytest.raises(SpecError, match="a pool of 12 GPUs is not whole nodes of 8 GPUs"):
        common.nodes_and_gpus(12, cluster)


# ---- files and the CLI -----------------------------------------------------------------------
def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    out = tmp_path / "launch.sh"
    common.write_atomic(out, "old\n")
    assert out.read_text() == "old\n" and os.access(out, os.X_OK)

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(common.os, "replace", boom)
    with pytest.raises(SpecError, match=r"cannot write .*launch.sh: No space left on device"):
        common.write_atomic(out, "new\n")
    assert out.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["launch.sh"]
    with pytest.raises(SpecError, match="it is a folder"):
        common.write_atomic(tmp_path, "x")


def nereus(*args):
    return subprocess.run([sys.executable, "-m", "nereus.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


def test_cli_emit_to_file_and_to_stdout(tmp_path):
    out = tmp_path / "sub" / "launch.sh"
    r = nereus("plan", "--job", JOB7, "--cluster", ONE_NODE, "--emit", "verl", "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "python3 -m verl.trainer.main_ppo \\" in text
    assert "predicted step time" in r.stdout and f"wrote {out}" in r.stdout
    assert re.search(r"in verl beside [\d.]+ s for the optimum|verl expresses the optimal plan as is", r.stdout)
    assert not [p for p in out.parent.iterdir() if p.name != "launch.sh"]  # no temp file left
    r = nereus("plan", "--job", JOB7, "--cluster", ONE_NODE, "--emit", "openrlhf")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/usr/bin/env bash\n") and "mem/GPU" not in r.stdout  # tables on stderr
    assert "mem/GPU" in r.stderr and "python3 -m openrlhf.cli.train_ppo_ray \\" in r.stdout


@pytest.mark.parametrize("args,message", [
    (("--out", "x.sh"), "--out needs --emit verl|openrlhf"),
    (("--emit", "verl", "--sweep", "gpus=8:16:x2"), "does not combine with --sweep"),
    (("--emit", "openrlhf", "--verl-engine", "fsdp"), "--verl-engine fsdp needs --emit verl"),
    (("--emit", "verl", "--out", "examples"), "cannot write examples: it is a folder"),
])
def test_cli_bad_emit_input_is_one_line_exit_2(args, message):
    r = nereus("plan", "--job", JOB7, "--cluster", ONE_NODE, *args)
    assert r.returncode == 2, r.stdout
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_unknown_framework_is_a_usage_error():
    r = nereus("plan", "--job", JOB7, "--cluster", ONE_NODE, "--emit", "deepspeed-chat")
    assert r.returncode == 2 and "invalid choice: 'deepspeed-chat'" in r.stderr


# ---- the package ---------------------------------------------------------------------------------
def test_frameworks_import_neither_torch_nor_the_frameworks():
    code = ("import sys, nereus.frameworks.verl, nereus.frameworks.openrlhf, nereus.frameworks.common; "
            "bad = [m for m in ('torch', 'verl', 'openrlhf', 'ray') if m in sys.modules]; sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr or "nereus.frameworks imported torch or a framework"


def test_readme_names_every_module_with_its_docstring():
    pkg = ROOT / "nereus" / "frameworks"
    readme = (pkg / "README.md").read_text()
    for path in sorted(pkg.glob("*.py")):
        first = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
        row = next((x for x in readme.splitlines() if x.startswith(f"| `{path.name}` |")), None)
        assert row is not None, f"README.md has no row for {path.name}"
        assert row == f"| `{path.name}` | {first} |", f"README row of {path.name} differs from its docstring"


def test_lower_layers_never_import_the_frameworks_package():
    lower = [p for d in ("models", "planner", "simulator", "executor", "calibration")
             for p in (ROOT / "nereus" / d).rglob("*.py")]
    assert len(lower) > 40
    users = [str(p.relative_to(ROOT)) for p in lower if "nereus.frameworks" in p.read_text()]
    assert not users, f"{users} import nereus.frameworks (it sits above the planner, beside commands/)"


def test_closest_keeps_the_fastest_gap_free_plan_and_reresolves_only_plans_with_gaps():
    from types import SimpleNamespace as NS

    from nereus.errors import InfeasibleError

    plans = {name: NS(name=name) for name in ("a", "a-pinned", "b", "c")}
    objective = {"a": 5.0, "a-pinned": 9.0, "b": 8.0, "c": None}
    solved = []

    def fake_solve(problem):
        solved.append(problem)
        t = objective[problem]
        return NS(plan=None if t is None else plans[problem], objective=t if t is not None else float("inf"))

    def has_gaps(plan):
        return ["shared value differs"] if plan.name == "a" else []

    def pins(problem, plan):
        return [("pinned", problem + "-pinned")]

    c = common.closest([("A", "a"), ("B", "b"), ("C", "c")], fake_solve, has_gaps, pins, "toy")
    assert c.label == "B" and c.solution.objective == 8.0  # a is faster but has gaps; pinned a is slower than b
    assert solved == ["a", "a-pinned", "b", "c"]
    assert c.tried == (("A", 5.0), ("A, pinned", 9.0), ("B", 8.0), ("C", None))
    objective["b"] = None
    objective["a-pinned"] = None
    with pytest.raises(InfeasibleError, match=r"no plan toy can express fits in memory \(tried A: 5.00 s with gaps; "
                                              r"A, pinned: infeasible; B: infeasible; C: infeasible\)"):
        common.closest([("A", "a"), ("B", "b"), ("C", "c")], fake_solve, has_gaps, pins, "toy")


def test_vllm_memory_fraction_leaves_room_for_the_colocated_models():
    from nereus.planner.cost.model import estimate

    problem = problem_of(JOB8, FOUR_NODES)
    em = emit("verl", problem, solver(problem).plan, solver, verl_engine="megatron")
    util = float(_kv(em.args)["actor_rollout_ref.rollout.gpu_memory_utilization"])
    g = em.plan.stage("actor/generation")
    kv = dict(em.plan.extras)["generation_kv_budget_gib"] * 2**30
    est = estimate(problem.job, problem.cluster, g.name, g.config, problem.workload, kv_budget_bytes=kv)
    colocated = dict(evaluate_plan(problem, em.plan).stage_mem_gib)["actor/generation"] * 2**30 - est.transient_bytes
    assert colocated > 10 * 2**30  # actor, critic, ref and reward state stay on the GPUs while vLLM runs
    usable, total = problem.cluster.gpu.usable_bytes, problem.cluster.gpu.memory_gib * 2**30
    room = min(est.mem_breakdown["weights"] + est.mem_breakdown["workspace"] + kv, usable - colocated)
    assert room - 0.011 * total < util * total <= room + 1e-6  # rounded down to 0.01


def test_openrlhf_pins_never_pair_autotp_with_zero3():
    problem = problem_of(JOB8, FOUR_NODES)
    plan = make_plan(problem.job, {"actor/generation": (P(tp=2, dp=16), 0, 32),
                                   "actor/training": (P(tp=2, dp=16, zero=3), 0, 32),
                                   "ref/inference": (P(tp=1, dp=32, micro_batch=2), 0, 32),
                                   "critic/training": (P(tp=2, dp=16, zero=3), 0, 32),
                                   "reward/inference": (P(dp=32), 0, 32)})
    labels = [label for label, _ in openrlhf.equalize(problem, plan)]
    assert labels == ["tp2 mb1 ZeRO-1 for all", "tp2 mb2 ZeRO-1 for all", "tp1 mb1 ZeRO-3 for all",
                      "tp1 mb1 ZeRO-1 for all"]
    pinned = openrlhf.equalize(problem, plan)[0][1]
    assert set(pinned.constraints.fixed_tp_pp) == {(n, 2, 1) for n in openrlhf.DEEPSPEED}
    assert (pinned.candidates.micro_batches, pinned.candidates.zeros, pinned.candidates.max_pp) == ((1,), (1,), 16)


def test_context_parallelism_is_emitted_where_the_framework_has_it_and_named_where_not():
    """A plan that splits sequences by context parallelism: verl's Megatron engine takes
    ``context_parallel_size`` (a key of its generated config), OpenRLHF its ring attention
    (``--ds.ring_attn_size``, an argument of train_ppo_ray); verl's FSDP engine has only Ulysses."""
    job = load_job(JOB8)
    problem = PlanProblem(job=job, cluster=load_cluster(FOUR_NODES), workload=job.workload())
    split = ("actor/training", "critic/training", "ref/inference")  # dp 3 each: cp 3 takes all of it
    cp = {k: (P(**{**v[0].to_dict(), "cp": 3}) if k in split else v[0], v[1], v[2]) for k, v in MEGATRON_PLAN.items()}
    plan = make_plan(job, cp)
    assert verl.gaps(plan, "megatron") == []
    kv = check_verl_keys(verl.emit(problem, plan, no_solve, engine="megatron").args, "megatron")
    assert kv["actor_rollout_ref.actor.megatron.context_parallel_size"] == "3"
    assert kv["actor_rollout_ref.ref.megatron.context_parallel_size"] == "3"
    assert kv["critic.megatron.context_parallel_size"] == "3"
    mixed = dict(cp, **{"ref/inference": MEGATRON_PLAN["ref/inference"]})
    assert any("one context_parallel_size" in g for g in verl.gaps(make_plan(job, mixed), "megatron"))
    fsdp = dict(FSDP_PLAN, **{"actor/training": (P(dp=32, zero=3, micro_batch=2, cp=2), 0, 32)})
    assert any("actor/training uses context parallelism 2" in g for g in verl.gaps(make_plan(job, fsdp), "fsdp"))
    paired = dict(PAIRED_PLAN, **{k: (P(**{**v[0].to_dict(), "cp": 2}), v[1], v[2]) for k, v in PAIRED_PLAN.items()
                                  if k != "actor/generation"})
    plan = make_plan(job, paired)
    assert openrlhf.gaps(plan) == []
    words = list(openrlhf.emit(problem_of(JOB8, FOUR_NODES), plan, no_solve).args)
    check_openrlhf_flags(words, openrlhf_flags())
    assert words[words.index("--ds.ring_attn_size") + 1] == "2"


@pytest.mark.parametrize("engine,verl_name,note", [("vllm", "vllm", None), ("sglang", "sglang", None),
                                                   ("tensorrt-llm", "trtllm", None), ("vllm-v0", "vllm", "V1 engine"),
                                                   ("static", "vllm", "does not offer")])
def test_emitters_launch_the_jobs_generation_engine_or_say_what_runs_instead(engine, verl_name, note):
    """verl's ``rollout.name`` is the job's engine where verl 0.9.1's rollout registry has it (read
    from the wheel as data); vLLM's V0 engine (gone from the vLLM releases both frameworks pin) and
    an engine a framework lacks run on vLLM, with a note saying so; OpenRLHF runs vLLM only, and
    takes the job's eager mode as ``--vllm.enforce_eager`` (a flag of its argparse)."""
    from dataclasses import replace as dc_replace
    base = problem_of(JOB8, FOUR_NODES)
    job = dc_replace(base.job, rollout=dc_replace(base.job.rollout, engine=engine, enforce_eager=True))
    problem = PlanProblem(job=job, cluster=base.cluster, workload=job.workload())
    registry = (_package_dir("verl", verl.VERSION) / "workers" / "rollout" / "base.py").read_text()
    assert f'("{verl_name}", "async")' in registry
    em = verl.emit(problem, make_plan(job, FSDP_PLAN), no_solve, engine="fsdp")
    kv = _kv(em.args)
    assert kv["actor_rollout_ref.rollout.name"] == verl_name and kv["actor_rollout_ref.rollout.enforce_eager"] == "true"
    o = openrlhf.emit(problem, make_plan(job, PAIRED_PLAN), no_solve)
    assert "--vllm.enforce_eager" in o.args and openrlhf_flags()["--vllm.enforce_eager"]
    for e, has_it in ((em, note is None), (o, engine == "vllm")):
        engine_lines = [n for n in e.notes if "generation runs on" in n]
        assert (not engine_lines) == has_it, (e.framework, e.notes)
        if note and engine_lines:
            assert note in engine_lines[0] or e.framework == "openrlhf"
            assert engine_lines[0] in e.render()


def test_verl_launch_notes_the_drivers_transfer_per_step():
    """verl's single controller moves every worker call's batch through its driver: the emitted script
    says how long that takes per step (one call per model-stage, the cost model's
    ``controller_transfer_s`` at the job's caps), outside the predicted step times."""
    from nereus.planner.cost.model import controller_transfer_s
    problem = problem_of(JOB8, FOUR_NODES)
    em = verl.emit(problem, make_plan(problem.job, FSDP_PLAN), no_solve, engine="fsdp")
    total, calls = verl.driver_s(problem)
    w = problem.workload
    assert calls == len(problem.job.model_stages()) == 7
    assert total == pytest.approx(sum(controller_transfer_s(s, w.sequences, w.prompt_len + w.response_len_max,
                                                             w.response_len_max, problem.params)
                                      for s in ("generation", "inference", "inference", "inference", "inference",
                                                "training", "training")))
    assert any(f"about {total:.1f} s per step over 7 calls" in n for n in em.notes)
    assert f"about {total:.1f} s per step" in em.render()
