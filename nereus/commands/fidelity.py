"""nereus fidelity: the cost model's predictions beside published GPU measurements, per row, with
MAPE and median ratio per category and split, and a log-log scatter."""
from __future__ import annotations

import argparse

from nereus.commands.common import console, write_json


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fidelity", help="check the cost model against published GPU measurements",
                       description="Predict every row of the measurement corpus with the cost model and compare. "
                                   "Held-out rows were never read by a fit.")
    p.add_argument("--corpus", metavar="DIR", help="corpus directory (default: nereus/calibration/published)")
    p.add_argument("--profile", default="auto",
                   help="auto: each row's fitted GPU profile (default); analytic: the uncalibrated defaults; "
                        "or a profile JSON applied to every row")
    p.add_argument("--split", choices=("fit", "heldout", "all"), default="all")
    p.add_argument("--rows", action="store_true", help="print every row, not only the summary")
    p.add_argument("--json", metavar="OUT", help="write the summary and every row as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write the log-log scatter")
    return p


def _async_speedups(con, corpus, preds, params_for) -> None:
    """The derived comparison of the ``async`` rows: async over sync step time, predicted vs published."""
    if not any(p.row.category == "async" for p in preds):
        return
    from rich.table import Table

    from nereus.fidelity.report import speedups

    sp = speedups(corpus, preds, params_for)
    t = Table("async row", "sync row", "same GPUs", "published", "predicted", "pred/pub",
              title="async speed-up over the sync baseline (sync step / async step)")
    for s in sp:
        t.add_row(s.async_id, s.sync_id, "yes" if s.same_gpus else "no", f"{s.published:.2f}x",
                  "-" if s.predicted is None else f"{s.predicted:.2f}x", s.reason[:48] if s.ratio is None else f"{s.ratio:.2f}")
    con.print(t)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from nereus.fidelity.corpus import load_corpus
    from nereus.fidelity.report import evaluate, params_source, scatter, summarize, to_json

    rows = load_corpus(args.corpus)
    if args.split != "all":
        rows = [r for r in rows if r.split == args.split]
    params_for, source = params_source(args.profile)
    preds = evaluate(rows, params_for)
    con = console()
    if args.rows:
        t = Table("id", "category", "split", "hardware", "model", "metric", "measured", "predicted", "ratio")
        for p in preds:
            t.add_row(p.row.id, p.row.category, p.row.split, p.row.hardware, p.row.model[:28], p.row.metric,
                      f"{p.row.value:.4g}", "-" if p.predicted is None else f"{p.predicted:.4g}",
                      p.reason[:40] if p.ratio is None else f"{p.ratio:.2f}")
        con.print(t)
    t = Table("category", "split", "rows", "predicted", "MAPE", "median ratio", "within 2x", "median error",
              title=f"cost model vs published measurements ({source})")
    for s in summarize(preds):
        f = (lambda k, fmt: fmt.format(s[k]) if k in s else "-")
        t.add_row(s["category"], s["split"], str(s["rows"]), str(s["predicted"]), f("mape", "{:.0%}"),
                  f("median_ratio", "{:.2f}"), f("within_2x", "{:.0%}"), f("median_error", "{:.2f}x"))
    con.print(t)
    for s in summarize(preds):
        if s["category"] == "memory" and "within_25pct" in s:
            con.print(f"memory ({s['split']}): {s['predicted']} rows, within 15% {s['within_15pct']:.0%}, within 25% "
                      f"{s['within_25pct']:.0%}, median |error| {s['median_abs_error']:.1%}, median ratio {s['median_ratio']:.3f}")
    for s in summarize(preds):
        if s["category"] == "moe":  # mixture-of-experts runs at the expert layout their source states
            con.print(f"moe ({s['split']}): {s['rows']} rows, {s['predicted']} predicted"
                      + (f", within 2x {s['within_2x']:.0%}, median error {s['median_error']:.2f}x" if s["predicted"] else ""))
    _async_speedups(con, load_corpus(args.corpus), preds, params_for)
    skipped = sum(1 for p in preds if p.predicted is None)
    if skipped:
        con.print(f"{skipped} rows not predicted (see --rows for why: MoE models, serving runs, unstated lengths, ...)")
    out = to_json(preds, source)
    if any(p.row.category == "async" for p in preds):
        from nereus.fidelity.report import speedup_summary, speedups

        out["async_speedups"] = speedup_summary(speedups(load_corpus(args.corpus), preds, params_for))
    write_json(args.json, out)
    if args.plot:
        from nereus.commands.common import figure_format
        from nereus.jsonio import atomic_path

        with atomic_path(args.plot, suffix=f".{figure_format(args.plot)}") as tmp:  # whole, or not at all
            scatter(preds, tmp)
        con.print(f"wrote {args.plot}")
    return 0
