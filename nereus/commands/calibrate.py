"""nereus calibrate: measure this machine (or read job logs) and write a cost profile."""
from __future__ import annotations

import argparse
import shlex
import sys

from nereus.commands.common import console, pos_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate", help="microbenchmark this machine or fit job logs; write a cost profile",
        description="Without --from-logs: run matmul / memory / collective microbenchmarks and time the reference "
                    "transformer's stages, fit CostParams, print the held-out error table and write a profile. "
                    "With --from-logs: fit per-stage correction factors from a job's per-step timing log.")
    p.add_argument("--quick", action="store_true", help="small grids (under 2 minutes on 2 CPU cores)")
    p.add_argument("--world", type=pos_int, default=2, help="processes for collectives and stage timings (2-4)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--backend", choices=("auto", "plain", "executor"), default="auto",
                   help="stage-timing subject: the executor's parallel transformer, or the plain-torch stand-in")
    p.add_argument("--out", metavar="PROFILE.json", help="write the profile here")
    p.add_argument("--report", metavar="OUT.md", help="write the error tables and parameters as Markdown")
    p.add_argument("--csv-dir", metavar="DIR", help="also save the raw measurement tables as CSV")
    g = p.add_argument_group("from job logs")
    g.add_argument("--from-logs", metavar="LOG",
                   help="per-step timing log: JSONL, CSV (a W&B export too) or a verl console log, verl-style keys")
    g.add_argument("--log-format", choices=("auto", "jsonl", "csv", "verl-console"), default="auto",
                   help="format of LOG (auto: .csv is CSV, '{' lines JSONL, 'step:N - ' lines a verl console log)")
    g.add_argument("--strict", action="store_true",
                   help="fail (exit 2) at the first malformed line or bad value instead of skipping it")
    g.add_argument("--job", help="job YAML the log came from")
    g.add_argument("--cluster", help="cluster YAML the log came from")
    g.add_argument("--plan", help="plan JSON the job ran with (default: --tp/--pp, DP over the whole cluster)")
    g.add_argument("--tp", type=pos_int, default=1)
    g.add_argument("--pp", type=pos_int, default=1)
    g.add_argument("--profile", help="start from this profile's parameters (default: analytic defaults)")
    return p


def run(args: argparse.Namespace) -> int:
    if args.from_logs:
        return _run_logs(args)
    if not 1 <= args.world <= 8:
        from nereus.errors import SpecError

        raise SpecError(f"--world must be between 1 and 8, got {args.world}")
    return _run_local(args)


def _run_local(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pathlib import Path

    from nereus.calibration.microbench import pick_device
    from nereus.calibration.run import calibrate_local, report_markdown

    device = pick_device() if args.device == "auto" else args.device
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            from nereus.errors import SpecError

            why = ("this torch " + torch.__version__ + " was built without CUDA" if torch.version.cuda is None
                   else f"torch sees {torch.cuda.device_count()} CUDA device(s)")
            raise SpecError(f"--device cuda: no usable CUDA device ({why}); use --device cpu, or auto")
    how = "nereus " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] \
        else f"nereus calibrate{' --quick' if args.quick else ''} --world {args.world}"
    bar = tqdm(desc=f"calibrating {device}", unit="bench", file=sys.stderr)
    try:
        prof, detail = calibrate_local(quick=args.quick, world=args.world, device=device, backend=args.backend,
                                       how=how, progress=bar.update, on_total=lambda n: setattr(bar, "total", n))
    finally:
        bar.close()
    _print_profile(prof)
    if args.csv_dir:  # one CSV per table, each written atomically
        for name, df in {**detail["tables"], "stages": detail["stages"]}.items():
            _write_text(str(Path(args.csv_dir) / f"{name}.csv"), df.to_csv(index=False))
    if args.report:
        _write_text(args.report, report_markdown(prof))
    if args.out:
        prof.save(args.out)
        console().print(f"profile written to {args.out}")
    return 0


