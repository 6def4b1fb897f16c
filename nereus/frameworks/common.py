"""What both emitters share: the emitted launch configuration, pool and memory arithmetic, the search for the closest expressible plan, and the atomic file write.

A framework module supplies three things: ``gaps(job, plan)`` (what of a plan it cannot express,
one sentence each with the numbers), candidate problems (the solver constrained to what it can
express) and ``equalize`` (re-solves that pin values the framework shares between models). The
search here solves every candidate, re-solves the ones whose answer still has gaps, and keeps the
fastest plan without gaps.
"""
from __future__ import annotations

import math
import os
import shlex
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable

from nereus.errors import InfeasibleError, SpecError
from nereus.planner.plan import GiB, Plan, StagePlacement
from nereus.planner.specs import ClusterSpec, Workload

# The decision units of a plan: one home model-stage per model, plus generation.
GEN = "actor/generation"
UNITS = (GEN, "actor/training", "critic/training", "ref/inference", "reward/inference")
TRAINABLE_UNITS = ("actor/training", "critic/training")


@dataclass(frozen=True, slots=True, kw_only=True)
class Emission:
    """A plan written as one framework's launch command, with what could not be expressed."""

    framework: str
    """``verl`` or ``openrlhf``."""
    version: str
    """The framework release whose config keys / flags the arguments were checked against."""
    variant: str
    """verl: ``megatron`` or ``fsdp``; OpenRLHF: the placement (``colocate_all``, ``paired``, ``apart``)."""
    command: tuple[str, ...]
    """The launcher, e.g. ``("python3", "-m", "verl.trainer.main_ppo")``."""
    args: tuple[str, ...]
    """Arguments after the command, one word each: verl ``key=value``; OpenRLHF ``--flag`` or ``--flag value``."""
    plan: Plan
    """The plan these arguments express: the optimum, or the closest expressible plan."""
    optimum: Plan
    gaps: tuple[str, ...]
    """What the framework cannot express of the optimum (empty: the optimum is emitted as is)."""
    notes: tuple[str, ...] = ()
    tried: tuple[tuple[str, float | None], ...] = ()
    """Constrained solves behind the closest plan: (label, predicted step seconds or None if infeasible)."""

    @property
    def step_time_s(self) -> float:
        return self.plan.step_time_s

    @property
    def slowdown(self) -> float:
        """Emitted plan's predicted step time over the optimum's, minus one."""
        return self.plan.step_time_s / self.optimum.step_time_s - 1.0

    def render(self, title: str = "") -> str:
        """A bash script: comments (gaps, plan, predicted times), then the command, one argument a line."""
        out = ["#!/usr/bin/env bash",
               f"# {self.framework} {self.version} launch written by `nereus plan --emit {self.framework}`"
               + (f" for {title}" if title else "")]
        out.append(f"# Predicted step time: {self.plan.step_time_s:.2f} s; the optimum: {self.optimum.step_time_s:.2f} s"
                   + ("" if not self.gaps else f" ({100 * self.slowdown:+.1f}%)") + " (Nereus cost model, not measured).")
        if self.gaps:
            out.append(f"# Not expressible in {self.framework}, so this is the closest plan that is ({self.variant}):")
            out += [f"#   - {g}" for g in self.gaps]
        else:
            out.append(f"# The optimal plan is expressible in {self.framework} as is ({self.variant}).")
        if self.tried:
            out.append("# Constrained solves (predicted step time):")
            out += [f"#   {label}: {'infeasible' if t is None else f'{t:.2f} s'}" for label, t in self.tried]
        out.append("# Plan (model-stage: tp x pp x dp, micro-batch, ZeRO, recompute, GPUs):")
        out += [f"#   {describe(s)}" for s in self.plan.stages]
        out += [f"# {n}" for n in self.notes]
        out.append("set -euo pipefail")
        out.append(" ".join(shlex.quote(w) for w in self.command) + " \\")
        words = list(self.args)
        i = 0
        while i < len(words):  # keep a flag and its value on one line
            line = [words[i]]
            if words[i].startswith("--") and i + 1 < len(words) and not words[i + 1].startswith("--"):
                line.append(words[i + 1])
                i += 1
            out.append("    " + " ".join(shlex.quote(w) for w in line) + " \\")
            i += 1
        out.append('    "$@"')
        return "\n".join(out) + "\n"


