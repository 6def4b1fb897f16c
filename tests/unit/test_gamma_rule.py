"""The admission rule's constants as data, and the published paper's gamma rule where the cost
rule binds (SIMULATED: restart mode at the measured RestartCost defaults, a drift trigger every 8
steps; the scenario of ``benchmarks/gamma_sweep.py``, first climb and fall)."""
import inspect
import math
import sys
from pathlib import Path

import pytest

from nereus.errors import SpecError
from nereus.planner.online.admission import AdmissionConstants
from nereus.planner.online.controller import Controller
from nereus.simulator.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gamma_sweep  # noqa: E402


def test_admission_constants_default_to_the_controllers_own_defaults():
    sig = inspect.signature(Controller.__init__).parameters
    for name, value in AdmissionConstants().controller_kwargs().items():
        assert sig[name].default == value, name


def test_admission_constants_round_trip_and_refuse_bad_values():
    c = AdmissionConstants(gamma=math.inf, replan_change=0.2, patience=0)
    assert c.to_dict()["gamma"] == "inf"
    assert AdmissionConstants.from_dict(c.to_dict()) == c
    with pytest.raises(SpecError, match=r"gamma must be a number >= 0, got -1"):
        AdmissionConstants(gamma=-1)
    with pytest.raises(SpecError, match=r"replan_change must be a fraction > 0, got 0"):
        AdmissionConstants(replan_change=0)
    with pytest.raises(SpecError, match=r"unknown keys \['gama'\]"):
        AdmissionConstants.from_dict({"gama": 1})


@pytest.fixture(scope="module")
def sweep():
    trace = gamma_sweep.drift_trace(2 * gamma_sweep.HALF)
    out = {}
    for g in (0.0, 0.5, 2.0, math.inf):
        out[g] = simulate(gamma_sweep.JOB, gamma_sweep.CLUSTER, trace, ["gamma-restart"], time_limit_s=1.0, seed=0,
                          admission=AdmissionConstants(gamma=g))["gamma-restart"]
    return out


def test_gamma_rule_transitions_are_monotone_in_gamma_where_relaunches_cost(sweep):
    n = {g: sum(1 for t in r.transition_s if t > 0) for g, r in sweep.items()}
    assert n[0.0] == 0  # gamma 0: only switches that cost nothing, and every relaunch costs
    assert list(n.values()) == sorted(n.values()), n
    assert n[math.inf] > n[0.5], n  # any saving admitted: more relaunches than the paper's default
    relaunch = [t for r in sweep.values() for t in r.transition_s if t > 0]
    step = [s for r in sweep.values() for s in r.step_s if math.isfinite(s)]
    assert min(relaunch) > 2 * sum(step) / len(step)  # the scenario's point: a switch costs more than 2 mean steps


def test_gamma_rule_pays_for_its_extra_relaunches_in_mean_step_time(sweep):
    """Every relaunch gamma inf adds costs more than the layouts it reaches save over this trace."""
    d = {g: r.to_dict() for g, r in sweep.items()}
    assert d[math.inf]["transition_s"] > d[0.5]["transition_s"]
    assert d[math.inf]["mean_step_s"] > d[0.5]["mean_step_s"]


def test_gamma_rule_replans_only_at_a_drift_trigger(tmp_path):
    """A flat trace, then one jump of +60%: the rule re-plans at its first step and at the jump only
    (every other decision is "no trigger"), whatever gamma admits there."""
    from nereus.simulator.trace import parse_trace

    trace = parse_trace("step,response_len_mean,response_len_max,gpus,response_len_cap\n0,1000,8192,8,8192\n"
                        "14,1000,8192,8,8192\n15,1600,8192,8,8192\n29,1600,8192,8,8192\n")
    audit = tmp_path / "gamma.jsonl"
    simulate(gamma_sweep.JOB, gamma_sweep.CLUSTER, trace, ["gamma"], time_limit_s=1.0, seed=0,
             admission=AdmissionConstants(gamma=math.inf), audit_path=str(audit))
    import json

    rows = [json.loads(x) for x in audit.read_text().splitlines()]
    replans = [r["step"] for r in rows if not r["must"] and "no trigger" not in r["reason"]]
    assert replans[0] == 0 and 1 <= len(replans) <= 3, replans  # the start, and once the forecast crosses +30%
    assert all(15 <= s <= 29 for s in replans[1:]), replans
