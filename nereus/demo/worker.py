"""One rank of the demo's GRPO run (spawned by ``run.py`` on ``world`` gloo processes).

Every step: weight sync of the actor into its generation layout (a real transition of the actor's
params, checksum-verified), generation with a KV cache that stops each sequence at its first wrong
token, old log-probs (actor/inference) and reference log-probs (ref/inference), one AdamW step of
GRPO on the actor (actor/training). Rank 0 hosts the controller (torch-free planner): it gets the
step's measured metrics and answers stay or switch; a switch is applied through the executor to
every model's state at once and verified by checksum before it commits.

The memory budget is enforced at phase boundaries: when any rank's accounted peak (store +
gradients + KV cache / logits / saved activations) passed the budget, the step is aborted there and
its update is not applied, as an out-of-memory step would be on a GPU.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.distributed as dist

from nereus.demo.grpo import group_advantages
from nereus.demo.setup import DEMO_MODEL, LAST_STEP, DemoConfig, cap_at
from nereus.demo.task import CountingTask
from nereus.errors import SpecError, TransitionError
from nereus.executor.apply import RolledBack, apply_transition
from nereus.executor.engine import Engine, warm_recompute
from nereus.executor.layout import check_executable, stored
from nereus.executor.memory import MemoryMeter
from nereus.executor.optim import AdamW
from nereus.executor.store import ShardStore
from nereus.executor.transport import DistTransport
from nereus.planner.cost.plan_times import same_layout
from nereus.planner.plan import Plan

GiB = 1024**3


def _fill(engine: Engine, full: dict[str, torch.Tensor]) -> None:
    for r in engine.regions:
        if r.kind == "param":
            engine.store.put(r, stored(DEMO_MODEL, r, full[r.tensor][tuple(slice(o, o + n) for o, n in
                                                                           zip(r.offsets, r.lengths))]))
        else:  # a fresh optimizer: Adam moments start at zero
            engine.store.put(r, stored(DEMO_MODEL, r, torch.zeros(r.lengths)))
    engine.store.step[engine.role] = 0
    engine.rebind(engine.placement)


def _any(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0])


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _sum(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t[0])


def _bcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def apply_on_every_rank(store, tplan, rank: int, world: int, fault, what: str):
    """Apply ``tplan`` on this rank as every rank does: (record fields, this rank's report or None).
    Fields: ``transition_s`` (slowest rank), ``transition_bytes``, ``regions_verified`` (all ranks)
    and ``verified``: every rank committed (each only after every rank's checksums matched) and
    between them they verified every region the plan creates (kept ones stay as they are); on a
    rollback on every rank, ``transition_error`` and ``rolled_back``. Ranks that disagree (some
    committed, some rolled back) raise TransitionError naming ``what``."""
    t0 = time.perf_counter()
    report, failure = None, ""
    try:
        report = apply_transition(store, tplan, rank, DistTransport(rank), timeout_s=60.0, fault=fault)
    except RolledBack as e:
        failure = str(e)
    rec = {"transition_s": _max(time.perf_counter() - t0), "transition_bytes": int(tplan.bytes_moved)}
    committed = _sum(int(report is not None))
    if 0 < committed < world:
        raise TransitionError(f"{committed} of {world} ranks committed {what}, the others "
                              f"rolled back: the layouts disagree ({failure or 'this rank committed'})")
    rec["regions_verified"] = _sum(report.regions_verified if report is not None else 0)
    rec["verified"] = bool(committed) and rec["regions_verified"] == len(set(tplan.dst) - set(tplan.kept))
    if not committed:
        rec["transition_error"], rec["rolled_back"] = failure, True
    return rec, report


def _gen_placement_plan(plan: Plan) -> Plan:
    """``plan`` with the actor's state homed in its generation layout (the weight-sync target)."""
    gen = plan.stage("actor/generation")
    home = replace(plan.stage("actor/training"), config=replace(gen.config, zero=0), first_gpu=gen.first_gpu,
                   gpus=gen.gpus, pool=gen.pool)
    return replace(plan, stages=tuple(home if s.name == "actor/training" else s for s in plan.stages))


class _Sync:
    """Per-step actor weight sync, training layout -> generation layout (params only)."""

    def __init__(self, job, cluster) -> None:
        self.job, self.cluster, self.cache = job, cluster, {}

    def plan_for(self, plan: Plan):
        """Rank 0 plans (torch-free planner) once per layout pair; other ranks get it broadcast."""
        from nereus.executor.scenario import restrict
        from nereus.planner.transition.build import plan_transition

        key = plan.layout_key()
        if key not in self.cache:
            t = plan_transition(self.job, self.cluster, plan, _gen_placement_plan(plan), mixed_precision=False,
                                include_optimizer=False, scheduler="greedy")
            self.cache[key] = restrict(t, "actor")
        return self.cache[key]


class _Run:
    """State of one rank across steps."""

    def __init__(self, rank: int, world: int, cfg: DemoConfig, full: dict, job, cluster, params, plan: Plan,
                 policy: str) -> None:
        self.rank, self.world, self.cfg, self.job, self.cluster = rank, world, cfg, job, cluster
        self.plan, self.policy = plan, policy
        warm_recompute()  # a one-time import cost, paid before the run rather than in a step
        self.task = CountingTask()
        self.store = ShardStore()
        self.actor = Engine(rank, world, DEMO_MODEL, plan.home("actor"), self.store, role="actor", trainable=True,
                            optim=AdamW(lr=cfg.lr))
        self.ref = Engine(rank, world, DEMO_MODEL, plan.home("ref"), self.store, role="ref", trainable=False)
        _fill(self.actor, full)
        _fill(self.ref, full)
        self.gen_store: ShardStore | None = None
        self.meter = MemoryMeter(cfg.budget_mb * 1024**2)
        self.meter.resident_fn = self._resident
        self.actor.meter = self.meter
        self.sync = _Sync(job, cluster)
        self.controller = None
        if rank == 0:
            from nereus.demo.policy import make_demo_controller

            self.controller = make_demo_controller(policy, job, cluster, params, plan, cfg)

    def _resident(self) -> int:
        grads = sum(t.grad.numel() * t.grad.element_size() for t in self.actor.w.values() if t.grad is not None)
        return self.store.nbytes() + grads + (self.gen_store.nbytes() if self.gen_store is not None else 0)

    def _timed(self, times: dict, name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times[name] = time.perf_counter() - t0
        return out

    def _generation_engine(self) -> Engine:
        gen = self.plan.stage("actor/generation")
        if same_layout(gen, self.plan.home("actor")):  # as the planner prices it (shares_training_weights)
            return self.actor  # generation runs on the training shards: nothing to sync
        else:
            tplan = _bcast(self.sync.plan_for(self.plan) if self.rank == 0 else None)
            tmp = ShardStore()
            for r, t in self.store.items():
                if r.model == "actor" and r.kind == "param":
                    tmp.put(r, t.detach())
            apply_transition(tmp, tplan, self.rank, DistTransport(self.rank), timeout_s=60.0)
            self.gen_store = tmp
            gplan = _gen_placement_plan(self.plan)
            engine = Engine(self.rank, self.world, DEMO_MODEL, gplan.home("actor"), tmp, role="actor", trainable=False)
        engine.meter = self.meter
        return engine

    def step(self, step: int) -> dict:
        cfg, task = self.cfg, self.task
        self.meter.reset()
        t_step = time.perf_counter()
        g = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
        prompts = task.prompts(cfg.prompts, g).repeat_interleave(cfg.samples, 0)
        cap = cap_at(cfg, step)
        targets = task.targets(prompts, cap)
        times: dict[str, float] = {}
        gen = self._timed(times, "actor/generation", self._generation_engine)
        seqs = self._timed(times, "actor/generation+", lambda: gen.generate(
            prompts, cap, cfg.temperature, seed=cfg.seed * 7919 + step, stop_targets=targets))
        times["actor/generation"] += times.pop("actor/generation+")
        if _any(seqs is None):
            raise RuntimeError(f"demo step {step}: plan {_layout_label(self.plan)} runs actor/generation on "
                               f"{gen.placement.gpus} of {self.world} ranks; the demo's worker needs every model "
                               "on every rank (colocated plans)")
        self.gen_store = None
        P = task.prompt_len
        resp = seqs[:, P:]
        wrong = resp != targets[:, :resp.shape[1]]
        first_wrong = torch.where(wrong.any(1), wrong.float().argmax(1), torch.full((resp.shape[0],), resp.shape[1]))
        lengths = torch.clamp(first_wrong + 1, max=resp.shape[1])
        rewards = task.score(prompts, resp, lengths)
        oom, phase = _any(self.meter.over_budget()), "generation"
        loss = None
        if not oom:
            ids = seqs
            infer_mb = self.plan.stage("actor/inference").config.micro_batch  # the actor's engine holds training's
            old = self._timed(times, "actor/inference", lambda: self.actor.logprobs(ids, infer_mb))
            refl = self._timed(times, "ref/inference", lambda: self.ref.logprobs(ids))
            oom, phase = _any(self.meter.over_budget()), "experience"
        if not oom:
            T = ids.shape[1]
            pos = torch.arange(T - 1)[None, :]
            mask = ((pos >= P - 1) & (pos < P - 1 + lengths[:, None])).float()
            adv = group_advantages(rewards, cfg.samples)
            weights = mask * (adv[:, None] + cfg.beta * (torch.exp(refl - old) - 1))
            weights = weights * (ids.shape[0] * (T - 1)) / mask.sum().clamp(min=1)
            loss = self._timed(times, "actor/training", lambda: self.actor.train_step(
                ids, weights, before_update=lambda: not _any(self.meter.over_budget())))
            oom, phase = loss is None, "training"
        peak = _max(float(self.meter.peak))
        lf = lengths.float()
        return {"step": step, "response_len_mean": float(lf.mean()), "response_len_max": int(lengths.max()),
                "response_len_p90": float(torch.quantile(lf, 0.9)), "reward": float(rewards.mean()),
                "loss": loss, "oom": oom, "oom_phase": phase if oom else "", "stage_times": times,
                "step_s": time.perf_counter() - t_step, "peak_mem_bytes": peak,
                "peak_mem_frac": peak / (cfg.budget_mb * 1024**2), "plan": _layout_label(self.plan),
                "plan_spec": self.plan.to_dict(),
                "cap": cap, "next_cap": cap_at(cfg, step + 1), "sequences": int(prompts.shape[0]),
                "recompute": self.plan.stage("actor/training").config.recompute}

    def decide(self, rec: dict) -> dict:
        """Rank 0 asks the controller; every rank applies its answer (a transition raises
        TransitionError after rolling back if any rank failed to verify its regions)."""
        answer = self._answer(self.controller.step(rec), rec.get("step")) if self.rank == 0 else None
        new_plan, tplan, info = _bcast(answer)
        rec = {**rec, **info}
        if new_plan is None:
            return rec
        if tplan is not None:
            fields, report = apply_on_every_rank(self.store, tplan, self.rank, self.world, self.cfg.fault,
                                                 "the transition")
            rec.update(fields)
            if rec.get("rolled_back"):  # every rank rolled back: its old layout is intact, the run stays on it
                if self.rank == 0:  # the controller goes back to the plan the run is still on, and audits it
                    self.controller.report_rollback(rec["transition_error"], step=rec["step"])
                return rec
            # the old state stays until commit (rollback): the transition's own high point
            rec["transition_peak_mem_frac"] = _max(float(report.peak_bytes)) / (self.cfg.budget_mb * 1024**2)
        self.plan = new_plan
        self.actor.rebind(new_plan.home("actor"))
        self.ref.rebind(new_plan.home("ref"))
        if self.rank == 0 and tplan is not None:
            self.controller.report_transition(rec["transition_s"])
        return rec

    def _answer(self, decision, step: int | None = None):
        """(new plan or None, transition plan or None, audit fields) on rank 0."""
        from nereus.planner.transition.build import plan_transition

        info = {"decision": decision.action, "reason": decision.reason, "must": decision.must,
                "predicted_cost_s": decision.predicted_cost_s, "controller_s": decision.overhead_s}
        if decision.plan == self.plan:
            return None, None, info
        if (refused := refuse_unexecutable(decision, self.controller, info, step)) is not None:
            return None, None, refused
        if decision.plan.layout_key() == self.plan.layout_key():
            return decision.plan, None, info  # knobs only (micro-batch): no state moves
        tplan = plan_transition(self.job, self.cluster, self.plan, decision.plan, mixed_precision=False,
                                scheduler="greedy")
        info["next_plan"] = _layout_label(decision.plan)
        return decision.plan, tplan, info


def refuse_unexecutable(decision, controller, info: dict, step: int | None) -> dict | None:
    """Audit fields of a refused decision when the reference executor cannot run ``decision.plan``
    (e.g. ZeRO-3, which it does not run), after telling the controller it was not applied; else None."""
    try:
        for s in decision.plan.stages:
            check_executable(s)
    except SpecError as e:
        controller.report_rollback(f"not applied: {e}", step=step)
        return {**info, "decision": "refused", "reason": f"{decision.reason}; not applied: {e}"}
    return None


def _layout_label(plan: Plan) -> str:
    parts = []
    for name in ("actor/training", "actor/generation", "ref/inference"):
        c = plan.stage(name).config
        parts.append(f"{name.split('/')[0][0]}{name.split('/')[1][0]}:tp{c.tp}dp{c.dp}" + (f"pp{c.pp}" if c.pp > 1 else ""))
    return " ".join(parts)


def rank_main(rank: int, world: int, cfg: DemoConfig, full: dict, job, cluster, params, plan: Plan,
              policy: str) -> list[dict]:
    """The whole run on one rank; rank 0 returns the per-step records."""
    from nereus.executor.launch import torchrun_env

    if torchrun_env() is not None:  # each torchrun process prepared (and timed) on its own: rank 0's decides
        full, job, cluster, params, plan = _bcast((full, job, cluster, params, plan))
    torch.manual_seed(cfg.seed)
    run = _Run(rank, world, cfg, full, job, cluster, params, plan, policy)
    records = []
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{policy} GRPO steps", unit="step", leave=False)
    for step in range(cfg.steps):
        rec = run.step(step)
        rec = run.decide(rec) if step + 1 < cfg.steps else {**rec, **LAST_STEP}
        records.append(rec)
        if bar is not None:
            bar.set_postfix(len=f"{rec['response_len_mean']:.0f}", plan=rec["plan"].split()[0],
                            mem=f"{rec['peak_mem_frac']:.0%}")
            bar.update(1)
    if bar is not None:
        bar.close()
    if run.controller is not None:
        run.controller.close()
    return records if rank == 0 else []
