"""Lower bounds ("floors") of a training or inference pass's time, a few arithmetic operations each,
for the option tables to skip pool sizes that cannot matter before pricing them in full.

A pass's time is a sum of non-negative terms (``passes.estimate_training`` / ``estimate_inference``);
the floor keeps two of them, computed as those functions compute them: the GEMM and attention
compute at the pass's own GEMM efficiency, and the log-prob pass over the vocabulary. Neither reads
the ZeRO stage, and recomputation only adds to them (8N instead of 6N, 4/3 of the attention), so the
floor of a config with ``recompute=False`` bounds every ZeRO stage and both recompute settings of it. ``FLOOR_MARGIN`` covers the float rounding of the sums.
``tests/unit/test_solver_bounds.py`` checks floor <= priced time for every option of the example jobs.
Per config, within a group: ``pass_floor(..., comm=True)`` (the config's own ZeRO stage and
recomputation, with the bubble and collectives on top) and ``memory_floor`` (its bytes per GPU), with
which the tables leave unpriced the configs that cannot matter or cannot fit
(``tests/unit/test_solver_memfloor.py``).

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
from nereus.planner.cost.comm import (
    TP_EDGE_COLLECTIVES,
    ag_s,
    ar_s,
    links,
    nodes_spanned,
)
from nereus.planner.cost.framework import host_copy_s
from nereus.planner.cost.lengths import decode_grid, expected_max, peak_context_per_seq
from nereus.planner.cost.memory import (
    GiB,
    kv_budget_full,
    kv_bytes_per_token_per_gpu,
    model_state_bytes,
    params_per_gpu,
    split_model_state_bytes,
)
from nereus.planner.cost.params import CostParams, latency_steps
from nereus.planner.cost.passes import (
    _computed,
    _micro_batches,
    fsdp_unsharded_bytes,
    logprob_vocab_s,
    padded_tokens,
    seq_moments,
    worst_micro_batch,
)
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload

FLOOR_MARGIN = 1e-9
"""Relative amount the floor is lowered by, so that float rounding never lifts it above the price."""


def pass_floor(job: JobSpec, cluster: ClusterSpec, model_stage: str, model: ModelSpec, w: Workload,
               p: CostParams, comm: bool = False) -> Callable[[ParallelConfig], float]:
    """``floor(cfg)``: a lower bound of the time ``model.estimate`` gives ``model_stage`` (training or
    inference; 0.0 for generation) under ``cfg`` with any ZeRO stage and either recompute setting, at
    the stage factors of ``p``, without framework options (``StageOptions``: the option tables price
    none). What does not depend on ``cfg`` is computed once, here.

    ``comm``: a tighter floor of ``cfg`` with its own ZeRO stage and recomputation, with which
    ``greedy.price_groups`` leaves a config unpriced when even its floors cannot survive tightening (and
    ``memory_floor`` leaves one that cannot fit): the compute at 8N and 4/3 of the attention when
    recomputing, plus the terms ``passes`` prices on top of it as it prices them: the pipeline bubble
    (the same compute times (pp - 1) / micro-batches), the TP all-reduces of every layer (4, or 6
    recomputing, per training micro-batch; 2 per layer and the edges' per inference micro-batch; a
    mixture of experts' training leaves them out: its MoE blocks trade them for the all-to-all),
    ZeRO-3's parameter all-gathers (two per training micro-batch, one per inference one) and, for a
    dense model's training, the optimizer step over its ZeRO-1 share. Worked example (Llama-3.1-70B
    PPO, actor training on 256 H100s, tp 4, pp 8, sp 2, micro-batch 1, ZeRO-1, no recompute): compute
    23.90 s + bubble 1.31 s + TP all-reduces 2.39 s + log-prob 0.30 s + optimizer 0.01 s = a floor of
    27.92 s where the cost model prices 29.52 s (its all-to-alls, pipeline sends and DP gradient
    all-reduce on top); the loose floor of the same config is 24.21 s."""
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

    head = "lm" if lm else "value"
    hbm = p.hbm_eff * cluster.gpu.hbm_bytes_per_s
    batches, all_tokens = micro_batches(w, per_step, padded), padded_tokens(w, 0)

    def compute_s(cfg: ParallelConfig, mb_tokens: float, tokens: float, s_sq: float, nf: int, attn: float) -> float:
        """The GEMMs at ``nf`` FLOPs per parameter and token, and ``attn`` times the attention."""
        split, gpus = cfg.seq_split, cfg.gpus
        eff = p.matmul_eff(mfu, 2 * mb_tokens / split * width / cfg.tp)
        flops = nf * matmul * tokens * E
        if routed:  # the routed experts at their own (smaller) GEMM's efficiency
            eff_x = p.matmul_eff(mfu, moe.expert_gemm_flops(model, mb_tokens / split / cfg.tp, cfg.ep * cfg.etp,
                                                            cfg.etp))
            compute, _ = moe.split_compute_s(model, flops, nf * routed * tokens * E, gpus, peak, eff, eff_x)
        else:
            compute = flops / (gpus * peak * eff)
        return compute + attn0 * s_sq * E * attn / (gpus * peak * p.mfu_attn)

    def terms(cfg: ParallelConfig) -> tuple:
        m, mb_tokens, _ = batches(cfg)
        tokens, s_sq = _computed(w, cfg, mb_tokens, s_sq0, True) if padded else (all_tokens, s_sq0)
        logprob = logprob_vocab_s(tokens * E, model.vocab, cfg, cluster, p, training=training) if lm else 0.0
        return m, mb_tokens, tokens, s_sq, logprob

    def floor(cfg: ParallelConfig) -> float:
        _, mb_tokens, tokens, s_sq, logprob = terms(cfg)
        compute = compute_s(cfg, mb_tokens, tokens, s_sq, n, 1)
        if lm:
            compute += logprob
        return compute * scale

    if not comm:
        return floor
    shapes: dict[tuple, list] = {}

    def comm_floor(cfg: ParallelConfig) -> float:
        tp, pp, dp, rc = cfg.tp, cfg.pp, cfg.dp, training and cfg.recompute
        key = (tp, pp, dp, cfg.micro_batch, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.token_budget)
        got = shapes.get(key)
        if got is None:  # what the config's ZeRO stage and recomputation leave unchanged, once per shape
            m, mb_tokens, tokens, s_sq, logprob = terms(cfg)
            layers_here, n_micro = math.ceil(model.layers / pp), E * per_step * m
            ar_tp = ar_s(mb_tokens / cfg.seq_split * h * 2, tp, cluster, p)
            rest = logprob
            if not training:
                rest += m * (layers_here * 2 + TP_EDGE_COLLECTIVES) * ar_tp
            elif not model.is_moe:
                rest += E * per_step * params_per_gpu(model, tp, pp, head) / dp * p.optimizer_bytes_per_param / hbm
            computes = [compute_s(cfg, mb_tokens, tokens, s_sq, n, 1)]
            if training:  # recomputing: 8N and 4/3 of the attention
                computes.append(compute_s(cfg, mb_tokens, tokens, s_sq, 8, 4 / 3))
            got = shapes[key] = [m, n_micro, layers_here, ar_tp, rest, computes, None]
        m, n_micro, layers_here, ar_tp, rest, computes, gather = got
        compute = computes[1 if rc else 0]
        t = compute + compute * (pp - 1) / m + rest
        if training and not model.is_moe:
            t += n_micro * layers_here * (6 if rc else 4) * ar_tp
        if cfg.zero >= 3:
            if gather is None:
                psi = _params(model, cfg, head, training)
                gather = got[6] = (2 * n_micro if training else m) * ag_s(psi * 2, dp, cluster, p, tp * pp)
            t += gather
        return t * scale

    return comm_floor


def micro_batches(w: Workload, per_step: int, padded: bool) -> Callable[[ParallelConfig], tuple[int, float, float]]:
    """``passes._micro_batches(w, cfg, per_step, padded, 0)`` as a function of ``cfg``: the same
    arithmetic, with what does not depend on ``cfg`` computed once (the floors ask it per config)."""
    s_mean = w.prompt_len + w.response_len_mean
    longest = w.prompt_len + expected_max(w.sequences, w.response_len_mean, w.response_len_p90, w.response_len_max)

    def batches(cfg: ParallelConfig) -> tuple[int, float, float]:
        if padded or cfg.token_budget:
            return _micro_batches(w, cfg, per_step, padded, 0)
        seqs, b = w.sequences / (per_step * (cfg.dp // cfg.seq_split)), cfg.micro_batch
        return max(1, math.ceil(seqs / b)), b * s_mean, worst_micro_batch(w, b, s_mean, longest)
    return batches


def _params(model: ModelSpec, cfg: ParallelConfig, head: str, training: bool) -> float:
    """Parameters per GPU of a training (``passes._train_shape``) or inference (``_infer_shape``) pass."""
    if training and model.is_moe:
        return sum(moe.stage_params(model, cfg.tp, cfg.pp, cfg.ep * cfg.etp, head))
    return params_per_gpu(model, cfg.tp, cfg.pp, head, None if training else cfg.ep * cfg.etp)


def memory_floor(job: JobSpec, model_stage: str, model: ModelSpec, w: Workload,
                 p: CostParams) -> Callable[[ParallelConfig, bool], float]:
    """``floor(cfg, offload)``: a lower bound of the bytes per GPU, resident + transient, that
    ``model.estimate`` gives ``model_stage`` (training or inference) under ``cfg`` with its ZeRO stage
    and recomputation, the optimizer state left out with ``offload`` (kept in host memory between
    updates, ``model.offloaded``; a looser bound then, since the update holds it again). The same terms ``passes`` sums, computed as it computes them:
    model states by ZeRO stage (``memory.model_state_bytes``; a frozen model's weights, sharded under
    ZeRO-3), activations of the largest micro-batch (all of them for the micro-batches in flight, or
    only the kept block inputs when recomputing), logits, ZeRO-3's unsharded layers, the workspace,
    and the reserve on all of them. The option tables drop a config whose floor exceeds a GPU before
    pricing it (it could never fit an empty GPU: ``_option_rows``), so of the configs the time floors
    (``pass_floor(..., comm=True)``) let through, only those that can fit are priced.
    ``tests/unit/test_solver_memfloor.py``: at most the priced bytes on every config of random jobs.

    Worked example (Llama-3.1-70B PPO, actor training on 256 H100s, tp 1, pp 1, micro-batch 1): under
    ZeRO-1 the model states alone (bf16 weights and fp32 gradients of all 70.6 B parameters, the
    optimizer over 256 ranks, the 13% reserve) come to 449 GiB of the 78 GiB usable, so neither
    recompute setting is priced; ZeRO-3 with recomputation fits (4.6 + 28.6 GiB)."""
    role, _, stage = model_stage.partition("/")
    if stage not in ("training", "inference"):
        return lambda cfg, offload=False: 0.0
    training = stage == "training"
    head = "value" if role in ("critic", "reward") else "lm"
    per_step = job.batch.mini_batches if training else 1
    padded, h, dt = job.sequence.padded, model.hidden, model.dtype_bytes
    keep = (1 + max(0.0, p.mem_reserve_frac)) * (1 - FLOOR_MARGIN)
    workspace = p.workspace_gib * GiB
    replicated = bool(p.act_bytes_replicated)  # (the kept block inputs are then whole on every TP rank)
    batches = micro_batches(w, per_step, padded)

    shapes: dict[tuple, list] = {}

    def floor(cfg: ParallelConfig, offload: bool = False) -> float:
        tp, pp, dp, zero = cfg.tp, cfg.pp, cfg.dp, cfg.zero
        key = (tp, pp, dp, cfg.micro_batch, cfg.sp, cfg.cp, cfg.ep, cfg.etp, cfg.token_budget)
        got = shapes.get(key)
        if got is None:  # what the ZeRO stage and recomputation leave unchanged, once per shape
            m, _, worst = batches(cfg)
            tok = worst / cfg.seq_split
            per_tok = p.act_bytes_per_token(h, moe.act_ffn(model, moe.imbalance(cfg)) if model.is_moe else model.ffn,
                                            model.kv_dim, tp, dt)
            layers_here = math.ceil(model.layers / pp)
            logits = tok * (model.vocab / tp if head == "lm" else 1) * p.logits_bytes
            if training:
                in_flight = min(pp, m)
                act = (in_flight * layers_here * tok * per_tok,  # (recomputing: the kept block inputs)
                       in_flight * layers_here * tok * dt * h / (1 if replicated else tp) + tok * per_tok)
                logits *= p.logits_copies_train
            else:
                act = (tok * per_tok,) * 2
            got = shapes[key] = [act, logits + workspace, _params(model, cfg, head, training), layers_here, {}]
        act, rest, psi, layers_here, by_zero = got
        states = by_zero.get(zero)
        if states is None:  # (resident bytes, optimizer bytes, ZeRO-3's unsharded layers)
            if not training:
                resident, optimizer = dt * psi / (dp if zero >= 3 else 1), 0.0
            else:
                if model.is_moe:
                    dense, expert = moe.stage_params(model, tp, pp, cfg.ep * cfg.etp, head)
                    ms = split_model_state_bytes(dense, expert, dp, moe.expert_dp(cfg), zero, dt)
                else:
                    ms = model_state_bytes(psi, dp, zero, dt)
                resident, optimizer = sum(ms.values()), ms["optimizer"]
            states = by_zero[zero] = (resident, optimizer, fsdp_unsharded_bytes(psi, cfg, layers_here, dt))
        resident, optimizer, unsharded = states
        transient = act[1 if training and cfg.recompute else 0] + rest + unsharded
        return (resident + transient) * keep - (optimizer if offload else 0.0)

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

    sums: dict[tuple[int, float], tuple[float, float]] = {}

    def seq_steps(grid, n: int, c: float) -> tuple[float, float]:
        """(sequence-steps, the context tokens they read) at concurrency c, as ``_decode_phase`` runs them
        (kept per (n, c): layouts of one replica size share them)."""
        got = sums.get((n, c))
        if got is None:
            out = ctx = 0.0
            for (px, a), (x, _) in pairwise(grid):
                s = (x - px) * min(c, max(a, 1.0))
                out += s
                ctx += s * (P + (px + x) / 2)
            q = max(0, n - c) * mean
            got = sums[n, c] = (out + q, ctx + q * (P + mean))
        return got

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
