"""Per-rank scenarios run by the multi-process tests, ``nereus reshard-check`` and the benchmark.

Each function runs on every rank (``launch(fn, world, ...)``) and returns plain data (dicts of
floats, ints, small tensors) so the parent can compare ranks and runs.
"""
from __future__ import annotations

import time

import torch

from nereus.errors import TransitionError
from nereus.executor.apply import STAGING_BYTES, FaultSpec
from nereus.executor.engine import Engine
from nereus.executor.launch import rank_device
from nereus.executor.scenario import init_store, mismatches, reference_logits
from nereus.executor.store import ShardStore
from nereus.planner.plan import Plan
from nereus.planner.specs import JobSpec
from nereus.planner.transition.types import TransitionPlan


LOGITS_TOL = 1e-5
"""fp32: logits in any layout within 1e-5 of the unsharded ones (only the reduction order differs)."""
BF16_REL_TOL = 2.0 ** -5
"""bf16: within 2^-5 (8 bf16 rounding steps of 2^-8) times the largest |logit|: a layout changes
where the bf16 roundings fall (TP partial sums, reductions), not how many."""


def logits_tolerance(precision: str, scale: float) -> float:
    """Largest |logits difference| accepted between layouts at ``precision``; ``scale``: the
    largest |logit| of the reference."""
    return LOGITS_TOL if precision == "fp32" else BF16_REL_TOL * max(1.0, scale)


def batch(model_vocab: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model_vocab, (rows, cols), generator=g)


def logits_in(rank: int, world: int, job: JobSpec, plan: Plan, seed: int, ids: torch.Tensor,
              precision: str = "fp32") -> torch.Tensor | None:
    """Logits of the seeded actor in ``plan`` (no transition)."""
    store = ShardStore()
    init_store(store, job, plan, rank, seed, precision=precision)
    eng = Engine(rank, world, job.model("actor"), plan.home("actor"), store, precision=precision)
    return eng.logits(ids)


def reshard_case(rank: int, world: int, job: JobSpec, plan_a: Plan, plan_b: Plan, tplan: TransitionPlan, seed: int,
                 fault: FaultSpec | None = None, timeout_s: float = 20.0,
                 staging_bytes: int | None = STAGING_BYTES, precision: str = "fp32") -> dict:
    """State in A -> transition to B; bits against the reference, logits B against A and
    against the never-resharded reference (``reference_logits``).
    With a fault: the transition must roll back to checksums identical to before.
    The state lives on ``rank_device()`` (the rank's GPU under NCCL); results come back on the host."""
    device = rank_device()
    ids = batch(job.model("actor").vocab, 4, 12, seed + 1).to(device)
    store = ShardStore(device)
    init_store(store, job, plan_a, rank, seed, precision=precision)
    eng = Engine(rank, world, job.model("actor"), plan_a.home("actor"), store, precision=precision)
    logits_a = _host(eng.logits(ids))
    before = store.checksums()
    t0 = time.perf_counter()
    try:
        report = eng.apply_transition(tplan, plan_b.home("actor"), timeout_s=timeout_s, fault=fault,
                                      staging_bytes=staging_bytes)
    except TransitionError as e:
        return {"rank": rank, "rolled_back": True, "error": str(e), "seconds": time.perf_counter() - t0,
                "checksums_equal": store.checksums() == before, "regions": len(before),
                "bytes_received": getattr(e, "bytes_received", 0), "exchanges_done": getattr(e, "exchanges_done", 0)}
    bad = mismatches(store, job, seed)
    logits_b = _host(eng.logits(ids))
    diff = scale = 0.0
    if logits_b is not None:  # against A where this rank saw A's logits, and always against the reference
        ref = reference_logits(job, seed, ids.cpu(), precision)
        diff, scale = float((logits_b - ref).abs().max()), float(ref.abs().max())
        if logits_a is not None:
            diff = max(diff, float((logits_a - logits_b).abs().max()))
    return {"rank": rank, "rolled_back": False, "seconds": report.seconds, "bytes_sent": report.bytes_sent,
            "bytes_received": report.bytes_received, "messages": report.messages, "mismatches": bad,
            "regions": len(store), "logits_max_diff": diff, "logits_scale": scale,
            "compared_logits": logits_b is not None}


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


