"""Generation: prefill, then continuous-batching decode over the decode grid of the response-length
distribution (the step ends with its longest response), each iteration max(weight + KV bytes /
HBM, FLOPs / peak) + TP collectives + the engine's overhead; KV capacity bounds concurrency.

A replica may span nodes, as vLLM runs one engine over several (Ray): TP over whole nodes (NeMo RL's
TP 16 / 32 rollouts) pays every layer's all-reduce hierarchically, its inter-node steps at the
profile's ``inter_latency_s`` and its remote ring at the scale-out link (``allreduce_s``); PP stages
on different nodes hand their activations over the scale-out link (``comm.pp_hops_s``). Both
constants are fitted on the profile's cross-node collective rows (fit split); no new one is added."""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from nereus.models.spec import ModelSpec
from nereus.planner.cost import moe
from nereus.planner.cost.comm import ar_s, links, nodes_spanned, pp_hops_s
from nereus.planner.cost.estimates import StageEstimate, finish
from nereus.planner.cost.framework import engine_wake_s, host_copy_s
from nereus.planner.cost.lengths import decode_grid, peak_context_per_seq
from nereus.planner.cost.memory import GiB, kv_budget_full, kv_bytes_per_token_per_gpu, params_per_gpu
from nereus.planner.cost.params import CostParams, allreduce_s, latency_steps
from nereus.planner.specs import ClusterSpec, JobSpec, ParallelConfig, Workload


