"""Random selection baseline: a uniform random score per example, reproducible from a seed.

``score(id) = u`` with ``u ∈ [0, 1)`` read from ``blake2b(f"{seed}:{id}")`` — it depends only on
the seed and the id, not on the order, sharding or size of the pool, so every rank / run agrees
and the top-k of the random scores is a uniform random subset.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

from ..analysis.score_table import write_scores


def random_score(example_id: str, seed: int = 0) -> float:
    """Uniform ``[0, 1)`` score of one id (53 bits of ``blake2b(f"{seed}:{id}")``)."""
    h = hashlib.blake2b(f"{seed}:{example_id}".encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(h, "big") >> 11) / float(1 << 53)


def random_scores(ids: Iterable[str], seed: int = 0) -> dict[str, float]:
    """``{id: random_score(id, seed)}`` in the score-table format (duplicate ids raise)."""
    out: dict[str, float] = {}
    for i in ids:
        i = str(i)
        if i in out:
            raise ValueError(f"duplicate example id {i!r}")
        out[i] = random_score(i, seed)
    return out


def random_subset(ids: Iterable[str], fraction: float, seed: int = 0) -> list[str]:
    """The ``max(1, round(fraction · n))`` ids with the largest random scores (a seeded uniform sample).

    Used for the paper's 1 % samples (layer-extraction calibration, regression-scorer hold-out).
    """
    from ..analysis.tables import select_top

    return select_top(random_scores(ids, seed), fraction)


def write_random_scores(ids: Iterable[str], path: str | os.PathLike, seed: int = 0) -> Path:
    """Write random scores of ``ids`` as a score table (Parquet or JSONL by suffix)."""
    return write_scores(random_scores(ids, seed), path)
