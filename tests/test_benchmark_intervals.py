"""The overhead interval the serving benchmark reports (issue #30): a percentile bootstrap of
the ratio of two variants' means over their rounds, seeded, so a report is reproducible."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from _common import ratio_ci95  # noqa: E402


def test_identical_rounds_give_an_interval_of_exactly_one():
    assert ratio_ci95([2.0, 2.0, 2.0], [2.0, 2.0, 2.0]) == [1.0, 1.0]


def test_the_interval_holds_the_ratio_of_the_means_and_narrows_with_more_rounds():
    few_fixed, few_stock = [1.02, 1.10, 0.98, 1.05], [1.00, 0.95, 1.04, 1.01]
    lo, hi = ratio_ci95(few_fixed, few_stock)
    ratio = (sum(few_fixed) / 4) / (sum(few_stock) / 4)
    assert lo < ratio < hi
    wide = hi - lo
    lo, hi = ratio_ci95(few_fixed * 9, few_stock * 9)
    assert lo < ratio < hi and hi - lo < wide / 2


def test_a_slower_variant_is_outside_one_and_the_same_seed_gives_the_same_interval():
    fixed, stock = [1.30, 1.32, 1.29, 1.31, 1.33], [1.00, 1.02, 0.99, 1.01, 0.98]
    assert ratio_ci95(fixed, stock)[0] > 1.2
    assert ratio_ci95(fixed, stock, seed=3) == ratio_ci95(fixed, stock, seed=3)


def test_fewer_than_two_rounds_a_side_give_no_interval():
    assert ratio_ci95([1.0], [1.0, 1.1]) is None