def reshard_chain(rank: int, world: int, job: JobSpec, plans: list[Plan], tplans: list[TransitionPlan],
                  seed: int, precision: str = "fp32") -> list[dict]:
    """Seeded state in ``plans[0]``, then every transition in turn. After each: bits of every
    region against the never-resharded reference, and logits, log-probs and greedy and sampled
    generations against those of ``plans[0]``."""
    model = job.model("actor")
    ids = batch(model.vocab, 4, 12, seed + 1)
    store = ShardStore()
    init_store(store, job, plans[0], rank, seed, precision=precision)
    eng = Engine(rank, world, model, plans[0].home("actor"), store, precision=precision)

    def outputs() -> dict:
        return {"logits": eng.logits(ids), "logprobs": eng.logprobs(ids),
                "greedy": eng.generate(ids[:, :5], 4), "sampled": eng.generate(ids[:, :5], 4, temperature=1.0, seed=3)}

    first = outputs()
    out = []
    for plan, tplan in zip(plans[1:], tplans):
        report = eng.apply_transition(tplan, plan.home("actor"))
        now = outputs()
        res = {"rank": rank, "mismatches": mismatches(store, job, seed), "regions": len(store),
               "bytes_sent": report.bytes_sent, "bytes_copied": report.bytes_copied, "messages": report.messages,
               "in_pool": eng.in_pool,
               "bytes_held": eng.bytes_held()}
        if first["logits"] is not None and now["logits"] is not None:
            res["logits_max_diff"] = float((first["logits"] - now["logits"]).abs().max())
            res["logprobs_max_diff"] = float((first["logprobs"] - now["logprobs"]).abs().max())
            res["greedy_equal"] = bool(torch.equal(first["greedy"], now["greedy"]))
            res["sampled_equal"] = bool(torch.equal(first["sampled"], now["sampled"]))
        out.append(res)
    return out


def _train(eng: Engine, phases: list[tuple[Plan, int]], tplans: list[TransitionPlan], rows: int, cols: int) -> dict:
    store, vocab = eng.store, eng.model.vocab
    losses: list[float | None] = []
    carried: list[dict] = []
    for i, (plan, steps) in enumerate(phases):
        if i > 0:
            before = {r: t.clone() for r, t in store.items() if r.kind != "param"}
            step_before = store.step.get("actor")
            eng.apply_transition(tplans[i - 1], plan.home("actor"))
            carried.append({"before": before, "after": {r: t.clone() for r, t in store.items() if r.kind != "param"},
                            "step_before": step_before, "step_after": store.step.get("actor")})
        for _ in range(steps):
            losses.append(eng.train_step(batch(vocab, rows, cols, 1000 + len(losses))))
    return {"losses": losses, "step": store.step.get("actor"), "carried": carried,
            "final": {r: t.detach().clone() for r, t in store.items() if r.model == "actor"}}


def train_run(rank: int, world: int, job: JobSpec, phases: list[tuple[Plan, int]], tplans: list[TransitionPlan],
              seed: int, rows: int = 8, cols: int = 12, reference: bool = True, precision: str = "fp32") -> dict:
    """Train ``k_i`` steps in plan i, transitioning between phases with ``tplans[i-1]``; then,
    in the same processes from the same seed, the run that stays in ``phases[0]``'s plan for
    as many steps. Step s trains on a batch seeded by s, so both runs see the same data."""
    out = {"rank": rank}
    total = sum(k for _, k in phases)
    runs = [("moved", phases, tplans)] + ([("stayed", [(phases[0][0], total)], [])] if reference else [])
    for name, ph, tps in runs:
        store = ShardStore()
        init_store(store, job, ph[0][0], rank, seed, random_moments=False, precision=precision)
        eng = Engine(rank, world, job.model("actor"), ph[0][0].home("actor"), store, precision=precision)
        out[name] = _train(eng, ph, tps, rows, cols)
    return out


def reshard_cases(rank: int, world: int, job: JobSpec, cases: list[tuple[Plan, Plan, TransitionPlan]], seed: int,
                  timeout_s: float = 20.0, precision: str = "fp32") -> list[dict]:
    """Several (A, B) cases one after the other in the same processes (fresh store each)."""
    return [reshard_case(rank, world, job, a, b, tp, seed + i, None, timeout_s, precision=precision)
            for i, (a, b, tp) in enumerate(cases)]


def reshard_fault_cases(rank: int, world: int, job: JobSpec, cases: list[tuple[Plan, Plan, TransitionPlan, FaultSpec]],
                        seed: int, timeout_s: float, precision: str = "fp32") -> list[dict]:
    """Fault cases one after the other in the same processes (torchrun: one process group for
    all); every case must roll back. A ``kill`` fault cannot run this way (it ends the run)."""
    return [reshard_case(rank, world, job, a, b, tp, seed + i, fault, timeout_s, precision=precision)
            for i, (a, b, tp, fault) in enumerate(cases)]
