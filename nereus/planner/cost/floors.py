"""Lower bounds ("floors") of a training or inference pass's time, a few arithmetic operations each,
for the option tables to skip pool sizes that cannot matter before pricing them in full.

A pass's time is a sum of non-negative terms (``passes.estimate_training`` / ``estimate_inference``);
the floor keeps two of them, computed as those functions compute them: the GEMM and attention
compute at the pass's own GEMM efficiency, and the log-prob pass over the vocabulary. Neither reads
the ZeRO stage, and recomputation only adds to them (8N instead of 6N, 4/3 of the attention), so the
floor of a config with ``recompute=False`` bounds every ZeRO stage and both recompute settings of it. ``FLOOR_MARGIN`` covers the float rounding of the sums.
``tests/unit/test_solver_bounds.py`` checks floor <= priced time for every option of the example jobs.

Worked example (Llama-3.1-8B PPO, 256 H100s, actor training at tp 2, micro-batch 2, no recompute):
compute 1.331 s + log-prob 0.019 s = a floor of 1.350 s, where the cost model prices 1.858 s (its
collectives, optimizer and bubble on top). Beside generation's fastest 28.57 s at 1,024 GPUs and the
experience phase, no 256-GPU actor option can reach the 30.10 s step greedy finds. (The compute and
log-prob terms are those of ``estimate_training`` / ``estimate_inference`` at recompute off: the
test above fails if those functions change them and this one is not changed with them.)
"""
from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise

from nereus.models.spec import ModelSpec
from nereus.planner.cost import moe
from nereus.planner.cost.comm import links, nodes_spanned
from nereus.planner.cost.framework import host_copy_s
from nereus.planner.cost.lengths import decode_grid, expected_max, peak_context_per_seq
from nereus.planner.cost.memory import (
    kv_budget_full,
    kv_bytes_per_token_per_gpu,
    params_per_gpu,
)
from nereus.planner.cost.params import CostParams, latency_steps
from nereus.planner.cost.passes import (
    _computed,
    _micro_batches,
    logprob_vocab_s,
    padded_tokens,
    seq_moments,
)
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

FLOOR_MARGIN = 1e-9
"""Relative amount the floor is lowered by, so that float rounding never lifts it above the price."""


def pass_floor(job: JobSpec, cluster: ClusterSpec, model_stage: str, model: ModelSpec, w: Workload,
               p: CostParams) -> Callable[[ParallelConfig], float]:
    """``floor(cfg)``: a lower bound of the time ``model.estimate`` gives ``model_stage`` (training or
    inference; 0.0 for generation) under ``cfg`` with any ZeRO stage and either recompute setting, at
    the stage factors of ``p``, without framework options (``StageOptions``: the option tables price
    none). What does not depend on ``cfg`` is computed once, here."""
    role, _, stage = model_stage.partition("/")
    if stage not in ("training", "inference"):
        return lambda cfg: 0.0
    training, padded, lm = stage == "training", job.sequence.padded, role not in ("critic", "reward")
    E = job.batch.ppo_epochs if training else 1
    per_step = job.batch.mini_batches if training else 1
    n, mfu = (6, p.mfu_train) if training else (2, p.mfu_prefill)
    _, s_sq0 = seq_moments(w)
    matmul, h, peak = model.matmul_params(), model.hidden, cluster.gpu.peak_flops
    width = h * (h if model.is_moe else model.ffn)
    attn0 = n * model.layers * model.heads * model.head_dim * w.sequences
    routed = moe.routed_active_params(model) if model.is_moe else 0
    scale = p.factor(stage) * (1 - FLOOR_MARGIN)

    def floor(cfg: ParallelConfig) -> float:
        _, mb_tokens, _ = _micro_batches(w, cfg, per_step, padded, 0)
        tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq0, True) if padded else (padded_tokens(w, 0), s_sq0)
        split, gpus = cfg.seq_split, cfg.gpus
        eff = p.matmul_eff(mfu, 2 * mb_tokens / split * width / cfg.tp)
        flops = n * matmul * tokens * E
        if routed:  # the routed experts at their own (smaller) GEMM's efficiency
            eff_x = p.matmul_eff(mfu, moe.expert_gemm_flops(model, mb_tokens / split / cfg.tp, cfg.ep * cfg.etp,
                                                            cfg.etp))
            compute, _ = moe.split_compute_s(model, flops, n * routed * tokens * E, gpus, peak, eff, eff_x)
        else:
            compute = flops / (gpus * peak * eff)
        compute += attn0 * s_sq * E / (gpus * peak * p.mfu_attn)
        if lm:
            compute += logprob_vocab_s(tokens * E, model.vocab, cfg, cluster, p, training=training)
        return compute * scale

    return floor


