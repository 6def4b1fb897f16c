"""Transition cost used when ``PlanProblem.transition_cost`` is not given: the transition planner's
bandwidth bound (``nereus.planner.transition.build.transition_cost``), or, where it cannot size the move
(e.g. the plans span different GPU counts), bytes of every re-laid-out model state over the
scale-out bandwidth of the smaller of the two pools."""
from __future__ import annotations

from typing import Callable

from nereus.errors import NereusError
from nereus.planner.plan import Plan
from nereus.planner.solver.problem import PlanProblem
from nereus.planner.specs import TRAINABLE


def bytes_over_bandwidth(problem: PlanProblem, old: Plan, new: Plan) -> float:
    c, p = problem.cluster, problem.params
    bw = c.gpu.inter_node_gbps * 1e9 * p.inter_link_eff
    total = 0.0
    for role in problem.job.roles:
        a, b = old.home(role), new.home(role)
        if (a.first_gpu, a.gpus, a.config.tp, a.config.pp, a.config.dp, a.config.zero) == \
           (b.first_gpu, b.gpus, b.config.tp, b.config.pp, b.config.dp, b.config.zero):
            continue
        nbytes = (16 if role in TRAINABLE else 2) * problem.job.model(role).num_params()
        total += nbytes / (min(a.gpus, b.gpus) * bw)
    return total


def default_transition_cost(problem: PlanProblem) -> Callable[[Plan, Plan], float]:
    def cost(old: Plan, new: Plan) -> float:
        try:
            from nereus.planner.transition.build import transition_cost

            return float(transition_cost(old, new, problem.cluster, problem.job))
        except (ImportError, NereusError):
            return bytes_over_bandwidth(problem, old, new)

    return cost
