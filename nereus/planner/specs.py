"""Specs: ClusterSpec, JobSpec, Workload, ParallelConfig. Frozen, validated, JSON/YAML round-trip.

These file formats are a public contract (see README "File formats"): fields are added, never
renamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import yaml

from nereus.errors import SpecError
from nereus.jsonio import check_keys, naming, number, one_line, read_text
from nereus.models.spec import ModelSpec, load_model

GiB = 1024**3
MAX_GPUS = 1 << 20
"""Most GPUs a cluster spec may hold (1,048,576: several times the largest cluster built). Past it
the planner's per-GPU work (pools, transition regions) stops answering in seconds, and 10^9 nodes is
a typo, not a cluster."""


class Stage(str, Enum):
    GENERATION = "generation"
    INFERENCE = "inference"
    TRAINING = "training"


ROLES = ("actor", "critic", "ref", "reward")
TRAINABLE = frozenset({"actor", "critic"})


def _positive(owner: str, name: str, v: Any, *, allow_zero: bool = False, real: bool = False) -> None:
    """A finite number > 0 (>= 0 with ``allow_zero``), a whole one unless ``real``; never a bool."""
    number(owner, name, v, whole=not real, minimum=0, allow_min=allow_zero)


# ------------------------------------------------------------------------------------------------
# Cluster
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# Job
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class BatchSpec:
    prompts: int
    samples_per_prompt: int = 1
    ppo_epochs: int = 1
    mini_batches: int = 1

    def __post_init__(self) -> None:
        for f in ("prompts", "samples_per_prompt", "ppo_epochs", "mini_batches"):
            _positive("batch", f, getattr(self, f))
        if self.mini_batches > self.sequences:
            raise SpecError(f"batch: mini_batches({self.mini_batches}) > sequences({self.sequences})")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceSpec:
    prompt_len: int
    response_len_mean: float
    response_len_max: int
    response_len_p90: float | None = None
    padded: bool = False
    """Training and log-prob micro-batches are padded to the step's longest sequence (no
    remove-padding / packing, as in Nereus's reference executor): activations scale with
    micro_batch x (prompt + longest response) instead of the tokens actually there."""

    def __post_init__(self) -> None:
        if not isinstance(self.padded, bool):
            raise SpecError(f"sequence: padded must be true or false, got {self.padded!r}")
        _positive("sequence", "prompt_len", self.prompt_len)
        _positive("sequence", "response_len_mean", self.response_len_mean, real=True)
        _positive("sequence", "response_len_max", self.response_len_max)
        if self.response_len_mean > self.response_len_max:
            raise SpecError(
                f"sequence: response_len_mean({self.response_len_mean}) > response_len_max({self.response_len_max})"
            )
        if self.response_len_p90 is not None:
            _positive("sequence", "response_len_p90", self.response_len_p90, real=True)
            if not self.response_len_p90 <= self.response_len_max:
                raise SpecError(
                    f"sequence: response_len_p90({self.response_len_p90}) > response_len_max({self.response_len_max})"
                )


ENGINES = ("vllm", "vllm-v0", "sglang", "tensorrt-llm", "static")
"""Continuous-batching engines (``vllm``: vLLM's V1 engine, the default from vLLM 0.8.0;
``vllm-v0``: its V0 engine, every release before 0.8.0 and ``VLLM_USE_V1=0`` or a V1 fall-back
after, whose scheduler, input preparation, sampling and output processing run in Python between
the GPU's iterations), and ``static``: a static-batch generator (Hugging Face ``generate``,
Nereus's reference executor) in which every sequence keeps its slot and KV until the batch's
longest response ends."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutSpec:
    """The generation engine, as a job configures it (verl's ``actor_rollout_ref.rollout``)."""

    engine: str = "vllm"
    """vllm (V1) | vllm-v0 | sglang | tensorrt-llm (continuous batching; per-iteration overheads
    fitted per engine) | static (static batching)."""
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory the engine may take (weights + KV + workspace); None: the profile's
    ``kv_mem_util`` (vLLM's default 0.9)."""
    max_num_seqs: int = 256
    """Most sequences one engine runs at once (vLLM's default 256); the rest wait."""
    sleep: bool = True
    """Colocated engines sleep between rollouts (weights to host, KV freed) and wake up each step."""
    enforce_eager: bool = False
    """The engine runs without CUDA graphs (vLLM ``enforce_eager``, SGLang ``--disable-cuda-graph``;
    verl's rollout default was ``enforce_eager=True`` in its early releases): every decode iteration
    launches its kernels from Python, ``CostParams.eager_layer_cpu_s`` per layer, which a small
    model's GPU time cannot hide."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise SpecError(f"rollout: engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.gpu_memory_utilization is not None:
            _positive("rollout", "gpu_memory_utilization", self.gpu_memory_utilization, real=True)
            if self.gpu_memory_utilization > 1:
                raise SpecError(f"rollout: gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _positive("rollout", "max_num_seqs", self.max_num_seqs)
        if not isinstance(self.sleep, bool):
            raise SpecError(f"rollout: sleep must be true or false, got {self.sleep!r}")
        if not isinstance(self.enforce_eager, bool):
            raise SpecError(f"rollout: enforce_eager must be true or false, got {self.enforce_eager!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@lru_cache(maxsize=64)
def _phases(roles: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """``JobSpec.phases`` of a job with ``roles`` (memoised: the solver and controller ask often)."""
    exp = ["actor/inference"]
    if "ref" in roles:
        exp.append("ref/inference")
    if "critic" in roles:
        exp.append("critic/inference")
    if "reward" in roles:
        exp.append("reward/inference")
    train = ["actor/training"] + (["critic/training"] if "critic" in roles else [])
    return (("actor/generation",), tuple(exp), tuple(train))


@lru_cache(maxsize=64)
def _model_stages(roles: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(ms for phase in _phases(roles) for ms in phase)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    algorithm: str
    models: tuple[tuple[str, ModelSpec], ...]
    """(role, model) pairs in ROLES order; a missing reward means a rule-based reward, a missing
    ref a job without a KL term (a common verl set-up)."""
    batch: BatchSpec
    sequence: SequenceSpec
    rollout: RolloutSpec = field(default_factory=RolloutSpec)

    def __post_init__(self) -> None:
        if self.algorithm not in ("ppo", "grpo"):
            raise SpecError(f"job: algorithm must be 'ppo' or 'grpo', got {self.algorithm!r}")
        roles = [r for r, _ in self.models]
        for r in roles:
            if r not in ROLES:
                raise SpecError(f"job: unknown model role {r!r}; roles are {list(ROLES)}")
        if "actor" not in roles:
            raise SpecError("job: models.actor is required")
        if self.algorithm == "ppo" and "critic" not in roles:
            raise SpecError("job: ppo needs models.critic (use algorithm: grpo for a critic-free job)")
        if self.algorithm == "grpo" and "critic" in roles:
            raise SpecError("job: grpo has no critic; remove models.critic or use algorithm: ppo")
        if self.algorithm == "grpo" and self.batch.samples_per_prompt < 2:
            raise SpecError(f"job: grpo needs samples_per_prompt >= 2, got {self.batch.samples_per_prompt}")

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.models)

    def model(self, role: str) -> ModelSpec:
        for r, m in self.models:
            if r == role:
                return m
        raise SpecError(f"job has no model {role!r} (roles: {list(self.roles)})")

    def model_stages(self) -> tuple[str, ...]:
        """Every model-stage of one RL step, in phase order."""
        return _model_stages(self.roles)

    def phases(self) -> tuple[tuple[str, ...], ...]:
        """Model-stages that may run at the same time: generation, experience preparation, training."""
        return _phases(self.roles)

    def workload(self) -> "Workload":
        s = self.sequence
        return Workload(
            sequences=self.batch.sequences, prompt_len=s.prompt_len, response_len_mean=s.response_len_mean,
            response_len_max=s.response_len_max, response_len_p90=s.response_len_p90,
        )

    def to_dict(self) -> dict[str, Any]:
        s = self.sequence
        seq: dict[str, Any] = {"prompt_len": s.prompt_len, "response_len_mean": s.response_len_mean,
                               "response_len_max": s.response_len_max}
        if s.response_len_p90 is not None:
            seq["response_len_p90"] = s.response_len_p90
        if s.padded:
            seq["padded"] = True
        b = self.batch
        return {
            "algorithm": self.algorithm,
            "models": {r: m.to_dict() for r, m in self.models},
            "batch": {"prompts": b.prompts, "samples_per_prompt": b.samples_per_prompt,
                      "ppo_epochs": b.ppo_epochs, "mini_batches": b.mini_batches},
            "sequence": seq,
            **({"rollout": self.rollout.to_dict()} if self.rollout != RolloutSpec() else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: Path | None = None) -> "JobSpec":
        check_keys("job", d, {"algorithm", "models", "batch", "sequence", "rollout"}, ("algorithm", "models", "batch", "sequence"))
        models = d["models"]
        check_keys("job.models", models, set(ROLES))
        pairs = tuple((r, load_model(models[r], base_dir)) for r in ROLES if r in models)
        check_keys("job.batch", d["batch"], {"prompts", "samples_per_prompt", "ppo_epochs", "mini_batches"}, ("prompts",))
        check_keys("job.sequence", d["sequence"],
                    {"prompt_len", "response_len_mean", "response_len_max", "response_len_p90", "padded"},
                    ("prompt_len", "response_len_mean", "response_len_max"))
        rollout = d.get("rollout") or {}
        check_keys("job.rollout", rollout, {f.name for f in fields(RolloutSpec)})
        return cls(algorithm=str(d["algorithm"]).lower(), models=pairs,
                   batch=BatchSpec(**d["batch"]), sequence=SequenceSpec(**d["sequence"]), rollout=RolloutSpec(**rollout))


# ------------------------------------------------------------------------------------------------
# Workload and parallel config
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """What one step processes."""

    sequences: int
    prompt_len: int
    response_len_mean: float
    response_len_max: int
    response_len_p90: float | None = None

    def __post_init__(self) -> None:
        _positive("workload", "sequences", self.sequences)
        _positive("workload", "prompt_len", self.prompt_len)
        _positive("workload", "response_len_mean", self.response_len_mean, real=True)
        _positive("workload", "response_len_max", self.response_len_max)
        if self.response_len_mean > self.response_len_max:
            raise SpecError(
                f"workload: response_len_mean({self.response_len_mean}) > response_len_max({self.response_len_max})"
            )

    @property
    def p90(self) -> float:
        """90th-percentile response length; without data, the exponential-tail estimate."""
        if self.response_len_p90 is not None:
            return float(self.response_len_p90)
        return float(min(self.response_len_max, self.response_len_mean * 2.3026))

    @property
    def tokens(self) -> float:
        return self.sequences * (self.prompt_len + self.response_len_mean)

    @property
    def seq_len_max(self) -> int:
        return self.prompt_len + self.response_len_max

    def with_lengths(self, mean: float | None = None, max_: int | None = None, p90: float | None = None,
                     gpus: int | None = None) -> "Workload":
        new_max = self.response_len_max if max_ is None else int(max_)
        new_mean = self.response_len_mean if mean is None else float(mean)
        return replace(self, response_len_mean=min(new_mean, new_max), response_len_max=new_max,
                       response_len_p90=p90 if p90 is not None else (None if mean is not None else self.response_len_p90))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Workload":
        check_keys("workload", d, {f.name for f in fields(cls)}, ("sequences", "prompt_len", "response_len_mean", "response_len_max"))
        return cls(**d)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    """Sequences per micro-batch (training/inference); ignored by generation."""
    zero: int = 1
    """ZeRO stage of the optimizer state (0, 1, 2, 3); only meaningful for training."""
    recompute: bool = False
    """Full activation recomputation."""
    sp: int = 1
    """Sequence parallelism (DeepSpeed-Ulysses, verl's ``ulysses_sequence_parallel_size``) of a
    training or inference stage: each sequence is split over ``sp`` of the ``dp`` ranks (sp
    divides dp; parameters are laid out as for dp), with all-to-alls around attention."""
    token_budget: int = 0
    """Tokens per micro-batch per GPU (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu``):
    sequences are packed up to this many tokens; 0 = fixed ``micro_batch`` sequences."""
    cp: int = 1
    """Context parallelism (Megatron's ``context_parallel_size``, ring attention) of a training or
    inference stage: each sequence is split over ``cp`` of the ``dp`` ranks (cp divides dp;
    parameters are laid out as for dp, gradients reduced over all of them), and every layer passes
    its key/value chunk around the ring of cp ranks, overlapped with attention. One way of splitting
    sequences at a time: cp and sp are not both above 1."""

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "micro_batch", "sp", "cp"):
            _positive("parallel config", f, getattr(self, f))
        _positive("parallel config", "token_budget", self.token_budget, allow_zero=True)
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3) or not isinstance(self.zero, int):
            raise SpecError(f"parallel config: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if not isinstance(self.recompute, bool):
            raise SpecError(f"parallel config: recompute must be true or false, got {self.recompute!r}")
        if self.dp % self.sp:
            raise SpecError(f"parallel config: sp({self.sp}) must divide dp({self.dp}) (sequence parallel ranks "
                            f"are taken from the data-parallel ones)")
        if self.dp % self.cp:
            raise SpecError(f"parallel config: cp({self.cp}) must divide dp({self.dp}) (context parallel ranks "
                            f"are taken from the data-parallel ones)")
        if self.sp > 1 and self.cp > 1:
            raise SpecError(f"parallel config: sp({self.sp}) and cp({self.cp}) both split sequences; use one of them")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}"

    @property
    def seq_split(self) -> int:
        """Ranks each sequence is split over (Ulysses sp or context-parallel cp)."""
        return self.sp * self.cp

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParallelConfig":
        check_keys("parallel config", d, {f.name for f in fields(cls)})
        return cls(**d)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------
def read_yaml(path: str | Path) -> Any:
    p = Path(path)
    text = read_text(p, "file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).split("\n")[0]
        raise SpecError(f"{p}: malformed YAML{where}: {one_line(problem)}") from None
    except RecursionError:
        raise SpecError(f"{p}: malformed YAML: nested too deeply") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise SpecError(f"{p}: malformed YAML: {str(e).split(':')[0]}") from None
    if not isinstance(data, Mapping):
        raise SpecError(f"{p}: expected a mapping at top level, got {type(data).__name__}")
    return data


def load_cluster(path: str | Path) -> ClusterSpec:
    """The cluster YAML at ``path``; every error is one line naming the file."""
    with naming(path):
        try:
            return ClusterSpec.from_dict(read_yaml(path))
        except TypeError as e:  # wrong field types reaching the dataclass
            raise SpecError(f"{path}: {e}") from None


def load_job(path: str | Path) -> JobSpec:
    """The job YAML at ``path`` (model files it names are read relative to it); every error is one
    line naming the file."""
    with naming(path):
        try:
            return JobSpec.from_dict(read_yaml(path), base_dir=Path(path).parent)
        except TypeError as e:
            raise SpecError(f"{path}: {e}") from None
