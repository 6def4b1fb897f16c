"""Restart-mode transitions: what a plan change costs a framework that cannot reshard live (verl,
OpenRLHF), and the launch configuration the decision carries.

Such a job switches plans by saving a checkpoint, stopping, and relaunching with the new launch
configuration: the switch costs

    save (trainable states written) + relaunch (processes, Ray, NCCL) + load (every model's state
    read back) + engine start and warm-up (weights into the inference engine, CUDA-graph capture)

``RestartCost`` holds the figures, each default read off the corpus's restart rows
(``nereus/calibration/published/restart.csv``, ``nereus.fidelity.fit.restart_defaults``: median over
sources of the fit-split rows; ``tests/unit/test_restart_costs.py`` ties each default to its rows).
The checkpoint rates depend on where the checkpoint goes, so they are kept per storage kind
(``STORAGE_DEFAULTS``), never mixed in one median: a shared parallel / distributed file system
(``parallel_fs``: Lustre, GPFS, Weka, VAST, Tectonic), node-local NVMe (``local_nvme``), an
NFS-class NAS (``nfs``) and object storage (``object``). The default kind is ``parallel_fs``, what RL
jobs on GPU clusters checkpoint to: verl saves through filesystem paths, each FSDP rank writing its
shards, with no object-storage backend (verl-project/verl#7641), so a multi-node run needs a shared
file system; AWS's slime/miles GRPO test case on H200 nodes (p5en) saves to FSx for Lustre
(awslabs/awsome-distributed-ai ``3.test_cases/pytorch/miles/docs/VERIFICATION_LOG.md``), as does a
NeMo RL GRPO run (NVIDIA-NeMo/RL#1847). A job that has measured its own relaunch passes
``measured_s``, and the controller's transition calibration scales the prediction by the restarts it
is told about, ``Controller.report_transition``.

Bytes: a trainable model's checkpoint holds bf16 weights, the fp32 master copy and two fp32 Adam
moments (2 + 4 + 4 + 4 = 14 bytes per parameter); a frozen model (reference, reward) is not saved and
is read back as bf16 weights (2 bytes per parameter). Storage: every node writes and reads at its own
bandwidth, all nodes together at most at the storage system's aggregate bandwidth.

Worked example (defaults, Llama-3.1-8B PPO: actor and critic 8.0e9 trainable, reference and reward
8.0e9 frozen, on 16 nodes, ``parallel_fs``): save 2 x 8e9 x 14 B = 224 GB at min(16 x 0.9766, 2000)
= 15.63 GB/s = 14.3 s; load 224 GB + 2 x 8e9 x 2 B = 256 GB at min(16 x 1.429, 2000) = 22.86 GB/s =
11.2 s; + 174.15 s relaunch + 47.85 s engine: 247.5 s (``object``, the one rate source before: 381.9
s; the assumed defaults before that: 163.4 s). The paper's universal-checkpoint restarts of 8B
actor/critic on H200 took 695.9-981.2 s (held-out rows ``paperuc-001/002``; docs/fidelity.md,
restart section, has the check).

The decision of a restart-mode switch carries the new plan as the framework's launch configuration,
so a training loop can relaunch with it. The planner does not import the framework emitters (they
sit above it, beside the CLI commands): the caller hands the controller an ``Emitter``, e.g. the
frameworks package's ``launch_config``, which returns plain data (framework, version, variant,
command, args, the rendered script, and where the framework cannot express the plan, the closest
plan's gaps).
"""
from __future__ import annotations

import math
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
STORAGE_KINDS = ("parallel_fs", "local_nvme", "nfs", "object")
"""Where a checkpoint is written: a shared parallel / distributed file system, node-local NVMe (the
checkpoint stays on each node, so this prices a relaunch on the same nodes), an NFS-class NAS, object
storage."""
DEFAULT_STORAGE = "parallel_fs"
"""What RL jobs on GPU clusters checkpoint to (module docstring: verl#7641, the AWS miles test case on
H200 nodes, NeMo RL#1847)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageRates:
    """Checkpoint bandwidths of one storage kind, GB/s."""

    write_gbps_per_node: float
    read_gbps_per_node: float
    storage_gbps: float
    """Aggregate bandwidth of the storage system (all nodes together)."""


STORAGE_DEFAULTS: Mapping[str, StorageRates] = {
    # write: llama3-001, 2 TB/s sustained (Llama 3 paper, section 3.3.1) / 2,048 nodes of 8 H100;
    # read: lumi18-001, 2 GB per node read in 1.4 s on 16 LUMI nodes (Lustre flash, LUMI-AI-Guide#18);
    # aggregate: llama3-002, the same 2 TB/s (a 16K-GPU fabric: a smaller cluster passes its own)
    "parallel_fs": StorageRates(write_gbps_per_node=0.9766, read_gbps_per_node=1.429, storage_gbps=2000.0),
    # write: miles1225-001, 53 GB in 8.3 s from one B300 node to node-local disk (awsome-distributed-ai#1225);
    # read: no row, read at the write rate; aggregate: nothing is shared
    "local_nvme": StorageRates(write_gbps_per_node=6.386, read_gbps_per_node=6.386, storage_gbps=math.inf),
    # dlrover-001..005: Megatron-LM GPT-1.5B on 2 x 8 A100 to an Aliyun NAS, 18 / 24 GB saved in 151 / 242 s,
    # loaded in 205 / 242 s; aggregate: the NAS's stated 100 MB/s (DLRover Flash Checkpoint blog)
    "nfs": StorageRates(write_gbps_per_node=0.1092, read_gbps_per_node=0.0935, storage_gbps=0.1),
    # gcsdf-001..004: a ~4 GB FSDP checkpoint from one 4 x V100 machine to GCS, saved in 6.37 / 18.57 s,
    # loaded in 20.23 / 73.40 s (gcs-connector-for-pytorch#174); aggregate: no row, 40 GB/s assumed
    "object": StorageRates(write_gbps_per_node=0.4215, read_gbps_per_node=0.12625, storage_gbps=40.0),
}
"""Each kind's defaults, read off the restart rows of that kind (``tests/unit/test_restart_costs.py``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartCost:
    """What a checkpoint-and-relaunch switch costs (see the module docstring)."""

    storage: str = DEFAULT_STORAGE
    """Where the checkpoint goes, one of ``STORAGE_KINDS``: picks the bandwidths left unset."""
    write_gbps_per_node: float | None = None
    """Checkpoint write bandwidth per node, GB/s; None: the storage kind's (``STORAGE_DEFAULTS``)."""
    read_gbps_per_node: float | None = None
    """Checkpoint read bandwidth per node, GB/s; None: the storage kind's."""
    storage_gbps: float | None = None
    """Aggregate bandwidth of the storage system, GB/s; None: the storage kind's."""
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
        if self.storage not in STORAGE_DEFAULTS:
            raise NereusError(f"restart cost: storage must be one of {STORAGE_KINDS}, got {self.storage!r}")
        kind = STORAGE_DEFAULTS[self.storage]
        for name in ("write_gbps_per_node", "read_gbps_per_node", "storage_gbps"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(kind, name))
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
