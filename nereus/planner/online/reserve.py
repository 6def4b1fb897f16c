"""Memory judgement of the controller: the memory held back per GPU when judging a plan, learned
from measured peaks and out-of-memory failures, and given back when plans run within it.

Three scopes (``MemoryReserves``), in GiB per GPU on top of what the cost model calls usable:

- common: every model-stage of a plan without its own record (it also shrinks the generation KV
  budget): raised to the measured underestimate (observed peak - predicted peak) of a step, and by
  an OOM in generation or in a stage the trainer did not name, so that the failed plan's predicted
  peak no longer fits;
- per model-stage (``actor/training``, ...): raised by an OOM in that stage, so that the failed
  plan's predicted peak there + common + this reserve exceeds the usable memory: the failed plan,
  and every plan as hungry in that stage, is predicted not to fit, the others are not touched;
- per plan: a plan that ran without ever running out of memory is judged by its own measured
  underestimate alone (measurement beats the model). A plan that ran out of memory loses that: from
  then on it is judged by the shared reserves (which its OOM raised to condemn it), or by its own
  measurement where that is larger.

Decay: a step that runs without OOM shows how much each shared reserve it was judged by was needed
at most (common: the largest underestimate measured on the last 10 such steps; a stage's: the observed peak - that stage's
predicted peak - common, or without a measured peak the room the stage had). A reserve above that
bound moves toward it by max(quantum, ``decay`` x the gap) / (1 + strikes) per step, strikes counting
the OOMs that raised it: reserves hold only what the evidence still supports, a plan condemned by a
shared reserve comes back when that reserve decays, and one that two OOMs raised decays a third as
fast as a measured one. Worked example (80 GiB GPU, quantum 1 GiB, decay 0.2): an OOM raised the
actor/training reserve to 7 GiB (strike 1); a step whose training could have needed at most 1 GiB
lowers it by max(1, 0.2 x 6) / 2 = 0.6 GiB, to 6.4 (judged as 7 GiB: effective reserves are rounded
up to the quantum, so that evaluations cached per reserve are shared).

Floors (``floor``, ``hungrier``): a reserve decays toward the underestimates of the plans that run,
which says nothing of a config that failed (underestimates differ between configs: TP4 and TP1
training do not share one); a plan never run predicted at least as hungry in a model-stage as a
config that ran out of memory there is held out, until that config runs that hungry. SIMULATED ppo-32b ramp_1024: without floors, decayed reserves
re-admitted never-run plans hungrier than failed ones.

Crash rate (``crash_rate``): a plan's strikes / (strikes + clean steps since its first OOM + 1); the
clean steps before it ran shorter responses (lengths grow in RL) and say little of the rate where it
failed (counting them, SIMULATED grpo-32b ramp_1024 re-admitted a plan after 1 OOM in 47 steps, and
it crashed again). A reserve that decays
re-admits a plan the model predicts to fit; the plan's own record says how often it did not. The
controller adds the expected crash-restarts to every plan's seconds over the horizon.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

from nereus.planner.plan import GiB, Plan
from nereus.planner.specs import Workload

GENERATION = "actor/generation"


@dataclass(slots=True)
class Reserve:
    """One shared reserve: its raw value (GiB) and the OOMs that raised it."""

    gib: float = 0.0
    strikes: int = 0

    def raise_to(self, need: float, *, oom: bool = False) -> bool:
        if oom:
            self.strikes += 1
        if need > self.gib + 1e-9:
            self.gib = need
            return True
        return False

    def decay_toward(self, bound: float, quantum: float, rate: float) -> None:
        bound = max(0.0, bound)
        if self.gib > bound:
            self.gib = max(bound, self.gib - max(quantum, rate * (self.gib - bound)) / (1 + self.strikes))


class MemoryReserves:
    """The reserves of one controller (see the module docstring). ``usable``: GiB per GPU the model
    calls usable; ``quantum``: the rounding step; ``decay``: the fraction of the gap closed per
    step that runs within a reserve (before the strikes' slow-down)."""

    def __init__(self, usable_gib: float, quantum_gib: float, decay: float = 0.2, window: int = 10) -> None:
        self.usable, self.quantum, self.decay = float(usable_gib), float(quantum_gib), float(decay)
        self._recent: deque[float] = deque(maxlen=window)
        """Underestimates measured on the last ``window`` clean steps (the common reserve decays toward
        their largest: one step's sampled lengths are noise)."""
        self.common = Reserve()
        self.stage: dict[str, Reserve] = {}
        self.measured: dict[tuple, float] = {}
        """Per plan that ran: the largest underestimate measured on it (GiB, rounded up)."""
        self.struck: dict[tuple, int] = {}
        """Per plan that ran out of memory: how often."""
        self.runs: dict[tuple, int] = {}
        """Per plan: the steps it ran without running out of memory."""
        self.since: dict[tuple, int] = {}
        """Per plan that ran out of memory: the clean steps it ran since its first OOM."""
        self.floor: dict[tuple, float] = {}
        """Per model-stage and config (``stage_key``): the predicted peak (GiB) from which plans
        never run are held out, the lowest a plan that ran out of memory there with that config had
        (raised past a peak that config ran at since)."""

    def _up(self, x: float) -> float:
        return min(self.quantum * math.ceil(max(0.0, x) / self.quantum - 1e-9), 0.75 * self.usable)

    @property
    def common_gib(self) -> float:
        return self._up(self.common.gib)

    def stage_gib(self, name: str) -> float:
        r = self.stage.get(name)
        return self._up(r.gib) if r is not None else 0.0

    def judge(self, key: tuple, stages: Iterable[str]) -> tuple[float, Mapping[str, float]]:
        """(reserve for the whole plan, extra reserve per model-stage) to judge plan ``key`` by."""
        own = self.measured.get(key)
        if own is not None and key not in self.struck:
            return own, {}
        extra = {s: g for s in stages if (g := self.stage_gib(s)) > 0}
        return max(self.common_gib, own or 0.0), extra

    def solver_reserve(self) -> float:
        """The one reserve the solver can take: common + the largest stage reserve (what it offers
        fits every stage; the controller re-judges each stage itself)."""
        return self.common_gib + max((self.stage_gib(s) for s in self.stage), default=0.0)

    def oom(self, key: tuple, peaks: Mapping[str, float], stage: str | None, judged_fit: bool,
            configs: Mapping[str, tuple] | None = None) -> None:
        """Plan ``key`` ran out of memory (in ``stage`` when known); ``peaks``: its predicted peak per
        model-stage (GiB, generation included). ``judged_fit``: whether it was predicted to fit (a
        plan run for want of another teaches the shared reserves nothing new, but is struck)."""
        self.struck[key] = self.struck.get(key, 0) + 1
        self.since.setdefault(key, 0)
        if not peaks:
            return
        if stage in peaks and stage != GENERATION:
            need = self.usable - self.common_gib - peaks[stage] + self.quantum
            r = self.stage.setdefault(stage, Reserve())
        else:
            s = stage if stage in peaks else max(peaks, key=peaks.get)
            need, r = self.usable - peaks[s] + self.quantum, self.common
        r.raise_to(min(need, 0.75 * self.usable) if judged_fit else 0.0, oom=True)
        s = stage if stage in peaks and stage != GENERATION else max(
            (k for k in peaks if k != GENERATION), key=peaks.get, default=None)
        if judged_fit and s is not None and configs and s in configs:
            f = (s, configs[s])
            self.floor[f] = min(self.floor.get(f, math.inf), peaks[s])

    def ran(self, key: tuple, peaks: Mapping[str, float], observed_gib: float | None,
            configs: Mapping[str, tuple] | None = None) -> None:
        """Plan ``key`` ran a step without OOM; ``peaks``: its predicted peak per model-stage other
        than generation (GiB); ``observed_gib``: the step's measured peak, when logged."""
        self.runs[key] = self.runs.get(key, 0) + 1
        if key in self.since:
            self.since[key] += 1
        if not peaks:
            return
        top = max(peaks.values())
        if observed_gib is not None:
            under = max(0.0, float(observed_gib) - top)
            self._recent.append(under)
            self.measured[key] = max(self.measured.get(key, 0.0), self._up(under))
            if not self.common.raise_to(under):
                self.common.decay_toward(max(self._recent), self.quantum, self.decay)
        else:  # no peak logged: the step ran, so no stage needed more than the room it had
            self.common.decay_toward(self.usable - top, self.quantum, self.decay)
        ceiling = self.usable if observed_gib is None else float(observed_gib)
        for s, p in peaks.items():
            f = (s, configs.get(s)) if configs else None
            if f is not None and p >= self.floor.get(f, math.inf):  # this config ran this hungry
                self.floor[f] = p + 1e-6
            r = self.stage.get(s)
            if r is not None:
                r.decay_toward(ceiling - p - self.common_gib, self.quantum, self.decay)

    def inherit(self, child: tuple, parent: tuple, scale: float = 1.0) -> bool:
        """Plan ``child`` has ``parent``'s layout and knobs with DP scaled: it is judged by
        ``parent``'s own measured underestimate times ``scale`` (1 where DP grows: ZeRO shards and
        per-rank batches only shrink; the ratio of predicted peaks where it shrinks), as long as
        neither ran out of memory. Returns whether it was."""
        own = self.measured.get(parent)
        if own is None or parent in self.struck or child in self.struck:
            return False
        self.measured[child] = max(self.measured.get(child, 0.0), self._up(own * scale))
        return True

    def hungrier(self, key: tuple, peaks: Mapping[str, float]) -> bool:
        """Whether plan ``key``, never run, is predicted at least as hungry (GiB) in a model-stage as
        a config that ran out of memory there (``floor``; any config: need grows with the predicted
        peak), whatever the reserves decayed to (they decay toward what other configs needed). Only
        the failed config running that hungry lifts its floor: another config's clean step says
        nothing of it (underestimates differ between configs)."""
        if key in self.measured or key in self.struck or not self.floor:
            return False
        return any(peaks.get(s, -math.inf) >= f for (s, _), f in self.floor.items())

    def crash_rate(self, key: tuple) -> float:
        """Out-of-memory failures per step of plan ``key`` as measured: strikes / (strikes + clean
        steps since its first OOM + 1); 0 for a plan that never ran out of memory. A decayed reserve says a struck plan
        is predicted to fit again; this says how often it failed where it ran (the controller prices
        it, ``Controller._score``)."""
        k = self.struck.get(key, 0)
        return k / (k + self.since.get(key, self.runs.get(key, 0)) + 1) if k else 0.0

    def to_dict(self) -> dict:
        return {"common_gib": self.common_gib, "stage_gib": {s: self.stage_gib(s) for s in self.stage},
                "plans_measured": len(self.measured), "plans_struck": len(self.struck)}


class MemoryReserve:
    """The memory half of ``Controller`` (its ``memory`` is a ``MemoryReserves``)."""

    def _mem_quantum(self) -> float:
        """The step, in GiB, by which memory reserves are rounded up: 1 GiB, or 1/64 of a GPU's usable
        memory where that is less (a 1 GiB quantum on a device of a few GiB, or the demo's MiB
        budgets, would reserve most of it for any underestimate)."""
        return min(1.0, self.cluster.gpu.usable_bytes / GiB / 64)

    def _judge(self, plan: Plan) -> tuple[float, Mapping[str, float]]:
        return self.memory.judge(plan.key(), (s.name for s in plan.stages))

    def _reserve_for(self, plan: Plan) -> float:
        """Memory held back from every stage of ``plan`` (see ``MemoryReserves.judge``)."""
        return self._judge(plan)[0]

    def _headroom(self, plan: Plan, t) -> float:
        """GiB to spare on the tightest model-stage of ``plan`` other than generation (negative:
        short), its stage reserves included."""
        r, extra = self._judge(plan)
        room = self.cluster.gpu.usable_bytes / GiB - r
        return min(room - g - extra.get(s, 0.0) for s, g in t.peak_mem_gib.items() if s != GENERATION)

    def _fits(self, plan: Plan, t) -> bool:
        """The model's verdict with the plan's reserves, stage reserves included."""
        return (t.feasible and all(map(math.isfinite, t.stage_s.values())) and self._headroom(plan, t) >= 0
                and not self.memory.hungrier(plan.key(), t.peak_mem_gib))

    def _configs(self, plan: Plan) -> dict[str, tuple]:
        """Each model-stage's config key (``library.stage_key``) of ``plan``."""
        return {name: key for name, key, _ in self._stage_info(plan)}

    def _proven(self, plan: Plan, w: Workload, slack: float = 0.05) -> bool:
        """Measurement beats the memory model: ``plan`` already ran without OOM at ``w``'s cap and a
        mean length within ``slack`` of ``w``'s (since its last OOM)."""
        ev = self._ran_ok.get(plan.key())
        return ev is not None and ev[0] == w.response_len_max and w.response_len_mean <= ev[1] * (1 + slack)
