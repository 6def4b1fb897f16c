"""A controller without dead ends (issue 29, item 1): when nothing is predicted to fit it falls back
to the most frugal plan at hand and says so; memory reserves decay as plans run within them, so a
plan an OOM condemned can come back; the library always holds the current plan and a plan per
generation TP; ``min_gain`` holds for knob-only switches; every rule asks the solver with the
calibrated parameters; a stay says what the library held. Same scenario (``controller_env``)."""
from __future__ import annotations

import math

from nereus.planner.online.controller import Controller, StepMetrics
from nereus.planner.online.library import Candidate, frugal_variants, gen_tp
from nereus.planner.online.plan_cache import LayoutRule, PlanCache, scale_plan
from nereus.planner.online.reserve import MemoryReserves

from controller_env import env  # noqa: F401 - the scenario's module fixture
from test_controller_thresholds import _const, _ctl, _metrics


def _peak(ctl: Controller, plan, w) -> float:
    """The model's predicted peak of ``plan`` over its non-generation model-stages (GiB)."""
    t = ctl._times(plan, w)
    return max(v for ms, v in t.peak_mem_gib.items() if not ms.endswith("/generation"))


def _ran(env, ctl: Controller, step: int, over_gib: float = 0.5) -> StepMetrics:
    """A clean step on the current plan whose measured peak is ``over_gib`` above the prediction."""
    m = _metrics(env, step, ctl.plan)
    return StepMetrics(step=step, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                       stage_times=m.stage_times, gpus_available=32, peak_mem_gib=_peak(ctl, ctl.plan, env.w) + over_gib)


def test_nothing_predicted_to_fit_falls_back_to_the_most_frugal_plan_and_leaves_the_dead_end(env):
    """A measured peak far above every prediction makes every plan, the current one included, look
    out of memory. Before, the controller stayed on the plan it had marked out ("no feasible plan
    found", every step). Now it switches to the plan with the most memory to spare (knobs at their
    most frugal), says so, marks the decision infeasible, and the next step (the fallback ran within
    its own measurement) is out of the dead end."""
    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    usable = env.cluster.gpu.usable_bytes / 2**30
    m0 = _metrics(env, 0, ctl.plan)
    d = ctl.step(StepMetrics(step=0, response_len_mean=m0.response_len_mean, response_len_max=m0.response_len_max,
                             stage_times=m0.stage_times, gpus_available=32, peak_mem_gib=2 * usable))
    dead = None
    for s in range(1, 8):  # every plan it moves to runs out of memory in training
        if "nothing is predicted to fit" in d.reason:
            dead = d
            break
        m = _metrics(env, s, ctl.plan)
        d = ctl.step(StepMetrics(step=s, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                                 gpus_available=32, oom=True, oom_stage="actor/training"))
    assert dead is not None, d.reason
    assert dead.must and not dead.feasible and "most frugal plan" in dead.reason and "library holds" in dead.reason
    trains = [s.config for s in dead.plan.stages if s.name.endswith("/training")]
    assert all(c.zero == 3 and c.recompute and c.micro_batch == 1 for c in trains), trains
    if dead.action == "stay":
        assert "that is the current plan" in dead.reason
    d1 = ctl.step(_ran(env, ctl, 9))
    assert d1.feasible and "nothing is predicted to fit" not in d1.reason, d1.reason


def test_shared_reserves_decay_toward_what_clean_steps_needed_and_strikes_slow_them():
    """Unit: an OOM in actor/training raises that stage's reserve so the failed plan's predicted peak
    no longer fits; steps that ran with 1 GiB to spare lower it by max(quantum, 0.2 x gap) / (1 +
    strikes) each; the common reserve decays toward the largest underestimate of its window."""
    r = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    r.oom(("a",), {"actor/training": 70.0, "actor/generation": 60.0}, "actor/training", judged_fit=True)
    assert r.stage_gib("actor/training") == 78.0 - 70.0 + 1.0
    assert r.judge(("a",), ["actor/training"])[1]["actor/training"] == 9.0
    for _ in range(3):  # another plan's training ran 1 GiB over its prediction: the common reserve holds that
        r.ran(("b",), {"actor/training": 40.0}, 41.0)
    assert r.common_gib == 1.0
    # bound 41 - 40 - 1 = 0: 9 -> 9 - 1.8/2 = 8.1 -> 8.1 - 1.62/2 = 7.29 -> 7.29 - 1.458/2 = 6.561
    assert math.isclose(r.stage["actor/training"].gib, 6.561, rel_tol=1e-9)
    assert r.stage_gib("actor/training") == 7.0  # rounded up to the quantum
    c = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    c.ran(("b",), {"actor/training": 40.0}, 52.0)  # 12 GiB underestimate: raised at once
    assert c.common_gib == 12.0
    for _ in range(9):  # still within the window of 10 clean steps: no decay below 12
        c.ran(("b",), {"actor/training": 40.0}, 42.0)
    assert c.common_gib == 12.0
    for _ in range(20):
        c.ran(("b",), {"actor/training": 40.0}, 42.0)
    assert c.common_gib == 2.0


