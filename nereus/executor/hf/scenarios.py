"""Per-rank scenarios on Hugging Face checkpoints, run by the multi-process tests (``launch``).

``hf_chain``: load a checkpoint into the first layout of a chain, logits, every transition of
the chain with every region compared bit for bit against the same checkpoint loaded straight
into that layout (Adam moments against their seeded values), logits in the last layout, then
the last layout gathered back into a Hugging Face state dict on rank 0 (params, and the fp32
master under ``bf16-mixed``). The parent compares logits with the ``transformers`` model and
the gathered dict with the checkpoint.

``moe_plan`` / ``random_moe_plan``: plans of a mixture-of-experts model with expert parallelism
(ep, etp) on the actor's and ref's stages, for the tests and ``nereus reshard-check --arch qwen3_moe``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from nereus.executor.engine import Engine
from nereus.executor.hf.checkpoint import Checkpoint, gather_state, load_regions
from nereus.executor.layout import OPT_KINDS, stored
from nereus.executor.scenario import reference, same_bits
from nereus.executor.store import TORCH_DTYPES, ShardStore
from nereus.models.spec import ModelSpec
from nereus.planner.plan import Plan, StagePlacement
from nereus.planner.specs import ParallelConfig
from nereus.planner.transition.emu import head_of
from nereus.planner.transition.types import Region, TransitionPlan

ROLES = ("actor", "ref")


@dataclass(frozen=True, slots=True, kw_only=True)
class HFCase:
    """One chain of layouts over one checkpoint (the actor and a frozen ref share its weights)."""

    model: ModelSpec
    checkpoint: str
    """A ``.safetensors`` file or a checkpoint directory (``checkpoint.Checkpoint``)."""
    precision: str
    plans: tuple[Plan, ...]
    tplans: tuple[TransitionPlan, ...]
    ids: torch.Tensor
    seed: int = 0
    """Seed of the actor's Adam moments (random, so that moving them is checked bit for bit)."""
    fused: bool = False
    """Gather with Megatron-style fused QKV and gate/up names."""
    fused_experts: bool = False
    """Gather routed experts as transformers 5.x's 3-D tensors (default: per-expert names)."""


def _expected(case: HFCase, ckpt: Checkpoint, r: Region) -> torch.Tensor:
    """Region ``r`` as the checkpoint loaded straight into the layout would hold it."""
    if r.kind in OPT_KINDS:
        return reference(case.model, case.seed, r)
    names = ckpt.names_for(case.model, head_of(r.model))
    return names.read(r.tensor, r.offsets, r.lengths, ckpt.fetch).to(TORCH_DTYPES[r.dtype])


def _load(store: ShardStore, case: HFCase, ckpt: Checkpoint, plan: Plan, rank: int) -> None:
    for role in ROLES:
        load_regions(store, case.model, role, plan.home(role), rank, ckpt, precision=case.precision)
    for r, t in list(store.items()):  # seeded moments instead of zeros
        if r.kind in OPT_KINDS:
            store.put(r, stored(case.model, r, reference(case.model, case.seed, r)))


def hf_chain(rank: int, world: int, cases: list[HFCase]) -> list[dict]:
    """Every case in turn in the same processes (a fresh store each); see the module docstring."""
    out = []
    for case in cases:
        ckpt = Checkpoint(case.checkpoint)
        store = ShardStore()
        _load(store, case, ckpt, case.plans[0], rank)
        eng = Engine(rank, world, case.model, case.plans[0].home("actor"), store, precision=case.precision)
        first = eng.logits(case.ids)
        bad: list[str] = []
        for plan, tplan in zip(case.plans[1:], case.tplans):
            eng.apply_transition(tplan, plan.home("actor"))
            bad += [f"{r.model}:{r.tensor}/{r.kind}@{r.offsets}" for r, t in store.items()
                    if not same_bits(t, _expected(case, ckpt, r))]
        last = eng.logits(case.ids)
        placement = case.plans[-1].home("actor")
        kinds = ("param", "master") if case.precision == "bf16-mixed" else ("param",)
        gathered = {k: gather_state(store, case.model, "actor", placement, rank, kind=k, fused=case.fused,
                                    precision=case.precision, fused_experts=case.fused_experts) for k in kinds}
        out.append({"rank": rank, "mismatches": bad, "regions": len(store),
                    "logits": (first, last),
                    "gathered": gathered if rank == 0 else None})
    return out


def moe_plan(tp: int = 1, pp: int = 1, dp: int = 1, *, ep: int = 1, etp: int = 1, first_gpu: int = 0, zero: int = 1,
             micro_batch: int = 1) -> Plan:
    """``scenario.make_plan`` with expert parallelism: actor training/inference and ref inference
    on one pool under one (tp, pp, dp, ep, etp) config."""
    cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=micro_batch, ep=ep, etp=etp)
    return Plan(stages=tuple(StagePlacement(name=s, config=cfg, pool=0, first_gpu=first_gpu, gpus=cfg.gpus)
                             for s in ("actor/training", "actor/inference", "ref/inference")))


def random_moe_plan(rng: random.Random, world: int, model: ModelSpec) -> Plan:
    """A random MoE placement over part or all of the world: (tp, pp) as ``reshard-check``'s dense
    rule, then ep | experts and etp | expert_ffn with ep * etp | tp * dp (Megatron)."""
    g = rng.choice([n for n in (1, 2, 4, 8) if n <= world])
    first = rng.randrange(0, world - g + 1)
    tp = rng.choice([t for t in (1, 2, 4) if g % t == 0 and t <= model.kv_heads and model.heads % t == 0
                     and model.ffn % t == 0 and model.expert_ffn % t == 0])
    pp = rng.choice([p for p in (1, 2, 4) if (g // tp) % p == 0 and p <= model.layers])
    dp = g // (tp * pp)
    ep = rng.choice([e for e in (1, 2, 4, 8) if (tp * dp) % e == 0 and model.experts % e == 0])
    etp = rng.choice([t for t in (1, 2, 4) if (tp * dp) % (ep * t) == 0 and model.expert_ffn % t == 0])
    return moe_plan(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, first_gpu=first, zero=rng.choice((0, 1)),
                    micro_batch=rng.choice((1, 2)))
