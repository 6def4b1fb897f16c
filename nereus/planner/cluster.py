"""The hardware a plan runs on: ``GPUSpec`` (memory, peak FLOPs, HBM and link bandwidths of one GPU
type, from a preset or overridden) and ``ClusterSpec`` (nodes x GPUs per node). Frozen, validated,
JSON/YAML round-trip; re-exported by ``specs``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, number

GiB = 1024**3
MAX_GPUS = 1 << 20
"""Most GPUs a cluster spec may hold (1,048,576: several times the largest cluster built). Past it
the planner's per-GPU work (pools, transition regions) stops answering in seconds, and 10^9 nodes is
a typo, not a cluster."""


def _positive(owner: str, name: str, v: Any, *, allow_zero: bool = False, real: bool = False) -> None:
    """A finite number > 0 (>= 0 with ``allow_zero``), a whole one unless ``real``; never a bool."""
    number(owner, name, v, whole=not real, minimum=0, allow_min=allow_zero)


@dataclass(frozen=True, slots=True, kw_only=True)
class GPUSpec:
    """One accelerator type. Bandwidths are per GPU per direction (COST_MODEL.md, Hardware)."""

    name: str
    memory_gib: float
    """HBM capacity in GiB as the vendor counts it (80 GB is taken as 80 GiB of usable budget
    minus ``reserved_gib``)."""
    tflops_bf16: float
    """Dense bf16 peak, TFLOP/s."""
    hbm_tbps: float
    """HBM bandwidth, TB/s."""
    intra_node_gbps: float
    """NVLink bandwidth per GPU per direction, GB/s."""
    inter_node_gbps: float
    """Scale-out (InfiniBand) bandwidth per GPU per direction, GB/s."""
    reserved_gib: float = 2.0
    """Memory kept back for the CUDA context, NCCL buffers and fragmentation."""

    def __post_init__(self) -> None:
        for f in ("memory_gib", "tflops_bf16", "hbm_tbps", "intra_node_gbps", "inter_node_gbps"):
            _positive(f"gpu {self.name!r}", f, getattr(self, f), real=True)
        _positive(f"gpu {self.name!r}", "reserved_gib", self.reserved_gib, allow_zero=True, real=True)
        if self.reserved_gib >= self.memory_gib:
            raise SpecError(f"gpu {self.name!r}: reserved_gib({self.reserved_gib}) >= memory_gib({self.memory_gib})")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * GiB

    @property
    def peak_flops(self) -> float:
        return self.tflops_bf16 * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12


GPU_PRESETS: dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec(name="a100-80gb", memory_gib=80, tflops_bf16=312, hbm_tbps=2.039,
                         intra_node_gbps=300, inter_node_gbps=25),
    "h100-80gb": GPUSpec(name="h100-80gb", memory_gib=80, tflops_bf16=989, hbm_tbps=3.35,
                         intra_node_gbps=450, inter_node_gbps=50),
    "h200": GPUSpec(name="h200", memory_gib=141, tflops_bf16=989, hbm_tbps=4.8,
                    intra_node_gbps=450, inter_node_gbps=50),
    # NVIDIA H20 (China-market Hopper): 148 TFLOP/s bf16 dense, 96 GB HBM3 at 4.0 TB/s, 900 GB/s NVLink
    "h20": GPUSpec(name="h20", memory_gib=96, tflops_bf16=148, hbm_tbps=4.0,
                   intra_node_gbps=450, inter_node_gbps=50),
    # AMD MI300X: 1,307 TFLOP/s bf16 dense, 192 GB HBM3 at 5.3 TB/s, 7 x 64 GB/s Infinity Fabric links
    "mi300x": GPUSpec(name="mi300x", memory_gib=192, tflops_bf16=1307, hbm_tbps=5.3,
                      intra_node_gbps=448, inter_node_gbps=50),
    "a100-40gb": GPUSpec(name="a100-40gb", memory_gib=40, tflops_bf16=312, hbm_tbps=1.555,
                         intra_node_gbps=300, inter_node_gbps=25),
    # export variants: the same chips with NVLink cut to 400 GB/s in both directions together
    "h800": GPUSpec(name="h800", memory_gib=80, tflops_bf16=989, hbm_tbps=3.35,
                    intra_node_gbps=200, inter_node_gbps=50),
    "a800-80gb": GPUSpec(name="a800-80gb", memory_gib=80, tflops_bf16=312, hbm_tbps=2.039,
                         intra_node_gbps=200, inter_node_gbps=25),
    # Blackwell, per GPU from NVIDIA's system datasheets (sparse figures halved to dense): HGX B200
    # 1,440 GB / 8 = 180 GB HBM3e at 8 TB/s, 36 PFLOP/s sparse bf16 / 8 = 2,250 dense; GB200 NVL72
    # 13.4 TB / 72 = 186 GB at 576 TB/s / 72 = 8 TB/s, 360 PFLOP/s sparse / 72 = 2,500 dense (the
    # higher clock of the Grace-coupled part). Fifth-generation NVLink 1.8 TB/s both ways together
    # (900 GB/s per direction; NVL72's NVLink domain is the rack: ``gpus_per_node`` up to 72), one
    # 400 Gb/s ConnectX-7 port per GPU. No fitted profile: the analytic efficiencies apply.
    "b200": GPUSpec(name="b200", memory_gib=180, tflops_bf16=2250, hbm_tbps=8.0,
                    intra_node_gbps=900, inter_node_gbps=50),
    "gb200": GPUSpec(name="gb200", memory_gib=186, tflops_bf16=2500, hbm_tbps=8.0,
                     intra_node_gbps=900, inter_node_gbps=50),
    # L40S: 362 TFLOP/s bf16 dense, 48 GB GDDR6 at 0.864 TB/s, no NVLink (PCIe Gen4 x16)
    "l40s": GPUSpec(name="l40s", memory_gib=48, tflops_bf16=362, hbm_tbps=0.864,
                    intra_node_gbps=32, inter_node_gbps=25),
}
_GPU_OVERRIDES = ("memory_gib", "tflops_bf16", "hbm_tbps", "intra_node_gbps", "inter_node_gbps", "reserved_gib")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _positive("cluster", "nodes", self.nodes)
        _positive("cluster", "gpus_per_node", self.gpus_per_node)
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise SpecError(f"cluster: nodes({self.nodes}) x gpus_per_node({self.gpus_per_node}) = "
                            f"{self.nodes * self.gpus_per_node} GPUs; at most {MAX_GPUS} are supported")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def spans_nodes(self, first_gpu: int, count: int) -> bool:
        return self.node_of(first_gpu) != self.node_of(first_gpu + count - 1)

    def with_gpus(self, gpus: int) -> "ClusterSpec":
        """The same cluster resized to ``gpus`` GPUs (whole nodes, or one partial node)."""
        _positive("cluster", "gpus", gpus)
        if gpus < self.gpus_per_node:
            return replace(self, nodes=1, gpus_per_node=gpus)
        if gpus % self.gpus_per_node:
            raise SpecError(f"gpus({gpus}) is not a multiple of gpus_per_node({self.gpus_per_node})")
        return replace(self, nodes=gpus // self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        preset = GPU_PRESETS.get(self.gpu.name)
        out: dict[str, Any] = {"gpu": self.gpu.name, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node}
        for k in _GPU_OVERRIDES:
            v = getattr(self.gpu, k)
            if preset is None or getattr(preset, k) != v:
                out[k] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterSpec":
        check_keys("cluster", d, {"gpu", "nodes", "gpus_per_node", *_GPU_OVERRIDES}, ("gpu", "nodes"))
        name = str(d["gpu"])
        overrides = {k: d[k] for k in _GPU_OVERRIDES if k in d}
        base = GPU_PRESETS.get(name.lower())
        if base is None:
            missing = [k for k in _GPU_OVERRIDES[:5] if k not in overrides]
            if missing:
                raise SpecError(
                    f"cluster: unknown gpu preset {name!r} (known: {', '.join(GPU_PRESETS)}); "
                    f"a custom gpu needs {missing}"
                )
            gpu = GPUSpec(name=name, **overrides)
        else:
            gpu = replace(base, **overrides) if overrides else base
        return cls(gpu=gpu, nodes=d["nodes"], gpus_per_node=d.get("gpus_per_node", 8))
