"""Response lengths of one RL step, sampled per sequence (the main source of step-to-step noise).

An empirically shaped distribution (issue 29 item 6), not the planner's log-normal: a gamma body and
the truncation spike at the cap, with the shape fitted to published RL response-length rows
(``docs/research/response_lengths.csv``; the rows used are ``FIT_ROWS``, each with its source id):

- **body**: a response would be ``G ~ Gamma(k, theta)`` tokens long if nothing cut it. Its shape
  depends on how long the responses are: ``k = K_AT_1000 x (m_b / 1000) ** -BETA``, ``m_b = k x theta``
  the body's mean, read inside ``BODY_MEAN_RANGE`` (250-3,500 tokens, the range of the rows; flat
  outside it, no extrapolation). Long chains of thought are relatively more dispersed (k 2.1 at
  3,500 tokens, coefficient of variation 0.69) than short answers (k 14 at 250 tokens, 0.27).
- **truncation spike**: a response the body makes longer than the row's cap is cut at the cap, so a
  point mass ``Q(k, cap / theta)`` (upper regularised gamma) piles up at the cap. That mass is what
  the rows publish (verl's ``response_length/clip_ratio``, TRL's ``completions/clipped_ratio``, a
  blog's "response clipping ratio"): ``K_AT_1000`` and ``BETA`` are the least-squares fit of it
  (``fit``), e.g. 5.7% at mean / cap = 0.43 for reasoning-length responses (DeepScaleR: 4.2%).
- ``m_b`` is solved so that the mean *after* truncation equals the row's mean (vectorised
  bisection on the closed-form mean of a gamma cut at the cap).
- a trace with a p90 sets ``k`` from the body's p90 / mean instead (the mean is still matched).
- the samples of one prompt share a prompt-level part: ``G = theta x (G_p + G_s)`` with
  ``G_p ~ Gamma(rho k)`` drawn once per prompt and ``G_s ~ Gamma((1 - rho) k)`` per sample; the sum is
  exactly ``Gamma(k, theta)`` and two samples of one prompt correlate by ``rho`` (before the cut):
  hard prompts make every sample long, and engines receive a prompt's samples together.

Sampling is seeded by (seed, step): every policy sees the same lengths at the same step.
"""
from __future__ import annotations

import numpy as np
from scipy.special import gammainc, gammaincc, gammaincinv

K_AT_1000 = 5.1728
"""Gamma shape at a body mean of 1,000 tokens; fitted (``fit(FIT_ROWS)``, sum of squared clip-share errors 0.0067)."""
BETA = 0.7222
"""Exponent of the shape's dependence on the body mean; fitted with ``K_AT_1000``."""
BODY_MEAN_RANGE = (250.0, 3500.0)
"""Body means (tokens) the fit rows span; the shape is held at its end values outside."""
PROMPT_CORRELATION = 0.5
"""Assumption (no corpus row): share of a response length's variance that belongs to the prompt."""

FIT_ROWS: tuple[tuple[str, str, float, float, float], ...] = (
    # (row ids in docs/research/response_lengths.csv, statistic the length is, length, cap, clip share)
    ("rlen-001+rlen-002", "mean", 3500.0, 8192.0, 0.042),   # DeepScaleR blog, R1-Distill-1.5B, 8k stage
    ("rlen-005+rlen-008", "mean", 288.698, 1024.0, 0.0),    # verl#2060, GSM8K GRPO step 1 (cap: example default)
    ("rlen-012+rlen-013", "median", 650.0, 256.0, 0.98),    # trl#5697, Qwen2.5-0.5B-Instruct, DeepMath
    ("rlen-012+rlen-014", "median", 650.0, 1024.0, 0.14),   # trl#5759, same at cap 1,024
    ("rlen-015+rlen-016", "median", 274.0, 256.0, 0.57),    # trl#6263, Qwen2.5-0.5B-Instruct, GSM8K
    ("rlen-017+rlen-018", "median", 315.0, 256.0, 0.80),    # trl#6263, Qwen2.5-Math-1.5B-Instruct
    ("rlen-019+rlen-020", "median", 248.0, 256.0, 0.50),    # trl#6263, Qwen3-0.6B (thinking off)
)
"""The rows ``K_AT_1000`` / ``BETA`` are fitted on; ``tests/unit/test_truth_lengths.py`` re-fits them from the CSV."""

_ITERS = 60


def shape_for(body_mean, k1: float = K_AT_1000, beta: float = BETA) -> np.ndarray:
    """Gamma shape of a body whose mean is ``body_mean`` tokens."""
    lo, hi = BODY_MEAN_RANGE
    return k1 * (np.clip(np.asarray(body_mean, float), lo, hi) / 1000.0) ** (-beta)


def cut_mean(k, theta, cap) -> np.ndarray:
    """E[min(G, cap)] for G ~ Gamma(k, theta)."""
    x = np.asarray(cap, float) / theta
    return k * theta * gammainc(k + 1, x) + cap * gammaincc(k, x)


