"""Work split over ranks or passes, largest first (longest-processing-time): every item, by decreasing size, goes
to the bin with the least total so far (ties: the first bin; equal sizes keep their order). Stage 1's share of the
layer decompositions per rank (:func:`iprox_lightning.compression.schedule.assign_layers`) and K-FAC's module
partitions and per-rank eigendecompositions (:func:`iprox_lightning.scoring.metrics.balanced_groups`) use it, and
so does ``train.py plan`` through them."""
from __future__ import annotations

from typing import Mapping


def largest_first(sizes: Mapping[str, float], bins: int) -> dict[str, int]:
    """``{name: bin}`` for ``bins >= 1`` bins: largest first, each to the bin with the least total so far."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    totals = [0] * bins
    owner: dict[str, int] = {}
    for name in sorted(sizes, key=lambda k: -sizes[k]):  # stable: equal sizes keep their order
        b = min(range(bins), key=lambda j: (totals[j], j))
        owner[name] = b
        totals[b] += sizes[name]
    return {name: owner[name] for name in sizes}
