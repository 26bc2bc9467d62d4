"""The benchmarks' one bootstrap: a percentile interval of a statistic over resampled items (fixed seed).

``scipy.stats.bootstrap`` is not used: the recorded confidence intervals (``bench/results/*/summary.json``) come
from this exact draw (one ``default_rng(seed).integers`` resample of the item indices at a time, resamples whose
statistic is undefined skipped), and a re-computed summary must give the same numbers.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np


def percentile_interval(stat: Callable[[np.ndarray], float], n_items: int, n: int, seed: int,
                        percentiles: Sequence[float] = (2.5, 97.5)) -> list[float]:
    """``[lo, hi]``: the ``percentiles`` of ``stat(index array)`` over ``n`` resamples with replacement of
    ``n_items`` items; NaN when no resample gives a finite value."""
    rng = np.random.default_rng(seed)
    vals = [v for v in (stat(rng.integers(0, n_items, n_items)) for _ in range(n)) if math.isfinite(v)]
    if not vals:
        return [float("nan"), float("nan")]
    lo, hi = np.percentile(vals, list(percentiles))
    return [float(lo), float(hi)]
