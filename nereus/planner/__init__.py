"""Torch-free planning: specs, cost model, plan solvers, EMUs and transition graphs, controller,
simulator. Importing this package must never import torch (tests/unit/test_imports.py)."""
from nereus.planner.cost import StageEstimate, estimate, weight_sync_s
from nereus.planner.cost_params import CostParams
from nereus.planner.specs import (ClusterSpec, GPUSpec, JobSpec, ParallelConfig, Workload, load_cluster,
                                  load_job)

__all__ = ["ClusterSpec", "CostParams", "GPUSpec", "JobSpec", "ParallelConfig", "StageEstimate", "Workload",
           "estimate", "load_cluster", "load_job", "weight_sync_s"]
