"""The one bootstrap: a percentile interval of a statistic over resampled items (fixed seed), for the pipeline's
fine-tuned effect and the benchmarks' confidence intervals.

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


def paired_gain(values: np.ndarray, others: Sequence[np.ndarray], higher_is_better: bool, n: int = 1000,
                seed: int = 0) -> tuple[float, list[float], list[float]]:
    """``values``' per-item improvement over the mean of ``others`` (each aligned with ``values`` item by item;
    positive = better, whatever the metric's direction): ``(mean, paired percentile-bootstrap CI over the items,
    the gain over each of others' means)``."""
    ref = np.mean(others, axis=0)
    d = (values - ref) if higher_is_better else (ref - values)
    sign = 1 if higher_is_better else -1
    gains = [(float(values.mean()) - float(o.mean())) * sign for o in others]
    return float(d.mean()), percentile_interval(lambda ix: float(d[ix].mean()), len(d), n, seed), gains
