"""Launch configurations for RL frameworks: a plan as verl Hydra overrides or OpenRLHF flags.

Where the framework cannot express the plan, the closest plan it can (see README.md). Light to
import (the CLI builds its parser from these names); the emitters load on first use."""
from __future__ import annotations

FRAMEWORKS = ("verl", "openrlhf")
VERL_ENGINES = ("auto", "megatron", "fsdp")

__all__ = ["FRAMEWORKS", "VERL_ENGINES", "emit", "launch_config"]


def emit(framework: str, problem, optimum, solve, *, verl_engine: str = "auto", dynamic_bsz: bool = False):
    """``optimum`` (the Plan solved for ``problem``) as ``framework``'s launch command, an
    :class:`~nereus.frameworks.common.Emission`. ``solve`` maps a PlanProblem to a PlanSolution; it
    is called only when the framework cannot express the optimum."""
    from nereus.errors import SpecError

    from nereus.frameworks.asynchronous import is_async

    asynchronous = is_async(optimum)  # an async plan: the framework's async trainer (verl_async, openrlhf_async)
    if framework == "verl":
        from nereus.frameworks import verl, verl_async

        if verl_engine not in VERL_ENGINES:
            raise SpecError(f"verl engine must be one of {', '.join(VERL_ENGINES)}, got {verl_engine!r}")
        return (verl_async if asynchronous else verl).emit(problem, optimum, solve, engine=verl_engine,
                                                           dynamic_bsz=dynamic_bsz)
    if framework == "openrlhf":
        from nereus.frameworks import openrlhf, openrlhf_async

        return (openrlhf_async if asynchronous else openrlhf).emit(problem, optimum, solve, dynamic_bsz=dynamic_bsz)
    raise SpecError(f"unknown framework {framework!r}; choose one of {', '.join(FRAMEWORKS)}")


def launch_config(framework: str, problem, plan, *, time_limit_s: float = 5.0, seed: int = 0) -> dict:
    """``plan`` as ``framework``'s launch command, as plain data: what a restart-mode controller
    decision carries (``Controller(..., transition_mode="restart", framework="verl",
    emitter=launch_config)``). Keys: framework, version, variant, command, args, script (the rendered
    launch script), gaps (empty when the framework expresses ``plan`` as is), expresses_plan_as_is and
    step_time_s (predicted, of the plan the arguments express). Where ``plan`` has gaps the emitter
    re-solves ``problem`` under the framework's constraints (``time_limit_s``, one worker, ``seed``)."""
    from dataclasses import replace

    from nereus.planner.solver import evaluate_plan, solve

    if not plan.step_time_s > 0:  # a plan built outside the solver: the render prints its predicted time
        plan = replace(plan, step_time_s=evaluate_plan(problem, plan).step_time_s)
    em = emit(framework, problem, plan, lambda q: solve(q, backend="cpsat", time_limit_s=time_limit_s, workers=1,
                                                        seed=seed))
    return {"framework": em.framework, "version": em.version, "variant": em.variant, "command": list(em.command),
            "args": list(em.args), "script": em.render("a restart-mode switch"), "gaps": list(em.gaps),
            "expresses_plan_as_is": not em.gaps, "step_time_s": em.plan.step_time_s}
