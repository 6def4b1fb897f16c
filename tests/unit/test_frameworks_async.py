"""`nereus plan --schedule one_step_off|fully_async --emit verl|openrlhf`: an async plan becomes verl's
async launch (every key one of the launcher's own config: `experimental/*/config/*.yaml` over the
generated `ppo_trainer` / `ppo_megatron_trainer`, read from the installed wheel as data), the schedule
maps to `async_training.*` as the docstring of nereus/frameworks/verl_async.py derives, what verl or
OpenRLHF cannot express is named, and OpenRLHF's async flags exist in its argparse definitions."""
import ast
import importlib.metadata
import importlib.util
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from nereus.errors import SpecError
from nereus.frameworks import emit, openrlhf, openrlhf_async, verl, verl_async
from nereus.frameworks.asynchronous import schedule_of
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.schedules import ScheduleSpec
from nereus.planner.solver import PlanProblem, solve
from nereus.planner.specs import ParallelConfig as P, load_cluster, load_job

JOB7, JOB8 = "examples/grpo-7b.yaml", "examples/ppo-8b.yaml"
FOUR_NODES = "examples/cluster-h100-4n.yaml"
ROOT = Path(__file__).resolve().parents[2]


def _package_dir(name: str, version: str) -> Path:
    spec = importlib.util.find_spec(name)  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} {version} is not installed (`make install` adds it with pip --no-deps)")
    assert importlib.metadata.version(name) == version
    return Path(list(spec.submodule_search_locations)[0])


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        out[prefix + str(k)] = v
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def async_config(kind: str, engine: str) -> dict:
    """The launcher's config as Hydra composes it: its YAML (``--config-name``) over the generated
    config its ``defaults`` names."""
    root = _package_dir("verl", verl.VERSION)
    own = yaml.safe_load((root / verl_async.CONFIG_DIRS[kind] / f"{verl_async.CONFIG_NAMES[(kind, engine)]}.yaml").read_text())
    base_name = own["defaults"][0]
    assert base_name == ("ppo_megatron_trainer" if engine == "megatron" else "ppo_trainer"), base_name
    base = yaml.safe_load((root / "trainer" / "config" / f"_generated_{base_name}.yaml").read_text())
    return _flatten(_merge(base, {k: v for k, v in own.items() if k not in ("hydra", "defaults")}))


def openrlhf_flags() -> set[str]:
    text = (_package_dir("openrlhf", openrlhf.VERSION) / "cli" / "train_ppo_ray.py").read_text()
    return {n.args[0].value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
            and getattr(n.func, "attr", "") == "add_argument" and n.args and isinstance(n.args[0], ast.Constant)
            and str(n.args[0].value).startswith("--")}


def async_plan(job, units: dict, schedule: dict) -> Plan:
    """``units``: home model-stage -> (ParallelConfig, first_gpu, gpus); generation on the rollout pool."""
    pools: dict = {}
    stages = []
    for name, (cfg, first, gpus) in units.items():
        pool = pools.setdefault((first, gpus), len(pools))
        names = [name, name.replace("training", "inference")] if name.endswith("training") else [name]
        stages += [StagePlacement(name=n, config=cfg, pool=pool, first_gpu=first, gpus=gpus, time_s=1.0)
                   for n in names if n in job.model_stages()]
    sp = {s.name: ("rollout" if s.stage == "generation" else "trainer") for s in stages}
    return Plan(stages=tuple(stages), step_time_s=10.0,
                extras=(("offload", ()), ("schedule", schedule), ("stage_pools", sp)))


def problem_of(job_path):
    job, cluster = load_job(ROOT / job_path), load_cluster(ROOT / FOUR_NODES)
    return PlanProblem(job=job, cluster=cluster, workload=job.workload())


def no_solve(q):
    raise AssertionError("the plan was expressible: nothing should be re-solved")


def _kv(args):
    return dict(a.split("=", 1) for a in args)


MEGATRON = {"actor/generation": (P(tp=4, dp=4), 0, 16), "actor/training": (P(tp=2, pp=2, dp=4), 16, 16),
            "ref/inference": (P(tp=2, pp=2, dp=4), 16, 16)}
FSDP = {"actor/generation": (P(tp=2, dp=8), 0, 16), "actor/training": (P(dp=16, zero=3), 16, 16),
        "ref/inference": (P(dp=16, micro_batch=2), 16, 16)}
