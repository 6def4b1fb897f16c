"""How much a held-out figure hangs on one constant: the RL-stage rows within 2x and the median
error, with one ``CostParams`` field set to each of several values on top of every row's fitted
profile (nothing refitted). For a constant measured or fitted outside the RL rows, this says how far
the check's verdict depends on where in its plausible range it sits.

    .venv/bin/python benchmarks/fidelity_sensitivity.py controller_gbps 0.18 0.23 0.3 0.445 0.6 [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import fields, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nereus.fidelity.corpus import load_corpus  # noqa: E402
from nereus.fidelity.predict import predict  # noqa: E402
from nereus.fidelity.report import fitted_params  # noqa: E402
from nereus.planner.cost.params import CostParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("field", help="a numeric CostParams field, e.g. controller_gbps")
    ap.add_argument("values", nargs="+", type=float)
    ap.add_argument("--category", default="rl_stages")
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    numeric = {f.name for f in fields(CostParams) if isinstance(getattr(CostParams(), f.name), float)}
    if args.field not in numeric:
        print(f"error: {args.field!r} is not a numeric CostParams field ({', '.join(sorted(numeric))})", file=sys.stderr)
        return 2
    rows = [r for r in load_corpus() if r.category == args.category and r.split == "heldout"]
    out = []
    for v in args.values:
        preds = [predict(r, lambda gpu, v=v: replace(fitted_params(gpu), **{args.field: v})) for r in rows]
        ratios = [p.ratio for p in preds if p.ratio is not None]
        within = sum(0.5 <= x <= 2 for x in ratios)
        err = statistics.median(max(x, 1 / x) for x in ratios) if ratios else float("nan")
        out.append({"value": v, "predicted": len(ratios), "within_2x": within, "median_error": err})
        print(f"{args.field} = {v:g}: {within} of {len(ratios)} within 2x ({100 * within / max(1, len(ratios)):.1f}%), "
              f"median error {err:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"field": args.field, "category": args.category, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
