"""Intervals for the numbers selfopd reports: accuracies are claims, not point values."""

from __future__ import annotations

import math
from dataclasses import dataclass

Z_95 = 1.959963984540054  # two-sided 95% normal quantile


@dataclass(frozen=True)
class Proportion:
    """k successes out of n, with a Wilson score 95% interval."""

    k: int
    n: int
    low: float
    high: float

    @property
    def value(self) -> float:
        return self.k / self.n if self.n else float("nan")

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"


def wilson_interval(k: int, n: int, z: float = Z_95) -> Proportion:
    """Wilson score interval: unlike the normal approximation it stays inside [0, 1] and
    behaves at 0/n and n/n, which small eval sets hit often."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return Proportion(0, 0, float("nan"), float("nan"))
    p = k / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # At 0/n and n/n the bound is exactly p; rounding would otherwise put it a hair past p.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return Proportion(k, n, low, high)


@dataclass(frozen=True)
class PairedDifference:
    """Mean of after - before over the same items, with a normal 95% interval.

    Pairing matters: base and trained models are evaluated on the same held-out items,
    so item difficulty cancels and the interval is much tighter than for two
    independent proportions.
    """

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}] (paired, n={self.n})"


def paired_difference(before: list[bool], after: list[bool], z: float = Z_95) -> PairedDifference:
    if len(before) != len(after) or not before:
        raise ValueError(f"need two equally long, non-empty outcome lists, got {len(before)} and {len(after)}")
    diffs = [float(a) - float(b) for a, b in zip(after, before)]
    mean, half = _mean_and_half_width(diffs, z)
    return PairedDifference(mean, mean - half, mean + half, len(diffs))


@dataclass(frozen=True)
class MeanEstimate:
    """A mean of per-item scores in [0, 1] (e.g. avg@k accuracy) with a normal 95% interval
    over items: the k samples of one item are correlated, so items are the unit."""

    value: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n})"


def mean_interval(scores: list[float], z: float = Z_95, unit_range: bool = True) -> MeanEstimate:
    """Mean with a normal 95% interval; clipped to [0, 1] for scores in that range."""
    if not scores:
        raise ValueError("need at least one score")
    mean, half = _mean_and_half_width(scores, z)
    if unit_range:
        return MeanEstimate(mean, max(0.0, mean - half), min(1.0, mean + half), len(scores))
    return MeanEstimate(mean, mean - half, mean + half, len(scores))


def _mean_and_half_width(values: list[float], z: float) -> tuple[float, float]:
    """Sample mean and the half-width of its normal interval (sample variance, n - 1)."""
    n = len(values)
    mean = sum(values) / n
    variance = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, z * math.sqrt(variance / n)
