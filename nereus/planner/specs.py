"""Specs: JobSpec, Workload, ParallelConfig; ClusterSpec and GPUSpec (from ``cluster.py``) re-exported.
Frozen, validated, JSON/YAML round-trip.

These file formats are a public contract (see README "File formats"): fields are added, never
renamed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

from nereus.errors import SpecError
from nereus.jsonio import MAX_WHOLE as _MAX_WHOLE, check_keys, naming, number, one_line, read_text
from nereus.models.spec import ModelSpec, load_model
from nereus.planner.cluster import GPU_PRESETS, MAX_GPUS, ClusterSpec, GPUSpec, _positive  # noqa: F401 (re-exported)
from nereus.planner.schedules import ScheduleSpec

GiB = 1024**3


class Stage(str, Enum):
    GENERATION = "generation"
    INFERENCE = "inference"
    TRAINING = "training"


ROLES = ("actor", "critic", "ref", "reward")
TRAINABLE = frozenset({"actor", "critic"})




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
    response_len_prompt_corr: float = 0.0
    """How strongly the lengths of one prompt's responses go together: the intraclass correlation of
    a step's response lengths grouped by prompt (``adapters.prompt_length_correlation``), 0 =
    independent. Micro-batches hold a prompt's adjacent samples, so it sets the longest micro-batch.
    Measure it from a logged batch (verl: ``response_length`` grouped by ``uid``); the online
    controller measures it from ``StepMetrics.response_len_prompt_corr``."""

    def __post_init__(self) -> None:
        if not isinstance(self.padded, bool):
            raise SpecError(f"sequence: padded must be true or false, got {self.padded!r}")
        number("sequence", "response_len_prompt_corr", self.response_len_prompt_corr, maximum=1.0)
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
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    """Synchronous steps, or rollout and training overlapped on disjoint pools (``schedules.py``)."""

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
            samples_per_prompt=self.batch.samples_per_prompt, response_len_prompt_corr=s.response_len_prompt_corr,
        )

    def to_dict(self) -> dict[str, Any]:
        s = self.sequence
        seq: dict[str, Any] = {"prompt_len": s.prompt_len, "response_len_mean": s.response_len_mean,
                               "response_len_max": s.response_len_max}
        if s.response_len_p90 is not None:
            seq["response_len_p90"] = s.response_len_p90
        if s.padded:
            seq["padded"] = True
        if s.response_len_prompt_corr:
            seq["response_len_prompt_corr"] = s.response_len_prompt_corr
        b = self.batch
        return {
            "algorithm": self.algorithm,
            "models": {r: m.to_dict() for r, m in self.models},
            "batch": {"prompts": b.prompts, "samples_per_prompt": b.samples_per_prompt,
                      "ppo_epochs": b.ppo_epochs, "mini_batches": b.mini_batches},
            "sequence": seq,
            **({"rollout": self.rollout.to_dict()} if self.rollout != RolloutSpec() else {}),
            **({"schedule": self.schedule.to_dict()} if self.schedule != ScheduleSpec() else {}),
        }

    def with_schedule(self, kind: str) -> "JobSpec":
        """This job with its schedule decided (``auto`` resolved to ``kind``)."""
        return replace(self, schedule=self.schedule.fixed(kind))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base_dir: Path | None = None) -> "JobSpec":
        check_keys("job", d, {"algorithm", "models", "batch", "sequence", "rollout", "schedule"},
                   ("algorithm", "models", "batch", "sequence"))
        models = d["models"]
        check_keys("job.models", models, set(ROLES))
        pairs = tuple((r, load_model(models[r], base_dir)) for r in ROLES if r in models)
        check_keys("job.batch", d["batch"], {"prompts", "samples_per_prompt", "ppo_epochs", "mini_batches"}, ("prompts",))
        check_keys("job.sequence", d["sequence"],
                    {"prompt_len", "response_len_mean", "response_len_max", "response_len_p90", "padded",
                     "response_len_prompt_corr"},
                    ("prompt_len", "response_len_mean", "response_len_max"))
        rollout = d.get("rollout") or {}
        check_keys("job.rollout", rollout, {f.name for f in fields(RolloutSpec)})
        return cls(algorithm=str(d["algorithm"]).lower(), models=pairs,
                   batch=BatchSpec(**d["batch"]), sequence=SequenceSpec(**d["sequence"]), rollout=RolloutSpec(**rollout),
                   schedule=ScheduleSpec.from_value(d["schedule"]) if "schedule" in d else ScheduleSpec())


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
    samples_per_prompt: int = 1
    """Adjacent sequences that share a prompt (the job's ``batch.samples_per_prompt``)."""
    response_len_prompt_corr: float = 0.0
    """Intraclass correlation of response lengths within a prompt (``SequenceSpec``)."""

    def __post_init__(self) -> None:
        _positive("workload", "sequences", self.sequences)
        _positive("workload", "samples_per_prompt", self.samples_per_prompt)
        number("workload", "response_len_prompt_corr", self.response_len_prompt_corr, maximum=1.0)
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
    ep: int = 1
    """Expert parallelism of a mixture-of-experts model (Megatron's ``expert_model_parallel_size``;
    vLLM's ``--enable-expert-parallel`` in generation): each MoE block's routed experts are split
    over ``ep`` ranks, tokens reach them by all-to-all. Megatron carves the expert layout from the
    same ranks as the dense one: inside a pipeline stage the tp * dp ranks (cp included) are
    regrouped as etp x ep x expert-dp, so ``ep * etp`` must divide ``tp * dp`` (Megatron-core
    ``parallel_state``: world_size % (etp * ep * pp) == 0). 1 on a dense model."""
    etp: int = 1
    """Expert tensor parallelism (Megatron's ``expert_tensor_parallel_size``): each routed expert's
    GEMMs split over ``etp`` ranks; 1 keeps experts whole. See ``ep``."""

    def __post_init__(self) -> None:
        tp, pp, dp, sp, cp, ep, etp = self.tp, self.pp, self.dp, self.sp, self.cp, self.ep, self.etp
        mb, tb = self.micro_batch, self.token_budget
        # fast path (the option tables build thousands): plain ints in range pass ``_positive`` as is
        if not (type(tp) is type(pp) is type(dp) is type(mb) is type(sp) is type(cp) is type(ep) is type(etp)
                is type(tb) is int and min(tp, pp, dp, mb, sp, cp, ep, etp) > 0 and tb >= 0
                and max(tp, pp, dp, mb, sp, cp, ep, etp, tb) <= _MAX_WHOLE):
            for f in ("tp", "pp", "dp", "micro_batch", "sp", "cp", "ep", "etp"):
                _positive("parallel config", f, getattr(self, f))
            _positive("parallel config", "token_budget", self.token_budget, allow_zero=True)
        if type(self.zero) is int and 0 <= self.zero <= 3 and type(self.recompute) is bool \
                and not dp % sp and not dp % cp and (sp == 1 or cp == 1) and not (tp * dp) % (ep * etp):
            return
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
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise SpecError(f"parallel config: ep({self.ep}) * etp({self.etp}) must divide tp({self.tp}) * dp({self.dp}) "
                            f"(Megatron regroups each pipeline stage's tp x dp ranks as etp x ep x expert-dp)")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return f"tp{self.tp}pp{self.pp}dp{self.dp}" + (f"ep{self.ep}" if self.ep > 1 else "") + \
            (f"etp{self.etp}" if self.etp > 1 else "")

    @property
    def seq_split(self) -> int:
        """Ranks each sequence is split over (Ulysses sp or context-parallel cp)."""
        return self.sp * self.cp

    def to_dict(self) -> dict[str, Any]:
        """Every field; ``ep`` and ``etp`` only when expert parallelism is on (either above 1), so a
        dense model's config, and every plan JSON row of it, is what it was before they existed."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.ep == 1 and self.etp == 1:
            del d["ep"], d["etp"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ParallelConfig":
        check_keys("parallel config", d, {f.name for f in fields(cls)})
        return cls(**d)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------
# libyaml's safe loader where PyYAML has it (its wheels do): the same documents as yaml.safe_load,
# and a hostile file of deeply nested "[" stops at libyaml's nesting limit (a YAMLError) instead of
# recursing in Python's parser until RecursionError (tests/unit/test_fuzz_inputs.py's bound)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: str | Path) -> Any:
    p = Path(path)
    text = read_text(p, "file")
    try:
        data = yaml.load(text, Loader=_SAFE_LOADER)
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
