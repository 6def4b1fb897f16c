"""Global plan solver: TP/PP/DP, micro-batch, ZeRO, recompute and GPU pool of every model-stage.
See README.md for the formulation and the role of each file."""
from nereus.planner.solver.check import evaluate_plan
from nereus.planner.solver.infeasible import explain_infeasible, raise_infeasible
from nereus.planner.solver.problem import (CandidateSettings, PlanConstraints, PlanEvaluation, PlanProblem,
                                           PlanSolution)
from nereus.planner.solver.solve import BACKENDS, solve

__all__ = ["BACKENDS", "CandidateSettings", "PlanConstraints", "PlanEvaluation", "PlanProblem", "PlanSolution",
           "evaluate_plan", "explain_infeasible", "raise_infeasible", "solve"]
