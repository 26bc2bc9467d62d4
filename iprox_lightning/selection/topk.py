"""The one top-k rule of the package: highest score first, ties broken by id (or position),
``k = max(1, round(f·n))`` for a fraction ``f``; and the shortlist cut of ``within_shortest``."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import UserInputError


def shortest_cut(lengths: Sequence[float], count: int) -> float:
    """The length of the ``count``-th shortest of ``lengths`` (``count`` capped at their number): every length at or
    below it is in the shortlist, ties at the cut kept (``select(within_shortest=...)``, the per-task Spearman among
    the shortest responses)."""
    return float(np.sort(np.asarray(lengths, dtype=np.float64))[min(count, len(lengths)) - 1])


def topk_count(k: int | float, n: int) -> int:
    """How many of ``n`` ranked examples a top-``k`` takes: an ``int`` count (capped at ``n``), or a
    ``float`` fraction in ``(0, 1]``: ``max(1, round(k·n))`` (0 when ``n == 0``)."""
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)):
        raise TypeError(f"k must be an int count or a float fraction, got {k!r}")
    if isinstance(k, (float, np.floating)):
        if not 0.0 < k <= 1.0:
            raise UserInputError(f"fraction k must be in (0, 1], got {k}")
        return min(n, max(1, int(round(k * n)))) if n else 0
    if k < 1:
        raise UserInputError(f"count k must be >= 1, got {k}")
    return min(int(k), n)


def topk_order(scores: Sequence[float], keys: Sequence[str] | None = None) -> np.ndarray:
    """Indices of ``scores`` from the highest down; ties broken by ``keys`` (ids) when given, else by
    position. The package's only ranking rule (``select``, retention, reports)."""
    s = np.asarray(scores, dtype=np.float64)
    if not np.isfinite(s).all():
        bad = int((~np.isfinite(s)).sum())
        raise UserInputError(f"cannot rank {bad} non-finite score(s) (NaN/inf); drop the rows flagged 'nonfinite' first")
    tie = np.arange(len(s)) if keys is None else np.unique(np.asarray(list(keys), dtype=object).astype(str),
                                                            return_inverse=True)[1]
    return np.lexsort((tie, -s))


def topk_indices(scores: Sequence[float], k: int | float, keys: Sequence[str] | None = None) -> np.ndarray:
    """Indices of the top-``k`` (count or fraction, :func:`topk_count`) scores, best first."""
    return topk_order(scores, keys)[: topk_count(k, len(scores))]
