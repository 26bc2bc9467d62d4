"""One reader for every kind of candidate pool (used by ``SFTDataModule`` and ``select``).

A pool is ``"builtin"``, a JSONL / JSON / Parquet file, a directory of them, a Hugging Face dataset id,
an in-memory ``datasets.Dataset``, a list of records (dicts), or a list mixing these sources. Every
record is validated and normalised by :func:`~iprox_lightning.data.sources.normalize_row` (Dolly
schema; ``field_map`` renames columns). In-memory records without an ``id`` get ``pool-<row>``;
their ``category`` defaults to ``pool``. Errors name the row (``pool[3]: missing field 'response'``).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import UserInputError
from ..io.output_guard import check_output_not_input
from .sources import DataFormatError, normalize_row, read_records, resolve_field_map
from .synthetic import generate_builtin_dataset

BUILTIN = "builtin"


def is_in_memory(pool: Any) -> bool:
    """True for a ``datasets.Dataset`` or a non-empty list/tuple of records (dicts)."""
    if type(pool).__name__ == "Dataset" and hasattr(pool, "column_names"):
        return True
    return isinstance(pool, (list, tuple)) and bool(pool) and all(isinstance(r, Mapping) for r in pool)


def describe(pool: Any) -> str:
    """A short name of the pool for messages and metadata."""
    if isinstance(pool, str):
        return pool
    if is_in_memory(pool):
        return f"<in-memory {type(pool).__name__} of {len(pool)} records>"
    return str(list(pool))


def read_pool(pool: Any, field_map: dict[str, str] | None = None, builtin_size: int = 2000) -> list[dict]:
    """Canonical records of ``pool`` (see the module doc), ids unique across all of it."""
    if is_in_memory(pool):
        fm = resolve_field_map(field_map)
        out = [normalize_row(dict(row), field_map=fm, where=f"pool[{i}]", default_id=f"pool-{i:06d}", default_task="pool")
               for i, row in enumerate(pool)]
        parts = [out]
    else:
        sources = [pool] if isinstance(pool, str) else list(pool)
        if not sources:
            raise UserInputError("pool: no source given")
        parts = [generate_builtin_dataset(builtin_size, seed=0) if s == BUILTIN else read_records(s, field_map)
                 for s in sources]
    records = [r for part in parts for r in part]
    seen: set[str] = set()
    for r in records:
        if r["id"] in seen:
            raise DataFormatError(f"pool {describe(pool)}: duplicate id {r['id']!r}")
        seen.add(r["id"])
    return records


def check_output_is_not_input(out: str | os.PathLike, pool: Any, what: str) -> None:
    """Refuse an output (``what``: the option's name) that is a pool file (by device and inode: a hard or symbolic
    link of it too), lies inside a pool directory, or contains a pool source: writing it would replace the pool, or
    make the next read of the pool take the output for pool data (:func:`~iprox_lightning.io.output_guard.check_output_not_input`)."""
    sources = [pool] if isinstance(pool, (str, os.PathLike)) else list(pool) if isinstance(pool, (list, tuple)) else []
    check_output_not_input(out, {"pool": [s for s in sources if isinstance(s, (str, os.PathLike))]}, what)
