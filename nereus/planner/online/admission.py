"""The controller's decision rules: must-switch, may-switch (saving over the horizon against
the transition cost x (1 + margin), ``min_gain``, the noise band ``_noise_band``), hysteresis
(patience, free switches included; dwell), the switch before a predicted failure, exploration
probes, and the stay / switch decisions with their numbers.

``AdmissionRules`` is a part of ``Controller``; the module docstring of ``controller.py`` states
the rules in order. ``AdmissionConstants`` holds the rules' constants as data (what ``nereus
simulate`` sets), including the published paper's gamma rule, which a controller follows instead of
the rules above when its ``gamma`` is set (``AdmissionRules._admit_gamma``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from nereus.errors import SpecError

from nereus.planner.cost.plan_times import compose_step
from nereus.planner.online.library import Candidate, stage_key, trapezoid
from nereus.planner.online.types import Decision, StepMetrics
from nereus.planner.plan import GiB


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConstants:
    """The admission rules' constants. The first five are ``Controller``'s keyword arguments of the
    same names, with its defaults (``tests/unit/test_gamma_rule.py`` checks they agree); ``gamma``
    and ``replan_change`` are the gamma rule's, used by a controller whose ``gamma`` is set (the
    ``gamma`` policies of the simulator)."""

    margin: float = 0.25
    """A saving over the horizon must exceed the transition cost x (1 + margin)."""
    min_gain: float = 0.01
    """Savings below this fraction of the horizon time are model noise (no switch)."""
    patience: int = 2
    """Steps in a row the same winner must win before a switch for speed."""
    min_dwell: int = 5
    """Steps after a costly switch before the next one for speed."""
    confidence: float = 3.0
    """Standard errors of measurement noise a saving must clear (0: off)."""
    gamma: float = 0.5
    """The gamma rule (the published paper's): at a drift trigger, switch to the fastest plan when
    its transition cost / its saving per step <= gamma x H, H the expected steps to the next
    trigger. 0: only switches that cost nothing; inf: any saving."""
    replan_change: float = 0.30
    """The gamma rule's drift trigger: the forecast mean response length moved this fraction away
    from the length at the last replan (or the GPU count changed)."""

    def __post_init__(self) -> None:
        for name in ("margin", "min_gain", "confidence", "gamma"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise SpecError(f"admission: {name} must be a number >= 0, got {v!r}")
        for name in ("patience", "min_dwell"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise SpecError(f"admission: {name} must be an integer >= 0, got {v!r}")
        r = self.replan_change
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            raise SpecError(f"admission: replan_change must be a fraction > 0, got {r!r}")

    def controller_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``Controller`` these constants set (not the gamma rule's)."""
        return {"margin": self.margin, "min_gain": self.min_gain, "patience": self.patience,
                "min_dwell": self.min_dwell, "confidence": self.confidence}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (an infinite gamma as the string "inf")."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AdmissionConstants":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(d) - names)
        if bad:
            raise SpecError(f"admission: unknown keys {bad}; known: {sorted(names)}")
        return cls(**{k: (math.inf if v == "inf" else v) for k, v in d.items()})


