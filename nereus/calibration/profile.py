"""The versioned calibration profile: hardware description, fitted ``CostParams``, fit quality,
and how / when / where it was measured.

One JSON file is the unit a user passes as ``--profile`` to the cost model, planner, controller
and simulator; ``CostParams.load`` reads its ``params``. The hardware entry is what lets the
analytic model predict a device that is not a GPU preset (the local CPU): :meth:`Hardware.cluster`
builds a ``ClusterSpec`` around it without touching ``GPU_PRESETS``.

Hardware values are nominal where a datasheet figure exists (GPU presets; a CPU's cores x clock x
FLOPs per cycle) and otherwise the fitted asymptote of a measurement (CPU memory copy, gloo
loopback); the efficiencies in ``params`` are relative to them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, naming, number, read_json, write_atomic
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import GPU_PRESETS, MAX_GPUS, ClusterSpec, GPUSpec

PROFILE_VERSION = 1
SHIPPED = ("a100-80gb", "h100-80gb", "h200", "h20", "mi300x", "cpu-local")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    """One device, described the way ``GPUSpec`` describes a GPU."""

    name: str
    """``cpu`` or a GPU preset / device name; becomes ``GPUSpec.name``."""
    device: str = "cuda"
    """``cpu`` or ``cuda``."""
    dtype: str = "bfloat16"
    """Compute dtype the peak refers to."""
    memory_gib: float
    tflops_bf16: float
    """Peak dense TFLOP/s in ``dtype`` (the field keeps GPUSpec's name)."""
    hbm_tbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int = 8
    reserved_gib: float = 2.0
    description: str = ""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, where its value comes from)."""

    def gpu_spec(self) -> GPUSpec:
        return GPUSpec(name=self.name, memory_gib=self.memory_gib, tflops_bf16=self.tflops_bf16,
                       hbm_tbps=self.hbm_tbps, intra_node_gbps=self.intra_node_gbps,
                       inter_node_gbps=self.inter_node_gbps, reserved_gib=self.reserved_gib)

    def cluster(self, nodes: int = 1, gpus_per_node: int | None = None) -> ClusterSpec:
        """A cluster of this device (an explicit override, so ``cpu`` needs no GPU preset)."""
        return ClusterSpec(gpu=self.gpu_spec(), nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["sources"] = dict(self.sources)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Hardware":
        check_keys("profile hardware", d, {f.name for f in fields(cls)})
        kw = dict(d)
        sources = d.get("sources", {})
        if not isinstance(sources, Mapping):
            raise SpecError(f"profile hardware: sources must map field -> where from, got {type(sources).__name__}")
        kw["sources"] = tuple((str(k), str(v)) for k, v in sources.items())
        for k in ("name", "device", "dtype", "description"):
            if k in kw and not isinstance(kw[k], str):
                raise SpecError(f"profile hardware: {k} must be text, got {kw[k]!r}")
        if "gpus_per_node" in kw:
            number("profile hardware", "gpus_per_node", kw["gpus_per_node"], whole=True, minimum=1, maximum=MAX_GPUS)
        try:
            hw = cls(**kw)
            hw.gpu_spec()  # validates the numbers
        except TypeError as e:
            raise SpecError(f"profile hardware: {e}") from None
        return hw

    @classmethod
    def from_preset(cls, gpu: str) -> "Hardware":
        if gpu not in GPU_PRESETS:
            raise SpecError(f"unknown gpu preset {gpu!r}; known: {', '.join(GPU_PRESETS)}")
        g = GPU_PRESETS[gpu]
        return cls(name=g.name, memory_gib=g.memory_gib, tflops_bf16=g.tflops_bf16, hbm_tbps=g.hbm_tbps,
                   intra_node_gbps=g.intra_node_gbps, inter_node_gbps=g.inter_node_gbps,
                   reserved_gib=g.reserved_gib, description=f"{g.name} datasheet (shared/reference/COST_MODEL.md)",
                   sources=(("all", "datasheet"),))


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    version: int = PROFILE_VERSION
    name: str
    hardware: Hardware
    params: CostParams
    fit: Mapping[str, Any] = field(default_factory=dict)
    """Fit quality (JSON): per-curve fits, ``heldout_mape`` {"microbench", "stages"} as fractions,
    held-out error tables. Empty for analytic profiles."""
    how: str = ""
    """The command that produced the profile."""
    when: str = ""
    """UTC ISO time of the measurement."""
    where: Mapping[str, Any] = field(default_factory=dict)
    """Host, torch version, device name, threads."""

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise SpecError(f"profile {self.name!r}: version {self.version} not supported (this build reads "
                            f"{PROFILE_VERSION})")

    @property
    def heldout_mape(self) -> dict[str, float | None]:
        return dict(self.fit.get("heldout_mape", {}))

    def cluster(self, nodes: int = 1, gpus_per_node: int | None = None) -> ClusterSpec:
        return self.hardware.cluster(nodes, gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "name": self.name, "hardware": self.hardware.to_dict(),
                "params": self.params.to_dict(), "fit": dict(self.fit), "how": self.how, "when": self.when,
                "where": dict(self.where)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
        missing = [k for k in ("name", "hardware", "params") if k not in d]
        if missing:
            raise SpecError(f"profile: missing field(s) {missing}")
        unknown = set(d) - {"version", "name", "hardware", "params", "fit", "how", "when", "where"}
        if unknown:
            raise SpecError(f"profile: unknown field(s) {sorted(unknown, key=str)}")
        for k in ("fit", "where"):
            if not isinstance(d.get(k, {}), Mapping):
                raise SpecError(f"profile: {k} must be a mapping, got {type(d[k]).__name__}")
        version = number("profile", "version", d.get("version", PROFILE_VERSION), whole=True)
        return cls(version=version, name=str(d["name"]),
                   hardware=Hardware.from_dict(d["hardware"]), params=CostParams.from_dict(d["params"]),
                   fit=dict(d.get("fit", {})), how=str(d.get("how", "")), when=str(d.get("when", "")),
                   where=dict(d.get("where", {})))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        write_atomic(p, json.dumps(self.to_dict(), indent=2, default=float) + "\n", what="profile")
        return p  # atomic: a reader never sees half a profile


def load_profile(path_or_name: str | Path) -> Profile:
    """A profile from a file, or a shipped one by name (``h200``, ``cpu-local``, ...)."""
    p = Path(path_or_name)
    if not p.exists() and str(path_or_name) in SHIPPED:
        text = resources.files("nereus.calibration").joinpath(f"profiles/{path_or_name}.json").read_text()
        return Profile.from_dict(json.loads(text))
    with naming(p):
        data = read_json(p, "profile", f" (shipped profiles: {', '.join(SHIPPED)})")
        if not isinstance(data, Mapping):
            raise SpecError(f"profile {p}: expected a JSON object, got {type(data).__name__}")
        return Profile.from_dict(data)


def analytic_profile(gpu: str) -> Profile:
    """The uncalibrated profile of a GPU preset: datasheet hardware, COST_MODEL.md anchors."""
    return Profile(name=f"{gpu}-analytic", hardware=Hardware.from_preset(gpu), params=CostParams(),
                   fit={"heldout_mape": {"microbench": None, "stages": None},
                        "note": "analytic defaults (efficiency anchors of shared/reference/COST_MODEL.md); not measured"},
                   how=f"nereus.calibration.profile.analytic_profile({gpu!r})", when=utc_now())


def utc_now() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def estimate_table(profile: Profile | str | Path):
    """The notebook view (nanoGPT ``transformer_sizing`` style): one row per held-out measurement
    with ``estimate | measured | ratio`` (and the uncalibrated estimate beside it)."""
    import pandas as pd

    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    rows = []
    for part in ("microbench", "stages"):
        for r in prof.fit.get(part, {}).get("heldout_table", []):
            rows.append({"part": part, "what": r["what"], "estimate": r["predicted_s"], "measured": r["measured_s"],
                         "ratio": r["predicted_s"] / r["measured_s"], "estimate_uncalibrated": r["analytic_s"],
                         "ratio_uncalibrated": r["analytic_s"] / r["measured_s"]})
    return pd.DataFrame(rows, columns=["part", "what", "estimate", "measured", "ratio", "estimate_uncalibrated",
                                       "ratio_uncalibrated"])
