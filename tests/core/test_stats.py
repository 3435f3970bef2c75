"""selfopd.core.stats: intervals checked against independent computations."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from selfopd.core.stats import (
    mean_interval,
    paired_change,
    paired_difference,
    pass_at_k,
    pass_ks,
    pooled_accuracy,
    pooled_change,
    prompt_accuracy,
    prompt_pass_at_k,
    crossed_interval,
    wilson_interval,
)


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


def _duplicated_eval_set():
    """Ten distinct prompts; one of them flips from wrong to right after training and happens
    to be repeated 30 times in the eval set (as "5 - 2 =" was 18 times in the old demo's)."""
    before = {f"p{i}": [i < 3] for i in range(10)}
    after = {f"p{i}": [i < 3] for i in range(10)}
    before["p9"], after["p9"] = [False] * 30, [True] * 30
    return before, after


def test_a_repeated_prompt_counts_once():
    before, after = _duplicated_eval_set()
    items_before = [o for key in sorted(before) for o in before[key]]
    items_after = [o for key in sorted(after) for o in after[key]]
    item_level = paired_difference(items_before, items_after, unit="items")
    assert item_level.n == 39 and item_level.low > 0  # 30 of 39 "items" improved: looks like a gain
    prompt_level = paired_change(before, after)
    assert prompt_level.n == 10 and prompt_level.mean == pytest.approx(0.1)
    assert prompt_level.low < 0 < prompt_level.high and prompt_level.verdict == "no significant change"
    assert "n=10 prompts" in str(prompt_level)
    accuracy = prompt_accuracy(after)  # 4 of 10 prompts, not 33 of 39 items
    assert accuracy.value == pytest.approx(0.4) and accuracy.n == 10


def test_prompt_accuracy_is_wilson_for_one_outcome_per_prompt_and_a_cluster_mean_otherwise():
    single = prompt_accuracy({f"p{i}": [i % 4 == 0] for i in range(40)})
    assert (single.k, single.n) == (10, 40) and single.low == wilson_interval(10, 40).low
    sampled = prompt_accuracy({"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0], "d": [1, 0, 0, 0]})
    expected = mean_interval([0.5, 1.0, 0.0, 0.25])
    assert (sampled.value, sampled.low, sampled.high, sampled.n) == (expected.value, expected.low, expected.high, 4)


def test_paired_change_pairs_by_prompt_not_by_position():
    before = {"a": [0], "b": [1], "c": [0]}
    after = {"c": [1], "b": [1], "a": [1], "z": [1]}  # another order, and a prompt the base never saw
    change = paired_change(before, after)
    assert change.n == 3 and change.mean == pytest.approx(2 / 3)


def _seed_tables(rng, seeds, prompts, seed_sd, prompt_sd=0.3, noise_sd=0.3, true=0.0):
    prompt_effect = rng.normal(0, prompt_sd, prompts)
    seed_effect = rng.normal(0, seed_sd, seeds)
    return true + prompt_effect[None, :] + seed_effect[:, None] + rng.normal(0, noise_sd, (seeds, prompts))


@pytest.mark.parametrize("seed_sd", [0.0, 0.1])
def test_crossed_interval_covers_the_truth_when_seeds_move_every_prompt(seed_sd):
    """A crossed random-effects simulation with three seeds: a training seed shifts all
    prompts together. The interval covers the true mean about 95% of the time whether or not
    seeds matter; treating the seeds' rows as more prompts (an interval over 450 "prompts")
    misses it far more often when they do."""
    rng = np.random.default_rng(0)
    trials, crossed, naive = 400, 0, 0
    for _ in range(trials):
        table = _seed_tables(rng, seeds=3, prompts=150, seed_sd=seed_sd)
        low, high = crossed_interval(table)
        crossed += low <= 0.0 <= high
        flat = mean_interval(list(table.ravel()), unit_range=False)
        naive += flat.low <= 0.0 <= flat.high
    assert 0.90 <= crossed / trials <= 0.99
    if seed_sd:
        assert naive / trials < 0.75


def test_pooled_change_over_seeds():
    rng = np.random.default_rng(1)
    keys = [f"p{i}" for i in range(60)]
    base = {k: [bool(rng.random() < 0.3)] for k in keys}
    runs = [{k: [bool(rng.random() < 0.3 + 0.1 * s)] for k in keys} for s in range(3)]
    pooled = pooled_change([(base, run) for run in runs])
    per_seed = [paired_change(base, run).mean for run in runs]
    assert pooled.mean == pytest.approx(np.mean(per_seed)) and pooled.seeds == 3 and pooled.n == 60
    assert pooled.low < pooled.mean < pooled.high and "60 prompts x 3 seeds" in str(pooled)
    one = pooled_change([(base, runs[0])])
    assert (one.mean, one.low, one.high) == pytest.approx(tuple(paired_change(base, runs[0]).__dict__[k]
                                                               for k in ("mean", "low", "high")))
    accuracy = pooled_accuracy(runs)
    assert accuracy.value == pytest.approx(np.mean([[v[0] for v in run.values()] for run in runs]))


def test_pooled_intervals_stay_inside_the_range_of_accuracies_when_two_seeds_disagree():
    """Two seeds far apart leave one degree of freedom (t = 12.7): the raw interval runs past
    [0, 1]; an accuracy's interval stops at 0 and 1, a change's at -1 and 1."""
    keys = [f"p{i}" for i in range(50)]
    base = {k: [False] for k in keys}
    runs = [{k: [i < 5] for i, k in enumerate(keys)}, {k: [i < 45] for i, k in enumerate(keys)}]
    raw_low, raw_high = crossed_interval(np.array([[float(v[0]) for v in run.values()] for run in runs]))
    assert raw_low < 0.0 and raw_high > 1.0
    accuracy = pooled_accuracy(runs)
    assert (accuracy.low, accuracy.high) == (0.0, 1.0) and accuracy.value == pytest.approx(0.5)
    change = pooled_change([(base, run) for run in runs])
    assert change.low >= -1.0 and change.high == 1.0 and change.mean == pytest.approx(0.5)


def test_a_99_percent_change_interval_is_the_95_percent_one_widened_by_the_ratio_of_quantiles():
    from scipy.stats import norm

    before = {f"p{i}": [i % 3 == 0] for i in range(40)}
    after = {f"p{i}": [i % 2 == 0] for i in range(40)}
    at95, at99 = paired_change(before, after), paired_change(before, after, level=0.99)
    assert at99.mean == at95.mean
    assert (at99.high - at99.mean) / (at95.high - at95.mean) == pytest.approx(norm.ppf(0.995) / norm.ppf(0.975))
    rng = np.random.default_rng(2)
    runs = [({k: [bool(rng.random() < 0.3)] for k in before}, {k: [bool(rng.random() < 0.5)] for k in before})
            for _ in range(3)]
    wide, narrow = pooled_change(runs, level=0.99), pooled_change(runs)
    assert wide.low < narrow.low < narrow.high < wide.high and wide.mean == narrow.mean


def _brute_force_pass_at_k(outcomes: list[bool], k: int) -> Fraction:
    """The share of the k-subsets of the samples holding a correct one, in exact arithmetic."""
    subsets = list(itertools.combinations(outcomes, k))
    return Fraction(sum(any(subset) for subset in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_correct_sample(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert abs(pass_at_k(n, c, k) - float(_brute_force_pass_at_k(outcomes, k))) < 1e-12, (n, c, k)


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 3, 1000  # C(2000, 1000) ~ 1e600
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert abs(pass_at_k(n, c, k) - float(exact)) < 1e-12
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_prompt_pass_at_k_averages_over_distinct_prompts():
    outcomes = {"a": [1, 0, 0, 0], "b": [0, 0, 0, 0], "c": [1, 1, 0, 1]}
    estimate = prompt_pass_at_k(outcomes, 2)
    per_prompt = [float(_brute_force_pass_at_k([bool(v) for v in values], 2)) for values in outcomes.values()]
    assert estimate.n == 3 and abs(estimate.value - sum(per_prompt) / 3) < 1e-12
    assert estimate == mean_interval(per_prompt)
    assert prompt_pass_at_k(outcomes, 1).value == pytest.approx(np.mean([0.25, 0, 0.75]))
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples"):
        prompt_pass_at_k(outcomes, 8)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(16)[-1] == 16