def _bisect_log(f, target, lo, hi) -> np.ndarray:
    """x in [lo, hi] with f(x) = target, f increasing, by bisection on log x (vectorised)."""
    lo, hi = np.log(lo), np.log(hi)
    for _ in range(_ITERS):
        mid = (lo + hi) / 2
        big = f(np.exp(mid)) > target
        hi, lo = np.where(big, mid, hi), np.where(big, lo, mid)
    return np.exp((lo + hi) / 2)


def shape_from_p90(ratio) -> np.ndarray:
    """Gamma shape whose p90 / mean is ``ratio`` (clamped to what shapes 0.3-300 express)."""
    r = np.asarray(ratio, float)
    # p90 / mean falls as k grows: bisect on -ratio
    return _bisect_log(lambda k: -gammaincinv(k, 0.9) / k, -r, np.full_like(r, 0.3), np.full_like(r, 300.0))


def params(mean, cap, p90=None, k1: float = K_AT_1000, beta: float = BETA) -> tuple[np.ndarray, np.ndarray]:
    """(k, theta) of the body whose mean after the cut at ``cap`` is ``mean`` (mean < cap);
    ``p90`` (NaN = none) fixes k from the body's p90 / mean instead of the fitted shape."""
    mean = np.asarray(mean, float)
    cap = np.broadcast_to(np.asarray(cap, float), mean.shape)
    mean = np.minimum(np.maximum(mean, 1.0), 0.999 * cap)
    p90 = np.full(mean.shape, np.nan) if p90 is None else np.broadcast_to(np.asarray(p90, float), mean.shape)
    fixed = ~np.isnan(p90)
    k_fixed = shape_from_p90(np.where(fixed, p90, 2.0 * mean) / mean) if fixed.any() else np.zeros(mean.shape)

    def k_of(mb):
        return np.where(fixed, k_fixed, shape_for(mb, k1, beta))

    mb = _bisect_log(lambda mb: cut_mean(k_of(mb), mb / k_of(mb), cap), mean, mean, 1e3 * cap)
    k = k_of(mb)
    return k, mb / k


def spike_mass(mean, cap, p90=None, k1: float = K_AT_1000, beta: float = BETA) -> np.ndarray:
    """Share of responses cut at the cap (the truncation spike) for rows of ``mean`` and ``cap``."""
    k, theta = params(mean, cap, p90, k1, beta)
    return gammaincc(k, np.asarray(cap, float) / theta)


def predicted_clip(kind: str, length: float, cap: float, k1: float, beta: float) -> float:
    """A fit row's clip share under (k1, beta): ``length`` is the row's mean (after the cut) or the
    median of the uncut responses (``kind`` "mean" / "median")."""
    if kind == "mean":
        return float(spike_mass(np.array([length]), np.array([cap]), None, k1, beta)[0])

    def median_of(mb):
        k = shape_for(mb, k1, beta)
        return mb / k * gammaincinv(k, 0.5)

    mb = _bisect_log(median_of, np.array([length]), np.array([length / 10]), np.array([length * 10]))
    k = shape_for(mb, k1, beta)
    return float(gammaincc(k, cap * k / mb)[0])


def fit(rows=FIT_ROWS) -> tuple[float, float, float]:
    """(k1, beta, sum of squared errors) minimising the squared error of every row's clip share."""
    from scipy.optimize import minimize

    def sse(p):
        k1, beta = float(np.exp(p[0])), float(p[1])
        return sum((predicted_clip(kind, x, cap, k1, beta) - c) ** 2 for _, kind, x, cap, c in rows)

    best = min((minimize(sse, [np.log(k0), b0], method="Nelder-Mead",
                         options={"xatol": 1e-7, "fatol": 1e-12, "maxiter": 4000})
                for k0 in (2.0, 8.0) for b0 in (0.2, 1.0)), key=lambda r: r.fun)
    return float(np.exp(best.x[0])), float(best.x[1]), float(best.fun)


class LengthSampler:
    """Per-step response lengths for a job of ``prompts x samples`` sequences."""

    def __init__(self, prompts: int, samples: int, seed: int = 0, correlation: float = PROMPT_CORRELATION) -> None:
        self.prompts, self.samples, self.seed = prompts, samples, seed
        self.rho = float(np.clip(correlation, 0.0, 1.0))

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    def sample(self, steps: np.ndarray, mean: np.ndarray, p90: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """[len(steps), sequences] int32 lengths in [1, cap]; ``p90`` NaN = no p90 in the trace.
        A prompt's samples are adjacent (the order engines and trainers receive them)."""
        mean, cap = np.asarray(mean, float), np.asarray(cap, float)
        k, theta = params(mean, cap, np.asarray(p90, float))
        x = np.empty((len(steps), self.sequences))
        for i, s in enumerate(np.asarray(steps)):
            rng = np.random.default_rng([self.seed, 7, int(s)])
            shared = rng.standard_gamma(self.rho * k[i], self.prompts) if self.rho > 0 else np.zeros(self.prompts)
            own = rng.standard_gamma((1 - self.rho) * k[i], self.sequences) if self.rho < 1 else 0.0
            x[i] = theta[i] * (np.repeat(shared, self.samples) + own)
        return np.clip(np.ceil(x), 1, cap[:, None]).astype(np.int32)
