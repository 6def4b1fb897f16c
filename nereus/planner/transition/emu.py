"""Elastic Model Units: the exact tensor regions every GPU holds under a plan.

An EMU is one data-parallel replica of one model's home model-stage (``HOME_STAGE``): the
regions its tp x pp GPUs hold. Rules (same as the executor's shard store):

- TP splits the dim the tensor inventory names (``tp_shard``); KV projections replicate when
  tp exceeds the KV heads.
- PP splits layers (``pp_layer_range``); the embedding sits on the first stage, the final norm
  and head on the last (a tied embedding on both).
- Trainable models (actor, critic) carry ``param`` plus Adam ``exp_avg`` / ``exp_avg_sq`` and,
  under mixed precision, an fp32 ``master`` copy of the bf16 param; without mixed precision
  every kind is fp32 and there is no master. Frozen models (ref, reward) carry ``param`` only.
- ZeRO >= 1 shards the optimizer kinds (and master) along DP on dim 0 of each TP shard
  (``split_range``); ZeRO-3 shards the param the same way (FSDP). A DP rank whose share is
  empty (a 1-row value head, dp > 1) holds nothing. ZeRO applies to training stages only.
- Critic and reward models have ``head="value"``.

- Mixture of experts (tensors with ``TensorInfo.expert`` set; ``expert_coords``): inside a
  pipeline stage the tp x dp ranks are regrouped as etp x ep x expert-dp (Megatron-core
  ``parallel_state``, expert order ``tp-ep-dp-pp``). With ``local = dp_rank * tp + tp_rank`` (the
  rank's index among its stage's tp * dp GPUs, which are consecutive): ``etp_rank = local % etp``,
  ``ep_rank = (local // etp) % ep``, ``edp_rank = local // (etp * ep)``, expert-dp = tp * dp /
  (ep * etp). EP rank k holds the whole experts [k E/ep, (k+1) E/ep); inside each the etp rank
  holds its slice as dense TP does (gate/up rows, down columns: ``tp_shard`` at etp). Routers,
  attention, norms and shared experts stay under the dense rules (router replicated). ZeRO >= 1
  shards an expert's optimizer kinds over the expert-dp group (``zero_box`` at edp, edp_rank);
  ZeRO-3 over it too. A generation stage follows vLLM instead: experts are sliced over the
  replica's tp ranks (ep 1: etp = tp) or whole on them (ep = tp: etp 1), so etp = tp // ep.
  Worked example: E = 8 experts, tp = 2, dp = 2, ep = 2, etp = 1 (training): GPUs 0-3 have local
  0-3 -> (etp, ep, edp) = (0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1): GPUs 0 and 2 hold experts
  0-3 whole, GPUs 1 and 3 experts 4-7, and under ZeRO-1 GPU 2 holds rows [F/2, F) of the
  optimizer state of expert 0's gate_proj (F rows), GPU 0 rows [0, F/2). With ep = 1, etp = 2
  instead, GPUs 0 and 2 hold rows [0, F/2) of every expert's gate/up (columns of down), GPUs 1
  and 3 the rest; with ep = etp = 1 and tp = 2 every GPU holds every expert whole (Megatron).

Worked example: Llama-3.1-8B actor, tp=4 pp=1 dp=2 ZeRO-1, GPU 5 = (tp 1, dp 1). Its
``layers.0.attn.k_proj.weight`` param is rows [256, 512) x cols [0, 4096) (bf16); its master,
exp_avg and exp_avg_sq are rows [384, 512) of that shard (fp32).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.models.inventory import TensorInfo, pp_layer_range, split_range, stage_tensors, tp_shard
from nereus.models.spec import ModelSpec
from nereus.planner.plan import HOME_STAGE, Plan, StagePlacement
from nereus.planner.transition.regions import Box
from nereus.planner.specs import TRAINABLE, JobSpec
from nereus.planner.transition.types import Holding, Region

OPTIMIZER_KINDS = frozenset({"master", "exp_avg", "exp_avg_sq"})


def head_of(role: str) -> str:
    """Critic and reward models end in a value head, actor and ref in the LM head."""
    return "value" if role in ("critic", "reward") else "lm"


def kinds_of(role: str, *, mixed_precision: bool = True, include_optimizer: bool = True) -> tuple[tuple[str, str], ...]:
    """(kind, dtype) pairs a GPU of ``role`` holds per tensor shard."""
    if role not in TRAINABLE or not include_optimizer:
        return (("param", "bf16" if mixed_precision else "fp32"),)
    if mixed_precision:
        return (("param", "bf16"), ("master", "fp32"), ("exp_avg", "fp32"), ("exp_avg_sq", "fp32"))
    return (("param", "fp32"), ("exp_avg", "fp32"), ("exp_avg_sq", "fp32"))


def tp_box(t: TensorInfo, tp: int, tp_rank: int) -> Box:
    """Box of tensor ``t`` held by TP rank ``tp_rank`` (the whole tensor when not split)."""
    dim, off, n = tp_shard(t, tp, tp_rank)
    offsets, lengths = [0] * len(t.shape), list(t.shape)
    if dim >= 0:
        offsets[dim], lengths[dim] = off, n
    return tuple(offsets), tuple(lengths)


def zero_box(box: Box, dp: int, dp_rank: int) -> Box | None:
    """DP rank ``dp_rank``'s ZeRO share of a TP shard: rows split along dim 0 with ``split_range``.
    Example: rows [256, 512) over dp=2 -> rank 1 holds rows [384, 512). None when empty."""
    off, ln = box
    o, n = split_range(ln[0], dp, dp_rank)
    if n == 0:
        return None
    return (off[0] + o,) + off[1:], (n,) + ln[1:]


def dp_sharded(kind: str, p: StagePlacement) -> bool:
    """Whether ``kind`` is split along DP under ``p``: optimizer kinds from ZeRO-1 on, params too
    under ZeRO-3 (FSDP) of a training stage; a frozen model's inference stage (its home) shards its
    params under ZeRO-3 only (verl's FSDP reference, OpenRLHF's stage-3 eval engine)."""
    if p.config.dp == 1:
        return False
    if p.stage != "training":
        return kind not in OPTIMIZER_KINDS and p.config.zero >= 3
    return p.config.zero >= (1 if kind in OPTIMIZER_KINDS else 3)


def shard_box(t: TensorInfo, kind: str, p: StagePlacement, tp_rank: int, dp_rank: int) -> Box | None:
    """Box of ``t``'s ``kind`` on the GPU at (tp_rank, dp_rank) of placement ``p``."""
    box = tp_box(t, p.config.tp, tp_rank)
    return zero_box(box, p.config.dp, dp_rank) if dp_sharded(kind, p) else box


