"""The verdict rule on synthetic numbers: "degraded" needs both the relative threshold
and two standard errors of the difference."""

from __future__ import annotations

import math

import pytest

from singd_cuda.harness.stats import (
    NOISE_SE,
    REL_THRESHOLD,
    RULE,
    compare,
    median_or_none,
    summarize,
    verdict,
)


def test_summary_is_mean_and_sample_std():
    s = summarize([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.n) == (2.0, 1.0, 3)
    assert s.se == pytest.approx(1 / math.sqrt(3))
    assert summarize([4.0]).std == 0.0
    assert summarize([]) is None


def test_clearly_worse_beyond_threshold_and_noise_is_degraded():
    ref = summarize([1.00, 1.01, 0.99])
    low = summarize([1.30, 1.31, 1.29])
    assert compare(low, ref) == "degraded"
    assert compare(ref, low) == "better"


def test_worse_beyond_threshold_but_within_noise_is_same():
    ref = summarize([0.6, 1.0, 1.4])  # SE of the difference ~0.33
    low = summarize([0.8, 1.3, 1.8])  # 37 % worse on average, but 2 SE ~0.7
    assert low.mean - ref.mean > REL_THRESHOLD * ref.mean
    assert compare(low, ref) == "same within noise"


def test_worse_beyond_noise_but_below_threshold_is_same():
    ref = summarize([1.000, 1.001, 0.999])
    low = summarize([1.050, 1.051, 1.049])  # 5 %: tiny noise, but under the threshold
    assert low.mean - ref.mean > NOISE_SE * math.hypot(low.se, ref.se)
    assert compare(low, ref) == "same within noise"


def test_one_seed_uses_the_threshold_alone():
    assert compare(summarize([1.2]), summarize([1.0])) == "degraded"
    assert compare(summarize([1.05]), summarize([1.0])) == "same within noise"


def test_failed_seeds_fail_the_cell_and_missing_sides_compare_equal():
    good = summarize([1.0, 1.0])
    assert verdict(good, good, failed_seeds=1) == "failed"
    assert verdict(good, good, failed_seeds=0) == "same within noise"
    assert compare(None, good) == compare(good, None) == "same within noise"


def test_rule_text_states_both_conditions():
    assert f"{REL_THRESHOLD:.0%}" in RULE and "standard errors" in RULE


def test_median_counts_not_reached_as_infinite():
    assert median_or_none([3.0, None, 1.0]) == 3.0
    assert median_or_none([3.0, None, None]) is None
    assert median_or_none([2.0, 4.0]) == 3.0
    assert median_or_none([]) is None
