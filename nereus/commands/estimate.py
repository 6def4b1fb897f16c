"""nereus estimate: time and memory of one model-stage under one parallel config."""
from __future__ import annotations

import argparse
from dataclasses import replace

from nereus.commands.common import GiB, add_job_cluster, console, load_specs, pos_float, pos_int, write_json
from nereus.planner.specs import ENGINES


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("estimate", help="time and memory of one model-stage under one parallel config",
                       description="Analytic estimate of one model-stage's time and peak memory per GPU.")
    add_job_cluster(p)
    p.add_argument("--model-stage", required=True, help="e.g. actor/training, actor/generation, ref/inference")
    p.add_argument("--tp", type=pos_int, default=1)
    p.add_argument("--pp", type=pos_int, default=1)
    p.add_argument("--dp", type=pos_int, default=1)
    p.add_argument("--micro-batch", type=pos_int, default=1)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=1)
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--sp", type=pos_int, default=1, help="Ulysses sequence parallelism (taken from dp; verl's "
                                                            "ulysses_sequence_parallel_size)")
    p.add_argument("--cp", type=pos_int, default=1, help="context parallelism, ring attention (taken from dp; "
                                                            "Megatron's context_parallel_size)")
    p.add_argument("--ep", type=pos_int, default=1, help="expert parallelism of a mixture-of-experts model (Megatron's "
                                                            "expert_model_parallel_size; generation: 1 or tp, vLLM's "
                                                            "--enable-expert-parallel)")
    p.add_argument("--etp", type=pos_int, default=1, help="expert tensor parallelism (Megatron's "
                                                             "expert_tensor_parallel_size); ep * etp divides tp * dp")
    p.add_argument("--token-budget", type=pos_int, help="tokens per micro-batch per GPU (verl's use_dynamic_bsz + "
                                                         "ppo_max_token_len_per_gpu) instead of --micro-batch")
    p.add_argument("--offload", action="store_true", help="optimizer state in host memory (out and back over PCIe "
                                                           "once per step)")
    p.add_argument("--gpu-memory-utilization", type=pos_float, help="generation engine's memory fraction (vLLM's "
                                                                    "gpu_memory_utilization; default 0.9)")
    p.add_argument("--engine", choices=ENGINES,
                   help="generation engine (vllm: vLLM's V1 engine, the default from 0.8.0; vllm-v0: its V0 engine, "
                        "before 0.8.0 or with VLLM_USE_V1=0)")
    p.add_argument("--max-num-seqs", type=pos_int, help="most sequences an engine runs at once (default 256)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="generation engine without CUDA graphs (vLLM enforce_eager): kernel launches per decode "
                        "iteration")
    p.add_argument("--response-len-mean", type=pos_float)
    p.add_argument("--response-len-max", type=pos_int)
    g = p.add_argument_group("framework settings (verl's FSDP workers)")
    g.add_argument("--no-remove-padding", action="store_true",
                   help="every sequence padded to prompt + max response (verl use_remove_padding=False); under "
                        "FSDP each layer then synchronises host and device (Hugging Face's flash-attention unpadding)")
    g.add_argument("--param-offload", choices=("none", "per_call", "per_micro_batch"), default="none",
                   help="parameters in host memory: loaded for each call (verl fsdp_config.param_offload of an "
                        "actor or critic) or for each micro-batch (FSDP CPUOffload, verl's offloaded reference)")
    g.add_argument("--grad-sync", choices=("step", "micro_batch"), default="step",
                   help="gradients reduced once per optimizer step, or after every micro-batch (FSDP without "
                        "no_sync, verl's default)")
    g.add_argument("--grad-reduce-fp32", action="store_true",
                   help="gradients reduced in fp32 (verl FSDP mixed_precision.reduce_dtype)")
    g.add_argument("--single-controller", action="store_true",
                   help="the call's batch goes through a driver process (verl's RayWorkerGroup: serialised out to "
                        "the workers and back, every sequence padded to prompt + max response)")
    p.add_argument("--json", metavar="OUT", help="write the estimate as JSON")
    return p


