"""selfopd.stats: intervals checked against independent computations."""

from __future__ import annotations

import math

import pytest

from selfopd.stats import mean_interval, paired_difference, wilson_interval


def test_wilson_matches_closed_form_and_stays_in_bounds():
    k, n, z = 30, 100, 1.959963984540054
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    interval = wilson_interval(k, n)
    assert interval.low == pytest.approx(centre - half) and interval.high == pytest.approx(centre + half)
    assert wilson_interval(0, 20).low == 0.0 and wilson_interval(20, 20).high == 1.0
    assert 0 < wilson_interval(0, 20).high < 0.2
    with pytest.raises(ValueError):
        wilson_interval(5, 3)


def test_paired_difference_by_hand():
    before = [False, False, True, True, False]
    after = [True, False, True, True, True]  # diffs 1, 0, 0, 0, 1: mean 0.4, sample sd sqrt(0.3)
    result = paired_difference(before, after)
    half = 1.959963984540054 * math.sqrt(0.3 / 5)
    assert result.mean == pytest.approx(0.4)
    assert (result.low, result.high) == pytest.approx((0.4 - half, 0.4 + half))
    with pytest.raises(ValueError):
        paired_difference([True], [True, False])


def test_mean_interval_by_hand_and_clipped():
    result = mean_interval([0.5, 1.0, 0.0, 0.5])  # mean 0.5, sample variance 1/6
    half = 1.959963984540054 * math.sqrt((1 / 6) / 4)
    assert result.value == 0.5 and result.high == pytest.approx(0.5 + half)
    assert mean_interval([1.0, 1.0]).low == 1.0 and mean_interval([1.0, 1.0]).high == 1.0


def test_wilson_bounds_are_exact_at_zero_and_all():
    # Rounding once put the lower bound of 0/25 a hair above 0, which broke error bars.
    for n in range(1, 400):
        assert wilson_interval(0, n).low == 0.0 and wilson_interval(n, n).high == 1.0
