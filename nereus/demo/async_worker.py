"""One rank of the demo's one-step-off run (``nereus demo --schedule one_step_off``).

The plan is asynchronous: actor/generation has a pool of its own (the rollout ranks), every other
model-stage sits on the rest (the trainer ranks). Step k, on disjoint ranks at the same time:

- trainer ranks: log-probs (actor/inference, ref/inference) and one GRPO step (actor/training) on
  batch k, which the rollout generated during step k-1 with the weights of version k-1;
- rollout ranks: generation of batch k+1 with the weights they hold (version k, synced at the end
  of step k-1).

Then every rank meets: the rollout hands batch k+1 over, rank 0's controller (torch-free planner)
observes step k and answers stay or switch; a switch (a re-split: rollout and trainer pools
change) moves the trainer state (actor params and Adam moments, ref params) to its new pools
through the executor's transition path (``apply_transition``: checksummed, committed only when every
rank verified it); then the weight sync, itself a transition of the actor's params from its
training layout (trainer ranks) into its generation layout (rollout ranks), creates the rollout's
copy of version k+1 (after a re-split: the new rollout replicas). So batch k+1 is trained at
version k+1 on weights one version newer than the ones that generated it: staleness 1 (batch 0,
generated before any update, has 0).

With ``cfg.check_sync`` every rank also sends rank 0 its actor params after each sync, and rank 0
compares the rollout's copy with the trainer's bit for bit (independently of the transition's own
checksums) and records a digest of each, so the staleness can be checked against what the rollout
really held. The memory meter records each rank's peak; an over-budget step is completed (CPU),
reported to the controller as out of memory, as a GPU would fail it.
"""
from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from nereus.demo.async_plan import (
    TRAINER_STAGES,
    rollout_ranks,
    split_label,
    trainer_ranks,
)
from nereus.demo.grpo import group_advantages
from nereus.demo.setup import DEMO_MODEL, LAST_STEP, DemoConfig, cap_at
from nereus.demo.task import CountingTask
from nereus.demo.worker import (
    _bcast,
    _fill,
    _gen_placement_plan,
    _max,
    _sum,
    _Sync,
    apply_on_every_rank,
    refuse_unexecutable,
)
from nereus.executor.apply import apply_transition
from nereus.executor.engine import Engine, warm_recompute
from nereus.executor.memory import MemoryMeter
from nereus.executor.optim import AdamW
from nereus.executor.parallel import group_of
from nereus.executor.store import ShardStore
from nereus.executor.transport import DistTransport
from nereus.planner.plan import Plan


def _maxes(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t]