def generation_floor(job: JobSpec, cluster: ClusterSpec, model: ModelSpec, w: Workload, p: CostParams,
                     max_kv_fraction: float = 1.0) -> Callable[[ParallelConfig], float]:
    """``floor(cfg)``: a lower bound of the time ``model.estimate`` gives ``actor/generation`` under
    ``cfg`` at any KV budget up to ``max_kv_fraction`` of ``memory.kv_budget_full``, at the stage
    factors of ``p``. ``generation._decode_phase`` runs ``steps`` iterations of ``active`` sequences
    each; the engine's ``concurrency`` c is at most what the largest budget admits (``most``). Two
    sums bound it whatever c is: the steps S (the decode grid ends at the step's expected longest
    response, plus (n - c) * mean / c queued while more wait than run), and the sequence-steps A
    (sum of steps * active: on the grid sum (x - x') * min(c, max(a', 1)) plus (n - c) * mean queued,
    concave in c up to n and constant beyond, so at least its value at c = 1 or c = min(most, n);
    n * mean when streaming, the longest times n with a static engine), and the context tokens the
    sequence-steps read (the same sums, each segment's weighted by its context P + (x' + x) / 2, the
    queue's and the streaming engine's by P + mean, a static engine's by P + longest / 2, as
    ``generation._decode_phase`` runs them; concave in c likewise). Each step reads the stage's
    weights once per pipeline stage, each sequence-step its context's KV (``decode_memory`` >= both
    over HBM); the engine's overhead is o0 per step + o1 per sequence-step; TP inside one
    node pays every layer's two all-reduces, their latency per step and (dense models) their bytes
    per sequence-step. Plus the prefill's compute (dense models: the GEMMs at the pass's base
    efficiency, which ``matmul_eff`` never exceeds, and attention), the host work per response and
    a colocated engine's weights to the host and back. Every term left out (the rest of prefill,
    compute beyond memory, the rest of the KV and collectives, partial rollouts' resumption, the KV
    pool's re-creation) is >= 0."""
    hbm = p.hbm_eff * cluster.gpu.hbm_bytes_per_s
    o0, o1 = p.engine_overhead_terms(job.rollout.engine)
    static = job.rollout.engine == "static"
    streaming = job.schedule.kind == "fully_async" and not static
    P, cap, mean, p90 = w.prompt_len, w.response_len_max, w.response_len_mean, w.response_len_p90
    longest = expected_max(w.sequences, mean, p90, cap)
    sleeps = job.rollout.sleep and not job.schedule.is_async
    intra, _ = links(cluster, p)
    lat = 2 * (latency_steps(1) * max(p.inter_latency_s, p.allreduce_latency_s))
    scale = p.factor("generation") * (1 - FLOOR_MARGIN)
    # prefill (``generation.prefill_s``, dense models): every prompt's GEMMs and attention at the
    # pass's best efficiency (``matmul_eff`` <= its base), the step's n prompts per replica
    peak_flops = cluster.gpu.peak_flops
    prompt_s = 0.0 if model.is_moe else (2 * model.matmul_params() * P / (peak_flops * p.mfu_prefill)
                                         + 2 * model.layers * model.heads * model.head_dim * P ** 2
                                         / (peak_flops * p.mfu_attn))

    def seq_steps(grid, n: int, c: float) -> tuple[float, float]:
        """(sequence-steps, the context tokens they read) at concurrency c, as ``_decode_phase`` runs them."""
        out = ctx = 0.0
        for (px, a), (x, _) in pairwise(grid):
            s = (x - px) * min(c, max(a, 1.0))
            out += s
            ctx += s * (P + (px + x) / 2)
        q = max(0, n - c) * mean
        return out + q, ctx + q * (P + mean)

    def floor(cfg: ParallelConfig) -> float:
        tp, pp = cfg.tp, cfg.pp
        n = math.ceil(w.sequences / cfg.dp)
        full = params_per_gpu(model, tp, pp) * model.dtype_bytes
        weights = model.dtype_bytes * moe.stage_params(model, tp, pp, tp)[0] if model.is_moe else full
        kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
        budget = max_kv_fraction * kv_budget_full(job, cluster, full, p)
        peak = P + cap if static else peak_context_per_seq(n, mean, p90, cap, P, total=w.sequences)
        runs = min(n * (1 + job.schedule.bound) if streaming else n, job.rollout.max_num_seqs)
        most = max(1, min(runs, int(budget // (kvg * peak)))) if budget > 0 else 1
        if streaming:
            steps, seqs = n * mean / most, n * mean
            ctx = seqs * (P + mean)
        elif static:
            steps, seqs = longest * math.ceil(n / most), longest * n
            ctx = seqs * (P + longest / 2)
        else:
            grid = decode_grid(n, mean, p90, cap, total=w.sequences)
            steps = longest + max(0, n - most) * mean / most
            one, most_c = seq_steps(grid, n, 1.0), seq_steps(grid, n, float(min(most, n)))
            seqs, ctx = min(one[0], most_c[0]), min(one[1], most_c[1])
        t = steps * (pp * weights / hbm + o0) + ctx * kvg / hbm
        t += seqs * o1 if o1 >= 0 else steps * o1 * job.rollout.max_num_seqs
        if tp > 1 and nodes_spanned(cluster, tp, 1) == 1:
            n_ar = 2 * model.layers
            t += steps * n_ar * (2 * latency_steps(tp) * p.allreduce_latency_s + lat)
            if not model.is_moe:
                t += seqs * n_ar * (2 * (tp - 1) / tp) * (model.hidden * 2 / pp) / intra
        t += n * p.gen_response_host_s
        t += n * prompt_s / (tp * pp)
        if sleeps:
            t += 2 * host_copy_s(full, p)
        return t * scale

    return floor
