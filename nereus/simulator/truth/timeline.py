"""Asynchronous schedules as two concurrent event streams (the ground truth; SIMULATED).

The rollout pool produces batches, the trainer pool consumes them in order when they are ready, and
both meet at weight syncs. Nothing here is a closed-form step time: every start, end and wait is an
event of the timeline, and idle time is measured on it.

- ``one_step_off`` (verl's one-step-off policy): batch k+1 is generated, as a whole, while the
  trainer trains on batch k; the weight sync after step k waits for both (the rollout cannot start
  batch k+2 before it has the weights of step k), so staleness is 1. Batch generation times come
  from the request-level engine (``engine.py``), one batch at a time.
- ``fully_async``: the streaming pool (``stream.py``) holds at most 1 + staleness batches in flight:
  batch j is released into the engines only when the trainer has finished batch j - 1 - staleness
  (the staleness bound); the engines keep generating while the trainer trains; every ``sync_every``
  trainer steps the pool stops for the weight sync and then prefills its partial rollouts again.
  Optionally verl's dynamic resource scheduling (``dynamic``: hybrid replicas on the trainer's GPUs
  that generate after a sync until enough samples are buffered; the decisions are the caller's
  policy object, the mechanism and its costs are here).

Idle time (verl's ``timing_s/wait_prev_gen`` and the fully-async idle ratios): the trainer's is the
time it waits for a batch or for the rollout at the sync barrier; the rollout pool's is the time it
has nothing to generate (waiting for the trainer, the staleness bound or the barrier). Sync time is
counted apart; the tail inside one batch (replicas that finish before the slowest) is part of the
generation, not idle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from nereus.simulator.truth.stream import StreamPool


@dataclass
class Timeline:
    kind: str
    staleness: int
    release: np.ndarray
    """When batch k's generation may start (one_step_off: starts)."""
    gen_end: np.ndarray
    train_start: np.ndarray
    train_end: np.ndarray
    step_end: np.ndarray
    """When the trainer is free after step k (its sync included)."""
    sync_s: float = 0.0
    syncs: int = 0
    rollout_idle_s: float = 0.0
    trainer_idle_s: float = 0.0
    trainer_wait_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step, the trainer's wait for its batch (verl's wait_prev_gen)."""
    hybrid_s: float = 0.0
    """Seconds the trainer's GPUs spent as hybrid rollout replicas (dynamic scheduling)."""
    switch_s: float = 0.0
    """Seconds of hybrid activations and deactivations."""
    activations: int = 0
    rollout_idle: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per step, the rollout pool's idle seconds (attributed to the step whose end releases it)."""
    trainer_idle: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def step_s(self) -> np.ndarray:
        return np.diff(np.concatenate([[0.0], self.step_end]))

    @property
    def total_s(self) -> float:
        return float(self.step_end[-1]) if len(self.step_end) else 0.0

    def idle_share(self) -> dict[str, float]:
        t = self.total_s or 1.0
        return {"rollout": self.rollout_idle_s / t, "trainer": self.trainer_idle_s / t, "sync": self.sync_s / t}

    def check(self) -> None:
        """The timeline's invariants (raises AssertionError): batches trained in order, after they were
        generated, and never released before the trainer finished batch k - 1 - staleness."""
        s = self.staleness
        assert np.all(self.train_start >= self.gen_end - 1e-9), "a batch trained before it was generated"
        assert np.all(self.train_start[1:] >= self.train_end[:-1] - 1e-9), "trainer steps overlap"
        for j in range(s + 1, len(self.release)):
            assert self.release[j] >= self.train_end[j - 1 - s] - 1e-9, \
                f"batch {j} started at {self.release[j]:.3f} before batch {j - 1 - s} was trained"


def one_step_off(gen_s: np.ndarray, train_s: np.ndarray, sync_s: float) -> Timeline:
    """Batch k+1 generated during step k; step k ends with the sync, which waits for both pools."""
    n = len(gen_s)
    rel, ge, ts, te, end = (np.zeros(n) for _ in range(5))
    wait = np.zeros(n)
    r_idle, t_idle = np.zeros(n), np.zeros(n)
    free = 0.0  # trainer free (after the previous sync)
    for k in range(n):
        if k <= 1:
            rel[k] = 0.0 if k == 0 else ge[0]
        else:
            rel[k] = end[k - 2]  # the weights of step k-2, synced at its end
        ge[k] = rel[k] + gen_s[k]
    for k in range(n):
        ts[k] = max(ge[k], free)
        wait[k] = ts[k] - free
        te[k] = ts[k] + train_s[k]
        barrier = max(te[k], ge[k + 1]) if k + 1 < n else te[k]
        t_idle[k] = wait[k] + (barrier - te[k])
        if k + 1 < n:
            r_idle[k] = barrier - ge[k + 1]
            end[k] = barrier + sync_s
            if k + 2 < n:
                rel[k + 2] = end[k]
                ge[k + 2] = rel[k + 2] + gen_s[k + 2]
        else:
            end[k] = te[k]
        free = end[k]
    syncs = max(0, n - 1)
    return Timeline("one_step_off", 1, rel, ge, ts, te, end, sync_s=syncs * sync_s, syncs=syncs,
                    rollout_idle_s=float(r_idle.sum()), trainer_idle_s=float(t_idle.sum()), trainer_wait_s=wait,
                    rollout_idle=r_idle, trainer_idle=t_idle)