def _digest(full: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(full):
        h.update(name.encode())
        h.update(full[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def compare_copies(pieces: list[tuple[str, list]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """Rank 0's check of a weight sync: ``pieces`` per rank (its side, "trainer" or "rollout", and
    its (region, tensor) actor params). The trainer's full tensors are assembled from its regions;
    every rollout region must equal its slice bit for bit, and the rollout's regions must cover
    every tensor. Returns whether they did, the mismatching regions and a digest of each side."""
    sides: dict[str, dict[str, torch.Tensor]] = {"trainer": {}, "rollout": {}}
    covered: dict[str, dict[str, torch.Tensor]] = {"trainer": {}, "rollout": {}}
    bad = []
    for side, regions in pieces:
        for r, t in regions:
            full = sides[side].setdefault(r.tensor, torch.zeros(shapes[r.tensor], dtype=t.dtype))
            seen = covered[side].setdefault(r.tensor, torch.zeros(shapes[r.tensor], dtype=torch.bool))
            box = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))
            full[box] = t
            seen[box] = True
    for side in sides:
        for name in shapes:
            if name not in covered[side] or not bool(covered[side][name].all()):
                bad.append(f"{side} does not hold all of {name}")
    for side, regions in pieces:
        if side != "rollout":
            continue
        for r, t in regions:
            ref = sides["trainer"].get(r.tensor)
            box = tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))
            if ref is None or not torch.equal(ref[box].contiguous().view(torch.uint8),
                                              t.contiguous().view(torch.uint8)):
                bad.append(f"rollout {r.tensor}@{r.offsets} differs from the trainer's")
    return {"bit_exact": not bad, "mismatches": bad[:8], "trainer_digest": _digest(sides["trainer"]),
            "rollout_digest": _digest(sides["rollout"])}


class AsyncRun:
    """State of one rank across the one-step-off run."""

    def __init__(self, rank: int, world: int, cfg: DemoConfig, full: dict, job, cluster, params, plan: Plan) -> None:
        self.rank, self.world, self.cfg, self.job, self.cluster, self.plan = rank, world, cfg, job, cluster, plan
        warm_recompute()
        self.task = CountingTask()
        self.store = ShardStore()
        self.actor = Engine(rank, world, DEMO_MODEL, plan.home("actor"), self.store, role="actor", trainable=True,
                            optim=AdamW(lr=cfg.lr))
        self.ref = Engine(rank, world, DEMO_MODEL, plan.home("ref"), self.store, role="ref", trainable=False)
        _fill(self.actor, full)
        _fill(self.ref, full)
        self.shapes = {k: tuple(v.shape) for k, v in full.items()}
        self.meter = MemoryMeter(cfg.budget_mb * 1024**2)
        self.meter.resident_fn = self._resident
        self.actor.meter = self.meter
        self.ref.meter = self.meter
        self.sync = _Sync(job, cluster)
        self.gen_store: ShardStore | None = None
        self.gen: Engine | None = None
        self.gen_version, self.gen_digest = -1, ""
        self._bind_groups()
        self.controller = None
        self.params = params
        if rank == 0 and not cfg.force_split:
            from nereus.demo.async_plan import make_async_controller

            self.controller = make_async_controller(job, cluster, params, plan, cfg)

    def _bind_groups(self) -> None:
        """The trainer ranks' group (collective: called on every rank at the same point)."""
        self.trainers = trainer_ranks(self.plan)
        self.trainer_group = group_of(self.trainers) if len(self.trainers) > 1 else None

    def _resident(self) -> int:
        grads = sum(t.grad.numel() * t.grad.element_size() for t in self.actor.w.values() if t.grad is not None)
        return self.store.nbytes() + grads + (self.gen_store.nbytes() if self.gen_store is not None else 0)

    @property
    def is_rollout(self) -> bool:
        return self.rank in rollout_ranks(self.plan)

    def version(self) -> int:
        """Optimizer steps the trainer's actor has taken (collective: every rank learns it)."""
        return int(_max(float(self.store.step.get("actor", 0))))

    # ---- the weight sync: trainer ranks -> rollout ranks ---------------------------------------
    def weight_sync(self) -> dict:
        """The actor's params from its training layout into its generation layout (a transition,
        checksummed end to end and committed only when every rank verified), timed."""
        tplan = _bcast(self.sync.plan_for(self.plan) if self.rank == 0 else None)
        version = self.version()
        tmp = ShardStore()
        for r, t in self.store.items():
            if r.model == "actor" and r.kind == "param":
                tmp.put(r, t.detach())
        dist.barrier()
        t0 = time.perf_counter()
        report = apply_transition(tmp, tplan, self.rank, DistTransport(self.rank), timeout_s=60.0)
        sync_s = _max(time.perf_counter() - t0)
        verified = _sum(report.regions_verified) == len(set(tplan.dst) - set(tplan.kept))
        gplan = _gen_placement_plan(self.plan)
        self.gen_store = tmp if self.is_rollout else None
        self.gen = Engine(self.rank, self.world, DEMO_MODEL, gplan.home("actor"), tmp, role="actor", trainable=False)
        self.gen.meter = self.meter
        self.gen_version = version
        out = {"sync_s": sync_s, "sync_bytes": int(tplan.bytes_moved), "sync_verified": bool(verified),
               "sync_version": version}
        if self.cfg.check_sync:
            out.update(self._check_sync())
        self.gen_digest = out.get("rollout_digest", "")
        return out

    def _check_sync(self) -> dict:
        if self.is_rollout:
            mine = ("rollout", [(r, t.detach().clone()) for r, t in self.gen_store.items()])
        else:
            mine = ("trainer", [(r, t.detach().clone()) for r, t in self.store.items()
                                if r.model == "actor" and r.kind == "param"])
        got = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, got, dst=0)
        return compare_copies(got, self.shapes) if self.rank == 0 else {}

    # ---- one step: training of batch k beside generation of batch k+1 --------------------------
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + step)
        prompts = self.task.prompts(self.cfg.prompts, g).repeat_interleave(self.cfg.samples, 0)
        cap = cap_at(self.cfg, step)
        return prompts, self.task.targets(prompts, cap), cap

    def generate(self, step: int) -> dict | None:
        """Rollout ranks: batch ``step`` with the weights they hold; None elsewhere."""
        if not self.is_rollout:
            return None
        prompts, targets, cap = self.batch(step)
        t0 = time.perf_counter()
        seqs = self.gen.generate(prompts, cap, self.cfg.temperature, seed=self.cfg.seed * 7919 + step,
                                 stop_targets=targets)
        return {"seqs": seqs, "gen_s": time.perf_counter() - t0, "version": self.gen_version,
                "digest": self.gen_digest, "plan": split_label(self.plan), "plan_key": self.plan.key(), "step": step}

    def handoff(self, item: dict | None) -> dict:
        """The rollout's first rank hands a generated batch to every rank."""
        return _bcast_from(item, rollout_ranks(self.plan)[0])

    def train(self, item: dict) -> dict:
        """Trainer ranks: experience and one GRPO step on the batch in ``item``; every figure is
        this rank's (0 where it had no part)."""
        cfg, task, P = self.cfg, self.task, self.task.prompt_len
        prompts, targets, cap = self.batch(item["step"])
        seqs = item["seqs"]
        resp = seqs[:, P:]
        wrong = resp != targets[:, :resp.shape[1]]
        first_wrong = torch.where(wrong.any(1), wrong.float().argmax(1), torch.full((resp.shape[0],), resp.shape[1]))
        lengths = torch.clamp(first_wrong + 1, max=resp.shape[1])
        rewards = task.score(prompts, resp, lengths)
        times = {"actor/inference": 0.0, "ref/inference": 0.0, "actor/training": 0.0}
        loss = None
        version = int(self.store.step.get("actor", 0))
        if self.rank in self.trainers:
            ids = seqs
            infer_mb = self.plan.stage("actor/inference").config.micro_batch
            t0 = time.perf_counter()
            old = self.actor.logprobs(ids, infer_mb)
            times["actor/inference"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            refl = self.ref.logprobs(ids)
            times["ref/inference"] = time.perf_counter() - t0
            if self.plan.home("ref").gpu_ids() != self.plan.home("actor").gpu_ids() and self.trainer_group is not None:
                t0 = time.perf_counter()  # the reference's pool hands its log-probs to the actor's
                buf = refl if refl is not None else torch.empty(ids.shape[0], ids.shape[1] - 1)
                dist.broadcast(buf, src=self.plan.home("ref").first_gpu, group=self.trainer_group)
                refl = buf
                times["ref/inference"] += time.perf_counter() - t0
            if self.actor.in_pool:
                T = ids.shape[1]
                pos = torch.arange(T - 1)[None, :]
                mask = ((pos >= P - 1) & (pos < P - 1 + lengths[:, None])).float()
                adv = group_advantages(rewards, cfg.samples)
                weights = mask * (adv[:, None] + cfg.beta * (torch.exp(refl - old) - 1))
                weights = weights * (ids.shape[0] * (T - 1)) / mask.sum().clamp(min=1)
                t0 = time.perf_counter()
                loss = self.actor.train_step(ids, weights)
                times["actor/training"] = time.perf_counter() - t0
        lf = lengths.float()
        return {"times": times, "loss": loss, "train_version": version, "cap": cap,
                "response_len_mean": float(lf.mean()), "response_len_max": int(lengths.max()),
                "response_len_p90": float(torch.quantile(lf, 0.9)), "reward": float(rewards.mean()),
                "sequences": int(prompts.shape[0])}

    # ---- a re-split: the controller's switch, applied through the executor ---------------------
    def decide(self, rec: dict) -> dict:
        answer = None
        if self.rank == 0:
            answer = self._scripted(rec) if self.cfg.force_split else self._answer(self.controller.step(rec),
                                                                                  rec["step"])
        new_plan, tplan, info = _bcast(answer)
        rec = {**rec, **info}
        if new_plan is None:
            return rec
        if tplan is not None:
            fields, _ = apply_on_every_rank(self.store, tplan, self.rank, self.world, self.cfg.fault, "the re-split")
            rec.update(fields)
            if rec.get("rolled_back"):
                if self.rank == 0:
                    self.controller.report_rollback(rec["transition_error"], step=rec["step"])
                return rec
            rec["resplit"] = len(rollout_ranks(new_plan)) != len(rollout_ranks(self.plan))
        self.plan = new_plan
        self.actor.rebind(new_plan.home("actor"))
        self.ref.rebind(new_plan.home("ref"))
        self._bind_groups()
        if self.rank == 0 and tplan is not None and self.controller is not None:
            self.controller.report_transition(rec["transition_s"])
        return rec

    def _answer(self, decision, step: int):
        """(new plan or None, transition plan or None, audit fields) on rank 0."""
        info = {"decision": decision.action, "reason": decision.reason, "must": decision.must,
                "predicted_cost_s": decision.predicted_cost_s}
        if decision.plan == self.plan:
            return None, None, info
        if (refused := refuse_unexecutable(decision, self.controller, info, step)) is not None:
            return None, None, refused
        return self._move(decision.plan, info)

    def _move(self, new: Plan, info: dict):
        from nereus.planner.transition.build import plan_transition

        info = {**info, "next_plan": split_label(new)}
        if new.layout_key() == self.plan.layout_key():
            return new, None, info
        # the generation copy is rebuilt by the next weight sync; the transition moves the state
        tplan = plan_transition(self.job, self.cluster, self.plan, new, mixed_precision=False, scheduler="greedy")
        return new, tplan, info

    def _scripted(self, rec: dict):
        """``cfg.force_split`` (tests): after the listed steps, the fastest plan the planner finds
        with that many rollout ranks, whatever a controller would say."""
        from nereus.demo.async_plan import split_plan

        step = rec["step"]
        want = dict(self.cfg.force_split).get(step)
        if want is None or want == len(rollout_ranks(self.plan)):
            return None, None, {"decision": "stay", "reason": "scripted run (force_split)"}
        w = self.job.workload().with_lengths(mean=max(1.0, rec["response_len_mean"]), max_=rec["next_cap"])
        return self._move(split_plan(self.job, self.cluster, self.params, self.cfg, want, w),
                          {"decision": "switch", "reason": f"scripted: {want} rollout rank(s) after step {step}",
                           "must": False, "predicted_cost_s": None})


def _bcast_from(obj, src: int):
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _record(step: int, item: dict, trained: dict, wall: dict, plan: Plan) -> dict:
    """Step ``step``'s record from what the ranks measured (already max-reduced in ``wall``); the
    weight sync that ends the step is added by ``add_sync``. ``stage_times`` are what the controller
    calibrates ``plan`` with: the batch trained here was generated during the step before, so right
    after a re-split its generation ran on the old plan's rollout pool and is left out (kept as
    ``gen_s`` with ``gen_plan``)."""
    gen = {"actor/generation": item["gen_s"]} if item.get("plan_key") == plan.key() else {}
    stage_times = {**gen, **{k: wall[k] for k in TRAINER_STAGES}}
    return {**{k: v for k, v in trained.items() if k != "times"}, "step": step, "stage_times": stage_times,
            "rollout_s": wall["rollout_s"], "train_s": wall["trainer_s"], "overlap_s": wall["overlap_s"],
            "handoff_s": wall["handoff_s"], "gen_s": item["gen_s"], "gen_version": item["version"], "gen_digest": item["digest"],
            "gen_plan": item["plan"], "staleness": trained["train_version"] - item["version"]}


def add_sync(rec: dict, sync: dict | None) -> dict:
    """``rec`` with the step's wall time (the overlapped phase, the hand-over, the weight sync that
    ends it; a re-split's transition is counted apart, ``transition_s``) and each pool's idle share
    of it: the part of the overlapped phase it waited for the other."""
    sync_s = sync["sync_s"] if sync else 0.0
    step_s = rec["overlap_s"] + rec["handoff_s"] + sync_s
    idle = {side: max(0.0, rec["overlap_s"] - busy) / step_s if step_s > 0 else 0.0
            for side, busy in (("rollout", rec["rollout_s"]), ("trainer", rec["train_s"]))}
    return {**rec, "sync": sync, "sync_s": sync_s, "step_s": step_s, "idle_share": idle}


def async_main(rank: int, world: int, cfg: DemoConfig, full: dict, job, cluster, params, plan: Plan) -> list[dict]:
    """The whole one-step-off run on one rank; rank 0 returns the per-step records."""
    from nereus.executor.launch import torchrun_env

    if torchrun_env() is not None:
        full, job, cluster, params, plan = _bcast((full, job, cluster, params, plan))
    torch.manual_seed(cfg.seed)
    run = AsyncRun(rank, world, cfg, full, job, cluster, params, plan)
    first_sync = run.weight_sync()  # version 0 onto the rollout ranks
    item = run.handoff(run.generate(0))  # batch 0: nothing to train beside it
    records: list[dict] = []
    for step in range(cfg.steps):
        run.meter.reset()
        dist.barrier()
        t0 = time.perf_counter()
        gen_next = run.generate(step + 1) if step + 1 < cfg.steps else None  # the last step has none to make
        trained = run.train(item) if rank in run.trainers else None
        busy = time.perf_counter() - t0
        mine = [busy, gen_next["gen_s"] if gen_next else 0.0, sum(trained["times"].values()) if trained else 0.0]
        vals = _maxes(mine + [trained["times"][k] if trained else 0.0 for k in TRAINER_STAGES])
        overlap_s = time.perf_counter() - t0  # the slower side's work, then the join
        trained = _bcast_from(trained, run.plan.home("actor").first_gpu)
        t2 = time.perf_counter()
        nxt = run.handoff(gen_next) if step + 1 < cfg.steps else None
        handoff_s = _max(time.perf_counter() - t2)
        peak = _max(float(run.meter.peak))
        wall = {"overlap_s": overlap_s, "handoff_s": handoff_s, "rollout_s": vals[1], "trainer_s": vals[2],
                **dict(zip(TRAINER_STAGES, vals[3:]))}
        rec = _record(step, item, trained, wall, run.plan)
        rec.update(peak_mem_bytes=peak, peak_mem_frac=peak / (cfg.budget_mb * 1024**2), plan=split_label(run.plan),
                   next_cap=cap_at(cfg, step + 1), rollout_ranks=len(rollout_ranks(run.plan)),
                   trainer_ranks=len(run.trainers), busy_max_s=vals[0])
        rec["oom"] = rec["peak_mem_frac"] > 1.0
        if step == 0:
            rec["first_sync"] = first_sync
        rec = run.decide(rec) if step + 1 < cfg.steps else {**rec, **LAST_STEP}
        # version step+1 onto the (possibly new) rollout ranks: after a re-split, its new replicas
        rec = add_sync(rec, run.weight_sync() if step + 1 < cfg.steps else None)
        records.append(rec)
        item = nxt
    if run.controller is not None:
        run.controller.close()
    return records if rank == 0 else []
