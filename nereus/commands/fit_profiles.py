"""nereus fit-profiles: fit each GPU's cost profile on the fit split of the measurement corpus."""
from __future__ import annotations

import argparse

from nereus.commands.common import console

DEFAULT_GPUS = ("a100-80gb", "h100-80gb", "h200", "h20", "mi300x")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fit-profiles", help="fit GPU cost profiles on the corpus's fit split",
                       description="Robust log-space fit of each GPU's cost coefficients on the fit-split rows of "
                                   "the published-measurement corpus; held-out rows are never read.")
    p.add_argument("--corpus", metavar="DIR", help="corpus directory (default: nereus/calibration/published)")
    p.add_argument("--out", metavar="DIR", default="nereus/calibration/profiles", help="where to write <gpu>.json")
    p.add_argument("--gpu", action="append", help=f"GPU to fit (repeatable; default: {', '.join(DEFAULT_GPUS)})")
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from nereus.calibration.profile import Hardware, Profile, utc_now
    from nereus.fidelity.corpus import load_corpus
    from nereus.fidelity.fit import fit_profile_params

    rows = load_corpus(args.corpus)
    con = console()
    corpus = args.corpus or "nereus/calibration/published"
    for gpu in args.gpu or DEFAULT_GPUS:
        with con.status(f"fitting {gpu}..."):
            params, record = fit_profile_params(rows, gpu)
        prof = Profile(name=gpu, hardware=Hardware.from_preset(gpu), params=params,
                       fit={"heldout_mape": {"microbench": None, "stages": None}, "corpus": record,
                            "note": "fitted on the fit split of the published-measurement corpus; check with "
                                    "`nereus fidelity --split heldout`"},
                       how=f"nereus fit-profiles --corpus {corpus} --out {args.out}", when=utc_now(),
                       where={"corpus": corpus})
        path = prof.save(Path(args.out) / f"{gpu}.json")
        con.print(f"{gpu}: {len(record['rows'])} fit rows {record['rows_by_category']}, fit-split MAPE "
                  f"{record['fit_mape']:.0%} (analytic {record['analytic_fit_mape']:.0%}) -> {path}")
    return 0