@dataclass
class Hybrid:
    """verl's hybrid replicas: how many, their KV budget, and the costs of switching them."""

    replicas: int
    kv: float
    activate_s: float
    """Weight sync into the hybrid engines (naive, colocated) + wake-up."""
    deactivate_s: float
    """Abort + sleep (weights offloaded, KV released)."""


def fully_async(pool: StreamPool, train_s: np.ndarray, sync_s: float, staleness: int, sync_every: int,
                dynamic=None, hybrid: Hybrid | None = None, poll_s: float = 1.0) -> Timeline:
    """The streaming schedule (module docstring). ``dynamic``: a policy object with verl's
    ``DynamicSchedulePolicyBase`` methods (``should_deactivate``, ``deactivate_wait_samples``,
    ``should_activate_after_step``, ``update_after_step``) driving ``hybrid``."""
    n = len(train_s)
    N = pool.n_per
    rel = np.full(n, math.nan)
    ts, te, end, wait = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    tl = Timeline("fully_async", staleness, rel, pool.batch_done, ts, te, end, trainer_wait_s=wait,
                  rollout_idle=np.zeros(n), trainer_idle=wait)
    sync_end = 0.0

    def release(j: int, at: float) -> None:
        if not pool.running():
            idle = max(0.0, at - max(pool.last_work, sync_end))
            tl.rollout_idle_s += idle
            tl.rollout_idle[max(0, j - 1 - staleness)] += idle
        rel[j] = at
        pool.release(j)

    for j in range(min(n, staleness + 1)):
        release(j, 0.0)
    free = 0.0
    active: list = []
    ctx = SimpleNamespace(required_samples=N, trigger_parameter_sync_step=sync_every, step_required_samples=N * sync_every,
                          total_generated_samples=0, expected_samples=0, buffer_samples=0, step_wait_times=[],
                          step_wait_samples=[], only_hybrid=False, last_activate_duration_s=0.0,
                          last_deactivate_duration_s=0.0)
    act_at = 0.0
    for k in range(n):
        now = free
        if dynamic is not None and dynamic.should_deactivate(k, bool(active), ctx):
            need = dynamic.deactivate_wait_samples(ctx)
            while pool.finished - k * N < need and pool.running():  # verl polls the queue every second
                now += poll_s
                pool.advance(now)
            tl.hybrid_s += now - act_at if active else 0.0
            if active:
                pool.remove_replicas(active)
                active = []
            now += hybrid.deactivate_s
            tl.switch_s += hybrid.deactivate_s
            ctx.last_deactivate_duration_s += hybrid.deactivate_s
            pool.advance(now)
        buffered = pool.finished - k * N
        t_ready = pool.advance_to_batch(k) if math.isnan(pool.batch_done[k]) else float(pool.batch_done[k])
        ts[k] = max(now, t_ready)
        wait[k] = ts[k] - now
        if wait[k] > 0:
            ctx.step_wait_times.append(wait[k])
            ctx.step_wait_samples.append(max(0, N - buffered))
        tl.trainer_idle_s += wait[k]
        te[k] = ts[k] + train_s[k]
        pool.advance(te[k])
        free = te[k]
        if k + 1 + staleness < n:
            release(k + 1 + staleness, te[k])
        if (k + 1) % sync_every == 0 and k + 1 < n:
            ctx.total_generated_samples, ctx.expected_samples = pool.finished, N * (k + 1)
            go = dynamic is not None and dynamic.should_activate_after_step(k, bool(active), ctx)
            pool.pause(sync_s)
            sync_end = free = te[k] + sync_s
            tl.sync_s += sync_s
            tl.syncs += 1
            if go and not active:
                free += hybrid.activate_s
                tl.switch_s += hybrid.activate_s
                ctx.last_activate_duration_s += hybrid.activate_s
                pool.advance(free)
                active = pool.add_replicas(hybrid.replicas, hybrid.kv, free)
                act_at = free
                tl.activations += 1
            if dynamic is not None:
                dynamic.update_after_step(k, ctx)
                ctx.last_activate_duration_s = ctx.last_deactivate_duration_s = 0.0
                ctx.step_wait_times, ctx.step_wait_samples = [], []
        end[k] = free
    tl.gen_end = pool.batch_done.copy()
    return tl