def engine_notes(job, framework: str, runs: str, has: tuple[str, ...]) -> tuple[str, ...]:
    """What an emitted launch changes of the job's generation engine (``job.rollout.engine``):
    ``framework``'s pinned vLLM release ``runs`` has only the V1 engine, so a job priced on vLLM's V0
    generates on V1; an engine outside ``has`` (the framework's rollout backends) runs on vLLM."""
    e = job.rollout.engine
    if e == "vllm-v0":
        return (f"The job prices generation on vLLM's V0 engine; {framework} pins vLLM {runs}, which has only the "
                f"V1 engine: generation runs on V1 (set `engine: vllm` and re-plan for {framework}'s figures).",)
    if e not in has:
        return (f"The job prices generation on {e!r}, which {framework} does not offer (its rollout engines: "
                f"{', '.join(has)}): generation runs on vLLM (set `engine: vllm` and re-plan for its figures).",)
    return ()


def describe(s: StagePlacement) -> str:
    c = s.config
    extra = "" if s.stage == "generation" else f", mb {c.micro_batch}" + (
        f", ZeRO-{c.zero}" + (", recompute" if c.recompute else "") if s.stage == "training" else "")
    experts = f", ep {c.ep}" + (f" etp {c.etp}" if c.etp > 1 else "") if c.ep * c.etp > 1 else ""
    return f"{s.name}: {c.tp} x {c.pp} x {c.dp}{extra}{experts}, {gpu_range(s)}"


def gpu_range(s: StagePlacement) -> str:
    return f"GPUs {s.first_gpu}-{s.first_gpu + s.gpus - 1}"


def units(plan: Plan) -> dict[str, StagePlacement]:
    """Home placement of every decision unit present in ``plan``."""
    names = {s.name for s in plan.stages}
    return {u: plan.stage(u) for u in UNITS if u in names}


def same_gpus(a: StagePlacement, b: StagePlacement) -> bool:
    return (a.first_gpu, a.gpus) == (b.first_gpu, b.gpus)


def overlap(a: StagePlacement, b: StagePlacement) -> bool:
    return a.first_gpu < b.first_gpu + b.gpus and b.first_gpu < a.first_gpu + a.gpus


def offloaded(plan: Plan) -> frozenset[str]:
    """Units whose optimizer state the plan keeps in host memory (the plan's ``offload`` extra)."""
    return frozenset(dict(plan.extras).get("offload") or ())


def nodes_and_gpus(gpus: int, cluster: ClusterSpec) -> tuple[int, int]:
    """A pool of ``gpus`` GPUs as (nodes, GPUs per node): whole nodes, or part of one node."""
    if gpus <= cluster.gpus_per_node:
        return 1, gpus
    if gpus % cluster.gpus_per_node:
        raise SpecError(f"a pool of {gpus} GPUs is not whole nodes of {cluster.gpus_per_node} GPUs")
    return gpus // cluster.gpus_per_node, cluster.gpus_per_node


def memory_fraction(nbytes: float, cluster: ClusterSpec, *, round_up: bool) -> float:
    """``nbytes`` as a fraction of one GPU's memory, to 0.01 (vLLM's ``gpu_memory_utilization``)."""
    x = nbytes / (cluster.gpu.memory_gib * GiB) * 100
    x = math.ceil(x - 1e-9) if round_up else math.floor(x + 1e-9)
    return min(max(x, 1), 99) / 100