PPO_FULLY_ASYNC = {"actor/generation": (P(tp=2, dp=4), 0, 8), "reward/inference": (P(tp=2, dp=4), 8, 8),
                   "actor/training": (P(tp=2, pp=2, dp=4), 16, 16), "critic/training": (P(tp=2, pp=2, dp=4), 16, 16),
                   "ref/inference": (P(tp=2, pp=2, dp=4), 16, 16)}


# ---- verl: every key is one of the launcher's config --------------------------------------------
@pytest.mark.parametrize("kind,engine,units,job", [
    ("one_step_off", "megatron", MEGATRON, JOB7), ("one_step_off", "fsdp", FSDP, JOB7),
    ("fully_async", "megatron", MEGATRON, JOB7), ("fully_async", "fsdp", FSDP, JOB7),
    ("fully_async", "megatron", PPO_FULLY_ASYNC, JOB8)])
def test_every_async_verl_key_is_a_key_of_the_launchers_config(kind, engine, units, job):
    problem = problem_of(job)
    plan = async_plan(problem.job, units, {"kind": kind, "staleness": 2, "sync_every": 2} if kind == "fully_async"
                      else {"kind": kind})
    em = emit("verl", problem, plan, no_solve, verl_engine=engine)
    assert em.gaps == () and em.plan is plan
    root = _package_dir("verl", verl.VERSION)
    # the launcher: its module and the YAML --config-name names, inside the wheel
    assert em.command[:3] == ("python3", "-m", verl_async.MODULES[kind])
    assert em.command[3] == "--config-name" and em.command[4] == verl_async.CONFIG_NAMES[(kind, engine)]
    module = root.parent / (verl_async.MODULES[kind].replace(".", "/") + ".py")
    src = module.read_text()
    assert f'config_path="config"' in src and module.parent.name == Path(verl_async.CONFIG_DIRS[kind]).parent.name
    cfg = async_config(kind, engine)
    kv = _kv(em.args)
    missing = [k for k in kv if k not in cfg]
    assert not missing, f"not keys of verl's {verl_async.CONFIG_NAMES[(kind, engine)]} config: {missing}"
    for k, v in kv.items():  # the value has the type of the config's default where it has one
        default = cfg[k]
        if default is not None and not (isinstance(default, str) and default.startswith("${")) and default != "???":
            got = yaml.safe_load(v)
            assert type(got) is type(default) or (isinstance(default, float) and isinstance(got, int)), (k, v, default)
    assert "model_engine" not in kv  # the --config-name carries the engine
    assert "verl" not in sys.modules  # read as data only
    # the two pools, where they land
    t, r = units["actor/training"], units["actor/generation"]
    assert (kv["trainer.nnodes"], kv["trainer.n_gpus_per_node"]) == (str(t[2] // 8), "8")
    assert (kv["rollout.nnodes"], kv["rollout.n_gpus_per_node"]) == (str(r[2] // 8), "8")
    assert kv["actor_rollout_ref.rollout.tensor_model_parallel_size"] == str(r[0].tp)
    assert kv["actor_rollout_ref.hybrid_engine"] == "false"
    assert kv["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    if "reward/inference" in units:
        assert (kv["reward.reward_model.enable_resource_pool"], kv["reward.reward_model.nnodes"],
                kv["reward.reward_model.n_gpus_per_node"]) == ("true", "1", "8")
    if kind == "one_step_off":
        assert not any(k.startswith("async_training.") for k in kv)
        assert kv["data.train_batch_size"] == str(problem.job.batch.prompts)


def test_fully_async_maps_staleness_and_sync_every_as_verls_rollouter_counts_them():
    """Between syncs verl generates (1 + staleness_threshold) x trigger x require_batches x
    ppo_mini_batch_size prompts; the plan allows 1 + staleness batches in flight."""
    problem = problem_of(JOB7)
    b = problem.job.batch
    for staleness, sync_every, threshold in ((2, 2, 0.5), (1, 1, 1.0), (3, 1, 3.0), (3, 3, 0.3333), (4, 2, 1.5)):
        plan = async_plan(problem.job, MEGATRON, {"kind": "fully_async", "staleness": staleness, "sync_every": sync_every})
        kv = _kv(emit("verl", problem, plan, no_solve, verl_engine="megatron").args)
        assert float(kv["async_training.staleness_threshold"]) == pytest.approx(threshold)
        assert kv["async_training.trigger_parameter_sync_step"] == str(sync_every)
        mini = int(kv["actor_rollout_ref.actor.ppo_mini_batch_size"])
        assert int(kv["async_training.require_batches"]) * mini == b.prompts  # one verl local step = one step
        per_sync = int(kv["async_training.require_batches"]) * mini * sync_every
        # verl's max_required_samples = int(required x (1 + threshold) x trigger): never above the bound
        assert int(per_sync * (1 + float(kv["async_training.staleness_threshold"]))) <= (1 + staleness) * b.prompts
        assert int(per_sync * (1 + float(kv["async_training.staleness_threshold"])) + 1) >= (1 + staleness) * b.prompts
        assert (kv["data.train_batch_size"], kv["data.gen_batch_size"]) == ("0", "1")  # the rollouter asserts both
        assert kv["async_training.partial_rollout"] == "true"
        assert kv["async_training.use_dynamic_resource_scheduling"] == "false"
        assert kv["async_training.concurrent_samples_per_replica"] == str(math.ceil(b.prompts * (1 + staleness) / 4))


# ---- what verl's async trainers cannot express -----------------------------------------------------
def test_async_gaps_name_the_pools_verl_cannot_launch():
    problem = problem_of(JOB7)
    cluster = problem.cluster
    # a trainer pool of 28 GPUs starting mid-node: not nnodes x n_gpus_per_node
    odd = async_plan(problem.job, {"actor/generation": (P(tp=4), 0, 4), "actor/training": (P(tp=2, pp=2, dp=7), 4, 28),
                                   "ref/inference": (P(tp=2, pp=2, dp=7), 4, 28)}, {"kind": "one_step_off"})
    g = verl_async.gaps(odd, "megatron", cluster, "one_step_off")
    assert any("trainer pool (GPUs 4-31, 28 GPUs)" in x and "trainer.nnodes x trainer.n_gpus_per_node" in x for x in g)
    # ref apart from the actor: one trainer pool
    apart = async_plan(problem.job, {"actor/generation": (P(tp=4, dp=2), 0, 8), "actor/training": (P(tp=2, pp=2, dp=4), 8, 16),
                                     "ref/inference": (P(tp=2, pp=2, dp=2), 24, 8)}, {"kind": "one_step_off"})
    g = verl_async.gaps(apart, "megatron", cluster, "one_step_off")
    assert any(x.startswith("ref/inference on GPUs 24-31 but actor/training on GPUs 8-23") for x in g)
    # the engine's limits stay: Megatron's one TP x PP
    mixed = async_plan(problem.job, {**MEGATRON, "ref/inference": (P(tp=4, pp=1, dp=4), 16, 16)}, {"kind": "one_step_off"})
    assert any("one Megatron parallel state" in x for x in verl_async.gaps(mixed, "megatron", cluster, "one_step_off"))
    assert verl_async.gaps(async_plan(problem.job, MEGATRON, {"kind": "one_step_off"}), "megatron", cluster,
                           "one_step_off") == []


def test_reward_model_on_the_trainer_pool_is_a_gap_and_one_step_off_refuses_one():
    problem = problem_of(JOB8)
    shared = {**PPO_FULLY_ASYNC, "reward/inference": (P(tp=2, pp=2, dp=4), 16, 16),
              "actor/generation": (P(tp=2, dp=8), 0, 16)}
    plan = async_plan(problem.job, shared, {"kind": "fully_async"})
    assert any("reward model only on a pool of its own" in x
               for x in verl_async.gaps(plan, "megatron", problem.cluster, "fully_async"))
    with pytest.raises(SpecError, match="one-step-off trainer maps no resource pool to a reward model"):
        emit("verl", problem, async_plan(problem.job, PPO_FULLY_ASYNC, {"kind": "one_step_off"}), no_solve)


def test_closest_async_plan_verl_can_express_is_solved_on_a_launchable_split():
    base = problem_of(JOB7)
    problem = replace(base, job=replace(base.job, schedule=ScheduleSpec(kind="one_step_off")))
    mixed = async_plan(problem.job, {**MEGATRON, "ref/inference": (P(tp=4, pp=1, dp=4), 16, 16)}, {"kind": "one_step_off"})
    em = emit("verl", problem, mixed, lambda q: solve(q, backend="cpsat", time_limit_s=20, workers=1, seed=0),
              verl_engine="megatron")
    assert em.gaps and "one Megatron parallel state" in em.gaps[0]
    assert verl_async.gaps(em.plan, "megatron", problem.cluster, "one_step_off") == []
    assert schedule_of(em.plan).kind == "one_step_off" and em.tried
    assert "# Not expressible in verl" in em.render()


# ---- OpenRLHF ------------------------------------------------------------------------------------
def test_openrlhf_async_flags_exist_and_fully_async_names_its_gaps():
    known = openrlhf_flags()
    problem = problem_of(JOB7)
    osp = async_plan(problem.job, {"actor/generation": (P(tp=4, dp=4), 0, 16), "actor/training": (P(dp=16), 16, 16),
                                   "ref/inference": (P(dp=16), 16, 16)}, {"kind": "one_step_off"})
    em = emit("openrlhf", problem, osp, no_solve)
    assert em.gaps == ()
    flags = [a for a in em.args if a.startswith("--")]
    assert not [f for f in flags if f not in known], [f for f in flags if f not in known]
    i = em.args.index("--train.async_queue_size")
    assert "--train.async_enable" in em.args and em.args[i + 1] == "1"
    assert "--train.partial_rollout_enable" not in em.args and "--train.colocate_all" not in em.args
    # fully_async: no stream and no sync interval in OpenRLHF: the closest one_step_off plan, gaps named
    fa = replace(osp, extras=(("offload", ()), ("schedule", {"kind": "fully_async", "staleness": 2, "sync_every": 2})))
    em = emit("openrlhf", problem, fa, lambda q: solve(q, backend="cpsat", time_limit_s=20, workers=1, seed=0))
    assert any("whole batches" in g for g in em.gaps) and any("sync_every 2" in g for g in em.gaps)
    assert schedule_of(em.plan).kind == "one_step_off"
    assert openrlhf_async.gaps(em.plan) == []
    assert em.args[em.args.index("--train.async_queue_size") + 1] == "2" and "--train.partial_rollout_enable" in em.args
    assert not [f for f in em.args if f.startswith("--") and f not in known]


def test_openrlhf_async_colocates_every_deepspeed_model_with_colocate_all():
    problem = problem_of(JOB8)
    units = {**PPO_FULLY_ASYNC, "reward/inference": (P(dp=16), 16, 16), "actor/training": (P(dp=16), 16, 16),
             "critic/training": (P(dp=16), 16, 16), "ref/inference": (P(dp=16), 16, 16),
             "actor/generation": (P(tp=2, dp=8), 0, 16)}
    plan = async_plan(problem.job, units, {"kind": "one_step_off"})
    assert openrlhf.gaps(plan)  # the synchronous trainer cannot put actor and critic together
    em = emit("openrlhf", problem, plan, no_solve)
    assert em.gaps == () and "--train.colocate_all" in em.args
    assert not set(openrlhf_async.COLOCATE_FLAGS) & set(em.args)


# ---- the CLI ------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,module", [("one_step_off", verl_async.MODULES["one_step_off"]),
                                             ("fully_async", verl_async.MODULES["fully_async"]),
                                             ("sync", verl.COMMAND[2])])
def test_cli_emits_the_async_launch_for_an_async_plan(tmp_path, schedule, module):
    out = tmp_path / "launch.sh"
    r = subprocess.run([sys.executable, "-m", "nereus.cli", "plan", "--job", JOB7, "--cluster", FOUR_NODES,
                        "--schedule", schedule, "--emit", "verl", "--out", str(out), "--time-limit", "20"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    text = out.read_text()
    assert f"python3 -m {module} " in text
    words = [ln.strip().rstrip("\\").strip() for ln in text.splitlines() if ln.startswith("    ") and "=" in ln]
    if schedule == "sync":
        assert not any(w.startswith("rollout.") for w in words)
        return
    engine = "megatron" if "megatron_trainer" in text else "fsdp"
    cfg = async_config(schedule, engine)
    keys = [w.split("=", 1)[0] for w in words]
    assert "rollout.nnodes" in keys and "rollout.n_gpus_per_node" in keys and "trainer.nnodes" in keys
    assert not [k for k in keys if k not in cfg]
    assert ("async_training.staleness_threshold" in keys) == (schedule == "fully_async")