class AdmissionRules:
    """The decision half of ``Controller``."""

    gamma: float | None = None
    """Follow the gamma rule (``_admit_gamma``) with this gamma instead of the cost rules; None: off.
    Set on an instance (``simulator.policies.make_controller``)."""
    replan_change: float = 0.30
    """The gamma rule's drift trigger (``AdmissionConstants.replan_change``)."""
    _gamma_ref: float | None = None
    """The forecast mean response length at the gamma rule's last replan."""
    _probe_from = None
    """The plan the last probe left, until the probe's plan has been measured (``_probe_return``)."""

    def _must_reason(self, m: StepMetrics, cur: Candidate) -> str:
        if m.oom:
            return f"step {m.step} ran out of memory on the current plan"
        if self.plan.num_gpus > self.gpus:
            return f"current plan uses {self.plan.num_gpus} GPUs, only {self.gpus} available"
        if not cur.feasible_next:
            return "current plan predicted out of memory next step"
        return ""

    def _decide(self, m: StepMetrics, cur: Candidate, cands: list[Candidate], must: str,
                regime_change: bool) -> Decision:
        back = self._probe_return(m, cur, cands, must)
        if back is not None:
            return back
        d = self._admit(m, cur, cands, must, regime_change)
        # no probe while a switch is pending behind hysteresis, or within min_dwell of the last switch
        # nor while the last probe's way back is still open
        if (d.action == "stay" and not must and self.explore and not d.reason.startswith("worth it")
                and m.step - self._last_switch >= self.min_dwell and self._probe_from is None):
            probe = self._probe(m, cur, cands)
            if probe is not None:
                c, why = probe
                d_from = self.plan
                d = self._switch(m, cur, c, "", why)
                if d.action == "switch":
                    self._probes_left -= 1
                    self._last_switch = m.step - self.min_dwell  # free to go back as soon as the probe is measured
                    self._probe_from = d_from
        return d

    def _probe_return(self, m: StepMetrics, cur: Candidate, cands: list[Candidate], must: str) -> Decision | None:
        """The second half of a probe's round trip, priced when the probe was admitted, so neither
        the margin, min_gain nor hysteresis (which guard switches the model alone argues for)
        applies. The probed plan is measured for ``min_dwell`` steps: before that, from its second
        step, go back to the plan the probe left only when the measurement is conclusive (it saves
        more than the way back at ``confidence`` se of noise, ``_noise_band``); at the end, on the measured means (it
        saves more than the way back). Otherwise the probe won, and its plan is kept. One noisy
        step is not a measurement: SIMULATED GRPO-8B on one H200 (``tests/unit/test_shape_calibration.py``),
        a return after the first step left the ground truth's best generation TP on a step 12%
        slower than its mean."""
        frm = self._probe_from
        if frm is None or (self._on_key < 1 and not must):
            return None
        if must:  # a must-switch picks among every candidate
            self._probe_from = None
            return None
        final = self._on_key >= self.min_dwell
        if final:
            self._probe_from = None
        elif self._on_key < 2:  # one step gives no spread: the noise of a config run once is unknown
            return None
        back = next((c for c in cands if c.plan.key() == frm.key()), None)
        if back is None or not back.feasible_next or not math.isfinite(back.horizon_s):
            return None
        if not math.isfinite(back.cost_s):
            back.cost_s = self.transition_cost(self.plan, back.plan)
        saving = cur.horizon_s - back.horizon_s
        band = 0.0 if final or self.confidence <= 0 else self._noise_band(back)
        if not saving - band > back.cost_s:
            return None
        self._probe_from = None
        why = (f"after {self._on_key} steps on it" if final else
               f"+ {band:.1f}s of noise ({self.confidence:g} se) after {self._on_key} steps")
        return self._switch(m, cur, back, "", f"probe measured: the plan it left saves {saving:.1f}s over the horizon "
                                              f"> {back.cost_s:.1f}s to go back {why} (the round trip was priced "
                                              f"with the probe)")

    def _admit(self, m: StepMetrics, cur: Candidate, cands: list[Candidate], must: str,
               regime_change: bool) -> Decision:
        """Admission (see the module docstring). A GPU-count change is a new regime: hysteresis
        (patience, dwell) guards against noise, not against a cluster that just grew."""
        feasible = [c for c in cands if c.feasible_next]
        if self.mode == "always":
            best = min(feasible, key=lambda c: self.predict(c.plan, self._ws0)[0]) if feasible else None
            if best is None or (not must and self.predict(best.plan, self._ws0)[0] >= 0.995 * self.predict(cur.plan, self._ws0)[0]):
                return self._stay(cur, best, must, "always: current plan is the best for next step")
            return self._switch(m, cur, best, must, "always: best plan for next step")
        if must:
            if not feasible:
                return self._fall_back(m, cur, cands, must)
            best = min(feasible, key=lambda c: c.net_s)
            return self._switch(m, cur, best, must, f"must switch: {must}; lowest transition + horizon time")
        if self.gamma is not None:
            return self._admit_gamma(m, cur, feasible, regime_change)
        if not feasible:
            return self._stay(cur, None, "", f"no alternative plan predicted to fit next step ({self._note})")
        best = min(feasible, key=lambda c: c.net_s)
        if not math.isfinite(best.net_s):  # every alternative fails later in the horizon, or its cost is unknown
            self._streak = ((), 0)
            fastest = min(feasible, key=lambda c: c.horizon_s)
            if math.isfinite(fastest.horizon_s) and fastest.horizon_s >= cur.horizon_s:
                # none is faster, so no transition was priced: say so, not "unknown cost"
                return self._stay(cur, fastest, "", self._slower(cur, fastest))
            return self._stay(cur, best, "", "no alternative is feasible over the whole horizon at a known cost")
        if not math.isfinite(cur.horizon_s):
            return self._admit_before_failure(m, cur, best, regime_change)
        saving = cur.horizon_s - best.horizon_s
        if saving <= 0:
            self._streak = ((), 0)
            return self._stay(cur, best, "", self._slower(cur, best))
        if saving <= self.min_gain * cur.horizon_s:  # knob-only switches too: the gain is the model's word alone
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"saving {saving:.1f}s over the horizon is below {self.min_gain:.0%} of "
                                             f"{cur.horizon_s:.0f}s (within model error)")
        if saving <= best.cost_s * (1 + self.margin) or saving <= 0:
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"saving {saving:.1f}s over the horizon does not repay "
                                             f"{best.cost_s:.1f}s x (1 + {self.margin:g})")
        band = self._noise_band(best) if self.confidence > 0 else 0.0
        if saving - band <= best.cost_s * (1 + self.margin):
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"saving {saving:.1f}s over the horizon is within what measurement "
                                             f"noise leaves uncertain of the two plans' difference ({band:.1f}s at "
                                             f"{self.confidence:g} se) plus {best.cost_s:.1f}s x (1 + {self.margin:g})")
        held = self._hysteresis(m, cur, best, regime_change)
        if held is not None:
            return held
        return self._switch(m, cur, best, "", f"saving {saving:.1f}s over the horizon > {best.cost_s:.1f}s "
                                              f"x (1 + {self.margin:g}) + {band:.1f}s of noise ({self.confidence:g} se)")

    def _admit_gamma(self, m: StepMetrics, cur: Candidate, feasible: list[Candidate],
                     regime_change: bool) -> Decision:
        """The published paper's rule, in place of the cost rules above (must-switches stay as they
        are): re-plan only at a drift trigger (the forecast mean length moved ``replan_change`` away
        from the length at the last re-plan, or the GPU count changed); there, take the plan fastest
        over the horizon when transition cost / saving per step <= gamma x H, H the steps the
        forecast's trend needs to move the length by another ``replan_change`` (at most the horizon).
        No margin, noise band, hysteresis or probe."""
        length = self._ws0.response_len_mean
        ref = self._gamma_ref
        if ref is not None and not regime_change and abs(length - ref) < self.replan_change * ref:
            return self._stay(cur, None, "", f"gamma rule: forecast mean length {length:.0f} is within "
                                             f"{self.replan_change:.0%} of {ref:.0f} at the last re-plan (no trigger)")
        self._gamma_ref = length
        best = min(feasible, key=lambda c: c.horizon_s) if feasible else None
        per = self._per_step(cur, best)
        if best is None or not per > 0:
            return self._stay(cur, best, "", "gamma rule: drift trigger, no faster plan predicted to fit")
        slope = abs(self.forecaster.slope())
        h = max(1.0, min(float(self._h), self.replan_change * length / slope if slope > 0 else math.inf))
        bound = self.gamma * h * per if self.gamma > 0 else 0.0  # gamma 0: free switches only, even at an infinite saving
        if not math.isfinite(best.cost_s) or best.cost_s > bound:
            return self._stay(cur, best, "", f"gamma rule: transition {best.cost_s:.1f}s / saving {per:.2f}s per step "
                                             f"> gamma {self.gamma:g} x H {h:.0f} steps to the next trigger")
        return self._switch(m, cur, best, "", f"gamma rule: transition {best.cost_s:.1f}s / saving {per:.2f}s per "
                                              f"step <= gamma {self.gamma:g} x H {h:.0f} steps to the next trigger")

    def _noise_band(self, c: Candidate) -> float:
        """How far, in seconds over the horizon, the predicted saving of ``c`` over the current plan
        can move at ``confidence`` standard errors of what measurement noise leaves in the calibration (``OnlineCalibration.se``, ``dependence``):
        the sources are the configs run, each with the standard error of its median; a config
        either plan holds moves with a source by its coefficient (1 for the config itself, the
        shape model's weight for a config never run), so a config both plans share moves both and
        only its effect on their difference counts. Each source is moved by +-``confidence`` se at
        each forecast point (sigma points at the band's own width, not 1 se scaled up: a stage off
        the critical path of an asynchronous plan counts only as far as the band puts it on, which
        a linearisation misses); the squares add over sources, the widths over the horizon (a
        factor's error persists from step to step). Without noise (a model the machine matches
        exactly) it is 0.

        On a flat trace two near-tied plans (a rollout pool of 112 or 96 GPUs, 1% apart) swapped
        places whenever 5% noise moved one stage's factor, and a plan never run inherited a slope
        the shape model had fitted to that noise. Neither is a saving: both lie within this sd."""
        cal, plans = self.calibration, (self.plan, c.plan)
        deps = [{name: cal.dependence(name, key, feats) for name, key, feats in self._stage_info(p)} for p in plans]
        src = {}
        for d in deps:
            for name, rows in d.items():
                for row in rows:
                    if (name, row) not in src and (se := cal.se(name, row)) > 0:
                        src[name, row] = se
        comp = [self._composition(p) for p in plans]  # an overlapping schedule's step factor is a source too
        for x in comp:
            if x is not None and x[2] > 0:
                src[x[0], x[1]] = x[2]
        if not src:
            return 0.0
        h = []
        for w in self._ws:
            base = [(p, t, self._corrected(p, t.stage_s)) for p in plans for t in (self._times(p, w),)]

            def diff(name=None, row=None, dlog=0.0, base=base) -> float:
                out = []
                for (p, t, st), d, x in zip(base, deps, comp):
                    k = d.get(name, {}).get(row, 0.0) if name is not None else 0.0
                    step = compose_step(self.job, p, {**st, name: st[name] * math.exp(k * dlog)} if k else st,
                                        t.weight_sync_s)
                    if x is not None:
                        step *= x[3] * (math.exp(dlog) if (name, row) == (x[0], x[1]) else 1.0)
                    out.append(step)
                return out[0] - out[1]

            d0 = diff()
            if not math.isfinite(d0):
                h.append(0.0)
                continue
            z = self.confidence
            var = sum((diff(name, row, sign * z * se) - d0) ** 2 for (name, row), se in src.items() for sign in (1, -1))
            h.append(math.sqrt(var / 2))
        return trapezoid(h, self._offsets_now)

    def _fall_back(self, m: StepMetrics, cur: Candidate, cands: list[Candidate], must: str) -> Decision:
        """Nothing is predicted to fit next step: run the most frugal plan at hand (``_fallback`` in
        ``library.py``) rather than the plan marked out; stay only where that is the current plan.
        Either way the decision says so and is ``feasible`` False: the model does not expect it to fit."""
        fb = next((c for c in cands if not math.isnan(c.spare_gib)), None)
        if fb is None:
            return self._stay(cur, None, must, f"must switch ({must}), but no plan at hand can run next step "
                                               f"({self._note})", feasible=False)
        why = (f"{must}; nothing is predicted to fit next step ({self._note}), so falling back to the most frugal "
               f"plan at hand (ZeRO-3, recomputation, micro-batch 1, TP or PP raised, optimizer offload, where the "
               f"rule allows): "
               f"{fb.spare_gib:+.1f} GiB to spare on its tightest model-stage by the reserves")
        if fb.plan.key() == self.plan.key():
            return self._stay(cur, None, must, f"{why}; that is the current plan, which stays (the reserves decay "
                                               f"as it runs within them)", feasible=False)
        return replace(self._switch(m, cur, fb, must, why), feasible=False)

    def _hysteresis(self, m: StepMetrics, cur: Candidate, best: Candidate, regime_change: bool) -> Decision | None:
        """A worthwhile switch waits for the same winner ``patience`` steps in a row, and one that
        costs time also for ``min_dwell`` steps after the last costly one (neither after a change of
        GPU count). A free switch (knobs, or a layout the transition prices at 0) waits for the
        patience too: free or not, a winner that noise elects for one step is not one."""
        if regime_change:
            return None
        key = best.plan.key() if best.cost_s <= 0 else best.plan.layout_key()
        n = self._streak[1] + 1 if self._streak[0] == key else 1
        self._streak = (key, n)
        if best.cost_s > 0 and m.step - self._last_switch < self.min_dwell:
            return self._stay(cur, best, "", f"worth it, but within {self.min_dwell} steps of the last switch")
        if n < self.patience:
            return self._stay(cur, best, "", f"worth it {n}/{self.patience} steps in a row (hysteresis)")
        return None

    def _admit_before_failure(self, m: StepMetrics, cur: Candidate, best: Candidate, regime_change: bool) -> Decision:
        """The current plan runs next step but is predicted to run out of memory later in the
        horizon, while ``best`` fits all of it. Both are compared over the steps the current plan
        still runs: ``best`` is taken now (with the usual hysteresis) when what it saves there, plus
        the model's error margin (``min_gain`` of that time), exceeds its transition x (1 + margin):
        a costly move waits for the failure, where the must-switch makes it (a forecast failure that
        never comes then costs nothing). A free move (new knobs, same layout) to a plan that fits
        the whole horizon is made at once, whatever it costs per step: the failure forecast is the
        memory model's, the truth tends to fail sooner, and after a crash the raised memory reserve
        may leave no plan predicted to fit. Without this, the infinite horizon time made every saving look like model noise, and
        a plan predicted to fail later was never left for a faster one (in restart mode for 450
        steps after the cluster grew, 12% slower than static)."""
        offsets = self._offsets(m.step)
        k = next((i for i, t in enumerate(cur.times) if not math.isfinite(t)), len(cur.times)) - 1
        cur_pre, best_pre = trapezoid(cur.times[:k + 1], offsets[:k + 1]), trapezoid(best.times[:k + 1], offsets[:k + 1])
        fails = offsets[k + 1] if k + 1 < len(offsets) else offsets[-1]
        saving = cur_pre - best_pre
        slack = self.min_gain * cur_pre
        if best.cost_s == 0:
            return self._switch(m, cur, best, "", f"current plan predicted out of memory within {fails} steps; this plan "
                                                  f"fits the whole horizon and costs no transition")
        if saving + slack <= best.cost_s * (1 + self.margin):
            self._streak = ((), 0)
            return self._stay(cur, best, "", f"current plan predicted out of memory within {fails} steps; it stays until "
                                             f"then (before that the best alternative saves {saving:.1f}s, which with "
                                             f"{slack:.1f}s of model error does not repay {best.cost_s:.1f}s x "
                                             f"(1 + {self.margin:g}))")
        held = self._hysteresis(m, cur, best, regime_change)
        if held is not None:
            return held
        return self._switch(m, cur, best, "", f"current plan predicted out of memory within {fails} steps; this plan "
                                              f"fits the whole horizon and saves {saving:.1f}s before then (+ "
                                              f"{slack:.1f}s of model error) > {best.cost_s:.1f}s x (1 + {self.margin:g})")

    def _probe(self, m: StepMetrics, cur: Candidate, cands: list[Candidate]) -> tuple[Candidate, str] | None:
        """Exploration: run a plan once to measure a config the model cannot be trusted on.

        Only when probes are left in this GPU regime, the current plan ran at least 2 steps, and the
        model is visibly wrong (|log(observed/predicted)| >= probe_threshold) on the current config
        of a model-stage the candidate changes to a config never run. The candidate must look
        plausible (mean prediction within probe_window of the current horizon time), and what the
        probe is expected to gain must pay for a round trip of transitions x (1 + margin) and
        min_gain: the expected saving over the horizon when the plan is kept only if it wins
        (``expected_gain``, the saving's spread from the shape model: its optimistic factors at
        mean - probe_kappa sd), less the expected cost of a crash on its first run (the run's
        first-run OOM rate x (a step + a relaunch), ``first_run_oom_rate``). A plan predicted 5%
        slower with a 10% spread gains 2% of the horizon on average, not the 5% its optimistic time
        promises. SIMULATED ppo-8b on 128 H100s losing a quarter of its GPUs
        (``benchmarks/simulate_flat_and_dip.py``): with the optimistic time alone, probes paid
        relaunches for plans measured slower and crashed on a first run."""
        if self._probes_left <= 0 or self._on_plan < 2 or not math.isfinite(cur.horizon_s):
            return None
        cal, best, best_gain, best_risk = self.calibration, None, 0.0, 0.0
        for c in cands:
            if not c.feasible_next or c.horizon_s > (1 + self.probe_window) * cur.horizon_s:
                continue
            changed = [s for s in c.plan.stages if stage_key(s) != stage_key(self.plan.stage(s.name))]
            if not any(not cal.seen(s.name, stage_key(s))
                       and cal.residual(s.name, stage_key(self.plan.stage(s.name))) >= self.probe_threshold
                       for s in changed):
                continue
            t = self._times(c.plan, self._ws0)
            mean_s = self.predict(c.plan, self._ws0)[0]
            if not (math.isfinite(mean_s) and mean_s > 0):
                continue
            opt_s = compose_step(self.job, c.plan, self._corrected(c.plan, t.stage_s, self.probe_kappa), t.weight_sync_s)
            x = self._composition(c.plan, se=False)  # the step composition predict() applies, applied alike
            opt_s *= 1.0 if x is None else x[3]
            # the candidate's horizon time as the shape model doubts it: its mean (without the crash
            # risk _score added, priced once below), and probe_kappa sd below it at the optimistic factors
            base = c.horizon_s - c.first_run_s
            sd = max(0.0, base * (1 - opt_s / mean_s)) / max(self.probe_kappa, 1e-9)
            gain = expected_gain(cur.horizon_s - base, sd)
            risk = c.first_run_s
            cost = c.cost_s if math.isfinite(c.cost_s) else self.transition_cost(self.plan, c.plan)
            if gain - risk > max(self.min_gain * cur.horizon_s, 2 * cost * (1 + self.margin)) and gain - risk > best_gain:
                c.cost_s = cost
                best, best_gain, best_risk = c, gain - risk, risk
        if best is None:
            return None
        return best, (f"probe: the model is off by >= {self.probe_threshold:.0%} on the current config; measured, "
                      f"this plan is expected to save {best_gain:.1f}s over the horizon (the expected gain under the "
                      f"shape model's doubt, less {best_risk:.1f}s of first-run crash risk) "
                      f"> 2 x {best.cost_s:.1f}s x (1 + {self.margin:g})")

    @staticmethod
    def _slower(cur: Candidate, best: Candidate) -> str:
        return (f"no alternative is faster over the horizon (the best is {best.horizon_s - cur.horizon_s:.1f}s "
                f"slower than the current {cur.horizon_s:.0f}s)")

    def _per_step(self, cur: Candidate, c: Candidate | None) -> float:
        if c is None or not math.isfinite(c.horizon_s):
            return 0.0
        return (cur.horizon_s - c.horizon_s) / max(1, self._h) if math.isfinite(cur.horizon_s) else math.inf

    def _stay(self, cur: Candidate, best: Candidate | None, must: str, reason: str, feasible: bool = True) -> Decision:
        return Decision(action="stay", plan=self.plan, transition=None, predicted_cost_s=0.0 if best is None else best.cost_s,
                        saving_per_step_s=self._per_step(cur, best), break_even_steps=break_even(cur, best, self),
                        reason=reason, must=bool(must), feasible=feasible and not must)

    def _switch(self, m: StepMetrics, cur: Candidate, best: Candidate, must: str, reason: str) -> Decision:
        trans = None
        if self.build_transition and best.cost_s > 0:
            from nereus.planner.transition.build import plan_transition

            trans = plan_transition(self.job, self.plans.cluster_for(max(self.plan.num_gpus, best.plan.num_gpus)),
                                    self.plan, best.plan)
            st = dict(trans.stats)
            if not st.get("keep_old_fits", True):
                tight = (f"keeping the old state until commit needs {st['peak_mem_bytes_keep_old'] / GiB:.1f} GiB on "
                         f"a GPU of {st['capacity_bytes'] / GiB:.1f} GiB (the executor has no host staging)")
                if not must:  # a switch for speed is not worth a transition that cannot keep its rollback state
                    self._streak = ((), 0)
                    return self._stay(cur, best, "", f"worth it, but {tight}")
                reason += f"; warning: {tight}"
        self._probe_from = None  # a switch closes the last probe's way back (a probe sets it again after)
        d = Decision(action="switch", plan=best.plan, transition=trans, predicted_cost_s=best.cost_s,
                     saving_per_step_s=self._per_step(cur, best), break_even_steps=break_even(cur, best, self),
                     reason=f"{reason} [{best.origin}]", must=bool(must))
        if best.cost_s > 0:
            self._last_switch = m.step
        self._last_cost_raw = self._cost.get((self.plan.layout_key(), best.plan.layout_key()), 0.0)
        self._last_engine_s = self._engine_s.get((self.plan.layout_key(), best.plan.layout_key()), 0.0)
        if best.plan.layout_key() != self.plan.layout_key():
            self._on_plan = 0
        if best.plan.key() != self.plan.key():
            self._on_key = 0
        if best.origin == "re-pool":
            self.rule = replace(self.rule, anchor=best.plan)
        self._streak = ((), 0)
        self._prev_plan = self.plan  # report_rollback returns to it
        self.plan = best.plan
        if best.plan.key() not in self._library:
            self._add(best.plan, best.origin)
        return d


def expected_gain(d: float, sd: float) -> float:
    """E[max(0, d + e)], e ~ N(0, sd): what running a plan whose saving is d on average, give or
    take sd, gains when one goes back whenever it loses (a probe's round trip)."""
    if not sd > 0:
        return max(0.0, d)
    z = d / sd
    return d * 0.5 * math.erfc(-z / math.sqrt(2)) + sd * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def break_even(cur: Candidate, c: Candidate | None, ctl: AdmissionRules) -> float:
    """Steps until the transition is repaid at the predicted per-step saving (inf if never)."""
    per = ctl._per_step(cur, c)
    if c is None or per <= 0:
        return math.inf
    return c.cost_s / per if math.isfinite(per) else 0.0