def generation_memory_fraction(job, cluster: ClusterSpec, plan: Plan, workload: Workload, params) -> float:
    """vLLM's ``gpu_memory_utilization`` for the plan's generation, rounded down: weights +
    workspace + the KV budget the solver chose (``generation_kv_budget_gib``), but no more than
    the GPU has left beside the state of the models colocated with it (the plan's peak memory of
    generation minus generation's own working set), since vLLM takes its whole budget up front.

    Example (Llama-3.1-8B at tp 4 on an H100, 78 of 80 GiB usable): KV budget 65.5 GiB + weights 3.7
    + workspace 1.0 = 70.2 GiB wanted; the plan's generation peak 36.3 GiB minus its own working set
    11.2 GiB = 25.1 GiB of colocated state leaves 52.9 GiB; 52.9 / 80 = 0.66."""
    from nereus.planner.cost.model import estimate

    g = plan.stage(GEN)
    kv = dict(plan.extras).get("generation_kv_budget_gib")
    est = estimate(job, cluster, GEN, g.config, workload, params, kv_budget_bytes=None if kv is None else kv * GiB)
    fixed = est.mem_breakdown.get("weights", 0.0) + est.mem_breakdown.get("workspace", 0.0)
    wanted = fixed + (kv * GiB if kv is not None else est.mem_breakdown.get("kv_cache", 0.0))
    colocated = max(0.0, g.mem_gib * GiB - est.transient_bytes) if g.mem_gib > 0 else 0.0
    return memory_fraction(min(wanted, cluster.gpu.usable_bytes - colocated), cluster, round_up=False)


def stage_memory_fraction(job, cluster: ClusterSpec, s: StagePlacement, workload: Workload, params) -> float:
    """The model-stage's own peak memory per GPU (resident + transient) as a fraction, rounded up."""
    from nereus.planner.cost.model import estimate

    est = estimate(job, cluster, s.name, s.config, workload, params)
    return memory_fraction(est.mem_bytes, cluster, round_up=True)


def micro_batch_tokens(cfg, workload: Workload) -> int:
    """Tokens of one micro-batch of a data-parallel group: the plan's ``token_budget`` per GPU times
    its sequence-parallel size when it packs by tokens, else ``micro_batch`` sequences of the longest
    length the plan was sized for (prompt + response cap)."""
    budget, sp = getattr(cfg, "token_budget", 0), getattr(cfg, "sp", 1)
    return budget * sp if budget else cfg.micro_batch * workload.seq_len_max


def packs_tokens(plan: Plan) -> bool:
    """Whether any model-stage of ``plan`` packs micro-batches by a token budget."""
    return any(getattr(s.config, "token_budget", 0) for s in plan.stages)


def flag(value: bool) -> str:
    return "true" if value else "false"


