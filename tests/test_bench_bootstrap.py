"""bench/bootstrap.py: the benchmarks' one percentile bootstrap (fidelity_v2, effect)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bootstrap import percentile_interval  # noqa: E402


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
