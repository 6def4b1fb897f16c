"""Restart-mode transitions: what a plan change costs a framework that cannot reshard live (verl,
OpenRLHF), and the launch configuration the decision carries.

Such a job switches plans by saving a checkpoint, stopping, and relaunching with the new launch
configuration: the switch costs

    save (trainable states written) + relaunch (processes, Ray, NCCL) + load (every model's state
    read back) + engine start and warm-up (weights into the inference engine, CUDA-graph capture)

``RestartCost`` holds the figures, each with a documented default (assumptions, not measurements; a
job that has measured its own relaunch passes ``measured_s``, and the controller's transition
calibration scales the prediction by the restarts it is told about, ``Controller.report_transition``).

Bytes: a trainable model's checkpoint holds bf16 weights, the fp32 master copy and two fp32 Adam
moments (2 + 4 + 4 + 4 = 14 bytes per parameter); a frozen model (reference, reward) is not saved and
is read back as bf16 weights (2 bytes per parameter). Storage: every node writes and reads at its own
bandwidth, all nodes together at most at the storage system's aggregate bandwidth.

Worked example (defaults, Llama-3.1-8B PPO: actor and critic 8.0e9 trainable, reference and reward
8.0e9 frozen, on 16 nodes): save 2 x 8e9 x 14 B = 224 GB at min(16 x 2, 40) = 32 GB/s = 7.0 s; load
224 GB + 2 x 8e9 x 2 B = 256 GB at min(16 x 4, 40) = 40 GB/s = 6.4 s; + 90 s relaunch + 60 s engine:
163.4 s.

The decision of a restart-mode switch carries the new plan as the framework's launch configuration,
so a training loop can relaunch with it. The planner does not import the framework emitters (they
sit above it, beside the CLI commands): the caller hands the controller an ``Emitter``, e.g. the
frameworks package's ``launch_config``, which returns plain data (framework, version, variant,
command, args, the rendered script, and where the framework cannot express the plan, the closest
plan's gaps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from nereus.errors import NereusError
from nereus.planner.plan import Plan
from nereus.planner.specs import TRAINABLE, ClusterSpec, JobSpec

TRANSITION_MODES = ("live", "restart")
Emitter = Callable[[str, Any, Plan], Mapping[str, Any]]
"""``emitter(framework, problem, plan)`` -> the launch configuration of ``plan`` as plain data
(``problem``: a ``PlanProblem`` for the plan's GPUs and the forecast workload)."""
TRAINABLE_CHECKPOINT_BYTES = 14
"""Bytes per parameter of a trainable model's checkpoint: bf16 weights + fp32 master + two fp32 Adam moments."""
FROZEN_LOAD_BYTES = 2
"""Bytes per parameter of a frozen model read back at relaunch (bf16 weights)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartCost:
    """What a checkpoint-and-relaunch switch costs (see the module docstring)."""

    write_gbps_per_node: float = 2.0
    """Checkpoint write bandwidth per node to shared storage, GB/s (assumption: a parallel file system
    client sustains 1-5 GB/s per node)."""
    read_gbps_per_node: float = 4.0
    """Checkpoint read bandwidth per node, GB/s (assumption: reads run about twice as fast as writes)."""
    storage_gbps: float = 40.0
    """Aggregate bandwidth of the storage system, GB/s (assumption: a mid-size Lustre / GPFS / VAST)."""
    relaunch_s: float = 90.0
    """Stopping and relaunching the job: scheduler, Ray cluster, imports, NCCL initialisation (assumption)."""
    engine_start_s: float = 60.0
    """Inference engine start and warm-up: weights into vLLM, KV allocation, CUDA-graph capture (assumption)."""
    measured_s: float | None = None
    """A measured or reported switch time; when given it replaces the formula."""

    def __post_init__(self) -> None:
        for name in ("write_gbps_per_node", "read_gbps_per_node", "storage_gbps"):
            if not getattr(self, name) > 0:
                raise NereusError(f"restart cost: {name} must be > 0, got {getattr(self, name)}")
        for name in ("relaunch_s", "engine_start_s"):
            if not getattr(self, name) >= 0:
                raise NereusError(f"restart cost: {name} must be >= 0, got {getattr(self, name)}")
        if self.measured_s is not None and not self.measured_s >= 0:
            raise NereusError(f"restart cost: measured_s must be >= 0, got {self.measured_s}")


def checkpoint_bytes(job: JobSpec) -> tuple[float, float]:
    """(bytes saved, bytes read back) of one checkpoint-and-relaunch of ``job``."""
    saved = sum(TRAINABLE_CHECKPOINT_BYTES * job.model(r).num_params() for r in job.roles if r in TRAINABLE)
    frozen = sum(FROZEN_LOAD_BYTES * job.model(r).num_params() for r in job.roles if r not in TRAINABLE)
    return float(saved), float(saved + frozen)


def restart_seconds(job: JobSpec, cluster: ClusterSpec, old: Plan, new: Plan, cost: RestartCost) -> float:
    """Seconds of switching ``old`` -> ``new`` by checkpoint and relaunch: the checkpoint written from
    ``old``'s nodes, read back on ``new``'s (whether the launch configuration changed at all is the
    caller's business: this prices a relaunch)."""
    if cost.measured_s is not None:
        return float(cost.measured_s)
    saved, read = checkpoint_bytes(job)
    g = cluster.gpus_per_node

    def nodes(p: Plan) -> int:
        return max(1, -(-p.num_gpus // g))

    write_bps = min(nodes(old) * cost.write_gbps_per_node, cost.storage_gbps) * 1e9
    read_bps = min(nodes(new) * cost.read_gbps_per_node, cost.storage_gbps) * 1e9
    return saved / write_bps + cost.relaunch_s + read / read_bps + cost.engine_start_s