# ---- the closest expressible plan ------------------------------------------------------------
Solve = Callable[[object], object]
"""``problem -> PlanSolution`` with the caller's backend, time limit, workers and seed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Closest:
    label: str
    solution: object
    """The PlanSolution of the chosen constrained problem."""
    tried: tuple[tuple[str, float | None], ...]


Repair = Callable[[object, Plan], list[tuple[str, Plan]]]
"""``(problem, plan) -> [(label, plan)]``: ``plan`` with values the solver has no pin for (the expert
layout) set to what the framework runs, to be re-evaluated (``evaluated``)."""


@dataclass(frozen=True, slots=True)
class Repaired:
    """A solved plan with its expert layout set by hand and re-evaluated by ``evaluate_plan``: what
    ``closest`` keeps of a PlanSolution (``plan``, ``objective``)."""

    plan: Plan
    objective: float
    status: str = "REPAIRED"


def with_expert_layout(plan: Plan, layouts: dict[str, tuple[int, int]], zero: int | None = None) -> Plan:
    """``plan`` with the (ep, etp) of each model-stage in ``layouts`` (a trainable model's inference
    stage follows its training stage, as it runs in that layout); ``zero``: the ZeRO stage of the
    model-stages whose layout changes (experts unsharded by EP sharded by ZeRO-3 instead)."""
    want = dict(layouts)
    for name, lay in layouts.items():
        if name in TRAINABLE_UNITS:
            want.setdefault(name.replace("training", "inference"), lay)

    def changed(c, lay):
        return replace(c, ep=lay[0], etp=lay[1], **({} if zero is None else {"zero": zero}))

    stages = tuple(replace(s, config=changed(s.config, want[s.name]))
                   if s.name in want and (s.config.ep, s.config.etp) != want[s.name] else s for s in plan.stages)
    return replace(plan, stages=stages)


def evaluated(problem, plan: Plan) -> Repaired | None:
    """``plan`` with the times, memory and step time ``evaluate_plan`` gives it; None if it does not fit."""
    from nereus.planner.solver import evaluate_plan

    try:
        ev = evaluate_plan(problem, plan)
    except SpecError:  # a layout the cost model refuses
        return None
    if not ev.feasible:
        return None
    t, m = dict(ev.stage_time_s), dict(ev.stage_mem_gib)
    stages = tuple(replace(s, time_s=t[s.name], mem_gib=m[s.name]) for s in plan.stages)
    extras = tuple((k, ev.weight_sync_s if k == "weight_sync_s" else ev.phase_makespan_s if k == "phase_makespan_s"
                    else v) for k, v in plan.extras)
    out = replace(plan, stages=stages, step_time_s=ev.step_time_s, extras=extras)
    return Repaired(plan=out, objective=ev.step_time_s)


def closest(candidates: Iterable[tuple[str, object]], solve: Solve, gaps: Callable[[Plan], list[str]],
            equalize: Callable[[object, Plan], list[tuple[str, object]]], framework: str,
            repair: Repair | None = None) -> Closest:
    """The fastest gap-free plan over ``candidates`` ((label, PlanProblem) pairs). A candidate whose
    plan still has gaps (values the framework shares between models differ) is re-solved with the
    pins ``equalize`` proposes; a plan that still has gaps after that is handed to ``repair`` (the
    expert layout, which the solver takes no pins for) and re-evaluated; raises InfeasibleError when
    nothing expressible fits."""
    tried: list[tuple[str, float | None]] = []
    best: tuple[str, object] | None = None

    def repaired(label: str, problem, plan: Plan) -> list[tuple[str, object]]:
        out = []
        for r_label, r_plan in (repair(problem, plan) if repair is not None else ()):
            r = evaluated(problem, r_plan)
            tried.append((f"{label}, {r_label}", None if r is None else r.objective))
            if r is not None and not gaps(r.plan):
                out.append((f"{label}, {r_label}", r))
        return out

    for label, problem in candidates:
        sol = solve(problem)
        tried.append((label, sol.objective if sol.plan is not None else None))
        if sol.plan is None:
            continue
        found = [(label, sol)] if not gaps(sol.plan) else []
        if not found:
            found += repaired(label, problem, sol.plan)
            for sub_label, sub in equalize(problem, sol.plan):
                s2 = solve(sub)
                tried.append((f"{label}, {sub_label}", s2.objective if s2.plan is not None else None))
                if s2.plan is not None and not gaps(s2.plan):
                    found.append((f"{label}, {sub_label}", s2))
                elif s2.plan is not None:
                    found += repaired(f"{label}, {sub_label}", sub, s2.plan)
        for cand in found:
            if best is None or cand[1].objective < best[1].objective:
                best = cand
    if best is None:
        shown = "; ".join(f"{lb}: {'infeasible' if t is None else f'{t:.2f} s with gaps'}" for lb, t in tried)
        raise InfeasibleError(f"no plan {framework} can express fits in memory (tried {shown})")
    return Closest(label=best[0], solution=best[1], tried=tuple(tried))


# ---- output --------------------------------------------------------------------------------
def write_atomic(path: str | Path, text: str, mode: int = 0o755) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and ``os.replace``, so
    a reader never sees half a file and a failed write leaves the old file in place."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(f"cannot write {p}: it is a folder")
    tmp = None
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, mode & ~umask)
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise SpecError(f"cannot write {p}: {e.strerror or e}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