def _run_logs(args: argparse.Namespace) -> int:
    from nereus.calibration.logs import fit_from_logs, read_log
    from nereus.calibration.profile import Hardware, Profile, load_profile, utc_now
    from nereus.errors import SpecError
    from nereus.planner.cost.params import CostParams
    from nereus.planner.specs import ParallelConfig, load_cluster, load_job

    if not (args.job and args.cluster):
        raise SpecError("--from-logs needs --job and --cluster (the job and cluster the log came from)")
    job, cluster = load_job(args.job), load_cluster(args.cluster)
    base_prof = load_profile(args.profile) if args.profile else None
    params = base_prof.params if base_prof else CostParams()
    if args.plan:
        from nereus.planner.plan import Plan

        configs = {s.name: s.config for s in Plan.load(args.plan)}
    else:
        if cluster.num_gpus % (args.tp * args.pp):
            raise SpecError(f"tp({args.tp}) * pp({args.pp}) does not divide the cluster's {cluster.num_gpus} GPUs")
        cfg = ParallelConfig(tp=args.tp, pp=args.pp, dp=cluster.num_gpus // (args.tp * args.pp))
        configs = {ms: cfg for ms in job.model_stages()}
    table = read_log(args.from_logs, fmt=args.log_format, strict=args.strict)
    con = console()
    for msg in table.issues:
        con.print(f"warning: {args.from_logs}: {msg}", soft_wrap=True)  # one line each, for grep
    res = fit_from_logs(table, job, cluster, configs, params)
    hw = base_prof.hardware if base_prof else Hardware.from_dict({
        "name": cluster.gpu.name, "memory_gib": cluster.gpu.memory_gib, "tflops_bf16": cluster.gpu.tflops_bf16,
        "hbm_tbps": cluster.gpu.hbm_tbps, "intra_node_gbps": cluster.gpu.intra_node_gbps,
        "inter_node_gbps": cluster.gpu.inter_node_gbps, "gpus_per_node": cluster.gpus_per_node,
        "reserved_gib": cluster.gpu.reserved_gib, "description": f"{cluster.gpu.name} from {args.cluster}"})
    s = res["summary"]
    prof = Profile(name=f"{cluster.gpu.name}-from-logs", hardware=hw, params=res["params"], how=_how(args),
                   when=utc_now(), where={"log": str(args.from_logs), "rows": len(table.frame),
                                          "issues": len(table.issues)},
                   fit={"heldout_mape": {"microbench": None, "stages": s["mape_after"]},
                        "heldout_mape_before": {"microbench": None, "stages": s["mape_before"]},
                        "stages": {"backend": "job-log", "factors": res["factors"], "fit_points": res["fit_points"],
                                   "fit_mape": res["fit_mape"], "summary": s,
                                   "heldout_table": res["table"].to_dict("records")}})
    con.print(f"{len(table.frame)} good rows from {args.from_logs} ({len(table.issues)} issue(s)); "
              f"{res['fit_points']} stage times fitted, {s['points']} held out")
    _print_profile(prof)
    if args.report:
        from nereus.calibration.run import report_markdown

        _write_text(args.report, report_markdown(prof))
    if args.out:
        prof.save(args.out)
        con.print(f"profile written to {args.out}")
    return 0


def _how(args: argparse.Namespace) -> str:
    return "nereus " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["calibrate"] \
        else f"nereus calibrate --from-logs {args.from_logs} --job {args.job} --cluster {args.cluster}"


def _print_profile(prof) -> None:
    from rich.table import Table

    con = console()
    f = prof.fit
    for part in ("stages", "microbench"):
        rows = f.get(part, {}).get("heldout_table", [])
        if not rows:
            continue
        t = Table("held-out " + part, "measured s", "analytic s", "calibrated s", "ratio", title=None)
        for r in rows:
            t.add_row(r["what"], f"{r['measured_s']:.4g}", f"{r['analytic_s']:.4g}", f"{r['predicted_s']:.4g}",
                      f"{r['predicted_s'] / r['measured_s']:.3f}")
        con.print(t)
    hm, hb = f.get("heldout_mape", {}), f.get("heldout_mape_before", {})
    m = Table("held-out MAPE", "before (analytic defaults)", "after (calibrated)")
    for part in ("microbench", "stages"):
        b, a = hb.get(part), hm.get(part)
        m.add_row(part, "-" if b is None else f"{100 * b:.1f}%", "-" if a is None else f"{100 * a:.1f}%")
    con.print(m)
    p = Table("fitted parameter", "value")
    for k in ("mfu_train", "mfu_prefill", "mfu_decode", "matmul_half_flops", "hbm_eff", "intra_link_eff",
              "allreduce_latency_s", "p2p_latency_s", "decode_step_overhead_s"):
        p.add_row(k, f"{getattr(prof.params, k):.4g}")
    for s, x in prof.params.stage_factor:
        p.add_row(f"stage_factor ({s})", f"{x:.4g}")
    con.print(p)


def _write_text(path: str, text: str) -> None:
    from nereus.jsonio import write_atomic

    write_atomic(path, text)  # a reader never sees half a report