def test_a_plan_an_oom_condemned_comes_back_when_the_reserve_that_condemned_it_decays(env):
    """An OOM in actor/training marks the plan out (a must-switch off it); while the plan switched to
    runs its training with half a GiB over the prediction, the stage reserve decays and the
    condemned plan is predicted to fit again. Before, a plan that ran out of memory was out for good."""
    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    ctl.step(_ran(env, ctl, 0))
    failed = ctl.plan
    m = _metrics(env, 1, failed)
    d = ctl.step(StepMetrics(step=1, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                             gpus_available=32, oom=True, oom_stage="actor/training"))
    assert d.must and d.action == "switch" and d.plan.key() != failed.key(), d.reason
    assert not ctl.predict(failed, env.w)[1]
    back = None
    for s in range(2, 40):
        ctl.step(_ran(env, ctl, s))
        if ctl.predict(failed, env.w)[1]:
            back = s
            break
    assert back is not None, ctl.memory.to_dict()


def test_the_library_always_holds_the_current_plan_and_a_plan_per_generation_tp(env):
    """With room for one plan, the library still keeps the current plan and, per generation TP it
    has seen, one plan (the fastest of it at the last scoring). Before, the oldest plan went first,
    whatever it was."""
    ctl = _ctl(env, _const(1e9), initial_gpus=None, library_size=1)
    seen = {gen_tp(ctl.plan)}
    for s in range(3):
        ctl.step(_metrics(env, s, ctl.plan))
        seen |= {gen_tp(p) for p, _ in ctl._library.values()}
        assert ctl.plan.key() in ctl._library
    held = {gen_tp(p) for p, _ in ctl._library.values()}
    assert len(seen) >= 2 and held == seen, (held, seen)


def test_min_gain_refuses_a_knob_only_switch_whose_saving_is_within_model_error(env):
    """A switch that changes knobs only (transition cost 0) and saves less than ``min_gain`` of the
    horizon is model noise too. Before, a free switch was exempt and flapped on noise."""
    ctl = _ctl(env, _const(1.0), initial_gpus=None)
    cur = Candidate(ctl.plan, "current", horizon_s=1000.0, feasible_next=True, times=(20.0,) * 5)
    m = _metrics(env, 0, ctl.plan)
    ctl._offsets(0)
    for saving, action in ((0.5 * ctl.min_gain * 1000.0, "stay"), (2 * ctl.min_gain * 1000.0, "switch")):
        alt = Candidate(ctl.plan, "keep-layout", cost_s=0.0, horizon_s=1000.0 - saving, feasible_next=True,
                        times=(19.9,) * 5)
        d = ctl._admit(m, cur, [alt], "", True)
        assert d.action == action, (saving, d.reason)
        if action == "stay":
            assert "within model error" in d.reason


def test_a_stay_without_alternative_says_what_the_library_held(env):
    """After the GPUs shrink from 32 to 8 the library still holds the 32-GPU plans: a stay for want
    of an alternative says how many plans the library holds and why none counts."""
    ctl = _ctl(env, _const(5.0), initial_gpus=None, explore=False)
    ctl.step(_metrics(env, 0, ctl.plan, gpus=32))
    ctl.step(_metrics(env, 1, ctl.plan, gpus=8))
    d = ctl.step(_metrics(env, 2, ctl.plan, gpus=8))
    big = sum(1 for p, _ in ctl._library.values() if p.num_gpus > 8)
    assert big >= 1
    if d.action == "stay" and "no alternative plan" in d.reason:
        assert f"{big} for more than the 8 GPUs granted" in d.reason and "library holds" in d.reason, d.reason
    else:  # the stay for another reason still carries the counts in the audit note
        assert f"{big} for more than the 8 GPUs granted" in ctl._note, ctl._note


