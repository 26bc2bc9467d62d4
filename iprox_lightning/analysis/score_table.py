"""Score tables as ``id -> score`` mappings (Parquet or JSON Lines).

The implementation lives in :mod:`iprox_lightning.io.scores`, the one home of the score table; this
module keeps the historical import path.
"""
from __future__ import annotations

from ..io.scores import JSONL_SUFFIXES, PARQUET_SUFFIXES, read_scores, write_scores

__all__ = ["read_scores", "write_scores", "PARQUET_SUFFIXES", "JSONL_SUFFIXES"]
