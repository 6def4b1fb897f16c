"""``GroundTruth``: what a step of a plan "really" takes in the simulation (SIMULATED).

Per step: the response lengths are sampled (``lengths.py``); generation runs them through the
engines (``engine.py``); inference and training run them through micro-batches and pipelines
(``pipeline.py``); stage times compose like the job's dataflow (phases in sequence; inside a phase,
model-stages sharing GPUs one after another, disjoint GPUs in parallel: pools may nest, so this is
counted per GPU range), plus the actor's weight sync
and, when the engine shares its GPUs, its wake-up and sleep (``network.py``). Each model-stage's
time gets a small seeded jitter (the same factor for every plan at a step: policies are compared on
common random numbers). A model-stage whose sampled batch does not fit in memory is an OOM: the step
fails after the phases before it and half of that stage.

Evaluation is vectorised over blocks of ``block`` steps and cached per (model-stage config, block),
so policies that run the same configuration share the work and the offline policies can score
whole candidate plans over the trace at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np

from nereus.errors import SpecError
from nereus.planner.plan import HOME_STAGE, Plan, StagePlacement
from nereus.planner.specs import TRAINABLE, ClusterSpec, JobSpec
from nereus.simulator.truth import network
from nereus.simulator.truth.corpus import tables
from nereus.simulator.truth.engine import _simulate, closed_form, covers, split_replicas
from nereus.simulator.truth.kernels import decode_coeffs, prefill_s
from nereus.simulator.truth.lengths import LengthSampler
from nereus.simulator.truth.memory import (ENGINE_MEMORY_UTILIZATION, GiB, capacity_bytes, kv_budget_tokens,
                                           offload_copy_s, offloaded_bytes, params_per_gpu, state_bytes)
from nereus.simulator.truth.pipeline import StageSpec, stage_times
from nereus.simulator.truth.timeline import Timeline, plan_timeline, schedule_of

Tasks = Iterable[tuple[int, int, float]]


@dataclass(frozen=True, slots=True)
class Observation:
    """One step as the job experiences it (what a training loop logs)."""

    stage_s: Mapping[str, float]
    step_s: float
    """inf when the step failed (OOM)."""
    feasible: bool
    peak_mem_gib: float
    response_len_mean: float
    response_len_max: int
    response_len_p90: float
    violations: tuple[str, ...] = field(default=())
    oom_stage: str | None = None
    lost_s: float = 0.0
    """Seconds burnt before a failure (0 when the step ran)."""


class LayoutChangePrices:
    """Seconds of a layout change a -> b, priced once per (layout, layout) pair by ``price(a, b)``;
    a change to the same layout is free. The one home of that rule for every simulated world (this
    ground truth and ``simulator/model_world.py``)."""

    def __init__(self, price: Callable[[Plan, Plan], float]) -> None:
        self._price = price
        self._seen: dict[tuple, float] = {}

    def __call__(self, a: Plan, b: Plan) -> float:
        if a.layout_key() == b.layout_key():
            return 0.0
        key = (a.layout_key(), b.layout_key())
        hit = self._seen.get(key)
        if hit is None:
            hit = self._seen[key] = float(self._price(a, b))
        return hit

    def priced(self) -> dict[tuple, float]:
        """Every price computed so far, by (layout key, layout key): what a forked worker hands back."""
        return dict(self._seen)

    def merge(self, priced: dict[tuple, float]) -> None:
        """Take prices computed elsewhere (a forked worker's ``priced()``; the same pure function of the
        pair, so a price already here is kept)."""
        for key, t in priced.items():
            self._seen.setdefault(key, float(t))


class GroundTruth:
    """The simulated machine for one job, cluster and trace (see the module docstring).

    ``trace`` needs ``rows`` with ``response_len_mean``, ``response_len_max``, optional
    ``response_len_cap`` (the trainer's limit; when absent the max is the cap),
    ``response_len_p90`` and ``prompt_len_mean``. ``schedule_fn(a, b)`` returns the transition
    planner's transfers (src GPU, dst GPU, bytes) in its order; transitions cannot be priced without it.
    """

    def __init__(self, job: JobSpec, cluster: ClusterSpec, trace, *, seed: int = 0, jitter: float = 0.02,
                 schedule_fn: Callable[[Plan, Plan], Tasks] | None = None, block: int = 64,
                 share_engines: bool = True) -> None:
        """``share_engines``: engines that differ only in their KV budget share what does not depend on
        it (``_generation``); False computes each budget alone (the same numbers, slower: the
        speed benchmark's control)."""
        self.job, self.cluster, self.seed, self.jitter, self.block = job, cluster, seed, jitter, block
        self.share_engines = share_engines
        self.tab = tables(cluster.gpu)
        self.links = network.Links.of(cluster, self.tab)
        self.schedule_fn = schedule_fn
        rows = trace.rows
        base = job.sequence
        self.n_steps = len(rows)
        self.mean = np.array([r.response_len_mean for r in rows], float)
        self.cap = np.array([(getattr(r, "response_len_cap", None) or r.response_len_max) for r in rows], float)
        self.p90 = np.array([np.nan if r.response_len_p90 is None else r.response_len_p90 for r in rows], float)
        self.prompt = np.array([base.prompt_len if r.prompt_len_mean is None else max(1, round(r.prompt_len_mean))
                                for r in rows], float)
        self.sampler = LengthSampler(job.batch.prompts, job.batch.samples_per_prompt, seed)
        self.stages = job.model_stages()
        rollout = getattr(job, "rollout", None)
        self.engine_util = getattr(rollout, "gpu_memory_utilization", None) or ENGINE_MEMORY_UTILIZATION
        self.max_seqs = int(getattr(rollout, "max_num_seqs", 256))
        self.engine_sleeps = bool(getattr(rollout, "sleep", True))
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._stage: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._coeffs: dict[tuple, tuple[np.ndarray, float]] = {}
        self._engines: dict[tuple, dict[str, np.ndarray]] = {}
        self._plans: dict[tuple, dict] = {}
        self.prices = LayoutChangePrices(self._live_transition_s)
        self._timelines: dict[tuple, Timeline] = {}

    # ---- lengths -------------------------------------------------------------------------------
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        hit = self._blocks.get(b)
        if hit is None:
            lo, hi = b * self.block, min(self.n_steps, (b + 1) * self.block)
            steps = np.arange(lo, hi)
            lengths = self.sampler.sample(steps, self.mean[lo:hi], self.p90[lo:hi], self.cap[lo:hi])
            rng = np.random.default_rng([self.seed, 11, b])
            jit = np.exp(rng.normal(0.0, self.jitter, (hi - lo, len(self.stages))))
            hit = self._blocks[b] = (lengths, jit)
        return hit

    def sample_all(self) -> None:
        """Sample every block's lengths now (before forking workers, so that they share them)."""
        for b in range(-(-self.n_steps // self.block)):
            self._block(b)

    def stage_results(self) -> dict:
        """Every model-stage block computed so far, by (stage key, block): what a forked worker hands
        back (a pure function of the key, the block and the seed)."""
        return dict(self._stage)

    def merge_stage_results(self, done: dict) -> None:
        """Take model-stage blocks computed elsewhere (``stage_results`` of a forked worker)."""
        for k, v in done.items():
            self._stage.setdefault(k, v)

    def engine_results(self) -> dict:
        """The generation work shared between KV budgets so far (``_engine_block``), by (TP, PP, DP,
        block): what a forked worker hands back with ``stage_results``."""
        return dict(self._engines) if self.share_engines else {}

    def merge_engine_results(self, done: dict) -> None:
        """Take ``engine_results`` of a forked worker: its closed forms, and the event runs it held
        that this process lacks (a run no budget shaped is the same wherever it ran)."""
        for k, v in done.items():
            mine = self._engines.get(k)
            if mine is None:
                self._engines[k] = v
                continue
            new = v["known"] & ~mine["known"]
            for f in ("clock", "held", "asked"):
                mine[f][new] = v[f][new]
            mine["known"] |= new

    def lengths(self, step: int) -> np.ndarray:
        """The sampled response lengths of ``step`` (every policy sees the same)."""
        lengths, _ = self._block(step // self.block)
        return lengths[step % self.block]

    # ---- per-plan structure ----------------------------------------------------------------------
    def _info(self, plan: Plan) -> dict:
        key = (plan.key(), schedule_of(plan)[0] != "sync")
        hit = self._plans.get(key)
        if hit is not None:
            return hit
        job, gpu = self.job, self.cluster.gpu
        # GPU segments: pools may nest (a generation pool over the actor's and the critic's), so
        # residents and phase times are counted per range of GPUs that every pool covers wholly or not
        cuts = sorted({g for s in plan.stages for g in (s.first_gpu, s.first_gpu + s.gpus)})
        segs = list(zip(cuts, cuts[1:]))
        covers = {s.name: [k for k, (a, b) in enumerate(segs) if s.first_gpu <= a and b <= s.first_gpu + s.gpus]
                  for s in plan.stages}
        resident = [0.0] * len(segs)
        # training stages whose optimizer state is on the host between optimizer steps: out of every
        # pool's resident memory, back on the GPU for the step (after the forward / backward passes,
        # whose transients are freed by then), the copies both ways paid in the stage's time
        host = set(dict(plan.extras).get("offload") or ())
        copy_s, back = {}, {}
        for role in job.roles:
            home = plan.stage(HOME_STAGE[role])
            c = home.config
            psi = params_per_gpu(job.model(role), c.tp, c.pp, value_head=role in ("critic", "reward"))
            held = state_bytes(psi, c.dp, c.zero, role in TRAINABLE)
            if role in TRAINABLE and f"{role}/training" in host:
                out = offloaded_bytes(psi, c.dp, c.zero)
                held -= out
                copy_s[f"{role}/training"], back[f"{role}/training"] = offload_copy_s(out), out
            for k in covers[home.name]:
                resident[k] += held
        gen = plan.stage("actor/generation")
        gen_resident = max(resident[k] for k in covers[gen.name])
        if not self.engine_sleeps:  # an engine that never sleeps keeps its memory through training
            for k in covers[gen.name]:
                resident[k] += self.engine_util * gpu.memory_gib * GiB
        keys, base = {}, {}
        for s in plan.stages:
            keys[s.name] = self._gen_key(s, gen_resident) if s.stage == "generation" else self._stage_key(s)
            base[s.name] = 0.0 if s.stage == "generation" else max(resident[k] for k in covers[s.name])
        train = plan.stage("actor/training")
        actor = job.model("actor")
        gen_bytes = 2 * params_per_gpu(actor, gen.config.tp, gen.config.pp)
        colocated = bool(set(covers[gen.name]) & set(covers[train.name]))
        # the full weights are gathered over the ranks that shard them: the whole pool under
        # ZeRO-3 / FSDP, the model-parallel group (tp x pp) otherwise
        tc = train.config
        group = train.gpus if tc.zero >= 3 else tc.tp * tc.pp
        sync = network.weight_sync_s(2 * actor.num_params(), group, self._spans(train.first_gpu, group),
                                     gen_bytes, colocated, self.tab, self.links)
        shared = any(set(covers[s.name]) & set(covers[gen.name]) for s in plan.stages if s.name != gen.name)
        overhead = sync + (network.wake_sleep_s(gen_bytes) if shared and self.engine_sleeps else 0.0)
        hit = self._plans[key] = {"keys": keys, "covers": covers, "segments": len(segs), "overhead": overhead,
                                  "resident": base, "capacity": capacity_bytes(gpu.memory_gib), "copy_s": copy_s,
                                  "back": back}
        return hit

    def _spans(self, first: int, count: int) -> bool:
        g = self.cluster.gpus_per_node
        return first // g != (first + count - 1) // g

    def _gen_key(self, s: StagePlacement, resident: float) -> tuple:
        c = s.config
        kv = kv_budget_tokens(self.job.model("actor"), c.tp, c.pp, self.cluster.gpu.memory_gib, resident,
                              util=self.engine_util, max_seqs=self.max_seqs)
        return ("generation", c.tp, c.pp, c.dp, kv)

    def _stage_key(self, s: StagePlacement) -> tuple:
        c, g = s.config, self.cluster.gpus_per_node
        if getattr(c, "cp", 1) > 1:
            raise SpecError(f"ground truth: {s.name} uses context parallelism cp{c.cp}, which the simulated machine "
                            f"does not model (the simulator's candidates leave it out)")
        span = c.tp * c.dp
        stage_inter = c.pp > 1 and (s.first_gpu // g != (s.first_gpu + span) // g)
        return (s.name, c.tp, c.pp, c.dp, c.micro_batch, getattr(c, "token_budget", 0), getattr(c, "sp", 1),
                c.zero, c.recompute, self._spans(s.first_gpu, span) or span > g, stage_inter)

    # ---- stage times on a block ------------------------------------------------------------------
    def _stage_block(self, key: tuple, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hit = self._stage.get((key, b))
        if hit is not None:
            return hit
        lengths, _ = self._block(b)
        lo = b * self.block
        prompt = self.prompt[lo:lo + len(lengths)]
        if key[0] == "generation":
            hit = self._generation(key, b, lengths, prompt, self.cap[lo:lo + len(lengths)])
        else:  # model-stages that differ only in their role (actor and reference inference) share the run
            same = (self._kernel_of(key[0]),) + key[1:]
            hit = self._stage.get((same, b))
            if hit is None:
                hit = self._stage[(same, b)] = self._train_infer(key, lengths, prompt)
        if len(self._stage) > 50_000:
            self._stage.clear()
        self._stage[(key, b)] = hit
        return hit

    def _generation(self, key: tuple, b: int, lengths: np.ndarray, prompt: np.ndarray, cap: np.ndarray):
        """Generation of block b under the KV budget of ``key``: the slowest replica per step. What
        does not depend on the budget is shared by every budget of one (TP, PP, DP) on the block
        (``_engine_block``): the closed form of each replica, and the event simulations that no
        budget shaped (``engine.covers``); only the replicas this budget presses and no shared run
        covers are simulated."""
        _, tp, pp, dp, kv = key
        fits = kv >= prompt + cap
        t = np.full(len(lengths), math.inf)
        if fits.any():
            ck = (tp, pp)
            if ck not in self._coeffs:
                self._coeffs[ck] = decode_coeffs(self.job.model("actor"), tp, pp, self.tab, self.max_seqs)
            a, beta = self._coeffs[ck]
            eng = self._engine_block(tp, pp, dp, b, lengths, prompt, a, beta)
            total = eng["total"].copy()
            pressed = ((eng["peak"] > kv) | (eng["count"] > self.max_seqs)) & fits[:, None]
            shared = pressed & eng["known"] & covers(kv, eng["held"], eng["asked"])
            total[shared] = eng["clock"][shared]
            idx = np.nonzero(pressed & ~shared)
            if len(idx[0]):
                reps = split_replicas(lengths, dp)[idx]
                clock, _, held, asked = _simulate(reps, prompt[idx[0]].astype(float), a, beta, kv,
                                                  self._prefill(tp, pp), self.max_seqs, demand=True)
                total[idx] = clock
                if held is not None:  # runs this budget did not shape: every budget that covers them shares them
                    own = covers(kv, held, asked)
                    at = tuple(x[own] for x in idx)
                    eng["known"][at], eng["clock"][at], eng["held"][at], eng["asked"][at] = \
                        True, clock[own], held[own], asked[own]
            t[fits] = total[fits].max(axis=1)
        peak = np.full(len(lengths), self.cluster.gpu.memory_gib * GiB * self.engine_util)
        return t, fits, peak

    def _prefill(self, tp: int, pp: int):
        actor = self.job.model("actor")

        def prefill(tokens, p):
            return prefill_s(actor, tp, pp, tokens, p, self.tab)

        return prefill

    def _engine_block(self, tp: int, pp: int, dp: int, b: int, lengths, prompt, a, beta) -> dict[str, np.ndarray]:
        """Per (TP, PP, DP) and block: every replica's closed form (``engine.closed_form``) and the
        event simulations shared between KV budgets (``known`` where one is held)."""
        key = (tp, pp, dp, b)
        hit = self._engines.get(key) if self.share_engines else None
        if hit is None:
            total, peak, count = closed_form(lengths, prompt, dp, a, beta, self._prefill(tp, pp))
            if len(self._engines) > 1024:  # a few MB each at DP 1,024
                self._engines.clear()
            hit = {"total": total, "peak": peak, "count": count, "known": np.zeros(total.shape, bool),
                   "clock": np.zeros(total.shape), "held": np.zeros(total.shape, np.int64),
                   "asked": np.zeros(total.shape)}
            if self.share_engines:
                self._engines[key] = hit
        return hit

    def _kernel_of(self, name: str) -> tuple:
        """What ``_train_infer`` reads of a model-stage's name: its model, training or not, value head."""
        role, _, stage = name.partition("/")
        return ("train/infer", self.job.model(role), stage == "training", role in ("critic", "reward"))

    def _train_infer(self, key: tuple, lengths: np.ndarray, prompt: np.ndarray):
        name, tp, pp, dp, mb, budget, sp, zero, recompute, span_inter, stage_inter = key
        role, _, stage = name.partition("/")
        b = self.job.batch
        spec = StageSpec(model=self.job.model(role), training=stage == "training", value_head=role in ("critic", "reward"),
                         tp=tp, pp=pp, dp=dp, micro_batch=mb, token_budget=budget, sp=sp, zero=zero, recompute=recompute,
                         mini_batches=b.mini_batches, epochs=b.ppo_epochs, span_inter=span_inter,
                         stage_inter=stage_inter)
        return stage_times(lengths + prompt[:, None].astype(lengths.dtype), spec, self.tab)

    def _stage_fits(self, info: dict, ms: str, b: int) -> np.ndarray:
        _, fits, pk = self._stage_block(info["keys"][ms], b)
        return fits if ms.endswith("/generation") else \
            info["resident"][ms] + np.maximum(pk, info["back"].get(ms, 0.0)) <= info["capacity"]

    # ---- steps -----------------------------------------------------------------------------------
    def _stage_cols(self, plan: Plan, b: int) -> np.ndarray:
        """[T, stages] seconds of each model-stage of ``plan`` on block b, with jitter."""
        return self._plan_block(plan, b, compose=False)[2]

    def _plan_block(self, plan: Plan, b: int, compose: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(step seconds, ok, stage times [T, stages] with jitter, peak bytes) of ``plan`` on block b;
        an asynchronous plan's step seconds come from its timeline over the trace (``timeline.py``)."""
        info = self._info(plan)
        _, jit = self._block(b)
        cols, ok, peak = [], None, None
        for i, ms in enumerate(self.stages):
            t, fits, pk = self._stage_block(info["keys"][ms], b)
            if not ms.endswith("/generation"):  # a trainer's peak: resident states of the pool + transient
                pk = info["resident"][ms] + np.maximum(pk, info["back"].get(ms, 0.0))
                fits = pk <= info["capacity"]
                peak = pk if peak is None else np.maximum(peak, pk)
            cols.append(t * jit[:, i] + info["copy_s"].get(ms, 0.0))
            ok = fits if ok is None else ok & fits
        if peak is None:
            peak = np.zeros(len(jit))
        st = np.stack(cols, axis=1)
        if not compose:
            return st, ok, st, peak
        if schedule_of(plan)[0] != "sync":
            lo = b * self.block
            total = self.timeline(plan).step_s[lo:lo + len(st)]
            return np.where(ok, total, math.inf), ok, st, peak
        total = np.full(len(st), info["overhead"])
        for phase in self.job.phases():  # a phase ends when its busiest GPU segment is done
            per_seg = np.zeros((len(st), info["segments"]))
            for ms in phase:
                per_seg[:, info["covers"][ms]] += st[:, self.stages.index(ms)][:, None]
            total = total + per_seg.max(axis=1)
        return np.where(ok, total, math.inf), ok, st, peak

    def timeline(self, plan: Plan) -> Timeline:
        """An asynchronous plan's event timeline over the whole trace (cached per plan and schedule)."""
        key = (plan.key(), schedule_of(plan))
        hit = self._timelines.get(key)
        if hit is None:
            hit = self._timelines[key] = plan_timeline(self, plan)
        return hit

    def step_times(self, plan: Plan, steps: np.ndarray | None = None) -> np.ndarray:
        """Seconds of ``plan`` at each of ``steps`` (all steps by default); inf where it OOMs."""
        steps = np.arange(self.n_steps) if steps is None else np.asarray(steps)
        out = np.empty(len(steps))
        blocks = steps // self.block
        for b in np.unique(blocks):
            total, _, _, _ = self._plan_block(plan, int(b))
            sel = blocks == b
            out[sel] = total[steps[sel] - b * self.block]
        return out

    def observe(self, plan: Plan, step: int) -> Observation:
        b, i = divmod(step, self.block)
        total, ok, st, peak = self._plan_block(plan, b)
        lengths = self.lengths(step)
        stats = (float(lengths.mean()), int(lengths.max()), float(np.percentile(lengths, 90)))
        stage_s = {ms: float(st[i, k]) for k, ms in enumerate(self.stages)}
        if ok[i]:
            return Observation(stage_s, float(total[i]), True, float(peak[i]) / GiB, *stats)
        info = self._info(plan)
        bad = next(ms for ms in self.stages if not self._stage_fits(info, ms, b)[i])
        lost = 0.0
        for phase in self.job.phases():
            if bad in phase:
                lost += 0.5 * stage_s[bad] if math.isfinite(stage_s[bad]) else 0.0
                break
            lost += max(stage_s[ms] for ms in phase)
        why = f"{bad} {plan.stage(bad).config.label()} out of memory at step {step} (SIMULATED)"
        return Observation({}, math.inf, False, float(peak[i]) / GiB, *stats, violations=(why,), oom_stage=bad,
                           lost_s=lost)

    # ---- transitions and restarts ----------------------------------------------------------------
    def transition_s(self, a: Plan, b: Plan) -> float:
        """Blocking seconds of a live switch a -> b (0 for the same layout)."""
        return self.prices(a, b)

    def refill_s(self, plan: Plan, step: int) -> float:
        """An asynchronous plan's pipeline after a switch: the trainer first waits for a whole batch."""
        if schedule_of(plan)[0] == "sync" or step >= self.n_steps:
            return 0.0
        return float(self._stage_cols(plan, step // self.block)[step % self.block, self.stages.index("actor/generation")])

    def _live_transition_s(self, a: Plan, b: Plan) -> float:
        if self.schedule_fn is None:
            raise SpecError("ground truth: no transition schedule function to price a layout change")
        t = network.replay(self.schedule_fn(a, b), self.links) + network.COMM_REBUILD_S
        ga, gb = a.stage("actor/generation"), b.stage("actor/generation")
        if (ga.first_gpu, ga.gpus, ga.config.tp, ga.config.pp, ga.config.dp) != \
                (gb.first_gpu, gb.gpus, gb.config.tp, gb.config.pp, gb.config.dp):
            t += network.ENGINE_START_S
        return t

    def restart_s(self, plan: Plan) -> float:
        """Seconds of a crash and relaunch on ``plan`` (checkpoint of every model read back)."""
        total = sum(self._checkpoint_bytes(role) for role in self.job.roles)
        return network.restart_s(total, self._nodes(plan))

    def switch_restart_s(self, a: Plan, b: Plan) -> float:
        """Seconds of a planned switch a -> b by checkpoint and relaunch (restart mode): the trainable
        models' states written from a's nodes, then a relaunch on b. 0 when nothing changes."""
        if a.key() == b.key():
            return 0.0
        saved = sum(self._checkpoint_bytes(role) for role in self.job.roles if role in TRAINABLE)
        return network.checkpoint_save_s(saved, self._nodes(a)) + self.restart_s(b)

    def _checkpoint_bytes(self, role: str) -> float:
        """A trainable model's checkpoint: bf16 weights + fp32 master + Adam moments + fp32 gradient
        buffer as Megatron saves it (16 bytes per parameter); a frozen model's bf16 weights."""
        return (16 if role in TRAINABLE else 2) * self.job.model(role).num_params()

    def _nodes(self, plan: Plan) -> int:
        return -(-plan.num_gpus // self.cluster.gpus_per_node)

    # ---- one model-stage on its own (differential checks) ------------------------------------------
    def stage_times(self, s: StagePlacement, steps: np.ndarray, resident_bytes: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """(seconds, peak bytes per GPU) of model-stage placement ``s`` at ``steps``, on a pool that
        holds ``resident_bytes`` of other state per GPU (generation: an engine with the KV budget
        that leaves; training/inference: the peak is resident + the stage's own)."""
        steps = np.asarray(steps)
        key = self._gen_key(s, resident_bytes) if s.stage == "generation" else self._stage_key(s)
        t, pk = np.empty(len(steps)), np.empty(len(steps))
        for b in np.unique(steps // self.block):
            sel = steps // self.block == b
            bt, fits, bp = self._stage_block(key, int(b))
            idx = steps[sel] - b * self.block
            t[sel] = np.where(fits[idx], bt[idx], np.inf)
            pk[sel] = bp[idx] + (0.0 if s.stage == "generation" else resident_bytes)
        return t, pk
