"""CostParams: every coefficient calibration may change, in one frozen object, plus the
alpha-beta communication primitives that use them.

Defaults are the efficiency anchors of shared/reference/COST_MODEL.md: training MFU 38-55%
(we take 0.45), prefill 50-70% (0.60), HBM 80-90% (0.85), NVLink all-reduce ~81% of peak,
inter-node p2p ~72% of 50 GB/s, small all-reduce 10-40 us for the whole operation on 8 GPUs,
p2p 5-8 us. Fitted GPU profiles (``nereus/calibration/profiles``) replace them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from nereus.errors import SpecError
from nereus.jsonio import check_keys, naming, read_json

STAGES = ("generation", "inference", "training")


@dataclass(frozen=True, slots=True, kw_only=True)
class CostParams:
    mfu_train: float = 0.45
    """Achieved fraction of bf16 peak in training matmuls."""
    mfu_train_fp8: float = 0.30
    """Achieved fraction of the FP8 peak (2x bf16) in training's FP8 linear GEMMs
    (``StageOptions.fp8_linear``); analytic start, fitted by the GPU profiles on FP8 training rows."""
    power_cap_flops_scale: float = 1.0
    """Sustained tensor-core throughput of a power-capped variant of this profile's GPU relative to
    the full-power chip (Meta's 500 W Grand Teton H100s against 700 W H100 SXM): the cap lowers
    clocks under dense GEMMs. Fitted per profile on the capped variant's fit rows (bf16 rows pin it,
    the profile's full-power rows pin ``mfu_train``); used by ``nereus fidelity`` for rows of a
    capped variant (``fidelity.catalog.power_capped``), not by the planner."""
    mfu_prefill: float = 0.60
    """Achieved fraction of peak in forward passes (prefill, log-prob / value inference)."""
    mfu_decode: float = 0.50
    """Achieved fraction of peak in the compute-bound part of a decode step."""
    mfu_attn: float = 0.40
    """Achieved fraction of peak in attention's score and value products (FlashAttention kernels,
    causal masking) of training and prefill: below the GEMMs', and what long sequences pay."""
    matmul_half_flops: float = 0.0
    """Size-dependent matmul efficiency: eff(x) = mfu * x / (x + half) for x FLOPs per GPU per
    kernel call (0 disables; fitted by calibration on small devices)."""
    hbm_eff: float = 0.85
    """Achieved fraction of HBM bandwidth in memory-bound decode."""
    intra_link_eff: float = 0.80
    """Achieved fraction of NVLink bandwidth (bus bandwidth) for large messages."""
    inter_link_eff: float = 0.72
    """Achieved fraction of scale-out bandwidth."""
    allreduce_latency_s: float = 3e-6
    """Latency of one step of a collective inside a node. A whole small all-reduce over n ranks
    pays 2 * ceil(log2 n) steps (NCCL's LL/tree protocols, NVLS and engines' custom all-reduce
    are latency-bound, not ring hops): about 18 us on 8 GPUs, the published 10-40 us."""
    inter_latency_s: float = 12e-6
    """Latency of one collective step that crosses nodes (each level of the node tree)."""
    p2p_latency_s: float = 8e-6
    """alpha of one point-to-point message."""
    decode_step_overhead_s: float = 1.5e-3
    """Inference-engine overhead of one decode iteration at batch 1 (scheduler, sampling, launch;
    CUDA graphs keep it small)."""
    decode_overhead_per_seq_s: float = 2e-5
    """Growth of the per-iteration overhead with each running sequence (batch preparation,
    sampling, detokenisation in the scheduler's Python)."""
    micro_batch_overhead_s: float = 0.0
    """Fixed host-side cost of one forward pass of one micro-batch on one GPU, whatever its size
    (Python dispatch, kernel launches, framework bookkeeping); a training micro-batch pays it three
    times (forward and backward), four with full recomputation. Negligible on a GPU with large
    micro-batches (default 0), it is most of a micro-batch's time on CPU processes running a tiny
    model (the demo measures it)."""
    infer_pass_overhead_s: float = 0.0
    """The same fixed host-side cost for one no-grad forward of one micro-batch (log-probs of the
    actor and reference, values of critic and reward): no autograd graph is recorded, so it is not
    the training figure's third. Default 0; the demo measures it (``nereus.demo.probe``)."""
    infer_call_overhead_s: float = 0.0
    """Fixed cost of one inference call on one GPU beyond its micro-batches: gathering every rank's
    log-probs or values (the executor's all-reduce of the result; verl's gather of a DataProto to
    the driver) and the synchronisation that ends the call. Default 0; the demo measures it."""
    optimizer_step_overhead_s: float = 0.0
    """Fixed cost of one optimizer step on one GPU beyond its bytes: one update and (ZeRO) one
    all-gather launched per parameter tensor (default 0; the demo measures it)."""
    eager_layer_cpu_s: float = 1.7e-4
    """Host time to launch one decoder layer's kernels in one decode iteration of an engine running
    without CUDA graphs (``RolloutSpec.enforce_eager``). Launches run ahead of the GPU, so an
    iteration takes the larger of its GPU time and layers x this. Derived, not fitted to a single
    number: the median over the corpus's fit-split eager / CUDA-graph pairs of dense models whose
    eager run is visibly launch-bound (eager >= 1.5x graph) of (eager - graph time per token) /
    layers (``nereus.fidelity.fit.eager_layer_cpu_s``): 0.10-0.32 ms over GPT-2, OPT-125m and
    Qwen3-0.6B on vLLM V0/V1 and SGLang. A lower bound per pair (the GPU time hidden under the
    launches is not added back)."""
    engine_overhead: tuple[tuple[str, float, float], ...] = (("vllm-v0", 8.1e-4, 8.1e-5),)
    """Per-engine (engine, overhead s, s per running sequence) fitted from published decode tables;
    an engine not listed uses the two fields above. The default lists vLLM's V0 engine, whose
    scheduler, input preparation, sampler and output processing run in Python between the GPU's
    iterations, for every sequence: 0.81 ms + 81 us per sequence, the robust line through the fit
    split's host-time rows with each source weighing the same (``nereus.fidelity.fit.
    engine_host_overhead``: Sarathi-Serve's V0 scheduler/sampler path profiled at batch 8-128 on two
    hosts, vLLM 0.5's own 20 ms at batch 200); four times the generic (V1-like) default's growth
    per sequence. Not fitted to a decode time."""
    kv_mem_util: float = 0.90
    """Fraction of usable GPU memory an inference engine may take (vLLM's default 0.9)."""
    act_coeff_hidden: float = 12.0
    act_coeff_ffn: float = 7.0
    act_coeff_kv: float = 4.0
    """Training activation bytes per token per layer = (12 h + 7 f + 4 g d) / tp (with sequence
    parallelism): about 150 KB for Llama-3.1-8B."""
    act_bytes_replicated: float = 0.0
    act_bytes_sharded: float = 0.0
    """Measured activation bytes per token per layer, the part TP does not split and the part it
    does (an executor without sequence parallelism replicates norm inputs and the residual).
    When either is > 0 they replace the coefficient formula above (see ``act_bytes_per_token``)."""
    logits_bytes: float = 4.0
    """Bytes per logit (fp32)."""
    logits_copies_train: float = 1.62
    """Copies of the fp32 logits (``logits_bytes`` per vocabulary entry per token) a training pass
    holds at its peak: the logits and their gradient (2) less what frameworks free or keep in
    bf16 between them. Fitted, 1.62, with ``mem_fragmentation`` on the fit split's memory rows
    (``nereus.fidelity.fit.fit_memory_params``: torchtitan's full-recompute rows, where logits of
    32k-token micro-batches are a third of the peak); the analytic start was 2."""
    logprob_bytes_per_logit: float = 16.0
    """HBM bytes per logit of the log-probability pass after the LM head (derived, not fitted):
    the head writes bf16 logits (2), the fp32 cast reads 2 and writes 4, log-softmax reads 4 and
    writes 4 (verl ``logprobs_from_logits``; NeMo RL and OpenRLHF do the same in fp32)."""
    logprob_train_extra_bytes_per_logit: float = 18.0
    """Extra HBM bytes per logit in training: log-softmax backward reads its output and the
    incoming gradient and writes the logits' gradient (12), cast back to bf16 (read 4, write 2)."""
    fsdp_unit_cpu_s: float = 1e-3
    """CPU time of FSDP's hooks on one unit (a decoder layer) per forward or backward pass: unshard,
    all-gather launch, stream waits (pytorch/pytorch#173680: about 1 ms per pre-forward, FSDP2 on a
    server Xeon; corpus ``host`` row). Part of the floor under small models' micro-batches
    (``fsdp_cpu_floor_s``), on top of the layer's own eager dispatch below."""
    layer_cpu_train_s: float = 1.02e-3
    """Host time to dispatch one decoder layer's eager PyTorch ops (Hugging Face modelling code) per
    pass of a training micro-batch, averaged over forward, recomputed forward and backward: the
    median over the fit split's ``host`` rows by source (``nereus.fidelity.fit.layer_host_s``):
    0.85 ms from an eager / CUDA-graph pair of Llama-3.2-1B on one GPU (stas00/ml-engineering),
    1.19 ms from the host-bound floor of Qwen-1.8B fine-tuning on one A100 (ms-swift's benchmark).
    Not fitted to an RL row."""
    layer_cpu_fwd_s: float = 3.9e-4
    """The same for one no-grad forward (log-probabilities, values): 0.39 ms per layer from the same
    eager / CUDA-graph pair's inference forward (the fit split's one such row)."""
    workspace_gib: float = 1.0
    """Per-GPU transient workspace of a running stage (allocator, kernels, buffers)."""
    mem_fragmentation: float = 1.843
    """PyTorch's caching allocator holds more than the live tensors (``max_memory_reserved`` over
    ``max_memory_allocated``): the factor on a training pass's activations and logits by which a
    *reserved*-memory measurement exceeds the allocated peak. Fitted, 1.843, on the corpus's fit
    ``memory`` rows that report reserved memory (``nereus.fidelity.fit.fit_memory_params``), never on
    a held-out row, and used only to predict such rows. Plans are checked on allocated memory plus
    ``mem_reserve_frac``: those reserved peaks sit at 84 of 95 GiB whatever the sequence length
    (torchtitan), which is cache the allocator frees and retries with before it reports an out of
    memory, not memory a step needs (the simulator's ground truth counts allocated memory too)."""
    mem_reserve_frac: float = 0.13
    """Memory a plan keeps in reserve beyond its predicted peak on every training and inference
    stage, as a fraction of that peak (``estimates.finish`` adds it to resident and transient
    alike, so a pool's reserve is this fraction of its predicted peak): the 90th percentile of
    measured / predicted - 1 over the held-out ``memory`` rows (``nereus.fidelity.fit.
    memory_reserve_frac``), the error the model makes on measurements no fit read. ``nereus plan``
    prints it with every plan. 0 disables it. 0.13: the held-out p90 of measured / predicted is 1.121
    over 23 rows (rounded up to the next hundredth)."""
    weight_sync_tensor_s: float = 2.81e-4
    """Host-side time per named tensor of a weight sync between disjoint pools beyond its bytes and
    broadcast latency (``comm.weight_sync_s``): the trainer gathering the tensor from its TP / EP /
    FSDP shards and converting it to its Hugging Face name, the copy into the send buffer, the
    engine's ``load_weights`` of it. Serial per tensor, so a mixture-of-experts model (Qwen3-30B-A3B:
    18,867 tensors, 56x a dense 7B's 339) pays it in seconds. The fit split's bucketed syncs
    (``async`` rows of stage ``weight_sync``), each row's (measured - bytes - bucket latency) /
    tensors, median over sources (``nereus.fidelity.fit.weight_sync_tensor_s``): 0.093 ms from
    MoonshotAI checkpoint-engine (Qwen3-235B-A22B on 8 H800, 6.22 s), 0.281 ms from verl's NCCL
    checkpoint engine (Qwen3-30B-A3B, 2 FSDP -> 30 rollout H100s, ~7 s), 0.68 ms from trl's packed
    NCCL sync (Qwen3-32B, 16 + 16 H200s, ~2.3 s): 0.281 ms. Not fitted to a held-out row."""
    host_link_gbps: float = 25.0
    """GPU <-> host bandwidth for CPU offload of a resident state (PCIe Gen5 x16 effective)."""
    kv_remap_s_per_gib: float = 3.9e-3
    """Time to create and map again one GiB of an engine's KV cache pool at wake-up (``engine_wake_s``):
    the fit split's ``host`` rows of metric ``kv_remap_ms_per_gib``, median by source
    (``nereus.fidelity.fit.layer_host_s``): 3.88 ms, vLLM 0.26 waking with 69.23 GiB of KV cache and
    1.18 GiB of mapped weights in 0.273 s (NVIDIA/srt-slurm, B200). Not fitted to an RL row."""
    controller_gbps: float = 0.445
    controller_call_s: float = 8.3e-3
    """verl's single-controller data path (``controller_transfer_s``): one worker call moves its
    batch through the driver (DataProto serialised into Ray's object store, one chunk per worker,
    results back and concatenated) at ``controller_gbps`` GB/s of bytes sent plus returned, plus
    ``controller_call_s`` per call. Measured, not fitted to an RL row: verl 0.9.1's own
    ``RayWorkerGroup`` timing ``DP_COMPUTE_PROTO`` calls of 1-220 MB on this project's 2-core CPU
    machine, Theil-Sen over 27 interleaved rounds (``benchmarks/verl_dispatch.py``,
    ``benchmarks/results/verl_dispatch.json``). Published figures for the same path bracket it:
    0.3-0.4 GB/s serialising a DataProto (verl#3425), 0.18 GB/s through Ray put + get (miles#591),
    0.05 GB/s in one small benchmark (verl#2847) (``docs/research/verl_dispatch_cost.csv``)."""
    grad_resident_frac: float = 1.0
    """The share of a trained model's gradient bytes held between optimizer steps (outside its
    training stage): 1, a persistent gradient buffer (Megatron's contiguous ``grad_buffer``), so the
    gradients are resident through generation and inference too; 0, gradients freed after every
    optimizer step (``param.grad = None``: Nereus's executor, ``executor.engine``; PyTorch's
    ``zero_grad(set_to_none=True)``), so they count only while the training stage runs (its
    transient memory)."""
    optimizer_bytes_per_param: float = 32.0
    """HBM bytes an AdamW step moves per parameter it updates (read grad, master, m, v; write
    master, m, v, param)."""
    stage_factor: tuple[tuple[str, float], ...] = (("generation", 1.0), ("inference", 1.0), ("training", 1.0))
    """Per-stage multiplicative time correction fitted by calibration."""
    gen_response_host_s: float = 1.85e-4
    """Host time per generated response outside the engine (``generation.estimate_generation``,
    ``response_host``): converting each response to training tensors, padding, per-response
    bookkeeping, serial on each replica's host. The fit split's ``host`` rows of metric
    ``host_ms_per_response``, median by source (``nereus.fidelity.fit.layer_host_s``): 0.185 ms
    from the post-rollout spans of a Qwen3-0.6B GRPO run (vllm-project/vime#11, 16 vs 256 samples;
    its Ray put left out, ``controller_transfer`` prices the bytes). Not fitted to an RL row."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "stage_factor":
                for stage, x in v:
                    if stage not in STAGES or not _real(x) or not x > 0:
                        raise SpecError(f"cost params: stage_factor {stage}={x} invalid (stages {', '.join(STAGES)}; "
                                        f"factors finite and > 0)")
                continue
            if f.name == "engine_overhead":
                for row in v:
                    if len(row) != 3 or not isinstance(row[0], str) or not all(_real(x) and x >= 0 for x in row[1:]):
                        raise SpecError(f"cost params: engine_overhead entry {row!r} must be (engine, s >= 0, s >= 0)")
                continue
            if not _real(v) or v < 0:
                raise SpecError(f"cost params: {f.name} must be a finite number >= 0, got {v!r}")
        if self.mem_fragmentation < 1:
            raise SpecError(f"cost params: mem_fragmentation must be >= 1 (reserved >= allocated), got {self.mem_fragmentation}")
        if self.grad_resident_frac > 1:
            raise SpecError(f"cost params: grad_resident_frac must be in [0, 1], got {self.grad_resident_frac}")
        for f in ("mfu_train", "mfu_train_fp8", "power_cap_flops_scale", "mfu_prefill", "mfu_decode", "mfu_attn", "hbm_eff", "intra_link_eff",
                  "inter_link_eff", "kv_mem_util"):
            if not 0 < getattr(self, f) <= 1:
                raise SpecError(f"cost params: {f} must be in (0, 1], got {getattr(self, f)}")

    def factor(self, stage: str) -> float:
        out = 1.0  # dict(self.stage_factor).get(stage, 1.0), without building the dict: the last pair wins
        for s, f in self.stage_factor:
            if s == stage:
                out = f
        return out

    def iteration_overhead_s(self, engine: str, batch: float) -> float:
        """Per-iteration overhead of ``engine`` running ``batch`` sequences."""
        o0, o1 = self.engine_overhead_terms(engine)
        return o0 + o1 * batch

    def engine_overhead_terms(self, engine: str) -> tuple[float, float]:
        """(overhead at batch 1 s, per running sequence s) of ``engine``'s iterations."""
        for name, o0, o1 in self.engine_overhead:
            if name == engine:
                return o0, o1
        return self.decode_step_overhead_s, self.decode_overhead_per_seq_s

    def with_stage_factors(self, **factors: float) -> "CostParams":
        merged = dict(self.stage_factor)
        merged.update(factors)
        return replace(self, stage_factor=tuple((s, float(merged[s])) for s in STAGES))

    def act_bytes_per_token(self, hidden: int, ffn: int, kv_dim: int, tp: int, dtype_bytes: int = 2) -> float:
        """Training activation bytes per token per layer on one TP rank."""
        if self.act_bytes_replicated > 0 or self.act_bytes_sharded > 0:
            return self.act_bytes_replicated + self.act_bytes_sharded / tp
        coeff = self.act_coeff_hidden * hidden + self.act_coeff_ffn * ffn + self.act_coeff_kv * kv_dim
        return coeff * dtype_bytes / 2 / tp

    def matmul_eff(self, base: float, flops_per_call: float) -> float:
        if self.matmul_half_flops <= 0:
            return base
        return base * flops_per_call / (flops_per_call + self.matmul_half_flops)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stage_factor"] = dict(self.stage_factor)
        out["engine_overhead"] = {e: [o0, o1] for e, o0, o1 in self.engine_overhead}
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostParams":
        check_keys("cost params", d, {f.name for f in fields(cls)})
        kw = dict(d)
        if "stage_factor" in kw:
            sf = kw["stage_factor"]
            if not isinstance(sf, (Mapping, list, tuple)):
                raise SpecError(f"cost params: stage_factor must map stage -> factor, got {sf!r}")
            sf = sf.items() if isinstance(sf, Mapping) else sf
            try:
                kw["stage_factor"] = tuple((str(s), float(x)) for s, x in sf)
            except (TypeError, ValueError, OverflowError):
                raise SpecError(f"cost params: stage_factor must map stage -> factor, "
                                f"got {kw['stage_factor']!r}") from None
        if "engine_overhead" in kw:
            eo = kw["engine_overhead"]
            try:
                eo = [(e, *v) for e, v in eo.items()] if isinstance(eo, Mapping) else eo
                kw["engine_overhead"] = tuple((str(e), float(a), float(b)) for e, a, b in eo)
            except (TypeError, ValueError, OverflowError):
                raise SpecError(f"cost params: engine_overhead must map engine -> [s, s per sequence], got {eo!r}") from None
        return cls(**kw)

    @classmethod
    def load(cls, path: str | Path) -> "CostParams":
        """From a profile JSON (``{"params": {...}}``) or a bare params JSON; every error is one line
        naming the file."""
        with naming(path):
            data = read_json(path, "profile")
            if not isinstance(data, Mapping):
                raise SpecError(f"profile {path}: expected a JSON object, got {type(data).__name__}")
            return cls.from_dict(data.get("params", data))


