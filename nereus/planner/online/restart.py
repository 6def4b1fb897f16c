"""Restart-mode transitions: what a plan change costs a framework that cannot reshard live (verl,
OpenRLHF), and the launch configuration the decision carries.

Such a job switches plans by saving a checkpoint, stopping, and relaunching with the new launch
configuration: the switch costs

    save (trainable states written) + relaunch (processes, Ray, NCCL) + load (every model's state
    read back) + engine start and warm-up (weights into the inference engine, CUDA-graph capture)

``RestartCost`` holds the figures, each default read off the corpus's restart rows
(``nereus/calibration/published/restart.csv``, ``nereus.fidelity.fit.restart_defaults``: median over
sources of the fit-split rows; ``tests/unit/test_restart_costs.py`` ties each default to its rows),
except ``storage_gbps``, which no row measures (an assumption). A job that has measured its own
relaunch passes ``measured_s``, and the controller's transition calibration scales the prediction by
the restarts it is told about, ``Controller.report_transition``.

Bytes: a trainable model's checkpoint holds bf16 weights, the fp32 master copy and two fp32 Adam
moments (2 + 4 + 4 + 4 = 14 bytes per parameter); a frozen model (reference, reward) is not saved and
is read back as bf16 weights (2 bytes per parameter). Storage: every node writes and reads at its own
bandwidth, all nodes together at most at the storage system's aggregate bandwidth.

Worked example (defaults, Llama-3.1-8B PPO: actor and critic 8.0e9 trainable, reference and reward
8.0e9 frozen, on 16 nodes): save 2 x 8e9 x 14 B = 224 GB at min(16 x 0.4215, 40) = 6.74 GB/s = 33.2 s;
load 224 GB + 2 x 8e9 x 2 B = 256 GB at min(16 x 0.12625, 40) = 2.02 GB/s = 126.7 s; + 174.15 s
relaunch + 47.85 s engine: 381.9 s (the assumed defaults before: 90 s + 60 s, 2 / 4 GB/s per node,
163.4 s). The paper's universal-checkpoint restarts of 8B actor/critic on H200 took 695.9-981.2 s
(held-out rows ``paperuc-001/002``).

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

    write_gbps_per_node: float = 0.4215
    """Checkpoint write bandwidth per node, GB/s: rows ``gcsdf-001/002`` (a ~4 GB FSDP checkpoint
    from one 4 x V100 machine to Google Cloud Storage in 6.37 s with Dataflux, 18.57 s with fsspec,
    GoogleCloudPlatform/gcs-connector-for-pytorch#174; one source: the median of its two). Object
    storage; a parallel file system writes faster."""
    read_gbps_per_node: float = 0.12625
    """Checkpoint read bandwidth per node, GB/s: rows ``gcsdf-003/004`` (the same checkpoint read back
    in 20.23 s / 73.40 s)."""
    storage_gbps: float = 40.0
    """Aggregate bandwidth of the storage system, GB/s (assumption: no corpus row measures it)."""
    relaunch_s: float = 174.15
    """Stopping and relaunching the job (scheduler, Ray, imports, workers, NCCL, model load): row
    ``verl384-001`` (verl + vLLM, Qwen2-7B, 3.7 min from launch to training, Ray spin-up excluded;
    verl-project/verl#384) minus ``engine_start_s``, which that time includes."""
    engine_start_s: float = 47.85
    """Inference engine start and warm-up (process, weights into vLLM, allocator, CUDA-graph capture,
    JIT): rows ``vllmsleep-101/102`` (vLLM 0.11 cold starts on A100, 37.6 s Qwen3-0.6B and 58.1 s
    Phi-3-vision; blog.vllm.ai 2025-10-26 sleep-mode post): their median."""
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
