"""Default transition cost until the transition planner is wired in: bytes of every model state
whose layout changes, over the scale-out bandwidth of the smaller of the two pools."""
from __future__ import annotations

from typing import Callable

from nereus.planner.plan import HOME_STAGE, Plan
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.specs import TRAINABLE


def default_transition_cost(problem: PlanProblem) -> Callable[[Plan, Plan], float]:
    c, p = problem.cluster, problem.params
    bw = c.gpu.inter_node_gbps * 1e9 * p.inter_link_eff

    def cost(old: Plan, new: Plan) -> float:
        total = 0.0
        for role in problem.job.roles:
            a, b = old.home(role), new.home(role)
            if (a.first_gpu, a.gpus, a.config.tp, a.config.pp, a.config.dp, a.config.zero) == \
               (b.first_gpu, b.gpus, b.config.tp, b.config.pp, b.config.dp, b.config.zero):
                continue
            nbytes = (16 if role in TRAINABLE else 2) * problem.job.model(role).num_params()
            total += nbytes / (min(a.gpus, b.gpus) * bw)
        return total

    return cost