def estimate_generation(job: JobSpec, cluster: ClusterSpec, ms: str, model: ModelSpec, cfg: ParallelConfig, w: Workload,
                p: CostParams, kv_budget_bytes: float | None) -> StageEstimate:
    """Prefill, then continuous-batching decode. At most ``concurrency`` sequences run at once
    (the engine's max_num_seqs, and as many as the KV budget holds at their peak); the rest wait
    for a free slot, so the engine runs full until the queue drains. The step ends with the
    longest response (order statistics of the replica's sample, clipped at the cap)."""
    tp, pp, dp = cfg.tp, cfg.pp, cfg.dp
    moe.check(model, cfg, "generation")
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    workspace = p.workspace_gib * GiB
    if kv_budget_bytes is None:
        kv_budget_bytes = kv_budget_full(job, cluster, weights, p)
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    n = math.ceil(w.sequences / dp)
    P, cap, mean, p90 = w.prompt_len, w.response_len_max, w.response_len_mean, w.response_len_p90
    one_seq = P + cap
    def no_room(kv: float, what: str) -> StageEstimate:
        """The estimate of a generation whose KV cache does not fit: infinite time, its memory needed."""
        return StageEstimate(ms, cfg, math.inf, {"decode": math.inf}, 0.0, weights + workspace + kv,
                             {"weights": weights, "kv_cache": kv, "workspace": workspace}, gpu.usable_bytes, 0,
                             (f"{what} needs {_gib(kv)} GiB of KV cache; {_gib(max(kv_budget_bytes, 0))} GiB left",))

    if kv_budget_bytes < one_seq * kvg:
        return no_room(one_seq * kvg, f"one {one_seq}-token sequence")
    # KV a sequence holds over its life, in expectation at its worst moment: max_x P(len > x) (P + x);
    # a static batch holds every row's slot and KV until its longest ends (the cap, at worst)
    if job.rollout.engine == "static":
        per_seq_peak = P + cap
    else:
        per_seq_peak = peak_context_per_seq(n, mean, p90, cap, P, total=w.sequences)
    streaming = job.schedule.kind == "fully_async" and job.rollout.engine != "static"
    # streaming: the next batches' prompts enter as this one's responses finish, so the engine runs
    # more than this batch's n, but never more than the staleness bound lets it run ahead: at most
    # 1 + staleness batches in flight
    in_flight = n * (1 + job.schedule.bound) if streaming else n
    if job.rollout.engine == "static":
        # a static batch (Hugging Face ``generate``, the reference executor) takes its rows at once,
        # at most max_num_seqs of them, and allocates their KV whatever room there is: it does not
        # shrink the batch to the KV budget as a paged engine's scheduler does, so short of room it
        # runs out of memory
        batch = max(1, min(n, job.rollout.max_num_seqs))
        if batch * per_seq_peak * kvg > kv_budget_bytes:
            return no_room(batch * per_seq_peak * kvg, f"a static batch of {batch} {per_seq_peak}-token sequences")
    concurrency = max(1, min(in_flight, job.rollout.max_num_seqs, int(kv_budget_bytes // (kvg * per_seq_peak))))
    t_prefill, acc = _decode_phase(model, tp, pp, cluster, p, job.rollout.engine, n, P, mean, p90, cap, w.sequences,
                                   concurrency, job.rollout.enforce_eager, streaming, cfg.ep)
    t = {"prefill": t_prefill, **dict(acc)}
    if streaming:  # partial rollouts: at every weight sync the in-flight responses are prefilled again
        # (every running sequence, at half its response on average), once per sync_every steps
        t["partial_resume"] = prefill_s(model, tp, pp, P + mean / 2, concurrency, concurrency, cluster,
                                        p) / job.schedule.sync_every
    if job.rollout.sleep and not job.schedule.is_async:
        # a colocated engine: weights back from host at wake-up, out again at sleep; KV pool re-created
        # (an async plan's rollout pool is its own and never sleeps)
        # sleep: the weights out to host memory, the KV pool released without a copy
        t["engine_wake_sleep"] = engine_wake_s(weights, kv_budget_bytes, p) + host_copy_s(weights, p)
    # every response is turned into training tensors on its replica's host after the engine returns
    # it (padding, conversion, bookkeeping; p.gen_response_host_s, from host rows, not an RL row)
    t["response_host"] = n * p.gen_response_host_s
    kv_used = min(concurrency * per_seq_peak * kvg, kv_budget_bytes)
    transient = {"weights": weights, "kv_cache": kv_used, "workspace": workspace}
    waves = math.ceil(n / concurrency)
    notes = (f"at most {concurrency} of {n} sequences per replica run at once (KV budget "
             f"{kv_budget_bytes / GiB:.1f} GiB, max_num_seqs {job.rollout.max_num_seqs}); the rest wait",) \
        if waves > 1 else ()
    return finish(ms, cfg, t, "generation", p, {}, transient, cluster, waves, notes)


def _gib(nbytes: float) -> str:
    """GiB to two decimals, or three significant digits below 0.1 GiB (a small model's KV cache)."""
    x = nbytes / GiB
    return f"{x:.2f}" if x >= 0.1 or x == 0 else f"{x:.3g}"


@lru_cache(maxsize=8192)
def _decode_phase(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec, p: CostParams, engine: str, n: int,
                  P: int, mean: float, p90: float | None, cap: int, total: int,
                  concurrency: int, eager: bool = False,
                  streaming: bool = False, ep: int = 1) -> tuple[float, tuple[tuple[str, float], ...]]:
    """Prefill seconds and the decode components of one replica's ``n`` sequences (of ``total``
    in the step), at most ``concurrency`` at a time, over the decode grid (points (x, sequences
    still running)). Cached: plans that differ elsewhere, or only in how much KV room they leave
    when as many sequences run at once, share it. ``eager``: no CUDA graphs, so each iteration
    lasts at least its kernel launches (``eager_launch_s``); the excess is ``eager_launch``.
    ``ep``: the engine's expert parallelism (``decode_terms``)."""
    grid = decode_grid(n, mean, p90, cap, total=total)
    static = engine == "static"
    if static:  # every row holds its slot until the longest of the batch ends
        grid = ((0.0, float(n)), (grid[-1][0], 0.0))
    t_prefill = prefill_s(model, tp, pp, P, n, min(n, concurrency), cluster, p)
    acc = {"decode_memory": 0.0, "decode_compute": 0.0, "tp_comm": 0.0, "step_overhead": 0.0}
    step_terms = decode_terms(model, tp, pp, cluster, p, ep)
    o0, o1 = p.engine_overhead_terms(engine)
    launch = eager_launch_s(model, p) if eager else 0.0
    if eager:
        acc["eager_launch"] = 0.0

    def run(steps: float, active: float, ctx: float) -> None:
        mem, cmp_, comm = step_terms(active, ctx)
        acc["decode_memory" if mem >= cmp_ else "decode_compute"] += steps * max(mem, cmp_)
        acc["tp_comm"] += steps * comm
        acc["step_overhead"] += steps * (o0 + o1 * active)
        if launch:
            acc["eager_launch"] += steps * max(0.0, launch - max(mem, cmp_) - comm)

    if streaming:  # fully async: the engine stays full; this batch's share of its work, no tail of its own
        run(n * mean / concurrency, concurrency, P + mean)
        return t_prefill, tuple(acc.items())
    if n > concurrency and static:  # sequential batches, each decoding to its longest
        run((math.ceil(n / concurrency) - 1) * grid[-1][0], concurrency, P + grid[-1][0] / 2)
    elif n > concurrency:  # queue phase: the engine stays full while waiting sequences take freed slots
        run((n - concurrency) * mean / concurrency, concurrency, P + mean)
    prev_x, prev_a = grid[0]
    for x, a in grid[1:]:
        run(x - prev_x, min(concurrency, max(prev_a, 1.0)), P + (prev_x + x) / 2)
        prev_x, prev_a = x, a
    return t_prefill, tuple(acc.items())


def prefill_s(model: ModelSpec, tp: int, pp: int, prompt_len: float, seqs: float, per_forward: float,
              cluster: ClusterSpec, p: CostParams) -> float:
    """Prefill of ``seqs`` prompts of ``prompt_len`` tokens on one replica, ``per_forward`` prompts
    per forward pass: each forward takes the longer of its compute (at the per-rank GEMM size's
    efficiency) and reading the rank's weights once (short prompts are memory-bound), plus 2 TP
    all-reduces per layer."""
    tokens = per_forward * prompt_len
    flops = 2 * model.matmul_params() * prompt_len * seqs
    attn = 2 * model.layers * model.heads * model.head_dim * prompt_len ** 2 * seqs
    forwards = math.ceil(seqs / max(1.0, per_forward))
    peak = tp * pp * cluster.gpu.peak_flops
    if model.is_moe:  # routed experts at one expert's GEMM size: all tokens, width f_e / tp (vLLM's TP experts)
        eff = p.matmul_eff(p.mfu_prefill, 2 * tokens * model.hidden * model.hidden / tp)
        eff_x = p.matmul_eff(p.mfu_prefill, moe.expert_gemm_flops(model, tokens, 1, tp))
        compute = moe.split_compute_s(model, flops, 2 * moe.routed_active_params(model) * prompt_len * seqs, tp * pp,
                                      cluster.gpu.peak_flops, eff, eff_x)[0] + attn / (peak * p.mfu_attn)
    else:
        eff = p.matmul_eff(p.mfu_prefill, 2 * tokens * model.hidden * model.ffn / tp)
        compute = flops / (peak * eff) + attn / (peak * p.mfu_attn)
    weights = forwards * pp * model.dtype_bytes * params_per_gpu(model, tp, pp) / (p.hbm_eff * cluster.gpu.hbm_bytes_per_s)
    return max(compute, weights) + forwards * 2 * model.layers * ar_s(tokens * model.hidden * 2, tp, cluster, p)


def decode_iteration_s(model: ModelSpec, tp: int, pp: int, active: float, ctx: float, cluster: ClusterSpec,
                       p: CostParams, engine: str = "vllm", eager: bool = False) -> float:
    """Wall time of one engine iteration decoding ``active`` sequences at context ``ctx``: the
    larger of the memory- and compute-bound times, the TP collectives, the engine's overhead.
    ``eager`` (no CUDA graphs): the GPU part lasts at least the iteration's kernel launches."""
    mem, cmp_, comm = decode_step_s(model, tp, pp, active, ctx, cluster, p)
    gpu = max(mem, cmp_) + comm
    if eager:
        gpu = max(gpu, eager_launch_s(model, p))
    return gpu + p.iteration_overhead_s(engine, active)


def eager_launch_s(model: ModelSpec, p: CostParams) -> float:
    """Host time to launch one decode iteration's kernels without CUDA graphs: every decoder layer's
    (``p.eager_layer_cpu_s``). Each rank of a TP group launches its own in parallel; the pipeline
    stages of a replica together launch every layer once per iteration."""
    return model.layers * p.eager_layer_cpu_s


def decode_step_s(model: ModelSpec, tp: int, pp: int, active: float, ctx: float, cluster: ClusterSpec,
                  p: CostParams) -> tuple[float, float, float]:
    """One decode step of ``active`` sequences at mean context ``ctx`` on one replica:
    (memory-bound time, compute-bound time, communication). With pp stages the batch is split
    into pp pipelined micro-batches, so every stage reads its weights pp times per token. The
    compute-bound part uses the per-rank GEMM size (smaller under TP, so less efficient)."""
    return decode_terms(model, tp, pp, cluster, p)(active, ctx)


def decode_terms(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec,
                 p: CostParams, ep: int = 1) -> Callable[[float, float], tuple[float, float, float]]:
    """``decode_step_s`` of one replica as a function of (active, ctx), with everything that
    depends only on the model, the layout and the parameters computed once (generation calls it
    at every point of its decode grid).

    Mixture of experts: a step reads the dense weights and, of each block's experts, the share its
    ``active / pp`` tokens route to (``moe.decode_expert_fraction``: 1 - (1 - k/E)^tokens); with
    the engine's expert parallelism (``ep`` = tp) the busiest rank reads and computes
    ``moe.CAPACITY_FACTOR`` times its share of the routed experts. Collectives are the dense ones:
    vLLM's EP inside one engine still all-reduces each MoE block's output over the tp ranks."""
    if model.is_moe:
        return _moe_decode_terms(model, tp, pp, cluster, p, ep)
    gpu = cluster.gpu
    weights = model.dtype_bytes * params_per_gpu(model, tp, pp)
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    hbm = p.hbm_eff * gpu.hbm_bytes_per_s
    n_mat, n_attn = 2 * model.matmul_params(), 4 * model.layers * model.heads * model.head_dim
    h, ffn, peak, shards = model.hidden, model.ffn, gpu.peak_flops, tp * pp
    intra, inter = links(cluster, p)
    nodes = nodes_spanned(cluster, tp, 1)
    n_ar = 2 * model.layers
    one_node = nodes == 1 and tp > 1
    lat = 2 * (latency_steps(tp) * p.allreduce_latency_s + latency_steps(1) * max(p.inter_latency_s, p.allreduce_latency_s))
    ring = 2 * (tp - 1) / tp

    def terms(active: float, ctx: float) -> tuple[float, float, float]:
        mem = (pp * weights + active * ctx * kvg) / hbm
        eff = p.matmul_eff(p.mfu_decode, 2 * active / pp * h * ffn / tp)
        cmp_ = active * (n_mat + n_attn * ctx) / shards / (eff * peak)
        act = active / pp * h * 2
        if tp == 1 or act <= 0:
            comm = 0.0
        elif one_node:  # allreduce_s inside one node, its terms computed once
            comm = n_ar * (lat + ring * act / intra)
        else:
            comm = n_ar * allreduce_s(act, tp, intra, p.allreduce_latency_s, nodes=nodes,
                                      alpha_inter=p.inter_latency_s, bw_inter=inter)
        if pp > 1:
            comm += pp_hops_s(act, tp, pp, cluster, p)
        return mem, cmp_, comm

    return terms


def _moe_decode_terms(model: ModelSpec, tp: int, pp: int, cluster: ClusterSpec, p: CostParams,
                      ep: int) -> Callable[[float, float], tuple[float, float, float]]:
    """``decode_terms`` of a mixture-of-experts model (see there)."""
    gpu = cluster.gpu
    dense_p, expert_p = moe.stage_params(model, tp, pp, tp)
    w_dense, w_expert = model.dtype_bytes * dense_p, model.dtype_bytes * expert_p
    load = moe.CAPACITY_FACTOR if ep > 1 else 1.0
    kvg = kv_bytes_per_token_per_gpu(model, tp, pp)
    hbm = p.hbm_eff * gpu.hbm_bytes_per_s
    n_routed = 2 * moe.routed_active_params(model)
    n_mat, n_attn = 2 * model.matmul_params() - n_routed, 4 * model.layers * model.heads * model.head_dim
    h, peak, shards = model.hidden, gpu.peak_flops, tp * pp
    width_split = 1 if ep > 1 else tp  # EP keeps experts whole; vLLM's default slices each over tp
    intra, inter = links(cluster, p)
    nodes = nodes_spanned(cluster, tp, 1)
    n_ar = 2 * model.layers

    def terms(active: float, ctx: float) -> tuple[float, float, float]:
        hit = min(1.0, load * moe.decode_expert_fraction(model, active / pp))
        mem = (pp * (w_dense + w_expert * hit) + active * ctx * kvg) / hbm
        eff = p.matmul_eff(p.mfu_decode, 2 * active / pp * h * h / tp)
        eff_x = p.matmul_eff(p.mfu_decode, moe.expert_gemm_flops(model, active / pp, 1, width_split))
        cmp_ = active * ((n_mat + n_attn * ctx) / eff + n_routed * load / eff_x) / shards / peak
        act = active / pp * h * 2
        comm = 0.0
        if tp > 1 and act > 0:
            comm = n_ar * allreduce_s(act, tp, intra, p.allreduce_latency_s, nodes=nodes,
                                      alpha_inter=p.inter_latency_s, bw_inter=inter)
        if pp > 1:
            comm += pp_hops_s(act, tp, pp, cluster, p)
        return mem, cmp_, comm

    return terms
