"""The controller's candidate plans: where they come from and how each is scored.

``Candidate`` is one plan with its predicted seconds over the horizon and transition cost;
``CandidateLibrary`` (a part of ``Controller``) asks the plan solver for the forecast workload
(the fastest plan under the rule, and the fastest keeping the current layout), adds the fastest
plan's other generation TPs, and keeps the plans found earlier in a bounded library that is
re-scored every step (evaluations, not solves). The helpers below are pure functions of a plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nereus.errors import NereusError
from nereus.models.inventory import check_tp
from nereus.models.spec import ModelSpec
from nereus.planner.online.plan_cache import LayoutRule, keep_layout
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import Workload


@dataclass(slots=True)
class Candidate:
    plan: Plan
    origin: str
    cost_s: float = 0.0
    horizon_s: float = math.inf
    feasible_next: bool = False
    times: tuple[float, ...] = ()
    """Predicted step time at each forecast point of the horizon (inf where it does not fit)."""

    @property
    def net_s(self) -> float:
        return self.horizon_s + self.cost_s


def trapezoid(times, offsets) -> float:
    """Seconds over the horizon from step times at the forecast points (trapezoid rule)."""
    total, prev_k, prev_t = times[0], offsets[0], times[0]
    for k, t in zip(offsets[1:], times[1:]):
        total += (k - prev_k) * (t + prev_t) / 2
        prev_k, prev_t = k, t
    return total


def stage_key(s: StagePlacement) -> tuple:
    """What a model-stage's calibration factor is specific to: its config and pool size."""
    c = s.config
    return (c.tp, c.pp, c.dp, c.micro_batch, c.zero, c.recompute, getattr(c, "sp", 1), getattr(c, "token_budget", 0),
            s.gpus)


def features(s: StagePlacement) -> tuple[float, ...]:
    """Shape features of a model-stage's config for the calibration's shape model: log2 of tp,
    pp, dp and the micro-batch (tokens / 4,096 under a token budget), recomputation, ZeRO-3."""
    c = s.config
    budget = getattr(c, "token_budget", 0)
    mb = budget / 4096 if budget else c.micro_batch
    return (math.log2(c.tp), math.log2(c.pp), math.log2(c.dp), math.log2(max(mb, 1e-3)), float(c.recompute),
            float(c.zero >= 3))


def gen_tp_variants(plan: Plan, model: ModelSpec, gpus_per_node: int, tps: tuple[int, ...] = (1, 2, 4, 8)) -> list[Plan]:
    """``plan`` with each other generation TP that splits ``model`` and divides its pool (DP adjusted)."""
    gen = plan.stage("actor/generation")
    c, out = gen.config, []
    for tp in tps:
        try:
            check_tp(model, tp)
        except NereusError:
            continue
        if tp != c.tp and tp <= gpus_per_node and gen.gpus % (tp * c.pp) == 0:
            g = replace(gen, config=replace(c, tp=tp, dp=gen.gpus // (tp * c.pp)))
            out.append(replace(plan, stages=tuple(g if s.name == gen.name else s for s in plan.stages)))
    return out


def layout(p: Plan) -> str:
    return " ".join(f"{s.name}:{s.config.label()}@{s.first_gpu}+{s.gpus}" for s in p.stages)


class CandidateLibrary:
    """The candidate half of ``Controller`` (it reads the controller's job, rule, plan, solver
    cache, calibration and library)."""

    def _solver_workload(self, w: Workload) -> Workload:
        """``w`` on the coarse grid the solver is asked on (plans are cached per grid cell)."""
        r = math.log(self.solve_bucket_ratio)
        mean = min(round(math.exp(round(math.log(w.response_len_mean) / r) * r), 1), 0.98 * w.response_len_max)
        ratio = round(4 * w.p90 / w.response_len_mean) / 4  # coarse tail shape, so the cache key is stable
        return replace(w, response_len_mean=mean, response_len_p90=round(min(float(w.response_len_max), ratio * mean), 1))

    def _ask(self, origin: str, rule: LayoutRule, w: Workload) -> None:
        if rule.anchor is not None or rule.placement == "colocated":
            # pools fixed: the solver only picks knobs inside each stage, which per-stage factors do
            # not reorder; asking with the base parameters lets calibration move without re-solves
            params, ckey = self.base_params, ()
        else:
            params, ckey = self.calibration.solver_params(self.base_params, self.calib_resolution)
        try:
            # the solver plans with the memory reserve on a grid of 4 quanta (rounded up): a reserve that
            # creeps up by a GiB does not re-solve everything
            grid = 4.0 * self._mem_quantum()
            reserve = grid * math.ceil(self._reserve / grid)
            p = self.plans.best(rule, self._solver_workload(w), self.gpus, params, ckey, hint=self.plan,
                                reserve_gib=reserve)
        except NereusError:
            p = None
        if p is not None:
            self._add(p, origin)
            if rule.name == "free" and self.explore and origin in ("best-horizon", "best-next"):
                # the same plan with the other generation TPs: the solver ranks them with stage-level
                # factors only, the controller with the per-config and shape corrections it learned
                for q in gen_tp_variants(p, self.job.model("actor"), self.cluster.gpus_per_node):
                    if q.key() not in self._library:
                        self._add(q, "gen-tp")

    def _add(self, p: Plan, origin: str) -> None:
        self._library.pop(p.key(), None)
        self._library[p.key()] = (p, origin)
        while len(self._library) > self.library_size:
            self._library.pop(next(iter(self._library)))

    def _candidates(self, ws: list[Workload], offsets: tuple[int, ...], must: bool) -> list[Candidate]:
        """Plans from the solver for the forecast (the fastest under the rule, and the fastest
        keeping the current layout), plus the plans found earlier (a library re-scored every
        step, which costs evaluations, not solves)."""
        if self.mode == "always":
            self._ask("best-next", self.rule, ws[0])
        else:
            self._ask("best-horizon", self.rule, ws[len(ws) // 2])
            if self.plan.num_gpus < self.gpus or (must and self.plan.num_gpus <= self.gpus):
                # the current layout stretched to new GPUs, or re-tuned to fit: cheapest to reach
                self._ask("keep-layout", keep_layout(self.plan), ws[len(ws) // 2])
        cur = self.plan.key()
        cur_s = self._cur_horizon_s
        out = []
        for key, (p, origin) in self._library.items():
            # plans for fewer GPUs than granted stay in the library but are only scored when forced
            if key == cur or p.num_gpus > self.gpus or (p.num_gpus < self.gpus and not must):
                continue
            c = Candidate(p, origin, cost_s=math.inf)
            self._score(c, ws, offsets)
            out.append(c)
        # the transition planner is only asked about the few fastest candidates that could pay for
        # themselves (a bound per layout pair is tenths of a second at 1,024 GPUs)
        could = sorted((c for c in out if c.feasible_next and (must or self.mode == "always" or c.horizon_s < cur_s)),
                       key=lambda c: c.horizon_s)
        for c in could[:self.cost_queries]:
            c.cost_s = self.transition_cost(self.plan, c.plan)
        if must and not any(c.feasible_next for c in out):
            self._ask("best-next", self.rule, ws[0])
            if self.rule.anchor is not None:
                # the pools a baseline keeps no longer fit: a user relaunches with new ones (same TP/PP rule)
                self._ask("re-pool", replace(self.rule, anchor=None), ws[0])
            return self._candidates(ws, offsets, False) if self._library else out
        return out
