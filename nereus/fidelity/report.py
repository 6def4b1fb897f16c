"""The fidelity report: every row's prediction beside its measurement, and per category and split
the mean absolute percentage error (MAPE), the median ratio predicted/measured, the share within
2x and the median error factor max(r, 1/r); a log-log scatter of predicted against measured."""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
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


# ---- asynchronous runs: speed-ups over sync ------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Speedup:
    """Async over sync step time for one published pair."""

    async_id: str
    sync_id: str
    published: float
    predicted: float | None
    reason: str = ""
    same_gpus: bool = True

    @property
    def ratio(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.published


def speedups(rows: Iterable[Row], preds: Iterable[Prediction], params_for: ParamsFor) -> list[Speedup]:
    """Each async ``step`` row naming its sync baseline (``sync_row``: a corpus row id; or
    ``sync_step_s``: the baseline's published step, whose configuration the corpus has not):
    published sync / async step, and the model's (sync priced by ``predict`` of the baseline row)."""
    by_id = {r.id: r for r in rows}
    pred = {p.row.id: p for p in preds}
    out = []
    for p in pred.values():
        r = p.row
        if r.category != "async" or r.get("stage") != "step":
            continue
        sid, quoted = r.get("sync_row"), r.num("sync_step_s")
        if sid is None and quoted is None:
            continue
        base = by_id.get(sid) if sid else None
        if sid and base is None:
            out.append(Speedup(r.id, sid, math.nan, None, f"baseline row {sid} not in the corpus"))
            continue
        published = (base.value if base else quoted) / r.value
        same = base is None or base.gpus == r.gpus
        if p.predicted is None:
            out.append(Speedup(r.id, sid or "quoted", published, None, f"async row: {p.reason}", same))
            continue
        if base is None:
            out.append(Speedup(r.id, "quoted", published, None, "the baseline's configuration is not in the corpus", same))
            continue
        bp = pred.get(sid) or predict(base, params_for)
        if bp.predicted is None:
            out.append(Speedup(r.id, sid, published, None, f"sync row: {bp.reason}", same))
            continue
        out.append(Speedup(r.id, sid, published, bp.predicted / p.predicted, "", same))
    return out


def speedup_summary(sp: list[Speedup]) -> dict:
    ratios = [s.ratio for s in sp if s.ratio is not None]
    rec: dict = {"pairs": len(sp), "predicted": len(ratios)}
    if ratios:
        import statistics

        rec.update(median_ratio=statistics.median(ratios), within_2x=sum(1 for x in ratios if 0.5 <= x <= 2) / len(ratios),
                   median_error=statistics.median(max(x, 1 / x) for x in ratios))
    rec["rows"] = [{"async": s.async_id, "sync": s.sync_id, "published": s.published, "predicted": s.predicted,
                    "ratio": s.ratio, "same_gpus": s.same_gpus, "reason": s.reason} for s in sp]
    return rec
