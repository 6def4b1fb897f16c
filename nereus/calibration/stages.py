"""Stage-level timing of a reference transformer, and the fit of per-stage corrections.

Each :class:`StageConfig` is one real run of one stage on this machine: generation (prefill +
greedy decode with a KV cache), inference (log-prob forward) or training (forward, backward,
gradient all-reduce across DP, AdamW step), at a given (tp, pp, dp), batch, micro-batch and
sequence length. One rank = one device (one single-thread process on CPU), as in microbench.

Subject: the executor's parallel reference transformer when it can be imported
(``backend="executor"``, see :mod:`nereus.calibration.executor_backend`), otherwise the
single-device plain-torch model of :mod:`nereus.calibration.reference` (``backend="plain"``: no
TP/PP, DP by gradient all-reduce over gloo). The backend is recorded in every row and profile.

The analytic prediction of a row is ``cost.estimate`` for the same model, workload and parallel
config on a cluster built from the profile's hardware entry.
"""
from __future__ import annotations

import statistics

from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import numpy as np
import pandas as pd

from nereus.calibration.fit import fit_positive, mape
from nereus.calibration.profile import Hardware
from nereus.calibration.subject import TIMED_MODEL
from nereus.models.spec import ModelSpec
from nereus.planner.cost.model import estimate
from nereus.planner.cost.params import STAGES, CostParams
from nereus.planner.specs import BatchSpec, JobSpec, ParallelConfig, SequenceSpec, Workload



@dataclass(frozen=True, slots=True, kw_only=True)
class StageConfig:
    stage: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    batch: int
    """Sequences in the step (all DP ranks together)."""
    micro_batch: int
    prompt_len: int
    response_len: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return (f"{self.stage} tp{self.tp}pp{self.pp}dp{self.dp} b{self.batch}/mb{self.micro_batch} "
                f"p{self.prompt_len}+r{self.response_len}")

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=self.dp, micro_batch=self.micro_batch, zero=0)

    def workload(self) -> Workload:
        r = self.response_len
        return Workload(sequences=self.batch, prompt_len=self.prompt_len, response_len_mean=r,
                        response_len_max=r, response_len_p90=r)


