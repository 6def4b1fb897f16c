"""What every corpus row's prediction shares: the ``Prediction`` record, the ``Unsupported``
reason, the profile a row belongs to, and small readers of a row's model, GPUs and integers."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from nereus.fidelity.catalog import (
    profile_gpu,
    resolve_gpu,
    resolve_model,
    with_precision,
)
from nereus.fidelity.corpus import Row
from nereus.models.spec import ModelSpec
from nereus.planner.cost.params import CostParams
from nereus.planner.specs import (
    BatchSpec,
    ClusterSpec,
    GPUSpec,
    JobSpec,
    SequenceSpec,
)

ParamsFor = Callable[[str], CostParams]
"""GPU profile name -> the cost parameters to predict its rows with."""


@dataclass(frozen=True, slots=True)
class Prediction:
    row: Row
    predicted: float | None
    reason: str = ""
    """Why there is no prediction (empty when there is one)."""
    profile: str = ""
    """The GPU profile the row is predicted with."""

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.row.value


class Unsupported(Exception):
    """The row describes something the cost model does not express."""


def row_gpu(row: Row) -> str | None:
    """The profile a row belongs to (for fitting and prediction), or None."""
    gpu, _ = resolve_gpu(row.hardware)
    return None if gpu is None else profile_gpu(gpu)


def _model(row: Row, gpu: GPUSpec) -> tuple[ModelSpec, GPUSpec]:
    model, why = resolve_model(row.model)
    if model is None:
        raise Unsupported(why)
    model, gpu, why = with_precision(model, gpu, row.get("dtype"))
    if why:
        raise Unsupported(why)
    return model, gpu


def _replica_cluster(gpu: GPUSpec, n: int) -> ClusterSpec:
    return ClusterSpec(gpu=gpu, nodes=max(1, math.ceil(n / 8)), gpus_per_node=min(8, max(1, n)))


def _int(row: Row, key: str, default: int | None = None) -> int:
    v = row.num(key)
    if v is None:
        if default is None:
            raise Unsupported(f"config has no numeric {key}")
        return default
    return int(v)


def _one_model_job(model: ModelSpec, seqs: int = 2) -> JobSpec:
    return JobSpec(algorithm="grpo", models=(("actor", model),), batch=BatchSpec(prompts=1, samples_per_prompt=2),
                   sequence=SequenceSpec(prompt_len=1, response_len_mean=1, response_len_max=1))
