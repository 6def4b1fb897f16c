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

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from nereus.errors import NereusError
from nereus.planner.online.types import Decision
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


class RestartMode:
    """The restart-mode half of ``Controller`` (``transition_mode="restart"``)."""

    def _init_restart_mode(self, transition_mode: str, framework: str | None, emitter: Emitter | None,
                           restart_cost: RestartCost | None) -> None:
        """``transition_mode``: "live" (the executor reshards in place, priced by the transition
        planner) or "restart" (the framework saves a checkpoint and relaunches with the new launch
        configuration, priced by ``restart.restart_seconds``; every change of launch configuration,
        knobs included, is a relaunch). ``framework`` (e.g. "verl") with ``emitter`` (the frameworks
        package's ``launch_config``): a restart-mode switch carries the new plan as that framework's
        launch configuration (``Decision.framework_config``); no framework: none."""
        if transition_mode not in TRANSITION_MODES:
            raise NereusError(f"controller: transition_mode must be one of {TRANSITION_MODES}, got {transition_mode!r}")
        if framework is not None and emitter is None:
            raise NereusError(f"controller: framework={framework!r} needs emitter= (the frameworks package's "
                              f"launch_config; the planner does not import the emitters)")
        self.transition_mode, self.framework, self._emitter = transition_mode, framework, emitter
        self.restart_cost = restart_cost or RestartCost()

    def restart_cost_s(self, a: Plan, b: Plan) -> float:
        """Predicted seconds of switching a -> b by checkpoint and relaunch (0 when the launch
        configuration does not change), x the transition calibration learned from reported restarts."""
        if a.key() == b.key():
            return 0.0
        key = (a.layout_key(), b.layout_key())  # the raw estimate, which report_transition calibrates
        c = self._cost.get(key)
        if c is None:
            c = self._cost[key] = restart_seconds(self.job, self.cluster, a, b, self.restart_cost)
        return self.calibration.predict_transition(c)

    def _with_launch_config(self, d: Decision) -> Decision:
        """A restart-mode switch carries the new plan as the framework's launch configuration."""
        if d.action != "switch" or self.transition_mode != "restart" or self.framework is None:
            return d
        from nereus.planner.solver import PlanProblem

        problem = PlanProblem(job=self.job, cluster=self.plans.cluster_for(d.plan.num_gpus), workload=self._ws0,
                              params=self.calibration.params(self.base_params))
        return replace(d, framework_config=dict(self._emitter(self.framework, problem, d.plan)))
