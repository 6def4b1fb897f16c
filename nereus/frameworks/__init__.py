"""Launch configurations for RL frameworks: a plan as verl Hydra overrides or OpenRLHF flags.

Where the framework cannot express the plan, the closest plan it can (see README.md). Light to
import (the CLI builds its parser from these names); the emitters load on first use."""
from __future__ import annotations

FRAMEWORKS = ("verl", "openrlhf")
VERL_ENGINES = ("auto", "megatron", "fsdp")

__all__ = ["FRAMEWORKS", "VERL_ENGINES", "emit"]


def emit(framework: str, problem, optimum, solve, *, verl_engine: str = "auto", dynamic_bsz: bool = False):
    """``optimum`` (the Plan solved for ``problem``) as ``framework``'s launch command, an
    :class:`~nereus.frameworks.common.Emission`. ``solve`` maps a PlanProblem to a PlanSolution; it
    is called only when the framework cannot express the optimum."""
    from nereus.errors import SpecError

    if framework == "verl":
        from nereus.frameworks import verl

        if verl_engine not in VERL_ENGINES:
            raise SpecError(f"verl engine must be one of {', '.join(VERL_ENGINES)}, got {verl_engine!r}")
        return verl.emit(problem, optimum, solve, engine=verl_engine, dynamic_bsz=dynamic_bsz)
    if framework == "openrlhf":
        from nereus.frameworks import openrlhf

        return openrlhf.emit(problem, optimum, solve, dynamic_bsz=dynamic_bsz)
    raise SpecError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")