# ---- a plan of the ground truth on the whole trace -------------------------------------------------
DYNAMIC = "dynamic_resource_scheduling"
"""Plan extra that marks a plan run with verl's dynamic resource scheduling (its runtime, not a layout)."""


def schedule_of(plan) -> tuple[str, int, int, bool]:
    """(kind, staleness, sync_every, dynamic) a plan records (``sync`` when it records none)."""
    ex = dict(plan.extras)
    rec = ex.get("schedule")
    if not isinstance(rec, dict) or rec.get("kind", "sync") == "sync":
        return ("sync", 0, 1, False)
    kind = rec["kind"]
    return (kind, int(rec.get("staleness", 1)), int(rec.get("sync_every", 1)) if kind == "fully_async" else 1,
            bool(ex.get(DYNAMIC, False)))


def plan_timeline(gt, plan) -> Timeline:
    """``plan``'s asynchronous run over the whole trace in ``gt`` (a ``GroundTruth``): its
    generation and trainer-pool times per step from the truth's own engines and pipelines, composed
    as event streams. A step that does not fit keeps its place (its time counts 0 here; the caller
    marks it infeasible)."""
    from nereus.simulator.truth import network
    from nereus.simulator.truth.kernels import decode_coeffs, prefill_s
    from nereus.simulator.truth.memory import kv_budget_tokens
    from nereus.simulator.truth.verl_dynamic import HYBRID_MEMORY_UTILIZATION, VerlDefaultDynamic

    kind, staleness, sync_every, dynamic = schedule_of(plan)
    info = gt._info(plan)
    job, stages = gt.job, gt.stages
    gi = stages.index("actor/generation")
    blocks = range(-(-gt.n_steps // gt.block))
    cols = [gt._stage_cols(plan, b) for b in blocks]
    st = np.concatenate([c for c in cols])
    st = np.where(np.isfinite(st), st, 0.0)
    gen = st[:, gi]
    train = np.zeros(gt.n_steps)
    for phase in job.phases():
        if "actor/generation" in phase:
            continue
        per_seg = np.zeros((gt.n_steps, info["segments"]))
        for ms in phase:
            per_seg[:, info["covers"][ms]] += st[:, stages.index(ms)][:, None]
        train += per_seg.max(axis=1)
    sync = float(info["overhead"])
    if kind == "one_step_off":
        return one_step_off(gen, train, sync)
    g = plan.stage("actor/generation")
    _, tp, pp, dp, kv = info["keys"]["actor/generation"]
    actor = job.model("actor")
    a, beta = decode_coeffs(actor, tp, pp, gt.tab, gt.max_seqs)
    lengths = np.concatenate([gt._block(b)[0] for b in blocks])
    prompt = float(np.mean(gt.prompt))
    pool = StreamPool(lengths, gt.prompt, dp, a, beta, kv,
                      lambda tokens: float(prefill_s(actor, tp, pp, np.array([tokens]), prompt, gt.tab)[0]), gt.max_seqs)
    policy = hybrid = None
    if dynamic:
        trainer_gpus = plan.num_gpus - g.gpus
        resident = max(info["resident"][ms] for ms in stages if ms != "actor/generation")
        hkv = kv_budget_tokens(actor, tp, pp, gt.cluster.gpu.memory_gib, resident, util=HYBRID_MEMORY_UTILIZATION,
                               max_seqs=gt.max_seqs)
        gen_bytes = 2 * actor.num_params() / (tp * pp)
        wake = network.wake_sleep_s(gen_bytes)
        hybrid = Hybrid(replicas=trainer_gpus // (tp * pp), kv=hkv,
                        activate_s=gen_bytes / gt.links.copy_bps + wake / 2, deactivate_s=wake / 2)
        policy = VerlDefaultDynamic() if hkv > 0 and hybrid.replicas > 0 else None
    return fully_async(pool, train, sync, staleness, sync_every, dynamic=policy, hybrid=hybrid)


def idle_at(gt, plan, step: int) -> tuple[float, float, float, float]:
    """(rollout idle, trainer idle, sync, step) seconds of an asynchronous ``plan`` at ``step``."""
    tl = gt.timeline(plan)
    kind, _, every, _ = schedule_of(plan)
    last = step == gt.n_steps - 1
    synced = not last and (kind == "one_step_off" or (step + 1) % every == 0)
    return (float(tl.rollout_idle[step]), float(tl.trainer_idle[step]),
            float(gt._info(plan)["overhead"]) if synced else 0.0, float(tl.step_s[step]))