def test_every_rule_asks_the_solver_with_the_calibrated_parameters(env):
    """A colocated (verl-like) rule used to ask the solver with the base parameters whatever the
    calibration had learned; with stage times measured at twice the model's, its later questions
    carry the learned stage factors."""
    from nereus.planner.solver import solve

    asked = []

    def spy(problem, **kw):
        asked.append(problem.params)
        return solve(problem, **kw)

    plans = PlanCache(env.job, env.cluster, time_limit_s=10, seed=0, solve_fn=spy)
    ctl = Controller(env.job, env.cluster, plans=plans, rule=LayoutRule(name="verl", placement="colocated"),
                     transition_cost_fn=_const(5.0), horizon=50, build_transition=False, initial_gpus=32)
    for s in range(3):
        ctl.step(_metrics(env, s, ctl.plan, scale={ms.name: 2.0 for ms in ctl.plan.stages}))
    assert any(abs(p.factor("training") - 1.0) > 0.05 or abs(p.factor("generation") - 1.0) > 0.05 for p in asked), \
        [(p.factor("training"), p.factor("generation")) for p in asked]


class _NoRoom:
    """The scenario's plan cache, except that the solver finds nothing once it is asked with a memory
    reserve (as for grpo-70b at 256 GPUs under a 38 GiB common reserve)."""

    def __init__(self, plans: PlanCache) -> None:
        self._plans = plans

    def __getattr__(self, name):
        return getattr(self._plans, name)

    def best(self, rule, w, gpus, params, calib_key=(), hint=None, reserve_gib=0.0):
        return None if reserve_gib > 0 else self._plans.best(rule, w, gpus, params, calib_key, hint, reserve_gib)


def test_more_gpus_under_a_large_shared_reserve_the_current_plan_rescaled_is_a_candidate(env):
    """The grpo-70b dead end (issue 29 item 1, SIMULATED ramp_1024): the plan that runs measured a large
    underestimate, which holds the common reserve up and condemns every plan never run; the solver,
    asked with that reserve, finds nothing; then the cluster doubles. Before, the library held no plan
    for the new GPU count predicted to fit and the controller stayed on half the GPUs ("no alternative
    plan predicted to fit", 250 steps there). Now the current plan rescaled to the GPUs granted (its
    layout and knobs, DP doubled: no more memory per GPU) is a candidate, judged by the current plan's
    own measurement, and the controller moves to it."""
    ctl = Controller(env.job, env.cluster, transition_cost_fn=_const(5.0), horizon=50, plans=_NoRoom(env.plans),
                     build_transition=False, initial_gpus=16)
    first = ctl.plan = frugal_variants(ctl.plan, env.job, env.cluster.gpus_per_node)[0]  # room to measure in
    ctl._library = {first.key(): (first, "initial")}
    usable = env.cluster.gpu.usable_bytes / 2**30
    d = None
    for s in range(10):
        g = 16 if s < 5 else 32
        m = _metrics(env, s, ctl.plan, gpus=g)
        d = ctl.step(StepMetrics(step=s, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                                 stage_times=m.stage_times, gpus_available=g, peak_mem_gib=usable - 2.0))
        if s < 5:
            assert d.action == "stay" and ctl.plan is first, d.reason
        elif d.action == "switch":
            break
    assert ctl.memory.common_gib >= usable / 4  # every plan never run is judged by that
    assert d.action == "switch" and d.plan.num_gpus == 32, d.reason
    assert "[rescaled]" in d.reason and d.feasible, d.reason
    assert d.plan == scale_plan(first, 32)

