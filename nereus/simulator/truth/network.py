"""The ground truth's links: per-step weight sync and engine wake/sleep, transitions, restarts.

Links: a GPU's NVLink port reaches the bus bandwidth the intra-node all-reduce table shows at 1 GiB
(capped by the GPU's NVLink bandwidth); its scale-out port reaches ``INTER_EFF`` of the cluster's
per-GPU scale-out bandwidth; each message pays the table's small-message latency (8-GPU all-reduce
of 8 bytes inside a node, 2-node all-reduce across nodes: an upper bound of a p2p's latency).

Transitions: the transition planner's transfers (source GPU, destination GPU, bytes), in the
planner's order, replayed on those links with contention: a transfer starts when both the sender's
send port and the receiver's receive port are free (local copies use the GPU's copy engine at half
its HBM bandwidth). On top: rebuilding the communicators of changed groups (``COMM_REBUILD_S``) and,
when the generation layout changes, starting a new inference engine (``ENGINE_START_S``).

Restart-mode switches (a framework that cannot reshard live): a checkpoint written
(``checkpoint_save_s``) and a relaunch on the new layout (``restart_s``).

Every constant without a corpus row is an assumption and says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from nereus.planner.specs import ClusterSpec
from nereus.simulator.truth.corpus import Tables

INTER_EFF = 0.80
"""Assumption: achieved fraction of a GPU's scale-out bandwidth by a large p2p transfer."""
HOST_LINK_BPS = 25e9
"""Assumption: GPU <-> host copy bandwidth (PCIe Gen5 x16, effective)."""
ENGINE_START_S = 40.0
"""Assumption: starting an inference engine with a new layout (process group, weight load into the
engine, CUDA-graph capture); vLLM start-ups of 7-70B models take tens of seconds."""
COMM_REBUILD_S = 2.0
"""Assumption: building the NCCL communicators of a changed layout."""
PROCESS_START_S = 60.0
"""Assumption: relaunching the job's processes after a crash (scheduler, imports, NCCL init)."""
CHECKPOINT_BPS_PER_NODE = 2e9
"""Assumption: checkpoint read bandwidth per node from shared storage."""
CHECKPOINT_WRITE_BPS_PER_NODE = 1e9
"""Assumption: checkpoint write bandwidth per node to shared storage (writes run slower than reads)."""
KV_REALLOC_S = 0.5
"""Assumption: re-allocating the KV cache when a colocated engine wakes up."""


@dataclass(frozen=True)
class Links:
    intra_bps: float
    inter_bps: float
    intra_lat_s: float
    inter_lat_s: float
    copy_bps: float
    gpus_per_node: int

    @classmethod
    def of(cls, cluster: ClusterSpec, tab: Tables) -> "Links":
        size = float(2**30)
        busbw = size * (2 * 7 / 8) / float(tab.allreduce_intra(size))
        return cls(intra_bps=min(busbw, cluster.gpu.intra_node_gbps * 1e9),
                   inter_bps=INTER_EFF * cluster.gpu.inter_node_gbps * 1e9,
                   intra_lat_s=float(tab.allreduce_intra(8.0)), inter_lat_s=float(tab.allreduce_inter(8.0)),
                   copy_bps=tab.hbm_bps / 2, gpus_per_node=cluster.gpus_per_node)

    def transfer_s(self, src: int, dst: int, nbytes: float) -> float:
        if src == dst:
            return nbytes / self.copy_bps
        if src // self.gpus_per_node == dst // self.gpus_per_node:
            return self.intra_lat_s + nbytes / self.intra_bps
        return self.inter_lat_s + nbytes / self.inter_bps


def replay(tasks: Iterable[tuple[int, int, float]], links: Links) -> float:
    """Makespan of ``tasks`` (src, dst, bytes) started in the given order, each as soon as its
    sender's send port and its receiver's receive port (a copy: the GPU's copy engine) are free."""
    send: dict[int, float] = {}
    recv: dict[int, float] = {}
    copy: dict[int, float] = {}
    end = 0.0
    for src, dst, nbytes in tasks:
        dur = links.transfer_s(src, dst, float(nbytes))
        if src == dst:
            t = copy.get(src, 0.0) + dur
            copy[src] = t
        else:
            t = max(send.get(src, 0.0), recv.get(dst, 0.0)) + dur
            send[src] = recv[dst] = t
        end = max(end, t)
    return end


def weight_sync_s(full_bytes: float, train_gpus: int, train_inter: bool, gen_bytes_per_gpu: float,
                  colocated: bool, tab: Tables, links: Links) -> float:
    """Actor weights from the training layout into the engine: an all-gather of the bf16 weights
    over the ``train_gpus`` ranks that shard them, then a local load into the engine's shard
    (colocated) or a broadcast to the engine replicas over the scale-out network (separate pools)."""
    gather = float(tab.allreduce_s(full_bytes, train_gpus, inter=train_inter)) / 2
    if colocated:
        return gather + gen_bytes_per_gpu / links.copy_bps
    return gather + links.inter_lat_s + full_bytes / links.inter_bps


def wake_sleep_s(gen_bytes_per_gpu: float) -> float:
    """A colocated engine each step: weights offloaded to the host and back, KV re-allocated."""
    return 2 * gen_bytes_per_gpu / HOST_LINK_BPS + KV_REALLOC_S


def restart_s(state_bytes_total: float, nodes: int) -> float:
    """A crash: relaunch, read the checkpoint, start the engine."""
    return PROCESS_START_S + state_bytes_total / (max(1, nodes) * CHECKPOINT_BPS_PER_NODE) + ENGINE_START_S


def checkpoint_save_s(state_bytes_saved: float, nodes: int) -> float:
    """Writing a checkpoint before a planned relaunch (restart-mode switch)."""
    return state_bytes_saved / (max(1, nodes) * CHECKPOINT_WRITE_BPS_PER_NODE)


def as_tasks(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> Iterable[tuple[int, int, float]]:
    return zip(src.tolist(), dst.tolist(), nbytes.tolist())
