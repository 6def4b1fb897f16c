"""Per-rank scenarios run by the multi-process tests, ``nereus reshard-check`` and the benchmark.

Each function runs on every rank (``launch(fn, world, ...)``) and returns plain data (dicts of
floats, ints, small tensors) so the parent can compare ranks and runs.
"""
from __future__ import annotations

import time

import torch

from nereus.errors import TransitionError
from nereus.executor.apply import FaultSpec
from nereus.executor.engine import Engine
from nereus.executor.scenario import init_store, mismatches
from nereus.executor.store import ShardStore
from nereus.planner.plan import Plan
from nereus.planner.specs import JobSpec
from nereus.planner.transition_types import TransitionPlan


def batch(model_vocab: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model_vocab, (rows, cols), generator=g)


def logits_in(rank: int, world: int, job: JobSpec, plan: Plan, seed: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits of the seeded actor in ``plan`` (no transition)."""
    store = ShardStore()
    init_store(store, job, plan, rank, seed)
    eng = Engine(rank, world, job.model("actor"), plan.home("actor"), store)
    return eng.logits(ids)


def reshard_case(rank: int, world: int, job: JobSpec, plan_a: Plan, plan_b: Plan, tplan: TransitionPlan, seed: int,
                 fault: FaultSpec | None = None, timeout_s: float = 20.0) -> dict:
    """State in A -> transition to B; bits against the reference, logits B against A.
    With a fault: the transition must roll back to checksums identical to before."""
    ids = batch(job.model("actor").vocab, 4, 12, seed + 1)
    store = ShardStore()
    init_store(store, job, plan_a, rank, seed)
    eng = Engine(rank, world, job.model("actor"), plan_a.home("actor"), store)
    logits_a = eng.logits(ids)
    before = store.checksums()
    t0 = time.perf_counter()
    try:
        report = eng.apply_transition(tplan, plan_b.home("actor"), timeout_s=timeout_s, fault=fault)
    except TransitionError as e:
        return {"rank": rank, "rolled_back": True, "error": str(e), "seconds": time.perf_counter() - t0,
                "checksums_equal": store.checksums() == before, "regions": len(before)}
    bad = mismatches(store, job, seed)
    logits_b = eng.logits(ids)
    diff = 0.0
    if logits_a is not None and logits_b is not None:
        diff = float((logits_a - logits_b).abs().max())
    return {"rank": rank, "rolled_back": False, "seconds": report.seconds, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "messages": report.messages, "mismatches": bad,
            "regions": len(store), "logits_max_diff": diff, "compared_logits": logits_a is not None and logits_b is not None}


def train_run(rank: int, world: int, job: JobSpec, phases: list[tuple[Plan, int]], tplans: list[TransitionPlan],
              seed: int, rows: int = 8, cols: int = 12) -> dict:
    """Train ``k_i`` steps in plan i, transitioning between phases with ``tplans[i]``.
    The batch of global step s is seeded by s, so any run sees the same data."""
    model = job.model("actor")
    store = ShardStore()
    init_store(store, job, phases[0][0], rank, seed, roles=("actor",))
    eng = Engine(rank, world, model, phases[0][0].home("actor"), store)
    losses: list[float | None] = []
    moments: list[dict] = []
    for i, (plan, steps) in enumerate(phases):
        if i > 0:
            before = {r: t.clone() for r, t in store.items() if r.kind != "param"}
            eng.apply_transition(tplans[i - 1], plan.home("actor"))
            moments.append({"before": before, "after": {r: t.clone() for r, t in store.items() if r.kind != "param"}})
        for _ in range(steps):
            s = len(losses)
            losses.append(eng.train_step(batch(model.vocab, rows, cols, 1000 + s)))
    return {"rank": rank, "losses": losses, "step": store.step.get("actor"), "moments": moments,
            "final": {r: t.detach().clone() for r, t in store.items()}}