def test_a_rescaled_plan_inherits_the_measurement_only_of_a_plan_that_never_ran_out_of_memory():
    """Unit (``MemoryReserves.inherit``): the child is judged by the parent's own underestimate; a
    parent that ran out of memory passes nothing on (it is judged by the shared reserves itself)."""
    r = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    r.ran(("p",), {"actor/training": 40.0}, 70.0)  # 30 GiB measured underestimate
    assert r.common_gib == 30.0
    assert r.judge(("c",), ["actor/training"])[0] == 30.0
    assert r.inherit(("c",), ("p",)) and r.judge(("c",), ["actor/training"]) == (30.0, {})
    r.oom(("q",), {"actor/training": 70.0}, "actor/training", judged_fit=True)
    assert not r.inherit(("d",), ("q",)) and ("d",) not in r.measured




def _within(plan, allowed) -> bool:
    """Whether every model-stage but generation keeps to ``allowed``'s TPs and micro-batches, and
    every training stage to its ZeRO stages and recomputation."""
    for s in plan.stages:
        if s.name == "actor/generation":
            continue
        c = s.config
        if c.tp not in allowed.tps or c.micro_batch not in allowed.micro_batches:
            return False
        if s.name.endswith("/training") and (c.zero not in allowed.zeros or c.recompute not in allowed.recompute):
            return False
    return True


def test_the_frugal_fallback_holds_only_knobs_the_solver_was_allowed(env):
    """The demo's solver may choose ZeRO 1 only (its executor runs ZeRO 0-2) and, for ``static``, no
    recomputation. Before, the dead-end fallback set every training stage to ZeRO-3 with
    recomputation whatever the candidate settings said, and ``make demo`` crashed in the executor
    ("ZeRO-3 ... the executor supports ZeRO 0-2 only") when static ran out of room. Now every
    frugal variant keeps to the allowed ZeRO stages, recomputation, micro-batches and TPs, and so
    does the controller's fallback when its solver is asked with those settings."""
    from nereus.planner.solver.problem import CandidateSettings

    allowed = CandidateSettings(tps=(1, 2), zeros=(0, 1), recompute=(False,), micro_batches=(2, 4))
    plans = PlanCache(env.job, env.cluster, time_limit_s=10, seed=0, candidates=allowed)
    ctl = Controller(env.job, env.cluster, transition_cost_fn=_const(5.0), horizon=50, plans=plans,
                     build_transition=False)
    assert _within(ctl.plan, allowed), ctl.plan
    variants = frugal_variants(ctl.plan, env.job, env.cluster.gpus_per_node, allowed=allowed)
    assert variants and all(_within(q, allowed) for q in variants)
    assert all(s.config.micro_batch == 2 for q in variants for s in q.stages if s.name != "actor/generation")
    # the default settings still reach ZeRO-3 with recomputation (the other dead-end tests rely on it)
    d = frugal_variants(ctl.plan, env.job, env.cluster.gpus_per_node)[0]
    assert all(s.config.zero == 3 and s.config.recompute for s in d.stages if s.name.endswith("/training"))

    usable = env.cluster.gpu.usable_bytes / 2**30
    m0 = _metrics(env, 0, ctl.plan)
    d = ctl.step(StepMetrics(step=0, response_len_mean=m0.response_len_mean, response_len_max=m0.response_len_max,
                             stage_times=m0.stage_times, gpus_available=32, peak_mem_gib=2 * usable))
    seen = [d]
    for s in range(1, 8):  # every plan it moves to runs out of memory in training
        if "nothing is predicted to fit" in d.reason:
            break
        m = _metrics(env, s, ctl.plan)
        d = ctl.step(StepMetrics(step=s, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                                 gpus_available=32, oom=True, oom_stage="actor/training"))
        seen.append(d)
    assert "nothing is predicted to fit" in d.reason, d.reason
    assert all(_within(x.plan, allowed) for x in seen), [(x.action, x.reason) for x in seen]


