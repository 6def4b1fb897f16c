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
from nereus.planner.cost.plan_times import compose_step
from nereus.planner.online.plan_cache import LayoutRule, keep_layout, scale_plan
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.solver.problem import CandidateSettings
from nereus.planner.specs import JobSpec, Workload

DEFAULT_SETTINGS = CandidateSettings()


@dataclass(slots=True)
class Candidate:
    plan: Plan
    origin: str
    cost_s: float = 0.0
    horizon_s: float = math.inf
    feasible_next: bool = False
    times: tuple[float, ...] = ()
    """Predicted step time at each forecast point of the horizon (inf where it does not fit)."""
    spare_gib: float = math.nan
    """A fallback's GiB to spare on its tightest model-stage next step (negative: short)."""
    first_run_s: float = 0.0
    """The expected crash of its first step, in ``horizon_s`` (a plan never run; ``Controller._score``)."""

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


def engine_changes(a: Plan, b: Plan) -> bool:
    """Whether a switch a -> b changes the inference engine's layout (pool, TP, PP or DP of
    generation), so that a new engine must start."""
    ga, gb = a.stage("actor/generation"), b.stage("actor/generation")
    return (ga.first_gpu, ga.gpus, ga.config.tp, ga.config.pp, ga.config.dp) != \
        (gb.first_gpu, gb.gpus, gb.config.tp, gb.config.pp, gb.config.dp)


def gen_tp(plan: Plan) -> int:
    return plan.stage("actor/generation").config.tp


def gen_tp_free(rule: LayoutRule) -> bool:
    """Whether ``rule`` lets the generation TP change (no pools kept, generation TP not pinned)."""
    return rule.anchor is None and all(ms != "actor/generation" for ms, _, _ in rule.fixed_tp_pp)