def stage_grid(quick: bool, max_world: int = 2, parallel: tuple[tuple[int, int, int], ...] = ((1, 1, 1), (1, 1, 2))
               ) -> tuple[StageConfig, ...]:
    """The measured configurations; ``parallel`` lists the (tp, pp, dp) layouts the backend can run."""
    layouts = [lay for lay in parallel if lay[0] * lay[1] * lay[2] <= max_world]
    if quick:  # three shapes per stage and layout: the middle one is held out
        shapes = {"generation": ((4, 4, 16, 8), (8, 8, 16, 12), (16, 16, 16, 16)),
                  "inference": ((4, 4, 16, 16), (8, 8, 32, 32), (16, 16, 32, 32)),
                  "training": ((4, 2, 16, 16), (8, 4, 16, 32), (8, 4, 32, 32))}
    else:  # five shapes (batch, micro-batch, prompt, response): ranks 1 and 4 of 5 are held out
        shapes = {"generation": ((4, 4, 16, 8), (4, 4, 16, 24), (8, 8, 16, 16), (16, 16, 16, 24), (16, 16, 32, 32)),
                  "inference": ((4, 4, 16, 16), (8, 8, 32, 32), (8, 4, 32, 64), (16, 8, 64, 64), (16, 16, 64, 128)),
                  "training": ((4, 2, 16, 16), (8, 4, 16, 32), (8, 4, 32, 32), (8, 8, 32, 64), (16, 8, 32, 64))}
    out = []
    for stage in STAGES:
        for tp, pp, dp in layouts:
            for b, mb, p, r in shapes[stage]:
                if b % dp or (b // dp) % min(mb, b // dp):
                    continue
                out.append(StageConfig(stage=stage, tp=tp, pp=pp, dp=dp, batch=b, micro_batch=min(mb, b // dp),
                                       prompt_len=p, response_len=r))
    return tuple(out)


def heldout_configs(configs: tuple[StageConfig, ...], every: int = 3) -> tuple[bool, ...]:
    """Deterministic hold-out: within each (stage, layout), every ``every``-th configuration in
    order of tokens, never the smallest or the largest (the fit must interpolate, not guess)."""
    flags = [False] * len(configs)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault((c.stage, c.tp, c.pp, c.dp), []).append(i)
    for idx in groups.values():
        idx.sort(key=lambda i: (configs[i].batch * (configs[i].prompt_len + configs[i].response_len), i))
        for rank, i in enumerate(idx):
            flags[i] = 0 < rank < len(idx) - 1 and rank % every == 1
    return tuple(flags)


# ---- plain-torch timing (runs in every rank) --------------------------------------------------------
def _replica_groups(world: int, sizes: set[int]) -> dict[int, Any]:
    """For each replica size w, the gloo group of this rank's replica (ranks [i*w, (i+1)*w)).
    Every rank creates every group in the same order, as torch.distributed requires."""
    import torch.distributed as dist

    mine: dict[int, Any] = {}
    rank = dist.get_rank()
    for w in sorted(sizes):
        for i in range(world // w):
            g = dist.new_group(list(range(i * w, (i + 1) * w)))
            if i * w <= rank < (i + 1) * w:
                mine[w] = g
    return mine


def _time_plain(rank: int, world: int, configs: tuple[StageConfig, ...], reps: int, seed: int,
                device: str = "cpu") -> list[float]:
    """Seconds of each config. A config of dp ranks runs as world // dp independent replicas, so
    every device is busy whatever the config (CPU cores share DRAM and cache; timing one rank
    alone would measure a machine no job sees)."""
    import torch
    import torch.distributed as dist

    from nereus.calibration.clock import Stopwatch, world_device_time
    from nereus.calibration.reference import PlainLM
    from nereus.calibration.spawn import tick

    dist_on = dist.is_available() and dist.is_initialized()
    groups = _replica_groups(world, {c.dp for c in configs}) if dist_on else {}
    net = PlainLM(TIMED_MODEL, seed=seed).to(device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(seed + rank)
    toks = {c: torch.randint(0, TIMED_MODEL.vocab, (c.batch // c.dp, c.prompt_len + c.response_len),
                             generator=gen).to(device) for c in configs}

    def run(c: StageConfig) -> None:
        x = toks[c]
        if c.stage == "generation":
            net.generate(x[:, :c.prompt_len], c.response_len)
        elif c.stage == "inference":
            with torch.no_grad():
                for mb in x.split(c.micro_batch):
                    net.log_probs(mb)
        else:
            opt.zero_grad(set_to_none=True)
            for mb in x.split(c.micro_batch):
                (-net.log_probs(mb).mean()).backward()
            if c.dp > 1:
                flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
                dist.all_reduce(flat, group=groups.get(c.dp))
            opt.step()
        if device == "cuda":
            torch.cuda.synchronize()

    # Passes over all configs (not repeats of one config in a row): a burst of load from a
    # neighbour then spoils one sample of several configs instead of every sample of one.
    samples: dict = {c: [] for c in configs}
    for pas in range(reps + 1):
        for c in configs:
            if dist_on:
                dist.barrier()
            with Stopwatch() as sw:
                run(c)
            dt = world_device_time(sw)  # slowest rank, less time lost to other processes
            if pas:  # pass 0 warms caches and the allocator
                samples[c].append(dt)
            tick(1)
    return [statistics.median(samples[c]) for c in configs]


def measure(configs: tuple[StageConfig, ...], world: int, reps: int = 2, seed: int = 0, backend: str = "plain",
            device: str = "cpu", progress: Callable[[int], None] | None = None) -> pd.DataFrame:
    """Run every config in one world of ``world`` ranks (one process when world is 1)."""
    from nereus.calibration.spawn import local_progress, run_world

    for c in configs:
        if world % c.world:
            raise ValueError(f"{c.label()}: tp*pp*dp = {c.world} does not divide the timing world ({world})")
    if backend == "executor":
        from nereus.calibration.executor_backend import time_configs as timer
    else:
        timer = _time_plain
    if world == 1 and backend == "plain":
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1 if device == "cpu" else threads)
        try:
            with local_progress(progress):
                secs = timer(0, 1, tuple(configs), reps, seed, device)
        finally:
            torch.set_num_threads(threads)
    else:
        secs = run_world(timer, world, (tuple(configs), reps, seed, device), timeout_s=900, progress=progress)[0]
    return pd.DataFrame([{**asdict(c), "label": c.label(), "seconds": s, "backend": backend}
                         for c, s in zip(configs, secs)])


# ---- prediction and fit -----------------------------------------------------------------------------
def timed_job(c: StageConfig, model: ModelSpec = TIMED_MODEL) -> JobSpec:
    return JobSpec(algorithm="grpo", models=(("actor", model), ("ref", model)),
                   batch=BatchSpec(prompts=max(1, c.batch // 2), samples_per_prompt=2),
                   sequence=SequenceSpec(prompt_len=c.prompt_len, response_len_mean=c.response_len,
                                         response_len_max=c.response_len))


def predict(c: StageConfig, params: CostParams, hw: Hardware, model: ModelSpec = TIMED_MODEL) -> float:
    cluster = hw.cluster(nodes=1, gpus_per_node=max(c.world, 1))
    return estimate(timed_job(c, model), cluster, f"actor/{c.stage}", c.parallel_config(), c.workload(), params).time_s


def row_config(row: Any) -> StageConfig:
    return StageConfig(stage=row.stage, tp=int(row.tp), pp=int(row.pp), dp=int(row.dp), batch=int(row.batch),
                       micro_batch=int(row.micro_batch), prompt_len=int(row.prompt_len),
                       response_len=int(row.response_len))


def fit_stage_params(rows: pd.DataFrame, params: CostParams, hw: Hardware) -> tuple[CostParams, dict[str, Any]]:
    """Per-stage factors (and the decode step overhead when generation is present), fitted on
    ``rows`` with every other parameter held at its microbenchmark value."""
    cfgs = [row_config(r) for r in rows.itertuples()]
    stages = [s for s in STAGES if any(c.stage == s for c in cfgs)]
    gen = "generation" in stages
    # Generation is fitted as (factor, per-step overhead as applied = factor x overhead): when
    # decode is overhead-bound the data fix only the applied overhead, and a weak prior then
    # keeps the factor (which also scales prefill and decode compute) near 1 without biasing it.
    names = [f"factor_{s}" for s in stages] + (["applied_step_overhead_s"] if gen else [])
    start = [1.0] * len(stages) + ([params.decode_step_overhead_s] if gen else [])

    def apply(v: dict[str, float]) -> CostParams:
        q = params.with_stage_factors(**{s: v[f"factor_{s}"] for s in stages})
        if not gen:
            return q
        return replace(q, decode_step_overhead_s=v["applied_step_overhead_s"] / v["factor_generation"])

    def pred(v: dict[str, float]) -> np.ndarray:
        q = apply(v)
        return np.array([predict(c, q, hw) for c in cfgs])

    pf = fit_positive(names, start, pred, rows["seconds"].to_numpy(float), prior={"factor_generation": 0.05})
    return apply(pf.as_dict()), {"values": pf.as_dict(), "points": pf.points, "fit_mape": pf.fit_mape}


def calibrate_stages(df: pd.DataFrame, params: CostParams, hw: Hardware) -> dict[str, Any]:
    """Fit on the non-held-out rows; error table (before = analytic defaults, after = fitted) on
    the held-out rows."""
    held = df["heldout"].to_numpy(bool)
    fitted, info = fit_stage_params(df[~held], params, hw)
    before = CostParams()
    rows = []
    for r in df[held].itertuples():
        c = row_config(r)
        rows.append({"what": c.label(), "stage": c.stage, "measured_s": r.seconds,
                     "analytic_s": predict(c, before, hw), "predicted_s": predict(c, fitted, hw)})
    table = pd.DataFrame(rows, columns=["what", "stage", "measured_s", "analytic_s", "predicted_s"])
    table["ratio"] = table["predicted_s"] / table["measured_s"]
    summary = {"mape_before": mape(table["analytic_s"], table["measured_s"]),
               "mape_after": mape(table["predicted_s"], table["measured_s"]), "points": int(len(table)),
               "by_stage": {s: {"mape_before": mape(g["analytic_s"], g["measured_s"]),
                                "mape_after": mape(g["predicted_s"], g["measured_s"]), "points": int(len(g))}
                            for s, g in table.groupby("stage")}}
    return {"params": fitted, "fit": info, "table": table, "summary": summary}
