"""The fidelity report: every row's prediction beside its measurement, and per category and split
the mean absolute percentage error (MAPE), the median ratio predicted/measured, the share within
2x and the median error factor max(r, 1/r); a log-log scatter of predicted against measured."""
from __future__ import annotations

import json
import statistics
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable

from nereus.fidelity.corpus import CATEGORIES, Row
from nereus.fidelity.predict import ParamsFor, Prediction, predict
from nereus.planner.cost.params import CostParams

PROFILE_DIR = Path(__file__).resolve().parents[1] / "calibration" / "profiles"


@lru_cache(maxsize=64)
def fitted_params(gpu: str) -> CostParams:
    """The shipped fitted profile of ``gpu`` (``nereus fit-profiles``), or the analytic defaults."""
    f = PROFILE_DIR / f"{gpu}.json"
    if not f.exists():
        return CostParams()
    data = json.loads(f.read_text())
    if not str(data.get("how", "")).startswith("nereus fit-profiles"):
        return CostParams()
    return CostParams.from_dict(data["params"])


def params_source(profile: str | None) -> tuple[ParamsFor, str]:
    """``auto`` (each row's fitted GPU profile, analytic where none), ``analytic``, or a profile
    file applied to every row."""
    if profile in (None, "auto"):
        return fitted_params, "fitted profile of each row's GPU (analytic where none)"
    if profile == "analytic":
        return (lambda _: CostParams()), "analytic defaults"
    p = CostParams.load(profile)
    return (lambda _: p), f"profile {profile}"


def evaluate(rows: Iterable[Row], params_for: ParamsFor) -> list[Prediction]:
    return [predict(r, params_for) for r in rows]


def summarize(preds: list[Prediction]) -> list[dict]:
    """One record per (category, split) with predictions; ``rows`` counts all, ``predicted`` those
    the model expresses."""
    out = []
    for cat in CATEGORIES:
        for split in ("fit", "heldout"):
            group = [p for p in preds if p.row.category == cat and p.row.split == split]
            if not group:
                continue
            ratios = [p.ratio for p in group if p.ratio is not None]
            rec = {"category": cat, "split": split, "rows": len(group), "predicted": len(ratios)}
            if ratios:
                rec.update(mape=statistics.fmean(abs(r - 1) for r in ratios), median_ratio=statistics.median(ratios),
                           within_2x=sum(1 for r in ratios if 0.5 <= r <= 2) / len(ratios),
                           median_error=statistics.median(max(r, 1 / r) for r in ratios))
                if cat == "memory":  # the memory goals: share within 15% / 25%, median |predicted / measured - 1|
                    rec.update(within_15pct=sum(1 for r in ratios if abs(r - 1) <= 0.15) / len(ratios),
                               within_25pct=sum(1 for r in ratios if abs(r - 1) <= 0.25) / len(ratios),
                               median_abs_error=statistics.median(abs(r - 1) for r in ratios))
            out.append(rec)
    return out


def to_json(preds: list[Prediction], source: str) -> dict:
    return {"params": source, "summary": summarize(preds),
            "rows": [{"id": p.row.id, "category": p.row.category, "split": p.row.split, "hardware": p.row.hardware,
                      "model": p.row.model, "metric": p.row.metric, "measured": p.row.value, "predicted": p.predicted,
                      "ratio": p.ratio, "profile": p.profile, "reason": p.reason} for p in preds]}


def scatter(preds: list[Prediction], path: str | Path, title: str = "") -> Path:
    """Log-log predicted vs measured, one colour per category, hollow markers for held-out rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    colours = dict(zip(CATEGORIES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")))
    lo, hi = float("inf"), 0.0
    for cat in CATEGORIES:
        for split, face in (("fit", None), ("heldout", "none")):
            pts = [(p.row.value, p.predicted) for p in preds if p.row.category == cat and p.row.split == split
                   and p.predicted is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
            ax.scatter(xs, ys, s=14, edgecolors=colours[cat], facecolors=face or colours[cat],
                       label=f"{cat} ({split}, {len(pts)})", alpha=0.8)
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [2 * lo, 2 * hi], "k:", lw=0.6)
        ax.plot([lo, hi], [lo / 2, hi / 2], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (published; the row's own unit)")
    ax.set_ylabel("predicted by the cost model")
    ax.set_title(title or "Cost model vs published GPU measurements (dotted: 2x)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def shipped_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("nereus.calibration").joinpath("profiles").iterdir()
                  if p.name.endswith(".json"))