def test_the_plan_that_ran_on_a_gpu_count_is_back_in_the_library_when_that_count_returns(env):
    """The job loses half its GPUs and gets them back (SIMULATED dip trace of issue 29). Before, the
    plan that ran on 32 GPUs had been evicted from the library while the job ran on 16, so when the
    32 came back it was not a candidate (every plan left could be condemned by shared reserves). Now
    the last plan that ran cleanly on 32 GPUs is back as ``ran-here`` and judged by its own
    measurement; a plan that ran out of memory there is not brought back."""
    ctl = _ctl(env, _const(5.0), initial_gpus=None, library_size=2)
    d = ctl.step(_ran(env, ctl, 0))
    ran32 = ctl.plan
    assert ran32.num_gpus == 32 and ctl._ran_at[32] is ran32
    for s in range(1, 6):  # 16 GPUs: a must-switch, then steps there fill the small library
        m = _metrics(env, s, ctl.plan, gpus=16)
        d = ctl.step(StepMetrics(step=s, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                                 stage_times=m.stage_times if ctl.plan.num_gpus <= 16 else {}, gpus_available=16))
    assert ctl.plan.num_gpus <= 16, d.reason
    ctl._library.pop(ran32.key(), None)  # evicted (a library of 2 plans)
    m = _metrics(env, 6, ctl.plan, gpus=32)
    ctl.step(StepMetrics(step=6, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                         stage_times=m.stage_times, gpus_available=32))
    assert ctl._library.get(ran32.key(), (None, ""))[1] == "ran-here"
    assert ctl.memory.judge(ran32.key(), [s.name for s in ran32.stages]) == (ctl.memory.measured[ran32.key()], {})
    # a plan that ran out of memory on 32 GPUs is not remembered as one that ran there
    ctl2 = _ctl(env, _const(5.0), initial_gpus=None)
    ctl2.step(_ran(env, ctl2, 0))
    m = _metrics(env, 1, ctl2.plan)
    ctl2.step(StepMetrics(step=1, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                          gpus_available=32, oom=True, oom_stage="actor/training"))
    assert 32 not in ctl2._ran_at or ctl2._ran_at[32].key() != ran32.key()


def test_a_switch_that_changes_the_inference_engine_is_priced_with_a_new_engine_start(env):
    """The SIMULATED dip trace's flapping (issue 29): the transition planner prices moving state only,
    so a switch of generation TP looked like 1-3 s where the job pays a new inference engine (tens
    of seconds). Now a switch that changes generation's layout adds ``engine_restart_s`` (default:
    the published engine start of ``RestartCost``), a knob-only switch does not, a caller's
    ``transition_cost_fn`` is taken as the whole price, and 0 turns it off (the demo)."""
    from nereus.planner.online.library import engine_changes, gen_tp_variants
    from nereus.planner.online.restart import RestartCost

    ctl = Controller(env.job, env.cluster, horizon=50, plans=env.plans, build_transition=False)
    a = ctl.plan
    b = gen_tp_variants(a, env.job.model("actor"), env.cluster.gpus_per_node)[0]
    knob = frugal_variants(a, env.job, env.cluster.gpus_per_node)[0]
    assert engine_changes(a, b) and not engine_changes(a, knob)
    assert ctl.engine_restart_s == RestartCost().engine_start_s > 0
    bound = env.plans.transition_cost(a, b)
    assert math.isclose(ctl.transition_cost(a, b), bound + ctl.engine_restart_s)
    assert math.isclose(ctl.transition_cost(a, knob), env.plans.transition_cost(a, knob))
    off = Controller(env.job, env.cluster, horizon=50, plans=env.plans, build_transition=False, engine_restart_s=0.0)
    assert math.isclose(off.transition_cost(a, b), bound)
    given = Controller(env.job, env.cluster, horizon=50, plans=env.plans, build_transition=False,
                       transition_cost_fn=_const(5.0))
    assert given.transition_cost(a, b) == 5.0


def test_on_fewer_gpus_the_current_plan_rescaled_is_judged_by_its_underestimate_scaled_by_the_peaks(env):
    """The job loses half its GPUs (SIMULATED dip trace of issue 29): the current plan with DP halved
    is a candidate ("rescaled"), judged by the current plan's measured underestimate times the ratio
    of the two predicted peaks (more per GPU on fewer GPUs), not by the shared reserves. Unit part:
    ``inherit(scale=...)`` rounds the scaled underestimate up to the quantum."""
    r = MemoryReserves(usable_gib=78.0, quantum_gib=1.0)
    r.ran(("p",), {"actor/training": 40.0}, 70.0)  # 30 GiB measured underestimate
    assert r.inherit(("c",), ("p",), scale=1.25) and r.measured[("c",)] == 38.0  # 37.5 rounded up
    ctl = _ctl(env, _const(5.0), initial_gpus=None)
    ctl.step(_ran(env, ctl, 0, over_gib=3.0))
    parent = ctl.plan
    half = scale_plan(parent, 16)
    assert half is not None
    m = _metrics(env, 1, parent, gpus=16)
    ctl.step(StepMetrics(step=1, response_len_mean=m.response_len_mean, response_len_max=m.response_len_max,
                         stage_times=m.stage_times, gpus_available=16))
    assert ctl._library.get(half.key(), (None, ""))[1] == "rescaled"
    w = ctl._ws0
    peaks = [max(v for ms, v in ctl._times(q, w).peak_mem_gib.items() if ms != "actor/generation")
             for q in (parent, half)]
    assert peaks[1] > peaks[0]
    own = ctl.memory.measured[parent.key()]
    assert ctl.memory.measured[half.key()] == ctl.memory._up(own * peaks[1] / peaks[0]) > own


