"""Costs of the framework around the GPU work: a single controller's dispatch (verl's driver),
host <-> GPU copies (parameter and optimizer offload, engine wake-up and sleep) and the CPU floor
of a stage run under PyTorch FSDP."""
from __future__ import annotations

from nereus.planner.cost.memory import GiB
from nereus.planner.cost.params import CostParams

CONTROLLER_TRAIN_TENSORS = 6
"""fp32 per-response-token tensors a verl update call carries besides the token tensors: old and
reference log-probs, token-level scores and rewards, advantages, returns (verl's batch at
``update_actor`` / ``update_critic``; the worker selects its keys only after the dispatch)."""


def controller_transfer_s(stage: str, sequences: float, width: int, response_cap: int, p: CostParams) -> float:
    """One worker call of a single-controller framework (verl's ``RayWorkerGroup``,
    ``Dispatch.DP_COMPUTE_PROTO``): the driver sends the step's batch out in one chunk per worker and
    gets the results back, serialised both ways; host work at ``p.controller_gbps`` GB/s of bytes
    sent plus returned, plus ``p.controller_call_s``. Bytes per sequence, padded to ``width`` tokens
    (``response_cap`` of them the response), as verl's batch holds them (int64 token tensors):

    - generation: sends the prompts' input_ids, attention_mask and position_ids (3 x 8 bytes per
      prompt token); gets back prompts, responses, input_ids, attention_mask, position_ids
      (4 x width x 8 bytes);
    - inference (log-probs, values): sends those five and the response mask (8 bytes per response
      token); gets one fp32 per response token;
    - training: sends the same plus ``CONTROLLER_TRAIN_TENSORS`` fp32 tensors per response token;
      gets back metrics (nothing to count)."""
    prompt = width - response_cap
    batch = 4 * width * 8
    if stage == "generation":
        per_seq = 3 * prompt * 8 + batch
    elif stage == "inference":
        per_seq = batch + 8 * response_cap + 4 * response_cap
    else:
        per_seq = batch + 8 * response_cap + CONTROLLER_TRAIN_TENSORS * 4 * response_cap
    return p.controller_call_s + sequences * per_seq / (p.controller_gbps * 1e9)


def host_copy_s(nbytes: float, p: CostParams) -> float:
    """``nbytes`` one way over the GPU <-> host link (``p.host_link_gbps``)."""
    return nbytes / (p.host_link_gbps * 1e9)


def param_offload_s(shard_params: float, mode: str, micro_batches: float, p: CostParams,
                    bytes_per_param: float = 2.0, passes_per_micro_batch: int = 1) -> float:
    """Host <-> GPU traffic of a parameter shard kept in host memory (``StageOptions.param_offload``)
    over the host link (``p.host_link_gbps``):

    - ``per_call``: verl's own offload of an actor / critic (``load_fsdp_model_to_gpu`` before the
      call, ``offload_fsdp_model_to_cpu`` after): the shard crosses twice per call;
    - ``per_micro_batch``: PyTorch FSDP ``CPUOffload(offload_params=True)`` (verl's reference model
      with ``param_offload``): the shard is copied to the GPU before every forward (and backward in
      training) of every micro-batch; the copy back is a pointer swap to the pinned host shard.

    ``bytes_per_param``: 4 for a trained model under verl's FSDP (fp32 flat parameters, bf16
    compute), the dtype's size for a frozen one."""
    nbytes = shard_params * bytes_per_param
    if mode == "per_call":
        return 2 * host_copy_s(nbytes, p)
    if mode == "per_micro_batch":
        return micro_batches * passes_per_micro_batch * host_copy_s(nbytes, p)
    return 0.0


def optimizer_offload_s(opt_share_params: float, p: CostParams) -> float:
    """Adam moments (fp32 m and v: 8 bytes per parameter of the optimizer's shard) loaded to the GPU
    before an update call and offloaded after it (verl ``optimizer_offload``)."""
    return 2 * host_copy_s(opt_share_params * 8.0, p)


def fsdp_cpu_floor_s(micro_batches: float, layers: int, passes: int, gpu_s: float, p: CostParams,
                     training: bool = True, synced: bool = False) -> float:
    """Time a stage run under PyTorch FSDP waits on the CPU beyond its GPU work. FSDP wraps every
    decoder layer as a unit whose pre-forward / pre-backward hooks (unshard, all-gather launch,
    stream waits, then the layer's eager kernel launches) run on the CPU once per pass per micro-
    batch: ``passes`` = 1 for a forward-only stage, 2 for forward + backward, 3 with activation
    recomputation. Per unit and pass the CPU spends FSDP's hooks (``p.fsdp_unit_cpu_s`` = 1 ms, as
    published for FSDP2's pre-forward on a server Xeon, pytorch/pytorch#173680) plus the layer's own
    eager dispatch (``p.layer_cpu_train_s`` averaged over a training micro-batch's passes, or
    ``p.layer_cpu_fwd_s`` for a no-grad forward, ``training=False``), both from the corpus's
    ``host`` rows. CPU and GPU overlap, so only the excess of the CPU time over the GPU time
    ``gpu_s`` is added; large micro-batches of large models hide it, small models with small
    micro-batches (RL on 0.5-1B models, a few sequences per micro-batch) are CPU-bound.
    ``synced``: every layer synchronises host and device (a padded batch in Hugging Face's flash-
    attention path, ``StageOptions.pad_to``), so the host never runs ahead: all of it is added."""
    layer = p.layer_cpu_train_s if training else p.layer_cpu_fwd_s
    cpu = micro_batches * layers * passes * (p.fsdp_unit_cpu_s + layer)
    return cpu if synced else max(0.0, cpu - gpu_s)


def engine_wake_s(weights_bytes: float, kv_bytes: float, p: CostParams) -> float:
    """A colocated engine's wake-up from a level-1 sleep (vLLM ``wake_up``, SGLang
    ``resume_memory_occupation``): its weights come back from pinned host memory over the host link,
    and its KV cache pool, released at sleep, is created and mapped again in GPU memory
    (``p.kv_remap_s_per_gib`` per GiB: 3.9 ms, vLLM 0.26 re-creating 69 GiB in 0.27 s, corpus row
    ``srtslurm-001``). The vLLM sleep-mode blog's wake-ups on A100 (corpus ``vllmsleep-*``) check it."""
    return host_copy_s(weights_bytes, p) + max(0.0, kv_bytes) / GiB * p.kv_remap_s_per_gib


def offload_s(nbytes: float, params: CostParams | None = None) -> float:
    """Moving a resident state to host memory and back once per step."""
    return 2 * host_copy_s(nbytes, params or CostParams())
