"""Score tables: ``id -> score`` mappings on disk (Parquet or JSON Lines).

A score table has at least the columns ``id`` (string) and ``score`` (float); other columns
(``task``, ``n_tokens``, ...) are ignored by :func:`read_scores`. The scoring engine writes
Parquet; JSON Lines (one ``{"id": ..., "score": ...}`` object per line) is accepted too, so
hand-made or external tables work the same way.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


def _check_finite(scores: Mapping[str, float], where: str) -> None:
    bad = [k for k, v in scores.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{where}: {len(bad)} non-finite score(s), e.g. id {bad[0]!r} -> {scores[bad[0]]}")


def read_scores(path: str | os.PathLike, *, id_column: str = "id", score_column: str = "score") -> dict[str, float]:
    """Read a Parquet or JSONL score table into ``{id: score}`` (ids as ``str``, scores as ``float``).

    The format is chosen by suffix (``.parquet``/``.pq`` vs ``.jsonl``/``.json``/``.ndjson``); an
    unknown suffix is sniffed (Parquet magic bytes ``PAR1``). A directory is read as the union of
    its ``*.parquet`` and ``*.jsonl`` files (one file per rank). Raises ``ValueError`` naming the
    file and row on a missing column, a duplicated id with different scores, or a non-finite score.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in PARQUET_SUFFIXES + JSONL_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"{path}: directory holds no .parquet/.jsonl score table")
        out: dict[str, float] = {}
        for f in files:
            _merge(out, read_scores(f, id_column=id_column, score_column=score_column), str(f))
        return out
    if not path.exists():
        raise FileNotFoundError(f"score table {path} does not exist")
    if path.suffix in PARQUET_SUFFIXES or (path.suffix not in JSONL_SUFFIXES and _is_parquet(path)):
        scores = _read_parquet(path, id_column, score_column)
    else:
        scores = _read_jsonl(path, id_column, score_column)
    _check_finite(scores, str(path))
    return scores


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def _merge(out: dict[str, float], new: Mapping[str, float], where: str) -> None:
    for k, v in new.items():
        if k in out and out[k] != v:
            raise ValueError(f"{where}: id {k!r} appears with two different scores ({out[k]} and {v})")
        out[k] = v


def _read_parquet(path: Path, id_column: str, score_column: str) -> dict[str, float]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    missing = [c for c in (id_column, score_column) if c not in table.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; columns are {table.column_names}")
    ids = [str(x) for x in table.column(id_column).to_pylist()]
    vals = table.column(score_column).to_pylist()
    out: dict[str, float] = {}
    for row, (k, v) in enumerate(zip(ids, vals)):
        if v is None:
            raise ValueError(f"{path}: row {row} (id {k!r}) has a null {score_column!r}")
        _merge(out, {k: float(v)}, f"{path} row {row}")
    return out


def _read_jsonl(path: Path, id_column: str, score_column: str) -> dict[str, float]:
    from iprox_lightning.data.sources import iter_jsonl

    out: dict[str, float] = {}
    for where, rec in iter_jsonl(path):
        if not isinstance(rec, dict) or id_column not in rec or score_column not in rec:
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"{where}: record lacks {id_column!r} or {score_column!r}: keys {keys}")
        if rec[score_column] is None:
            raise ValueError(f"{where}: id {rec[id_column]!r} has a null {score_column!r}")
        _merge(out, {str(rec[id_column]): float(rec[score_column])}, where)
    return out


def write_scores(scores: Mapping[str, float], path: str | os.PathLike, **extra_columns) -> Path:
    """Write ``{id: score}`` as Parquet (``.parquet``/``.pq``) or JSON Lines (any other suffix).

    ``extra_columns`` are ``{column: {id: value}}`` mappings written next to ``id`` and ``score``.
    Rows keep the mapping's order. Returns the path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = [str(k) for k in scores]
    cols = {"id": ids, "score": [float(scores[k]) for k in scores]}
    for name, col in extra_columns.items():
        cols[name] = [col.get(k) for k in ids]
    if path.suffix in PARQUET_SUFFIXES:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(cols), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for i in range(len(ids)):
                f.write(json.dumps({c: v[i] for c, v in cols.items()}) + "\n")
    return path