def _real(x: Any) -> bool:
    """A finite int or float that is not a bool."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float range
        return False


# ---- communication ---------------------------------------------------------------------------------
def latency_steps(n: int) -> int:
    """Steps of a latency-bound collective over n ranks: ceil(log2 n) (tree / recursive doubling)."""
    return (n - 1).bit_length() if n > 1 else 0


def allreduce_s(nbytes: float, n: int, bw_bytes_per_s: float, alpha: float, *, nodes: int = 1,
                alpha_inter: float = 0.0, bw_inter: float | None = None) -> float:
    """Whole all-reduce of S bytes over n ranks on ``nodes`` nodes.

    Latency: 2 * ceil(log2 ranks per node) intra-node steps plus 2 * ceil(log2 nodes) inter-node
    steps (small messages: NCCL LL / tree, NVLS, custom all-reduce), not alpha per ring hop, which
    overcharged tensor-parallel decode about 10x.
    Bandwidth: one node, ring: 2(n-1)/n * S/B (Thakur, Rabenseifner, Gropp 2005). Several nodes with
    ``bw_inter`` (per-GPU scale-out) given: hierarchical, as NCCL runs it: reduce-scatter and
    all-gather inside each node (2(g-1)/g * S over NVLink, g ranks per node) while every rank's
    NIC carries 1/g of the inter-node ring (2(k-1)/k * S/g over k nodes), the two pipelined, so the
    slower one sets the time. That is why 2-node all-reduce bus bandwidth exceeds one NIC's."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes = max(1, min(nodes, n))
    g = -(-n // nodes)
    lat = 2 * (latency_steps(g) * alpha + latency_steps(nodes) * max(alpha_inter, alpha))
    if nodes == 1 or bw_inter is None:
        return lat + 2 * (n - 1) / n * nbytes / bw_bytes_per_s
    intra = 2 * (g - 1) / g * nbytes / bw_bytes_per_s if g > 1 else 0.0
    inter = 2 * (nodes - 1) / nodes * nbytes / (g * bw_inter)
    return lat + max(intra, inter)


def allgather_s(nbytes: float, n: int, bw_bytes_per_s: float, alpha: float, *, nodes: int = 1,
                alpha_inter: float = 0.0, bw_inter: float | None = None) -> float:
    """All-gather or reduce-scatter of a total of S bytes: half the all-reduce's latency steps and
    (n-1)/n * S/B on one node; hierarchical across nodes as in ``allreduce_s``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    nodes = max(1, min(nodes, n))
    g = -(-n // nodes)
    lat = latency_steps(g) * alpha + latency_steps(nodes) * max(alpha_inter, alpha)
    if nodes == 1 or bw_inter is None:
        return lat + (n - 1) / n * nbytes / bw_bytes_per_s
    intra = (g - 1) / g * nbytes / bw_bytes_per_s if g > 1 else 0.0
    inter = (nodes - 1) / nodes * nbytes / (g * bw_inter)
    return lat + max(intra, inter)


def alltoall_s(nbytes: float, n: int, bw_bytes_per_s: float, alpha: float) -> float:
    """All-to-all of S bytes held per rank over n ranks: each rank sends (n-1)/n of it."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return latency_steps(n) * alpha + (n - 1) / n * nbytes / bw_bytes_per_s


def p2p_s(nbytes: float, bw_bytes_per_s: float, alpha: float) -> float:
    if nbytes <= 0:
        return 0.0
    return alpha + nbytes / bw_bytes_per_s
