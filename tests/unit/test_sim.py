"""End-to-end simulation on a small trace: every policy, the oracle bound, the JSON contract."""
import json

import numpy as np
import pytest

from nereus.cli import main
from nereus.commands.simulate import CHOICES
from nereus.simulator.simulate import simulate
from nereus.simulator.schedules import TransitionSchedules
from nereus.simulator.trace import parse_trace
from nereus.simulator.truth.machine import GroundTruth
from nereus.planner.specs import load_cluster, load_job

TRACE = """# test trace: growing lengths, a cap raise and a GPU jump
step,response_len_mean,response_len_max,gpus
0,1500,4096,8
10,2500,4096,8
20,5000,16384,32
30,9000,16384,32
39,9500,16384,32
"""
KEYS = {"steps", "mean_step_s", "total_s", "transition_s", "transition_overhead", "transitions", "infeasible_steps"}


@pytest.fixture(scope="module")
def world():
    job = load_job("examples/grpo-7b.yaml")
    cluster = load_cluster("examples/cluster-h100-4n.yaml")
    trace = parse_trace(TRACE, "test")
    return job, cluster, GroundTruth(job, cluster, trace, seed=0, schedule_fn=TransitionSchedules(job, cluster))


@pytest.fixture(scope="module")
def results(world):
    job, cluster, gt = world
    return simulate(job, cluster, parse_trace(TRACE, "test"), gt=gt, time_limit_s=2, seed=0)


def test_no_online_policy_beats_the_oracle(results):
    """The oracle's optimum over every plan used is a bound for a policy that ran every step
    without a crash (a crash replaces a priced transition by a restart; a dropped step is not run)."""
    oracle = results["oracle"].total_s
    checked = 0
    for name, r in results.items():
        if name not in ("oracle", "static-naive") and not any(r.dropped) and not any(r.ooms):
            checked += 1
            assert r.total_s >= oracle * (1 - 1e-9), (name, r.total_s, oracle)
    assert results["hindsight"].total_s >= oracle * (1 - 1e-9)
    assert checked or all(any(r.ooms) or any(r.dropped) for n, r in results.items() if n not in ("oracle", "hindsight"))


def test_adaptive_beats_static_with_its_transitions_paid(results):
    """On lengths that grow 6x and a GPU jump, the controller's run, every transition and crash
    included, is shorter than static's, and it completes every step (SIMULATED truth)."""
    a, s = results["adaptive"], results["static"]
    d = a.to_dict()
    assert d["transitions"] >= 1 and d["transition_s"] > 0
    assert a.total_s == pytest.approx(np.nansum(a.step_s) + d["transition_s"] + d["restart_s"])
    assert not any(a.dropped)
    assert a.total_s < 0.9 * s.total_s, (d, s.to_dict())


def test_summary_records_and_counts(results):
    for name, r in results.items():
        d = r.to_dict()
        assert KEYS <= set(d) and d["steps"] == 40
        assert d["transitions"] == sum(1 for t in r.transition_s if t > 0)
        assert abs(d["total_s"] - np.nansum(r.step_s) - d["transition_s"] - d["restart_s"]) < 1e-6
        assert d["label"] == "SIMULATED"
    assert results["adaptive"].to_dict()["transitions"] >= 1  # the GPU jump is taken


def test_adaptive_restart_pays_the_truths_checkpoint_and_relaunch_for_every_switch(world, results):
    """Restart mode: every plan change is charged the ground truth's checkpoint save + relaunch (far
    above the live transition of the same pair), and the controller, pricing it so, switches less."""
    _, _, gt = world
    r, live = results["adaptive-restart"], results["adaptive"]
    seq = [r.plans[k] for k in r.plan_index]
    charged = 0
    for i in range(1, len(seq)):
        if r.transition_s[i] > 0:
            charged += 1
            assert r.transition_s[i] == pytest.approx(gt.switch_restart_s(seq[i - 1], seq[i]))
            assert r.transition_s[i] > gt.transition_s(seq[i - 1], seq[i]) + 60  # a relaunch, not a reshard
    assert charged >= 1  # the GPU jump is worth a relaunch
    assert r.to_dict()["transitions"] <= live.to_dict()["transitions"]
    assert gt.switch_restart_s(seq[0], seq[0]) == 0.0