def with_offload(e, params):
    """The estimate with its optimizer state in host memory: no longer resident on the GPU, moved
    out and back once per step (``cost.offload_s``), as the solver's offload option prices it."""
    from dataclasses import replace as dc_replace

    from nereus.planner.cost.model import offload_s

    opt = e.mem_breakdown.get("optimizer", 0.0)
    if not opt:
        return e
    t = {**e.time_breakdown, "offload": offload_s(opt, params)}
    mem = {**e.mem_breakdown, "optimizer": 0.0}
    return dc_replace(e, time_s=sum(t.values()), time_breakdown=t, resident_bytes=e.resident_bytes - opt,
                      mem_breakdown=mem)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when the config fits; 2 with a one-line error naming GiB needed vs usable when it
    does not (the tables and ``--json`` are still written: they show where the memory goes)."""
    import math

    from rich.table import Table

    from nereus.errors import InfeasibleError
    from nereus.planner.cost.model import StageOptions, estimate
    from nereus.planner.specs import ParallelConfig

    job, cluster, params = load_specs(args)
    ro = {k: v for k, v in (("engine", args.engine), ("gpu_memory_utilization", args.gpu_memory_utilization),
                            ("max_num_seqs", args.max_num_seqs), ("enforce_eager", args.enforce_eager))
          if v is not None}
    if ro:
        job = replace(job, rollout=replace(job.rollout, **ro))
    w = job.workload()
    if args.response_len_mean or args.response_len_max:
        w = w.with_lengths(mean=args.response_len_mean, max_=args.response_len_max)
    cfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=args.dp, micro_batch=args.micro_batch, zero=args.zero,
                         recompute=args.recompute, sp=args.sp, cp=args.cp, token_budget=args.token_budget or 0,
                         ep=args.ep, etp=args.etp)
    opts = StageOptions(pad_to=job.sequence.prompt_len + w.response_len_max if args.no_remove_padding else 0,
                        param_offload=args.param_offload, grad_sync=args.grad_sync,
                        grad_reduce_bytes=4 if args.grad_reduce_fp32 else 0,
                        controller_width=job.sequence.prompt_len + w.response_len_max if args.single_controller else 0)
    e = estimate(job, cluster, args.model_stage, cfg, w, params, options=opts)
    if args.offload:
        e = with_offload(e, params)
    con = console()
    con.print(f"[bold]{args.model_stage}[/] {cfg.label()} (micro-batch {cfg.micro_batch}, ZeRO-{cfg.zero}"
              f"{', recompute' if cfg.recompute else ''}) on {cluster.gpu.name}, "
              f"{w.sequences} sequences x ({w.prompt_len} prompt + {w.response_len_mean:g} mean / "
              f"{w.response_len_max} max response)")
    t = Table("time component", "seconds", "share")
    for k, v in e.time_breakdown.items():
        t.add_row(k, f"{v:.3f}", f"{v / e.time_s:.0%}" if e.time_s and e.time_s != float('inf') else "-")
    t.add_row("[bold]total[/]", f"[bold]{e.time_s:.3f}[/]", "")
    con.print(t)
    m = Table("memory per GPU", "GiB", "kind")
    for k, v in e.mem_breakdown.items():
        kind = "resident" if k in ("grads", "optimizer") or (k == "weights" and e.resident_bytes > 0) else "transient"
        m.add_row(k, f"{v / GiB:.2f}", kind)
    m.add_row("[bold]peak[/]", f"[bold]{e.mem_bytes / GiB:.2f}[/]", f"of {e.capacity_bytes / GiB:.1f} GiB usable")
    con.print(m)
    if e.waves > 1:
        con.print(f"generation runs in {e.waves} waves (KV cache cannot hold every sequence at once)")
    for n in e.notes:
        con.print(f"note: {n}")
    verdict = "[green]fits[/]" if e.fits else f"[red]does NOT fit[/] ({e.mem_bytes / GiB:.1f} > {e.capacity_bytes / GiB:.1f} GiB)"
    con.print(f"verdict: {verdict}")
    write_json(args.json, e.to_dict())
    if not e.fits:  # the breakdown above says where the memory goes; the exit code says it does not fit, as plan's does
        why = f"; {e.notes[0]}" if e.notes and not math.isfinite(e.time_s) else ""
        raise InfeasibleError(f"{args.model_stage} {cfg.label()} (micro-batch {cfg.micro_batch}, ZeRO-{cfg.zero}) does "
                              f"not fit: needs {e.mem_bytes / GiB:.1f} GiB per GPU, {e.capacity_bytes / GiB:.1f} GiB "
                              f"usable{why}", binding=args.model_stage, need_bytes=e.mem_bytes,
                              have_bytes=e.capacity_bytes)
    return 0
