"""A job's schedule: synchronous steps, or rollout and training overlapped on disjoint GPU pools.

- ``sync``: one step's phases run one after another (colocated, hybrid or disaggregated pools).
  Step time = generation + experience preparation + training (phase makespans) + weight sync.
- ``one_step_off``: the rollout pool generates the batch of step k+1 while the trainer pool runs
  experience preparation and training of step k (staleness 1: verl's one-step-off policy).
  Both wait for the weight sync at the end of each step, which cannot overlap:
  step = max(rollout, trainer) + sync.
- ``fully_async``: the rollout streams responses (new prompts enter as others finish, so the
  rollout is bound by its throughput, not by the longest response of a batch), the trainer takes
  a batch whenever one is ready, and weights are synced every ``sync_every`` trainer steps, within
  the user's ``staleness`` bound. In-flight responses are paused at a sync and resumed under the
  new weights (partial rollouts), whose contexts are prefilled again (priced by the cost model's
  generation estimate). step = max(rollout, trainer) + sync / sync_every.

Where the gain comes from (the cost model prices each; nothing here is a constant): with
perfectly linear scaling a balanced split gains nothing over ``sync``, since the same GPU-seconds
are spent either way. It comes from (1) the rollout's tail, which more data parallelism does not
shorten (the longest response sets the makespan), overlapped with training instead of idling the
trainer's GPUs; under ``fully_async`` streaming removes it; (2) a dedicated rollout pool never
sleeps its engine, so it pays no wake-up, sleep or KV re-creation per step; (3) each pool holds
only its own models' memory. Against that: the sync crosses pools (scale-out links, not the
local copy a colocated engine gets), and each side idles when the other is slower.

Worked example (the test ``test_async_step_time_worked_example`` checks it). Phase makespans
(rollout 60 s, experience 10 s, training 30 s) and a 4 s weight sync:
  sync:          60 + 10 + 30 + 4 = 104 s
  one_step_off:  max(60, 10 + 30) + 4 = 64 s; trainer idle (60 - 40) / 60 = 33% of the step
  fully_async (sync_every 2): max(60, 40) + 4 / 2 = 62 s
(on the same pools; a real async plan has its own split, which the solver chooses.)

Staleness is the user's bound, never raised by the planner: ``sync`` has 0; ``one_step_off``
needs >= 1; ``fully_async`` needs >= 1 and ``sync_every`` <= staleness. ``auto`` lets the solver
choose among the schedules the bound admits (only ``sync`` with staleness 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from nereus.errors import SpecError
from nereus.jsonio import check_keys, number

SCHEDULES = ("sync", "one_step_off", "fully_async")
"""The schedules a plan can have."""
CHOICES = ("auto", *SCHEDULES)
"""What a job may ask for (``auto``: the solver chooses)."""
ROLLOUT, TRAINER = "rollout", "trainer"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    kind: str = "sync"
    """``auto``, ``sync``, ``one_step_off`` or ``fully_async``."""
    staleness: int = -1
    """Most policy versions between the weights a response was generated with and the weights that
    train on it. -1 (unset): 0 for sync, 1 for the others and for auto."""
    sync_every: int = 1
    """fully_async: trainer steps between weight syncs (<= staleness)."""

    def __post_init__(self) -> None:
        if self.kind not in CHOICES:
            raise SpecError(f"job.schedule: must be one of {list(CHOICES)}, got {self.kind!r}")
        if self.staleness != -1:
            number("job.schedule", "staleness", self.staleness, whole=True, minimum=0, allow_min=True)
        number("job.schedule", "sync_every", self.sync_every, whole=True, minimum=1, allow_min=True)
        s = self.bound
        if self.kind in ("one_step_off", "fully_async") and s < 1:
            raise SpecError(f"job.schedule: {self.kind} needs staleness >= 1, got {s}")
        if self.kind == "one_step_off" and self.sync_every != 1:
            raise SpecError(f"job.schedule: one_step_off syncs every step (sync_every 1), got {self.sync_every}")
        if self.kind in ("fully_async", "auto") and self.sync_every > max(1, s):
            raise SpecError(f"job.schedule: sync_every({self.sync_every}) > staleness({s}): responses would "
                            f"be trained on weights more than {s} versions old")

    @property
    def bound(self) -> int:
        """The staleness bound in force."""
        if self.staleness != -1:
            return self.staleness
        return 0 if self.kind == "sync" else 1

    @property
    def is_async(self) -> bool:
        return self.kind in ("one_step_off", "fully_async")

    def candidates(self) -> tuple[str, ...]:
        """The schedules the solver may choose from."""
        if self.kind != "auto":
            return (self.kind,)
        return SCHEDULES if self.bound >= 1 else ("sync",)

    def fixed(self, kind: str) -> "ScheduleSpec":
        """This spec with the schedule decided (``auto`` resolved to ``kind``)."""
        if kind not in self.candidates():
            raise SpecError(f"job.schedule: {kind} is not allowed by {self.kind} with staleness {self.bound}")
        sync_every = self.sync_every if kind == "fully_async" else 1
        return ScheduleSpec(kind=kind, staleness=self.bound if kind != "sync" else 0, sync_every=sync_every)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.staleness != -1:
            out["staleness"] = self.staleness
        if self.sync_every != 1:
            out["sync_every"] = self.sync_every
        return out

    @classmethod
    def from_value(cls, v: Any) -> "ScheduleSpec":
        """``schedule: one_step_off`` or ``schedule: {kind: fully_async, staleness: 2, sync_every: 2}``."""
        if isinstance(v, str):
            return cls(kind=v)
        if not isinstance(v, Mapping):
            raise SpecError(f"job.schedule: expected a name {list(CHOICES)} or a mapping, got {type(v).__name__}")
        check_keys("job.schedule", v, {"kind", "staleness", "sync_every"}, ("kind",))
        return cls(**dict(v))


def step_time(schedule: ScheduleSpec, makespans: Sequence[float], sync_s: float) -> float:
    """Steady-state seconds per step from the phase makespans (generation first) and the weight
    sync (see the module docstring)."""
    if not schedule.is_async:
        return sum(makespans) + sync_s
    rollout, trainer = makespans[0], sum(makespans[1:])
    return max(rollout, trainer) + sync_s / (schedule.sync_every if schedule.kind == "fully_async" else 1)


def idle_shares(schedule: ScheduleSpec, makespans: Sequence[float], sync_s: float) -> dict[str, float]:
    """Share of a step each pool of an async plan waits on the other (verl's idle-ratio metrics)."""
    if not schedule.is_async:
        return {}
    step = step_time(schedule, makespans, sync_s)
    rollout, trainer = makespans[0], sum(makespans[1:])
    stall = step - max(rollout, trainer)
    return {ROLLOUT: (step - rollout - stall) / step if step > 0 else 0.0,
            TRAINER: (step - trainer - stall) / step if step > 0 else 0.0}
