"""verl 0.9.1's dynamic resource scheduling, as the job would run it (the ground truth's model of
that runtime; SIMULATED).

Source: ``verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml``
(``use_dynamic_resource_scheduling``, ``dynamic_schedule_deactivate_ratio: 0.3``,
``dynamic_schedule_enable_rebalance: True``) and its ``dynamic_schedule/default_policy.py``
(``DefaultDynamicSchedulePolicy``), in the installed 0.9.1 wheel. Documented behaviour, reproduced:

- hybrid rollout replicas live (asleep) on the trainer's GPUs; after a weight sync they are
  activated when samples are short: gap = ratio x step_required - (generated - expected) > 0 and
  gap x per-sample time > switch cost (rolling mean of the last 3 activate + deactivate durations,
  10 s before any); per-sample time = this cycle's trainer wait / samples waited on, 1,000 s before
  any (deliberately pessimistic: the first cycle activates);
- before each trainer step, when hybrid replicas are active, the trainer waits (polling every 1 s)
  until ratio x step_required samples are buffered, then deactivates them and trains;
- after each sync the ratio adapts: + clip(waited samples / step_required, 0.02, 0.1) (at most 1)
  when the trainer had to wait for samples, else - 0.02.

Where the config is vague and this reads the code: ``expected_samples`` is the samples the trainer
has consumed so far; the ratio has no lower bound in the code (below 0 the wait is none);
``step_required`` = one batch x ``trigger_parameter_sync_step`` (``sync_every``).
"""
from __future__ import annotations

DEFAULT_SWITCH_THRESHOLD_S = 10.0
SWITCH_OVERHEAD_WINDOW_SIZE = 3
RATIO_INCREASE_MIN, RATIO_INCREASE_MAX, RATIO_DECREASE_STEP = 0.02, 0.1, 0.02
INITIAL_PER_SAMPLE_TIME_S = 1000.0
HYBRID_MEMORY_UTILIZATION = 0.4
"""The config's advice for hybrid replicas ('gpu_memory_utilization should be kept low (e.g. 0.3-0.5)'):
its middle."""


class VerlDefaultDynamic:
    def __init__(self, deactivate_ratio: float = 0.3) -> None:
        self.ratio = deactivate_ratio
        self.switches: list[float] = []
        self.per_sample_s = INITIAL_PER_SAMPLE_TIME_S
        self.history: list[float] = []
        """The ratio after each sync (diagnostics)."""

    def should_deactivate(self, step: int, active: bool, ctx) -> bool:
        return active

    def deactivate_wait_samples(self, ctx) -> int:
        return int(ctx.step_required_samples * self.ratio)

    def _gap(self, ctx) -> float:
        return self.ratio * ctx.step_required_samples - (ctx.total_generated_samples - ctx.expected_samples)

    def should_activate_after_step(self, step: int, active: bool, ctx) -> bool:
        if self._gap(ctx) <= 0:
            return False
        wait, waited = sum(ctx.step_wait_times), sum(ctx.step_wait_samples)
        if wait > 0 and waited > 0:
            self.per_sample_s = wait / waited
        recent = self.switches[-SWITCH_OVERHEAD_WINDOW_SIZE:]
        cost = sum(recent) / len(recent) if recent else DEFAULT_SWITCH_THRESHOLD_S
        return max(0.0, self._gap(ctx)) * self.per_sample_s - cost > 0

    def update_after_step(self, step: int, ctx) -> None:
        if step <= 0:
            return
        overhead = ctx.last_activate_duration_s + ctx.last_deactivate_duration_s
        if overhead > 0:
            self.switches.append(overhead)
        waited = sum(ctx.step_wait_samples)
        if waited > 0:
            req = ctx.step_required_samples
            delta = min(RATIO_INCREASE_MAX, max(RATIO_INCREASE_MIN, waited / req if req else RATIO_INCREASE_MAX))
            self.ratio = min(1.0, self.ratio + delta)
        else:
            self.ratio -= RATIO_DECREASE_STEP
        self.history.append(self.ratio)