def expert_layout(p: StagePlacement) -> tuple[int, int]:
    """(ep, etp) experts are placed by under ``p``: the config's (Megatron) in training and
    inference stages; in a generation stage vLLM's, etp = tp // ep (ep is 1 or tp there)."""
    c = p.config
    if p.stage == "generation":
        if c.tp % c.ep:
            raise SpecError(f"{p.name}: ep({c.ep}) must divide tp({c.tp}) in generation (vLLM places experts "
                            f"over the replica's tp ranks)")
        return c.ep, c.tp // c.ep
    return c.ep, c.etp


def expert_coords(p: StagePlacement, tp_rank: int, dp_rank: int) -> tuple[int, int, int, int]:
    """(etp_rank, ep_rank, edp_rank, edp) of the GPU at (tp_rank, dp_rank) of ``p``'s pipeline
    stage: local = dp_rank * tp + tp_rank regrouped etp fastest, then ep, then expert-dp (see the
    module docstring for a worked example)."""
    c = p.config
    ep, etp = expert_layout(p)
    if (c.tp * c.dp) % (ep * etp):
        raise SpecError(f"{p.name}: ep({ep}) * etp({etp}) must divide tp({c.tp}) * dp({c.dp})")
    local = dp_rank * c.tp + tp_rank
    return local % etp, (local // etp) % ep, local // (etp * ep), c.tp * c.dp // (ep * etp)


def expert_box(t: TensorInfo, experts: int, kind: str, p: StagePlacement, tp_rank: int, dp_rank: int) -> Box | None:
    """Box of routed-expert tensor ``t`` (``t.expert`` set) on the GPU at (tp_rank, dp_rank) of
    ``p``, None when its EP rank does not hold that expert or its ZeRO share is empty."""
    ep, etp = expert_layout(p)
    if experts % ep:
        raise SpecError(f"{p.name}: ep({ep}) must divide the {experts} experts")
    etp_rank, ep_rank, edp_rank, edp = expert_coords(p, tp_rank, dp_rank)
    if t.expert // (experts // ep) != ep_rank:
        return None
    box = tp_box(t, etp, etp_rank)
    c = p.config
    sharded = edp > 1 and p.stage == "training" and c.zero >= (1 if kind in OPTIMIZER_KINDS else 3)
    return zero_box(box, edp, edp_rank) if sharded else box


@lru_cache(maxsize=65536)
def expert_grid(shape: tuple[int, ...], tp_dim: int | None, expert: int, experts: int, kind: str,
                p: StagePlacement) -> tuple[tuple[int, int, Box], ...]:
    """(tp_rank, dp_rank, box) of every holding of a routed-expert tensor in one pipeline stage of
    ``p`` (``_box_grid``'s form for the transition's pieces; ``kind`` only matters through
    ZeRO, so callers pass ``param`` or an optimizer kind)."""
    t = TensorInfo("t", shape, tp_dim, None, None, "layer", expert)
    out = []
    for dp_rank in range(p.config.dp):
        for tp_rank in range(p.config.tp):
            box = expert_box(t, experts, kind, p, tp_rank, dp_rank)
            if box is not None:
                out.append((tp_rank, dp_rank, box))
    return tuple(out)


@lru_cache(maxsize=4096)
def layer_stages(layers: int, pp: int) -> tuple[int, ...]:
    """Pipeline stage of every layer: ``layer_stages(5, 2) == (0, 0, 1, 1, 1)``."""
    out = []
    for s in range(pp):
        first, last = pp_layer_range(layers, pp, s)
        out.extend([s] * (last - first))
    return tuple(out)


def stages_holding(model: ModelSpec, t: TensorInfo, pp: int, head: str) -> tuple[int, ...]:
    """Pipeline stages that hold tensor ``t`` (two for a tied embedding when pp > 1)."""
    if t.part == "layer":
        return (layer_stages(model.layers, pp)[t.layer],)
    if t.part == "embed":
        tied_last = model.tie_embeddings and head == "lm" and pp > 1
        return (0, pp - 1) if tied_last else (0,)
    return (pp - 1,)


def rank_coords(p: StagePlacement, gpu: int) -> tuple[int, int, int] | None:
    """(tp_rank, pp_rank, dp_rank) of ``gpu`` in placement ``p`` (Megatron order: TP fastest, then
    DP, then PP; the inverse of ``StagePlacement.gpu_of``); None when the GPU is outside its pool."""
    local = gpu - p.first_gpu
    if not 0 <= local < p.gpus:
        return None
    c = p.config
    return local % c.tp, local // (c.tp * c.dp), (local // c.tp) % c.dp


def gpu_regions(model: ModelSpec, role: str, p: StagePlacement, tp_rank: int, pp_rank: int, dp_rank: int,
                kinds: tuple[tuple[str, str], ...]) -> list[Region]:
    """Every region the GPU at (tp_rank, pp_rank, dp_rank) of ``p`` holds of ``role``'s ``kinds``
    ((kind, dtype) pairs, see ``kinds_of``): tensor by tensor in inventory order, kinds in the
    given order. The one rule for what a rank holds: the planner's holdings and the executor's
    shard store both come from here."""
    out: list[Region] = []
    for t in stage_tensors(model, p.config.pp, pp_rank, head_of(role)):
        for kind, dtype in kinds:
            if t.expert is None:
                box = shard_box(t, kind, p, tp_rank, dp_rank)
            else:
                box = expert_box(t, model.experts, kind, p, tp_rank, dp_rank)
            if box is not None:
                out.append(Region(role, t.name, kind, box[0], box[1], dtype))
    return out


def role_holdings(job: JobSpec, role: str, p: StagePlacement, *, mixed_precision: bool = True,
                  include_optimizer: bool = True) -> list[Holding]:
    """Every region ``role``'s home placement ``p`` holds, GPU by GPU, in a fixed order."""
    model = job.model(role)
    kinds = kinds_of(role, mixed_precision=mixed_precision, include_optimizer=include_optimizer)
    c = p.config
    out: list[Holding] = []
    for pp_rank in range(c.pp):
        for dp_rank in range(c.dp):
            for tp_rank in range(c.tp):
                gpu = p.gpu_of(tp_rank, pp_rank, dp_rank)
                out.extend(Holding(gpu, r) for r in gpu_regions(model, role, p, tp_rank, pp_rank, dp_rank, kinds))
    return out


def holdings(job: JobSpec, plan: Plan, *, mixed_precision: bool = True, include_optimizer: bool = True) -> tuple[Holding, ...]:
    """Every region every GPU holds under ``plan``, over all models of ``job``, sorted."""
    out: list[Holding] = []
    for role in job.roles:
        out.extend(role_holdings(job, role, plan.home(role), mixed_precision=mixed_precision,
                                 include_optimizer=include_optimizer))
    out.sort()
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class EMU:
    """One data-parallel replica of one model's home model-stage and the regions it holds."""

    model: str
    stage: str
    """Home model-stage, e.g. ``actor/training``."""
    dp_rank: int
    holdings: tuple[Holding, ...]

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(sorted({h.gpu for h in self.holdings}))

    @property
    def nbytes(self) -> int:
        return sum(h.region.nbytes for h in self.holdings)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "stage": self.stage, "dp_rank": self.dp_rank,
                "holdings": [{"gpu": h.gpu, **h.region.to_dict()} for h in self.holdings]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EMU":
        hs = tuple(Holding(int(h["gpu"]), Region.from_dict(h)) for h in d["holdings"])
        return cls(model=d["model"], stage=d["stage"], dp_rank=int(d["dp_rank"]), holdings=hs)


def build_emus(job: JobSpec, plan: Plan, *, mixed_precision: bool = True, include_optimizer: bool = True) -> tuple[EMU, ...]:
    """One EMU per (model home stage, DP replica), in ROLES order then DP rank."""
    out: list[EMU] = []
    for role in job.roles:
        p = plan.home(role)
        hs = role_holdings(job, role, p, mixed_precision=mixed_precision, include_optimizer=include_optimizer)
        by_dp: dict[int, list[Holding]] = {d: [] for d in range(p.config.dp)}
        for h in hs:
            local = h.gpu - p.first_gpu
            by_dp[(local // p.config.tp) % p.config.dp].append(h)
        out.extend(EMU(model=role, stage=HOME_STAGE[role], dp_rank=d, holdings=tuple(sorted(by_dp[d])))
                   for d in range(p.config.dp))
    return tuple(out)
