"""Random selection baseline: a uniform random score per example, reproducible from a seed.

``score(id) = u`` with ``u ∈ [0, 1)`` read from ``blake2b(f"{seed}:{id}")`` — it depends only on
the seed and the id, not on the order, sharding or size of the pool, so every rank / run agrees
and the top-k of the random scores is a uniform random subset.

:func:`length_matched_subset` is the control a selection's effect should beat besides plain random: a seeded random
subset with the same response lengths as the selection (per length, the ids with the largest random scores), so
what a fine-tune gains from it beyond the lengths it picked can be measured.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from ..analysis.tables import select_top
from ..io.scores import write_scores


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
    return select_top(random_scores(ids, seed), fraction)


def write_random_scores(ids: Iterable[str], path: str | os.PathLike, seed: int = 0) -> Path:
    """Write random scores of ``ids`` as a score table (Parquet or JSONL by suffix)."""
    return write_scores(random_scores(ids, seed), path)


def length_matched_subset(reference_ids: Sequence[str], lengths: Mapping[str, float], seed: int = 0) -> list[str]:
    """A seeded random subset of ``lengths``' ids with the length histogram of ``reference_ids``.

    ``lengths``: ``{id: response length}`` over the pool (e.g. a score table's ``n_tokens``); ``reference_ids``: the
    selection to match, ids of that pool. For each length ``L`` the reference has ``m`` times, the ``m`` ids of
    length ``L`` with the largest :func:`random_score` are taken — a uniform draw from the same length stratum (the
    reference's own ids may be among them; every stratum holds at least the reference's ``m``). Returns the ids by
    length ascending, largest random score first within a length.
    """
    ref = [str(i) for i in reference_ids]
    missing = [i for i in ref if i not in lengths]
    if missing:
        raise ValueError(f"length_matched_subset: {len(missing)} reference id(s) are not in the pool's lengths, "
                         f"e.g. {missing[0]!r}")
    if len(set(ref)) != len(ref):
        raise ValueError("length_matched_subset: duplicate reference ids")
    need: dict[float, int] = {}
    for i in ref:
        need[float(lengths[i])] = need.get(float(lengths[i]), 0) + 1
    strata: dict[float, list[str]] = {L: [] for L in need}
    for i, n in lengths.items():
        if float(n) in strata:
            strata[float(n)].append(str(i))
    out: list[str] = []
    for L in sorted(need):
        out += sorted(strata[L], key=lambda i: (-random_score(i, seed), i))[: need[L]]
    return out
