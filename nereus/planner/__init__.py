"""Torch-free planning: specs and plans (here), the cost model (``cost/``), the plan solvers
(``solver/``), EMUs and transitions (``transition/``) and online control (``online/``). Importing this package must never import torch (tests/unit/test_imports.py)."""
from nereus.planner.cost.model import StageEstimate, estimate, weight_sync_s
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import (ClusterSpec, GPUSpec, JobSpec, ParallelConfig, Workload, load_cluster,
                                  load_job)

__all__ = ["ClusterSpec", "CostParams", "GPUSpec", "JobSpec", "ParallelConfig", "StageEstimate", "Workload",
           "estimate", "load_cluster", "load_job", "weight_sync_s"]
