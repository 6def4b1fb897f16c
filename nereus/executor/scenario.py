"""Building blocks shared by the multi-process tests, ``nereus reshard-check`` and the benchmark:
a job and plans over a tiny model, seeded state in a store, and the never-resharded reference.

Everything here is data or per-rank work; plans and transition plans are made in the parent
process (``nereus.planner``) and passed to the ranks as pickled data.
"""
from __future__ import annotations

import torch

from nereus.executor import model as M
from nereus.executor.layout import OPT_KINDS, param_dtype, rank_regions, stored
from nereus.executor.store import TORCH_DTYPES, ShardStore
from nereus.models.inventory import tensor_inventory
from nereus.models.spec import ModelSpec
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import TRAINABLE, BatchSpec, ClusterSpec, GPU_PRESETS, JobSpec, ParallelConfig, SequenceSpec
from nereus.planner.transition.types import Region, TransitionPlan

ROLE_SEED = {"actor": 0, "ref": 7919}


def tiny_job(model: ModelSpec) -> JobSpec:
    """A GRPO job whose actor and ref are ``model`` (the ref is frozen: params only)."""
    return JobSpec(algorithm="grpo", models=(("actor", model), ("ref", model)),
                   batch=BatchSpec(prompts=4, samples_per_prompt=2),
                   sequence=SequenceSpec(prompt_len=8, response_len_mean=8, response_len_max=16))


def local_cluster(world: int) -> ClusterSpec:
    return ClusterSpec(gpu=GPU_PRESETS["h100-80gb"], nodes=1, gpus_per_node=world)


def make_plan(tp: int = 1, pp: int = 1, dp: int = 1, *, first_gpu: int = 0, zero: int = 1,
              micro_batch: int = 1) -> Plan:
    """Actor training/inference and ref inference on one pool with one parallel config."""
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch)
    n = cfg.gpus
    stages = tuple(StagePlacement(name=s, config=cfg, pool=0, first_gpu=first_gpu, gpus=n)
                   for s in ("actor/training", "actor/inference", "ref/inference"))
    return Plan(stages=stages)


def restrict(tplan: TransitionPlan, model: str) -> TransitionPlan:
    """The part of a transition plan that concerns one model (a projection of the data)."""
    from dataclasses import replace

    keep = lambda hs: tuple(h for h in hs if h.region.model == model)  # noqa: E731
    ops = tuple(op for op in tplan.ops if op.region.model == model)
    return replace(tplan, src=keep(tplan.src), dst=keep(tplan.dst), kept=keep(tplan.kept), ops=ops,
                   bytes_moved=sum(op.region.nbytes for op in ops),
                   bytes_kept=sum(h.region.nbytes for h in keep(tplan.kept)))


def _slice(full: torch.Tensor, r: Region) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))]


def reference(model: ModelSpec, seed: int, r: Region) -> torch.Tensor:
    """The never-resharded value of region ``r``: rebuilt from the seed, whatever the layout (as
    ``model.initial_region``: a bf16 param is the fp32 value rounded, a master the fp32 value)."""
    inv = tensor_inventory(model)
    index = next(i for i, t in enumerate(inv) if t.name == r.tensor)
    kind = "param" if r.kind == "master" else r.kind
    return _slice(M.init_tensor(inv[index], index, seed + ROLE_SEED[r.model], kind), r).to(TORCH_DTYPES[r.dtype])


def init_store(store: ShardStore, job: JobSpec, plan: Plan, rank: int, seed: int, *,
               random_moments: bool = True, roles: tuple[str, ...] | None = None, precision: str = "fp32") -> None:
    """Fill ``store`` with this rank's regions of every role under ``plan``, from the seed, step 0,
    at ``precision`` (``layout.PRECISIONS``). Adam moments are random by default so that moving
    them is checked bit for bit; training runs start them at zero like a fresh optimizer."""
    for role in roles or job.roles:
        model = job.model(role)
        kinds = ("param",) + (OPT_KINDS if role in TRAINABLE and random_moments else ())
        regions = rank_regions(model, plan.home(role), rank, role, role in TRAINABLE, precision)
        if not regions:
            continue
        full = M.init_full(model, seed + ROLE_SEED[role], kinds)
        for r in regions:
            store.put(r, stored(model, r, M.initial_region(full, r)).to(store.device))
        store.step[role] = 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes in logical (row-major) order, whatever the memory layouts."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def mismatches(store: ShardStore, job: JobSpec, seed: int) -> list[str]:
    """Regions whose bits differ from the never-resharded reference."""
    return [f"{r.model}:{r.tensor}/{r.kind}@{r.offsets}" for r, t in store.items()
            if not same_bits(t.cpu(), reference(job.model(r.model), seed, r))]  # the reference is built on the host


def reference_logits(job: JobSpec, seed: int, ids: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """Logits of the never-resharded actor on one process: full weights from the seed (rounded to
    bf16 under ``bf16-mixed``), no groups; fp32."""
    model = job.model("actor")
    dtype = TORCH_DTYPES[param_dtype(precision)]
    w = {name: t.to(dtype) for (name, _), t in M.init_full(model, seed + ROLE_SEED["actor"]).items()}
    with torch.no_grad():
        x = M.embed(ids, w, 0, None)
        for i in range(model.layers):
            x = M.block(x, w, i, model, None, None)
        return M.head(x, w, None, model.norm_eps).float()