def test_the_engine_start_is_not_scaled_by_the_learned_transition_factor(env):
    """SIMULATED 8k ramp (issue 29): knob-only switches measured 4x their bound clamped the learned
    transition factor at 4, and a 48 s engine start was then predicted 191 s. The factor now corrects
    the moving of state only; a reported switch teaches it its time less the engine start."""
    from nereus.planner.online.library import gen_tp_variants

    from nereus.planner.online.library import engine_changes

    ctl = Controller(env.job, env.cluster, horizon=50, plans=env.plans, build_transition=False)
    a = ctl.plan
    pairs = [(q, env.plans.transition_cost(a, q)) for f in frugal_variants(a, env.job, env.cluster.gpus_per_node)
             for q in gen_tp_variants(f, env.job.model("actor"), env.cluster.gpus_per_node) if engine_changes(a, q)]
    b, bound = max(pairs, key=lambda x: x[1])  # a switch that moves state and starts an engine
    assert bound > 0
    for _ in range(3):
        ctl.calibration.update_transition(4.0 * 10.0, 10.0)  # state moves measured at 4x their bound
    assert math.isclose(ctl.transition_cost(a, b), 4.0 * bound + ctl.engine_restart_s)
    ctl._last_cost_raw, ctl._last_engine_s = bound, ctl.engine_restart_s
    ctl.report_transition(ctl.engine_restart_s + 3.0 * bound)
    measured, predicted = ctl.calibration.transition_pairs[-1]
    assert math.isclose(measured, 3.0 * bound) and predicted == bound


def test_the_fallback_can_raise_pp_where_tp_cannot_rise(env):
    """The audit of issue 29: the fallback raised TP only, so a model whose TP already filled a node (or
    a rule whose TP is capped) had no deeper split to fall back to. ``frugal_variants`` now also offers
    each model with PP doubled and DP halved (within the settings' ``max_pp``, the layers and the GPUs),
    and none where ``max_pp`` forbids it."""
    from dataclasses import replace

    from nereus.planner.solver.problem import CandidateSettings

    ctl = Controller(env.job, env.cluster, horizon=50, plans=env.plans, build_transition=False)
    base = ctl.plan
    allowed = CandidateSettings(tps=(base.stage("actor/training").config.tp,), max_pp=16)  # TP may not rise
    variants = frugal_variants(base, env.job, env.cluster.gpus_per_node, allowed=allowed)
    deeper = [q for q in variants
              if any(q.stage(s.name).config.pp == 2 * s.config.pp for s in base.stages)]
    assert deeper, [q.key() for q in variants]
    for q in deeper:
        for s in q.stages:
            c = s.config
            assert c.tp * c.pp * c.dp == s.gpus and env.job.model(s.role).layers % c.pp == 0
        moved = {s.role for s in q.stages if s.config.pp != base.stage(s.name).config.pp}
        # a trainable model's training and inference move together; generation moves on its own
        assert len(moved) == 1
    assert {s.role for q in deeper for s in q.stages if s.config.pp != base.stage(s.name).config.pp} >= \
        {"actor"}, "the actor (trained) is one of the models the fallback can split deeper"
    flat = frugal_variants(base, env.job, env.cluster.gpus_per_node, allowed=replace(allowed, max_pp=1))
    assert all(q.stage(s.name).config.pp == s.config.pp for q in flat for s in base.stages)