def test_forked_online_policies_give_the_sequential_results(world, results):
    """``workers=2`` (online policies in forked processes, each with its own plan cache, and the
    offline policies' extra candidates solved beside them) changes the speed, never a result."""
    job, cluster, gt = world
    names = ["static", "adaptive", "adaptive-restart", "hindsight", "oracle"]
    forked = simulate(job, cluster, parse_trace(TRACE, "test"), names, gt=gt, time_limit_s=2, seed=0, workers=2)
    serial = simulate(job, cluster, parse_trace(TRACE, "test"), names, gt=gt, time_limit_s=2, seed=0)
    assert list(forked) == names
    for n in names:
        a, b = serial[n], forked[n]
        if n in ("static", "adaptive", "adaptive-restart"):
            assert np.array_equal(np.array(a.step_s), np.array(results[n].step_s), equal_nan=True), n
        assert np.array_equal(np.array(a.step_s), np.array(b.step_s), equal_nan=True), n
        assert a.transition_s == b.transition_s and a.ooms == b.ooms, n


def test_cli_simulate_writes_json_and_rejects_bad_policy(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    out = tmp_path / "s.json"
    rc = main(["simulate", "--job", "examples/grpo-7b.yaml", "--cluster", "examples/cluster-h100-4n.yaml",
               "--trace", str(trace), "--policy", "static", "--steps", "12", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert KEYS <= set(data["static"]) and data["static"]["steps"] == 12
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--job", "examples/grpo-7b.yaml", "--cluster", "examples/cluster-h100-4n.yaml",
              "--trace", str(trace), "--policy", "nope"])
    assert e.value.code == 2
    rc = main(["simulate", "--job", "examples/grpo-7b.yaml", "--cluster", "examples/cluster-h100-1n.yaml",
               "--trace", str(trace), "--policy", "static"])
    assert rc == 2 and "asks for 32 GPUs" in capsys.readouterr().err


def test_cli_simulate_runs_the_policies_a_comma_list_names_and_no_other(tmp_path, capsys):
    """``--policy static,verl`` runs those two (a repeated flag used to keep only the last, silently);
    a misspelt or repeated name is a one-line usage error naming it."""
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE)
    out = tmp_path / "s.json"
    args = ["simulate", "--job", "examples/grpo-7b.yaml", "--cluster", "examples/cluster-h100-4n.yaml",
            "--trace", str(trace), "--steps", "6"]
    assert main([*args, "--policy", "static,verl", "--json", str(out)]) == 0
    assert {"static", "verl"} == set(json.loads(out.read_text())) & {*CHOICES}
    for bad, says in (("static,adaptve", "unknown policy 'adaptve'"), ("static,static", "named twice")):
        with pytest.raises(SystemExit) as e:
            main([*args, "--policy", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_forked_runs_hand_the_offline_policies_the_solver_picks_a_serial_run_makes(world, monkeypatch):
    """The extra candidates solved in a worker are the ones ``run_offline`` would solve itself."""
    from nereus.planner.cost.params import CostParams
    from nereus.planner.online.plan_cache import PlanCache
    from nereus.simulator import simulate as sim

    job, cluster, gt = world
    seen = {}
    real = sim.run_offline

    def spy(*args, **kw):
        seen["picked"] = (args[7], args[8])  # simulate passes (picked, seconds) positionally
        return real(*args, **kw)

    monkeypatch.setattr(sim, "run_offline", spy)
    trace = parse_trace(TRACE, "test")
    simulate(job, cluster, trace, ["static", "verl", "oracle"], gt=gt, time_limit_s=2, seed=0, workers=2)
    picked, seconds = seen["picked"]
    want = sim.offline_picks(job, trace, PlanCache(job, cluster, time_limit_s=2, seed=0,
                                                   candidates=sim.SIM_CANDIDATES), CostParams())
    assert seconds > 0 and picked and [p.key() for p in picked] == [p.key() for p in want]
