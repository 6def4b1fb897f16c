"""Response lengths of one RL step, sampled per sequence (the main source of step-to-step noise).

Each step draws ``prompts x samples_per_prompt`` lengths from a log-normal whose mean and 90th
percentile follow the trace row, truncated at the row's cap (a response that reaches the cap is cut
there, so truncated responses pile up at the cap, as in real runs):

- sigma from p90 / mean of the row (``DEFAULT_P90_OVER_MEAN`` when the trace has no p90);
- mu such that the mean *after* truncation equals the row's mean (bisection on the closed-form
  mean of a log-normal clipped at the cap);
- the samples of one prompt share a prompt-level factor (correlation ``PROMPT_CORRELATION`` of the
  log-lengths): hard prompts make every sample long, and engines receive a prompt's samples
  together, so replicas see that correlation.

Sampling is seeded by (seed, step): every policy sees the same lengths at the same step.
"""
from __future__ import annotations

import numpy as np
from scipy.special import ndtr

Z90 = 1.2815515655446004
DEFAULT_P90_OVER_MEAN = 1.7
"""Assumption when a trace has no p90: right-skewed length distributions of reasoning RL runs."""
PROMPT_CORRELATION = 0.5
"""Assumption: share of the log-length variance that belongs to the prompt."""


def sigma_for(ratio: np.ndarray) -> np.ndarray:
    """Log-normal sigma whose p90 / mean equals ``ratio`` (clamped to what a log-normal can express)."""
    ln_r = np.clip(np.log(np.maximum(ratio, 1.0 + 1e-6)), 1e-6, Z90 * Z90 / 2 - 1e-6)
    return Z90 - np.sqrt(Z90 * Z90 - 2 * ln_r)


def clipped_mean(mu: np.ndarray, sigma: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """E[min(X, cap)] for X log-normal(mu, sigma)."""
    lc = np.log(cap)
    return np.exp(mu + sigma**2 / 2) * ndtr((lc - mu - sigma**2) / sigma) + cap * (1 - ndtr((lc - mu) / sigma))


def solve_mu(mean: np.ndarray, sigma: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """mu with clipped_mean(mu, sigma, cap) = mean (mean < cap), by bisection (vectorised)."""
    mean = np.minimum(mean, 0.999 * cap)
    lo = np.log(np.maximum(mean, 1.0)) - sigma**2 / 2 - 1.0
    hi = np.log(cap) + 4 * sigma + 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        too_big = clipped_mean(mid, sigma, cap) > mean
        hi = np.where(too_big, mid, hi)
        lo = np.where(too_big, lo, mid)
    return (lo + hi) / 2


class LengthSampler:
    """Per-step response lengths for a job of ``prompts x samples`` sequences."""

    def __init__(self, prompts: int, samples: int, seed: int = 0, correlation: float = PROMPT_CORRELATION) -> None:
        self.prompts, self.samples, self.seed = prompts, samples, seed
        self.rho = correlation

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    def sample(self, steps: np.ndarray, mean: np.ndarray, p90: np.ndarray, cap: np.ndarray) -> np.ndarray:
        """[len(steps), sequences] int32 lengths in [1, cap]; ``p90`` NaN = no p90 in the trace.
        A prompt's samples are adjacent (the order engines and trainers receive them)."""
        mean, cap = np.asarray(mean, float), np.asarray(cap, float)
        ratio = np.where(np.isnan(p90), DEFAULT_P90_OVER_MEAN, np.asarray(p90, float) / np.maximum(mean, 1.0))
        sigma = sigma_for(ratio)
        mu = solve_mu(mean, sigma, cap)
        z = np.empty((len(steps), self.sequences))
        a, b = np.sqrt(self.rho), np.sqrt(1 - self.rho)
        for i, s in enumerate(np.asarray(steps)):
            rng = np.random.default_rng([self.seed, 7, int(s)])
            zp = np.repeat(rng.standard_normal(self.prompts), self.samples)
            z[i] = a * zp + b * rng.standard_normal(self.sequences)
        x = np.exp(mu[:, None] + sigma[:, None] * z)
        return np.clip(np.ceil(x), 1, cap[:, None]).astype(np.int32)
