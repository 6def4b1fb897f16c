"""Plan: the parallel config and GPU pool of every model-stage, with predicted time and memory.

This is the JSON written by ``nereus plan --json`` and read by ``nereus transition`` and
``nereus simulate`` (a public contract: fields are added, never renamed).

GPU numbering inside a pool follows Megatron's order, TP fastest, then DP, then PP:
``gpu = first_gpu + tp_rank + tp * (dp_rank + dp * pp_rank)``. A pool is a contiguous range of
GPUs ``[first_gpu, first_gpu + gpus)``; model-stages with the same ``pool`` id share it
(colocated, time-multiplexed). Trainable models run their inference stage in their training
layout (``actor/inference`` has the pool, tp, pp and dp of ``actor/training``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from nereus.errors import SpecError
from nereus.jsonio import naming, number, read_json
from nereus.planner.specs import ParallelConfig

GiB = 1024**3

# The state of each model lives in the layout of its "home" model-stage; transitions move it.
# The actor's generation copy is rebuilt from the training layout every step (weight sync).
HOME_STAGE = {"actor": "actor/training", "critic": "critic/training", "ref": "ref/inference",
              "reward": "reward/inference"}
STAGES = ("generation", "inference", "training")


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePlacement:
    name: str
    """Model-stage, e.g. ``actor/training``."""
    config: ParallelConfig
    pool: int
    """Pool id; equal ids mean the same GPUs."""
    first_gpu: int
    """Global index of the pool's first GPU."""
    gpus: int
    """Pool size; equals tp * pp * dp."""
    time_s: float = 0.0
    """Predicted duration of this model-stage per step."""
    mem_gib: float = 0.0
    """Predicted peak memory per GPU of the pool while this model-stage runs (GiB)."""

    def __post_init__(self) -> None:
        if self.config.gpus != self.gpus:
            c = self.config
            raise SpecError(f"{self.name}: tp({c.tp}) * pp({c.pp}) * dp({c.dp}) = {c.gpus} != pool gpus({self.gpus})")
        if self.first_gpu < 0 or self.pool < 0:
            raise SpecError(f"{self.name}: pool({self.pool}) and first_gpu({self.first_gpu}) must be >= 0")

    @property
    def role(self) -> str:
        return self.name.split("/")[0]

    @property
    def stage(self) -> str:
        return self.name.split("/")[1]

    def gpu_of(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        c = self.config
        return self.first_gpu + tp_rank + c.tp * (dp_rank + c.dp * pp_rank)

    def gpu_ids(self) -> range:
        return range(self.first_gpu, self.first_gpu + self.gpus)

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        return {"name": self.name, "tp": c.tp, "pp": c.pp, "dp": c.dp, "pool": self.pool, "gpus": self.gpus,
                "time_s": self.time_s, "mem_gib": self.mem_gib, "first_gpu": self.first_gpu,
                "micro_batch": c.micro_batch, "zero": c.zero, "recompute": c.recompute,
                **({"sp": c.sp} if c.sp != 1 else {}), **({"cp": c.cp} if c.cp != 1 else {}),
                **({"token_budget": c.token_budget} if c.token_budget else {}),
                **({"ep": c.ep, "etp": c.etp} if (c.ep, c.etp) != (1, 1) else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StagePlacement":
        if not isinstance(d, Mapping):
            raise SpecError(f"plan: a model-stage entry must be a mapping, got {type(d).__name__}")
        try:
            name = d["name"]
            role, _, stage = name.partition("/") if isinstance(name, str) else ("", "", "")
            if role not in HOME_STAGE or stage not in STAGES:
                raise SpecError(f"plan: model-stage name must be <role>/<stage> with role in {list(HOME_STAGE)} and "
                                f"stage in {list(STAGES)}, got {name!r}")
            owner = f"plan: {name}"
            cfg = ParallelConfig(tp=d["tp"], pp=d["pp"], dp=d["dp"], micro_batch=d.get("micro_batch", 1),
                                 zero=d.get("zero", 1), recompute=d.get("recompute", False), sp=d.get("sp", 1),
                                 cp=d.get("cp", 1), token_budget=d.get("token_budget", 0), ep=d.get("ep", 1),
                                 etp=d.get("etp", 1))
            return cls(name=name, config=cfg, pool=number(owner, "pool", d["pool"], whole=True),
                       first_gpu=number(owner, "first_gpu", d.get("first_gpu", 0), whole=True),
                       gpus=number(owner, "gpus", d["gpus"], whole=True),
                       time_s=float(number(owner, "time_s", d.get("time_s", 0.0))),
                       mem_gib=float(number(owner, "mem_gib", d.get("mem_gib", 0.0))))
        except KeyError as e:
            raise SpecError(f"plan: model-stage entry is missing field {e.args[0]!r}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    stages: tuple[StagePlacement, ...]
    step_time_s: float = 0.0
    """Predicted step time: sum of phase makespans + weight sync."""
    status: str = "FEASIBLE"
    solve_s: float = 0.0
    gap: float = 0.0
    backend: str = ""
    extras: tuple[tuple[str, Any], ...] = field(default=())
    """Free-form extra figures (e.g. weight_sync_s, phase makespans) kept in the JSON."""
    _num_gpus: int = field(init=False, repr=False, compare=False, default=0)
    _layout_key: tuple = field(init=False, repr=False, compare=False, default=())
    _key: tuple = field(init=False, repr=False, compare=False, default=())
    """Derived once in ``__post_init__``: the simulator and controller ask these millions of times."""

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise SpecError(f"plan: duplicate model-stages in {names}")
        pools: dict[int, tuple[int, int]] = {}
        for s in self.stages:
            prev = pools.setdefault(s.pool, (s.first_gpu, s.gpus))
            if prev != (s.first_gpu, s.gpus):
                raise SpecError(f"plan: pool {s.pool} is [{prev[0]}, +{prev[1]}) for one model-stage and "
                                f"[{s.first_gpu}, +{s.gpus}) for {s.name}")
        object.__setattr__(self, "_num_gpus", max((s.first_gpu + s.gpus for s in self.stages), default=0))
        # expert layouts (ep, etp) move state like tp does; the schedule (sync or async) changes the step
        sched = dict(self.extras).get("schedule")
        kind = sched.get("kind", "sync") if isinstance(sched, Mapping) else "sync"
        object.__setattr__(self, "_layout_key", tuple(
            (s.name, s.first_gpu, s.gpus, s.config.tp, s.config.pp, s.config.dp, s.config.zero, s.config.ep,
             s.config.etp) for s in self.stages) + (kind,))
        # optimizer offload is a knob (it moves a state to the host, not between GPUs): in the key only
        off = tuple(sorted(dict(self.extras).get("offload") or ()))
        object.__setattr__(self, "_key", tuple(
            (s.name, s.first_gpu, s.gpus, s.config.tp, s.config.pp, s.config.dp, s.config.micro_batch, s.config.zero,
             s.config.recompute, s.config.sp, s.config.cp, s.config.token_budget, s.config.ep, s.config.etp)
            for s in self.stages) + (kind,) + ((("offload",) + off,) if off else ()))

    def __iter__(self) -> Iterator[StagePlacement]:
        return iter(self.stages)

    def stage(self, name: str) -> StagePlacement:
        for s in self.stages:
            if s.name == name:
                return s
        raise SpecError(f"plan has no model-stage {name!r}; it has {[s.name for s in self.stages]}")

    def home(self, role: str) -> StagePlacement:
        """Placement holding ``role``'s persistent state (see HOME_STAGE)."""
        return self.stage(HOME_STAGE[role])

    @property
    def num_gpus(self) -> int:
        return self._num_gpus

    def layout_key(self) -> tuple:
        """What a transition must change: pools and (tp, pp, dp, zero, ep, etp) of every model-stage, and
        the schedule."""
        return self._layout_key

    def key(self) -> tuple:
        """Everything about the plan that changes its time or memory: pools, layout and knobs."""
        return self._key

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "step_time_s": self.step_time_s, "solve_s": self.solve_s, "gap": self.gap,
                "backend": self.backend, "model_stages": [s.to_dict() for s in self.stages], **dict(self.extras)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        if "model_stages" not in d:
            raise SpecError("plan JSON: missing 'model_stages' (write plans with `nereus plan --json`)")
        if d.get("status") == "INFEASIBLE":
            raise SpecError("plan JSON: status is INFEASIBLE; it holds no plan")
        known = {"status", "step_time_s", "solve_s", "gap", "backend", "model_stages"}
        extras = tuple((k, v) for k, v in d.items() if k not in known)
        if not isinstance(d["model_stages"], list) or not d["model_stages"]:
            raise SpecError(f"plan JSON: model_stages must be a non-empty list, got {d['model_stages']!r:.60}")
        figures = {k: float(number("plan JSON", k, d.get(k) or 0.0)) for k in ("step_time_s", "solve_s")}
        gap = d.get("gap") or 0.0  # None or Infinity: a backend without a bound
        figures["gap"] = gap if gap == float("inf") else float(number("plan JSON", "gap", gap))
        return cls(stages=tuple(StagePlacement.from_dict(s) for s in d["model_stages"]),
                   status=str(d.get("status", "FEASIBLE")), backend=str(d.get("backend", "")), extras=extras,
                   **figures)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan JSON at ``path`` (``nereus plan --json``); every error is one line naming the file."""
        with naming(path):
            data = read_json(path, "plan file")
            if not isinstance(data, Mapping):
                raise SpecError(f"plan {path}: expected a JSON object, got {type(data).__name__}")
            return cls.from_dict(data)