def frugal_variants(plan: Plan, job: JobSpec, gpus_per_node: int, fixed: set[str] = frozenset(),
                    allowed: CandidateSettings = DEFAULT_SETTINGS) -> list[Plan]:
    """``plan`` with its knobs at their most frugal among those ``allowed`` (the solver's candidate
    settings: every training stage at the highest ZeRO stage allowed, with recomputation if allowed;
    every training and inference stage at the smallest micro-batch, no token budget; a trainable
    model's inference pass follows its training's ZeRO stage), and that plan with one model's TP
    doubled (DP halved; the training and inference of a trainable model together) for each model
    whose model-stages are not in ``fixed`` and whose doubled TP is allowed and fits in a node, then
    the same with PP doubled (within ``allowed.max_pp``, dividing the layers and the stage's GPUs): a
    model whose TP already fills a node can still halve its per-GPU weights and states that way. A
    fallback never holds a knob its solver could not choose (the demo's executor runs ZeRO 0-2
    and no PP only); where ``allowed.offload`` holds True, every trained model's optimizer state goes
    to host memory between updates (``cost.model.offloaded``: the rollout's KV cache gets the room)."""
    trainable = {s.role for s in plan.stages if s.name.endswith("/training")}
    stages = []
    for s in plan.stages:
        c = s.config
        if s.name != "actor/generation":
            train = s.role in trainable
            c = replace(c, micro_batch=min(allowed.micro_batches), token_budget=0,
                        zero=max(allowed.zeros) if train else c.zero,
                        recompute=max(allowed.recompute) if s.name.endswith("/training") else c.recompute)
        stages.append(replace(s, config=c))
    extras = dict(plan.extras)
    if True in allowed.offload:  # every trained model's optimizer state in host memory between updates
        extras["offload"] = tuple(sorted(f"{r}/training" for r in trainable))
    try:
        base = replace(plan, stages=tuple(stages), extras=tuple(extras.items()))
    except (NereusError, ValueError):
        return []
    out = [base] if base.key() != plan.key() else []
    groups: dict[str, list[str]] = {}
    for s in base.stages:
        groups.setdefault("actor/generation" if s.name == "actor/generation" else s.role, []).append(s.name)
    for names in groups.values():
        if any(n in fixed for n in names):
            continue
        first = base.stage(names[0])
        tp = first.config.tp * 2
        try:
            check_tp(job.model(first.role), tp)
            heads = job.model(first.role).heads
            if tp > gpus_per_node or tp not in allowed.tps or any(base.stage(n).gpus % (tp * base.stage(n).config.pp)
                                         or heads % (tp * base.stage(n).config.sp) for n in names):
                continue
            new = {n: replace(base.stage(n), config=replace(base.stage(n).config, tp=tp,
                                                             dp=base.stage(n).gpus // (tp * base.stage(n).config.pp)))
                   for n in names}
            out.append(replace(base, stages=tuple(new.get(s.name, s) for s in base.stages)))
        except (NereusError, ValueError):
            continue
    for names in groups.values():  # then PP doubled: what TP cannot give once it fills a node
        if any(n in fixed for n in names):
            continue
        pp = base.stage(names[0]).config.pp * 2
        layers = job.model(base.stage(names[0]).role).layers
        if pp > allowed.max_pp or layers % pp or any(
                base.stage(n).gpus % (base.stage(n).config.tp * pp * base.stage(n).config.sp) for n in names):
            continue
        try:
            new = {n: replace(base.stage(n), config=replace(
                base.stage(n).config, pp=pp, dp=base.stage(n).gpus // (base.stage(n).config.tp * pp)))
                for n in names}
            out.append(replace(base, stages=tuple(new.get(s.name, s) for s in base.stages)))
        except (NereusError, ValueError):
            continue
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

    def _ask(self, origin: str, rule: LayoutRule, w: Workload, reserve_gib: float | None = None) -> Plan | None:
        # the calibrated parameters for every rule: a stage factor changes the trade between a
        # stage's knobs and the memory they free for another (recompute vs KV room), fixed pools or not
        params, ckey = self.calibration.solver_params(self.base_params, self.calib_resolution)
        # the solver plans with the memory reserve on a grid of 4 quanta (rounded up): a reserve that
        # creeps up by a GiB does not re-solve everything
        grid = 4.0 * self._mem_quantum()
        r = self.memory.solver_reserve() if reserve_gib is None else reserve_gib
        try:
            p = self.plans.best(rule, self._solver_workload(w), self.gpus, params, ckey, hint=self.plan,
                                reserve_gib=grid * math.ceil(r / grid - 1e-9))
        except NereusError:
            p = None
        if p is not None:
            self._add(p, origin)
            if self.explore and origin in ("best-horizon", "best-next") and gen_tp_free(rule):
                # the same plan with the other generation TPs: the solver ranks them with stage-level
                # factors only, the controller with the per-config and shape corrections it learned
                for q in gen_tp_variants(p, self.job.model("actor"), self.cluster.gpus_per_node):
                    if q.key() not in self._library:
                        self._add(q, "gen-tp")
        return p

    def _add_rescaled(self, w: Workload) -> None:
        """The current plan on all the GPUs granted: its layout and knobs, DP scaled (``scale_plan``),
        as static does. Not left to the solver (which plans with the shared memory reserves and may
        find nothing). On more GPUs it holds no more per GPU than the current plan, so the current
        plan's own measurement judges it (``MemoryReserves.inherit``), and where the current plan ran
        at the cap so did it (``_ran_ok``). Without it, SIMULATED grpo-70b ramp_1024: a plan that ran
        under a common reserve of 36-38 GiB (held up by its own measured underestimates) stayed on
        128 of 256 GPUs for 250 steps, as the solver, asked with that reserve, found nothing for 256.

        On fewer GPUs (a must-switch) it holds more per GPU (larger ZeRO shards; micro-batches are
        unchanged), and its underestimate is taken as the current plan's scaled by the ratio of the
        two predicted peaks (``inherit(scale=...)``: the model's memory error taken as a share of
        the peak, not a constant, which is the more cautious reading when the child's peak is the
        larger). It has not run at the cap. Without it, SIMULATED ppo-8b on
        128 H100s losing 32 GPUs (``benchmarks/simulate_flat_and_dip.py``): every plan for 96 GPUs was
        held out by reserves that OOMs on 128 had raised, and adaptive ran its most frugal fallback
        there, 7-8% slower per step than static's rescaled plan."""
        p = scale_plan(self.plan, self.gpus)
        if p is None or p.key() == self.plan.key():
            return
        if p.num_gpus > self.plan.num_gpus:
            if self.memory.inherit(p.key(), self.plan.key()) and (ev := self._ran_ok.get(self.plan.key())) is not None:
                self._ran_ok.setdefault(p.key(), ev)
        else:
            try:
                parent, child = (max(v for ms, v in self._times(q, w).peak_mem_gib.items() if ms != "actor/generation")
                                 for q in (self.plan, p))
            except (NereusError, ValueError):
                return
            if parent <= 0 or not math.isfinite(child):
                return
            self.memory.inherit(p.key(), self.plan.key(), scale=max(1.0, child / parent))
        if p.key() not in self._library:
            self._add(p, "rescaled")

    def _add_ran_here(self) -> None:
        """The last plan that ran a step on the GPUs now granted without running out of memory
        (``_ran_at``), back in the library if it was evicted while the job ran on another GPU count:
        judged by its own measured underestimate (``MemoryReserves.judge``), not by the shared
        reserves that OOMs elsewhere raised. Without it, SIMULATED ppo-8b on 128 H100s losing 32
        GPUs for 70 steps (``benchmarks/simulate_flat_and_dip.py``, dip_ramp): the plan that ran
        there before the loss had left the library, every plan left for 128 GPUs was predicted out
        of memory, and adaptive stayed on its 96-GPU fallback rescaled, 12-14% slower per step than
        static for the rest of the run."""
        p = self._ran_at.get(self.gpus)
        if p is not None and p.key() != self.plan.key() and p.key() not in self._library:
            self._add(p, "ran-here")

    def _add(self, p: Plan, origin: str) -> None:
        """Into the library (most recent last). Room is made by the oldest plan that is not the
        current one, not the fastest of its generation TP at the last scoring, and not the last of
        its generation TP: the library may exceed ``library_size`` by those (at most one per TP)."""
        self._library.pop(p.key(), None)
        self._library[p.key()] = (p, origin)
        keep = self._pinned | {self.plan.key(), p.key()}
        while len(self._library) > self.library_size:
            per_tp: dict[int, int] = {}
            for q, _ in self._library.values():
                per_tp[gen_tp(q)] = per_tp.get(gen_tp(q), 0) + 1
            old = next((k for k, (q, _) in self._library.items() if k not in keep and per_tp[gen_tp(q)] > 1), None)
            if old is None:
                break
            self._library.pop(old)

    def _pin(self, scored: list[Candidate]) -> None:
        """Remember the fastest plan over the horizon per generation TP (the current one included)."""
        best: dict[int, Candidate] = {}
        for c in scored:
            tp = gen_tp(c.plan)
            if math.isfinite(c.horizon_s) and (tp not in best or c.horizon_s < best[tp].horizon_s):
                best[tp] = c
        self._pinned = {c.plan.key() for c in best.values()}

    def _library_note(self, out: list[Candidate]) -> str:
        """What the library held besides the current plan, for a stay's reason."""
        n = len(self._library) - (self.plan.key() in self._library)
        more = sum(1 for p, _ in self._library.values() if p.num_gpus > self.gpus)
        fewer = sum(1 for p, _ in self._library.values() if p.num_gpus < self.gpus)
        oom = sum(1 for c in out if not c.feasible_next)
        return (f"the library holds {n} other plan{'s' * (n != 1)}: {oom} predicted out of memory next step, "
                f"{more} for more than the {self.gpus} GPUs granted, {fewer} for fewer (weighed only when forced)")

    def _candidates(self, ws: list[Workload], offsets: tuple[int, ...], must: bool,
                    retry: bool = False) -> list[Candidate]:
        """Plans from the solver for the forecast (the fastest under the rule, and the fastest
        keeping the current layout), plus the plans found earlier (a library re-scored every
        step, which costs evaluations, not solves)."""
        if self.mode == "always":
            self._ask("best-next", self.rule, ws[0])
        else:
            self._ask("best-horizon", self.rule, ws[len(ws) // 2])
            if self.plan.num_gpus < self.gpus or (must and self.plan.num_gpus <= self.gpus):
                # the current layout stretched to new GPUs, or re-tuned to fit: cheapest to reach
                self._ask("keep-layout", keep_layout(self.plan, self.rule), ws[len(ws) // 2])
        if self.plan.num_gpus != self.gpus:
            self._add_rescaled(ws[0])
        self._add_ran_here()
        frm = self._probe_from  # a probe's way back stays at hand until the probe is measured
        if frm is not None and frm.key() != self.plan.key() and frm.key() not in self._library:
            self._add(frm, "probe-from")
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
        self._pin(out + [Candidate(self.plan, "current", horizon_s=cur_s)])
        self._note = self._library_note(out)
        # the transition planner is only asked about the few fastest candidates that could pay for
        # themselves (a bound per layout pair is tenths of a second at 1,024 GPUs)
        could = sorted((c for c in out if c.feasible_next and (must or self.mode == "always" or c.horizon_s < cur_s)),
                       key=lambda c: c.horizon_s)
        for c in could[:self.cost_queries]:
            c.cost_s = self.transition_cost(self.plan, c.plan)
        if must and not any(c.feasible_next for c in out):
            if not retry:
                self._ask("best-next", self.rule, ws[0])
                if self.rule.anchor is not None:
                    # the pools a baseline keeps no longer fit: a user relaunches with new ones (same TP/PP rule)
                    self._ask("re-pool", replace(self.rule, anchor=None), ws[0])
                return self._candidates(ws, offsets, True, retry=True)
            fallback = self._fallback(ws, offsets)
            if fallback is not None:
                out.append(fallback)
        return out

    def _fallback(self, ws: list[Workload], offsets: tuple[int, ...]) -> Candidate | None:
        """Nothing is predicted to fit next step: the most frugal plan at hand (fewest OOMs so far,
        then most GiB to spare on its tightest model-stage, reserves included, then the faster). From the
        current plan, the library, and the solver asked with lower memory reserves, each also with
        its knobs at their most frugal (``frugal_variants``: the highest ZeRO stage allowed, recomputation, micro-batch 1,
        TP doubled where the rule leaves TP free). ``origin`` "fallback", ``feasible_next`` False
        unless the variant is predicted to fit; ``spare_gib`` set (other candidates leave it nan)."""
        pool = {k: p for k, (p, _) in self._library.items() if p.num_gpus <= self.gpus}
        pool.setdefault(self.plan.key(), self.plan)
        if self.plan.num_gpus > self.gpus and (p := scale_plan(self.plan, self.gpus)) is not None:
            pool.setdefault(p.key(), p)
        rules = [self.rule] + ([replace(self.rule, anchor=None)] if self.rule.anchor is not None else [])
        full = self.memory.solver_reserve()
        for rule in rules:
            for r in (full / 2, 0.0) if full > 0 else ():
                p = self._ask("frugal-ask", rule, ws[0], reserve_gib=r)
                if p is not None:
                    pool.setdefault(p.key(), p)
                    break
        fixed = {ms for ms, _, _ in self.rule.fixed_tp_pp}
        allowed = self.rule.candidate_settings(self.plans.candidates or DEFAULT_SETTINGS)
        best, best_key = None, None
        for p in list(pool.values()):
            for q in [p] + frugal_variants(p, self.job, self.cluster.gpus_per_node, fixed, allowed):
                if q.num_gpus > self.gpus:
                    continue
                try:
                    t = self._times(q, ws[0])
                except NereusError:  # a variant the cost model cannot price (e.g. heads vs TP x SP)
                    continue
                room = self._headroom(q, t)
                if not math.isfinite(room):
                    continue
                step = compose_step(self.job, q, self._corrected(q, t.stage_s), t.weight_sync_s)
                # a plan that ran out of memory less often first: the model's memory is the doubtful part
                k = (-self.memory.struck.get(q.key(), 0), math.floor(room / self._mem_quantum()),
                     -step if math.isfinite(step) else -math.inf)
                if best_key is None or k > best_key:
                    best, best_key = q, k
        if best is None:
            return None
        c = Candidate(best, "fallback", cost_s=self.transition_cost(self.plan, best))
        self._score(c, ws, offsets)
        c.spare_gib = best_key[1] * self._mem_quantum()
        return c
