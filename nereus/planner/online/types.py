"""What a training loop gives the controller each step (``StepMetrics``) and what it gets back
(``Decision``). Plain data: the controller lives in ``controller.py``; adapters from framework
metric dicts in ``adapters.py``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from nereus.planner.plan import Plan
from nereus.planner.transition.types import TransitionPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """What the training loop measured in one step (all optional except the lengths)."""

    step: int
    response_len_mean: float
    response_len_max: int
    """Longest response observed this step (verl's ``response_length/max``: noisy, at most the cap)."""
    response_len_p90: float | None = None
    prompt_len: int | None = None
    stage_times: Mapping[str, float] = field(default_factory=dict)
    """Seconds per model-stage, e.g. {"actor/generation": 41.2, "actor/training": 12.0}."""
    peak_mem_gib: float | None = None
    gpus_available: int | None = None
    """GPUs the job may use from the next step on (default: unchanged)."""
    response_len_cap: int | None = None
    """The trainer's response cap for the next step (default: the last cap given, else the job's
    ``sequence.response_len_max``, raised if a longer response is ever observed)."""
    oom: bool = False
    """The step failed with out-of-memory on the current plan."""
    oom_stage: str | None = None
    """The model-stage that ran out of memory, when known (a crash's traceback names it)."""
    response_len_prompt_corr: float | None = None
    """The intraclass correlation of this step's response lengths within a prompt, when measured
    (``adapters.prompt_length_correlation``): the controller plans its longest micro-batch with it."""
    step_s: float | None = None
    """The step's wall time (verl's ``timing_s/step``), when logged: on an asynchronous plan the
    stages overlap, and only the step says by how much (``Controller._calibrate``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    action: str
    """"stay" or "switch"."""
    plan: Plan
    """The plan to run the next step on (the current one when staying)."""
    transition: TransitionPlan | None
    """The transition graph to apply (None when staying, when only knobs change, or when the caller
    asked not to build it)."""
    predicted_cost_s: float
    """The predicted transition time to ``plan`` on a switch; on a stay, that of the best alternative
    weighed (inf when none was priced: no alternative was faster over the horizon)."""
    saving_per_step_s: float
    break_even_steps: float
    reason: str
    must: bool = False
    resolved: bool = False
    """Whether this step called the plan solver."""
    feasible: bool = True
    """False when no feasible plan is known for the next step (the caller cannot run it safely)."""
    overhead_s: float = 0.0
    framework_config: Mapping[str, Any] | None = None
    """Restart mode: the new plan as the framework's launch configuration (framework, version,
    variant, command, args, script, gaps; ``restart.emit_config``), to relaunch from the checkpoint with.
    None in live mode, when staying, or when the controller was given no framework."""
