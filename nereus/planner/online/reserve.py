"""Memory judgement of the controller: the step by which memory reserves are rounded, the reserve
held back when judging a plan (its own measured underestimate once it ran, else the reserve the
calibration learned), and measured evidence that a plan runs at a workload."""
from __future__ import annotations

from nereus.planner.plan import GiB, Plan
from nereus.planner.specs import Workload


class MemoryReserve:
    """The memory half of ``Controller``."""

    def _mem_quantum(self) -> float:
        """The step, in GiB, by which memory reserves are rounded up: 1 GiB, or 1/64 of a GPU's usable
        memory where that is less (a 1 GiB quantum on a device of a few GiB, or the demo's MiB
        budgets, would reserve most of it for any underestimate)."""
        return min(1.0, self.cluster.gpu.usable_bytes / GiB / 64)

    def _reserve_for(self, plan: Plan) -> float:
        """Memory held back when judging ``plan``: its own measured underestimate once it has run
        (a plan that ran out of memory keeps all of it), else the reserve calibration learned."""
        return self._plan_reserve.get(plan.key(), self._reserve)

    def _proven(self, plan: Plan, w: Workload, slack: float = 0.05) -> bool:
        """Measurement beats the memory model: ``plan`` already ran without OOM at ``w``'s cap and a
        mean length within ``slack`` of ``w``'s."""
        ev = self._ran_ok.get(plan.key())
        return ev is not None and ev[0] == w.response_len_max and w.response_len_mean <= ev[1] * (1 + slack)
