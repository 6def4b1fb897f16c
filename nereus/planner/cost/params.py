"""CostParams: every coefficient calibration may change, in one frozen object, plus the
alpha-beta communication primitives that use them.

Defaults are the efficiency anchors of shared/reference/COST_MODEL.md: training MFU 38-55%
(we take 0.45), prefill 50-70% (0.60), HBM 80-90% (0.85), NVLink all-reduce ~81% of peak,
inter-node p2p ~72% of 50 GB/s, all-reduce latency floor 30-40 us, p2p 5-8 us.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, read_json

STAGES = ("generation", "inference", "training")


@dataclass(frozen=True, slots=True, kw_only=True)
class CostParams:
    mfu_train: float = 0.45
    """Achieved fraction of bf16 peak in training matmuls."""
    mfu_prefill: float = 0.60
    """Achieved fraction of peak in forward passes (prefill, log-prob / value inference)."""
    mfu_decode: float = 0.50
    """Achieved fraction of peak in the compute-bound part of a decode step."""
    matmul_half_flops: float = 0.0
    """Size-dependent matmul efficiency: eff(x) = mfu * x / (x + half) for x FLOPs per GPU per
    kernel call (0 disables; fitted by calibration on small devices)."""
    hbm_eff: float = 0.85
    """Achieved fraction of HBM bandwidth in memory-bound decode."""
    intra_link_eff: float = 0.80
    """Achieved fraction of NVLink bandwidth (bus bandwidth) for large messages."""
    inter_link_eff: float = 0.72
    """Achieved fraction of scale-out bandwidth."""
    allreduce_latency_s: float = 30e-6
    """alpha of one all-reduce hop."""
    p2p_latency_s: float = 8e-6
    """alpha of one point-to-point message."""
    decode_step_overhead_s: float = 1.5e-3
    """Scheduler / kernel-launch overhead of one decode step of an inference engine."""
    kv_mem_util: float = 0.90
    """Fraction of usable GPU memory an inference engine may take (vLLM's default 0.9)."""
    act_coeff_hidden: float = 12.0
    act_coeff_ffn: float = 7.0
    act_coeff_kv: float = 4.0
    """Training activation bytes per token per layer = (12 h + 7 f + 4 g d) / tp (with sequence
    parallelism): about 150 KB for Llama-3.1-8B."""
    act_bytes_replicated: float = 0.0
    act_bytes_sharded: float = 0.0
    """Measured activation bytes per token per layer, the part TP does not split and the part it
    does (an executor without sequence parallelism replicates norm inputs and the residual).
    When either is > 0 they replace the coefficient formula above (see ``act_bytes_per_token``)."""
    logits_bytes: float = 4.0
    """Bytes per logit (fp32)."""
    logits_copies_train: float = 2.0
    """Logits plus their gradient in training."""
    workspace_gib: float = 1.0
    """Per-GPU transient workspace of a running stage (allocator, kernels, buffers)."""
    host_link_gbps: float = 25.0
    """GPU <-> host bandwidth for CPU offload of a resident state (PCIe Gen5 x16 effective)."""
    stage_factor: tuple[tuple[str, float], ...] = (("generation", 1.0), ("inference", 1.0), ("training", 1.0))
    """Per-stage multiplicative time correction fitted by calibration."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stage_factor":
                for stage, x in v:
                    if stage not in STAGES or not x > 0:
                        raise SpecError(f"cost params: stage_factor {stage}={x} invalid")
                continue
            if not isinstance(v, (int, float)) or v < 0:
                raise SpecError(f"cost params: {f.name} must be a number >= 0, got {v!r}")
        for f in ("mfu_train", "mfu_prefill", "mfu_decode", "hbm_eff", "intra_link_eff", "inter_link_eff", "kv_mem_util"):
            if not 0 < getattr(self, f) <= 1:
                raise SpecError(f"cost params: {f} must be in (0, 1], got {getattr(self, f)}")

    def factor(self, stage: str) -> float:
        return dict(self.stage_factor).get(stage, 1.0)

    def with_stage_factors(self, **factors: float) -> "CostParams":
        merged = dict(self.stage_factor)
        merged.update(factors)
        return replace(self, stage_factor=tuple((s, float(merged[s])) for s in STAGES))

    def act_bytes_per_token(self, hidden: int, ffn: int, kv_dim: int, tp: int, dtype_bytes: int = 2) -> float:
        """Training activation bytes per token per layer on one TP rank."""
        if self.act_bytes_replicated > 0 or self.act_bytes_sharded > 0:
            return self.act_bytes_replicated + self.act_bytes_sharded / tp
        coeff = self.act_coeff_hidden * hidden + self.act_coeff_ffn * ffn + self.act_coeff_kv * kv_dim
        return coeff * dtype_bytes / 2 / tp

    def matmul_eff(self, base: float, flops_per_call: float) -> float:
        if self.matmul_half_flops <= 0:
            return base
        return base * flops_per_call / (flops_per_call + self.matmul_half_flops)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stage_factor"] = dict(self.stage_factor)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostParams":
        check_keys("cost params", d, {f.name for f in fields(cls)})
        kw = dict(d)
        if "stage_factor" in kw:
            sf = kw["stage_factor"]
            sf = sf.items() if isinstance(sf, Mapping) else sf
            kw["stage_factor"] = tuple((str(s), float(x)) for s, x in sf)
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> "CostParams":
        """From a profile JSON (``{"params": {...}}``) or a bare params JSON."""
        data = read_json(path, "profile")
        if not isinstance(data, Mapping):
            raise SpecError(f"profile {path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data.get("params", data))


# ---- alpha-beta communication ------------------------------------------------------------------
def allreduce_s(nbytes: float, n: int, bw_bytes_per_s: float, alpha: float) -> float:
    """Ring all-reduce: 2(n-1) alpha + 2(n-1)/n * S/B (Thakur, Rabenseifner, Gropp 2005)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw_bytes_per_s


def allgather_s(nbytes: float, n: int, bw_bytes_per_s: float, alpha: float) -> float:
    """Ring all-gather or reduce-scatter of a total of S bytes: (n-1) alpha + (n-1)/n * S/B."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw_bytes_per_s


def p2p_s(nbytes: float, bw_bytes_per_s: float, alpha: float) -> float:
    if nbytes <= 0:
        return 0.0
    return alpha + nbytes / bw_bytes_per_s
