"""bootstrap.py: the one percentile bootstrap (pipeline's fine-tuned effect, fidelity_v2, effect) and the
paired gain over reference rows."""
from __future__ import annotations

import math

import numpy as np

from iprox_lightning.evaluation.bootstrap import paired_gain, percentile_interval


def test_percentile_interval_of_a_mean():
    x = np.array([0.0, 1.0])
    # resamples of two items: the mean is 0 (a quarter of them), 0.5 (half) or 1 (a quarter)
    assert percentile_interval(lambda ix: float(x[ix].mean()), 2, 1000, seed=0) == [0.0, 1.0]
    assert percentile_interval(lambda ix: float(x[ix].mean()), 2, 1000, seed=0, percentiles=(40, 60)) == [0.5, 0.5]
    x = np.arange(100, dtype=float)
    lo, hi = percentile_interval(lambda ix: float(x[ix].mean()), 100, 500, seed=1)
    assert 43 < lo < 49.5 < hi < 56  # mean 49.5, standard error 2.9: ±1.96·2.9
    assert percentile_interval(lambda ix: float(x[ix].mean()), 100, 500, seed=1) == [lo, hi]  # fixed seed


def test_percentile_interval_skips_undefined_resamples():
    calls = iter(range(10))
    assert percentile_interval(lambda ix: float("nan") if next(calls) % 2 else 1.0, 3, 10, seed=0) == [1.0, 1.0]
    lo, hi = percentile_interval(lambda ix: float("nan"), 3, 10, seed=0)
    assert math.isnan(lo) and math.isnan(hi)


def test_paired_gain_by_hand():
    v = np.array([1.0, 2.0, 3.0, 4.0])
    others = [np.array([2.0, 2.0, 4.0, 4.0]), np.array([0.0, 2.0, 2.0, 4.0])]  # mean [1, 2, 3, 4]: no gain
    diff, ci, gains = paired_gain(v, others, higher_is_better=True, n=200, seed=0)
    assert diff == 0.0 and ci == [0.0, 0.0] and gains == [-0.5, 0.5]
    # a loss (lower is better) 0.25 below the reference on every item: gain +0.25 with a zero-width paired CI,
    # although the items themselves spread from 1 to 4
    diff, ci, gains = paired_gain(v - 0.25, [v], higher_is_better=False, n=200, seed=0)
    assert math.isclose(diff, 0.25) and np.allclose(ci, [0.25, 0.25]) and math.isclose(gains[0], 0.25)
    # the CI is the percentile bootstrap of the per-item differences' mean, the same draw as percentile_interval
    d = np.array([0.5, -0.1, 0.3, 0.0, 0.2])
    _, ci, _ = paired_gain(d, [np.zeros(5)], higher_is_better=True, n=300, seed=3)
    assert ci == percentile_interval(lambda ix: float(d[ix].mean()), 5, 300, seed=3)
