"""The score table: its columns, its reading and writing, the pool it was scored on.

A scoring output directory (its lock, shards, merge and ``settings.json``) is :mod:`.score_dir`; the merged table
``scores.parquet`` and its ``settings.json`` sidecar are read and written here.

Columns (:data:`SCHEMA_VERSION` 2): ``id``, ``score``, ``score_max`` (LESS max over validation tasks),
``score/<task>`` per validation task, ``n_tokens`` (response tokens), ``zero_grad`` (no gradient: score
0), ``nonfinite`` (the example's gradient was NaN/inf: scores NaN), ``task`` (the example's own task).

Also here: :func:`read_scores` / :func:`write_scores` (``id -> score`` tables in Parquet or JSONL, for
external or hand-made tables). The top-k rule: :mod:`iprox_lightning.selection.topk`.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import InputNotFoundError, UserInputError
from .atomic import atomic_path, open_atomic
from .jsonfile import read_json, write_json

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
SCORES_FILE = "scores.parquet"
SETTINGS_FILE = "settings.json"
FLAG_COLUMNS = ("zero_grad", "nonfinite")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


# ----------------------------------------------------------------------------------- small helpers


# ----------------------------------------------------------------------------------- one writer at a time


# ----------------------------------------------------------------------------------- columns
def arrow_table(ids, scores, task_names, task_scores, n_tokens, zero_grad, nonfinite=None, tasks=None):
    """The score table's Arrow layout (the only place the column list is defined)."""
    n = len(ids)
    ts = np.asarray(task_scores, dtype=np.float64).reshape(n, len(task_names))
    nonfinite = np.zeros(n, bool) if nonfinite is None else np.asarray(nonfinite, bool).reshape(n)
    with np.errstate(invalid="ignore"):
        smax = ts.max(axis=1) if task_names else np.asarray(scores, np.float64)
    cols: dict[str, Any] = {
        "id": pa.array([str(i) for i in ids], pa.string()),
        "score": pa.array(np.asarray(scores, np.float64).reshape(n), pa.float64()),
        "score_max": pa.array(np.where(nonfinite, np.nan, smax) if n else smax, pa.float64()),
    }
    for k, t in enumerate(task_names):
        cols[f"score/{t}"] = pa.array(ts[:, k], pa.float64())
    cols["n_tokens"] = pa.array(np.asarray(n_tokens, np.int64).reshape(n), pa.int64())
    cols["zero_grad"] = pa.array(np.asarray(zero_grad, bool).reshape(n), pa.bool_())
    cols["nonfinite"] = pa.array(nonfinite, pa.bool_())
    cols["task"] = pa.array([None if t is None else str(t) for t in (tasks if tasks is not None else [None] * n)],
                            pa.string())
    return pa.table(cols)


def task_names_of(table) -> list[str]:
    return [c[len("score/"):] for c in table.column_names if c.startswith("score/")]


def predictions_to_arrow(preds: Sequence[dict]):
    """Arrow table of ``InfluenceScoringModule.predict_step`` outputs (``None`` when empty)."""
    preds = [p for p in preds if len(p["id"])]
    if not preds:
        return None
    names = list(preds[0]["task_names"])
    ids = [i for p in preds for i in p["id"]]
    ts = np.concatenate([np.asarray(p["task_scores"], np.float64).reshape(len(p["id"]), len(names)) for p in preds])
    cat = lambda k, dt: np.concatenate([np.asarray(p[k], dtype=dt) for p in preds])  # noqa: E731
    nonfinite = np.concatenate([np.asarray(p.get("nonfinite", np.zeros(len(p["id"]), bool)), bool) for p in preds])
    tasks = [t for p in preds for t in (p["task"] if p.get("task") is not None else [None] * len(p["id"]))]
    return arrow_table(ids, cat("score", np.float64), names, ts, cat("n_tokens", np.int64), cat("zero_grad", bool),
                       nonfinite, tasks)


def flag_counts(table) -> dict[str, int]:
    return {f: int(pc.sum(table.column(f)).as_py() or 0) for f in FLAG_COLUMNS if f in table.column_names}


# ----------------------------------------------------------------------------------- shards


# ----------------------------------------------------------------------------------- the scored pool
def scored_pool(settings: Mapping) -> dict:
    """The ``"pool"`` entry of a score table's settings (:func:`read_scored`: sources, records digest,
    ``builtin_size``, ``field_map``); ``{}`` for other tables and for tables scored before it was recorded."""
    info = settings.get("pool")
    return dict(info) if isinstance(info, Mapping) else {}


def read_scored(path: str | os.PathLike):
    """``(path, pyarrow.Table, settings)`` of a score table read once for ``select``: :func:`read_table` and, for a
    merged table (``scores.parquet``), the ``settings.json`` beside it (``{}`` for any other table)."""
    p, table = read_table(path)
    return p, table, (read_settings(p.parent) if p.name == SCORES_FILE else {})


def check_scored_pool(table_path: str | os.PathLike, scored: Mapping, records: Sequence[Mapping], pool_name: Any,
                      *, allow_mismatch: bool = False) -> str:
    """Compare the pool ``select`` copies records from with the one that was scored (:func:`scored_pool`); returns
    ``"match"``, ``"not recorded"`` or ``"mismatch allowed"``. A mismatch raises ``ValueError`` saying what differs
    and how to override: the ids would pick records that did not earn the scores."""
    from .records import records_digest  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    want = scored.get("records") if isinstance(scored, Mapping) else None
    if not isinstance(want, Mapping):
        return "not recorded"
    have = records_digest(records)
    if have == {"n": want.get("n"), "content": want.get("content")}:
        return "match"
    msg = (f"{table_path} was scored on pool {scored.get('source')!r} ({want.get('n')} records, digest "
           f"{want.get('content')}), but the pool {pool_name} holds other records ({have['n']} records, digest "
           f"{have['content']}): an edited, re-sorted or other pool makes the ids pick records that did not earn the "
           "scores")
    if not allow_mismatch:
        raise UserInputError(msg + "; score this pool, or pass allow_pool_mismatch=True (CLI: --allow_pool_mismatch "
                               "true) to select from it anyway")
    log.warning("%s; selecting anyway (allow_pool_mismatch)", msg)
    return "mismatch allowed"


# ----------------------------------------------------------------------------------- merged table
def read_table(path: str | os.PathLike):
    """``(path, pyarrow.Table)`` of a merged score table (a directory means its ``scores.parquet``)."""
    p = Path(path)
    if p.is_dir():
        p = p / SCORES_FILE
    if not p.exists():
        raise InputNotFoundError(f"score table not found: {p}")
    try:
        t = pq.read_table(p)
    except Exception as e:
        raise UserInputError(f"{p}: cannot read Parquet score table ({type(e).__name__}: {e})") from None
    for c in ("id", "score"):
        if c not in t.column_names:
            raise UserInputError(f"{p}: score table has no {c!r} column (columns: {t.column_names})")
    check_columns(t, p)
    return p, t


def check_columns(table, where: Any) -> None:
    """Refuse a score table whose score columns (``score``, ``score_max``, ``score/<task>``) are not numeric or hold
    nulls, or whose ``id`` column holds nulls: ``ValueError`` naming the file, the column and the first bad row."""
    for c in table.column_names:
        if c != "id" and c != "score" and c != "score_max" and not c.startswith("score/"):
            continue
        col = table.column(c)
        if c != "id" and not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise UserInputError(f"{where}: column {c!r} holds {col.type} values, not numbers (e.g. row 0: "
                                 f"{col[0].as_py()!r}); a score table's scores are floats")
        if col.null_count:
            row = pc.index(pc.is_null(col), True).as_py()
            rid = table.column("id")[row].as_py() if c != "id" else None
            raise UserInputError(f"{where}: row {row}" + (f" (id {rid!r})" if rid is not None else "")
                                 + f" has a null {c!r}; {col.null_count} null(s) in that column")


def _check_finite(scores: Mapping[str, float], where: str) -> None:
    bad = [k for k, v in scores.items() if not math.isfinite(v)]
    if bad:
        raise UserInputError(f"{where}: {len(bad)} non-finite score(s), e.g. id {bad[0]!r} -> {scores[bad[0]]}; "
                             "these rows are flagged 'nonfinite' by the scorer")


def read_scores(path: str | os.PathLike, *, id_column: str = "id", score_column: str = "score") -> dict[str, float]:
    """Read a Parquet or JSONL score table into ``{id: score}`` (ids as ``str``, scores as ``float``).

    The format is chosen by suffix (``.parquet``/``.pq`` vs ``.jsonl``/``.json``/``.ndjson``); an
    unknown suffix is sniffed (Parquet magic bytes ``PAR1``). A directory holding ``scores.parquet`` is
    that table; any other directory is the union of its ``*.parquet`` and ``*.jsonl`` files (names starting with
    ``.`` skipped). Raises
    ``ValueError`` naming the file and row on a missing column, a duplicated id with different scores,
    or a non-finite score.
    """
    path = Path(path)
    if path.is_dir():
        if (path / SCORES_FILE).is_file():
            return read_scores(path / SCORES_FILE, id_column=id_column, score_column=score_column)
        files = sorted(p for p in path.iterdir()
                       if p.suffix in PARQUET_SUFFIXES + JSONL_SUFFIXES and not p.name.startswith("."))
        if not files:
            raise InputNotFoundError(f"{path}: directory holds no .parquet/.jsonl score table")
        out: dict[str, float] = {}
        for f in files:
            _merge(out, read_scores(f, id_column=id_column, score_column=score_column), str(f))
        return out
    if not path.exists():
        raise InputNotFoundError(f"score table {path} does not exist")
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
            raise UserInputError(f"{where}: id {k!r} appears with two different scores ({out[k]} and {v})")
        out[k] = v


def _read_parquet(path: Path, id_column: str, score_column: str) -> dict[str, float]:
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise UserInputError(f"{path}: cannot read Parquet score table ({type(e).__name__}: {e})") from None
    missing = [c for c in (id_column, score_column) if c not in table.column_names]
    if missing:
        raise UserInputError(f"{path}: missing column(s) {missing}; columns are {table.column_names}")
    ids = table.column(id_column).to_pylist()
    vals = table.column(score_column).to_pylist()
    out: dict[str, float] = {}
    for row, (k, v) in enumerate(zip(ids, vals)):
        where = f"{path}, row {row}"
        if k is None:
            raise UserInputError(f"{where}: null {id_column!r}")
        _merge(out, {str(k): _score_value(v, where, str(k), score_column)}, where)
    return out


def _score_value(v: Any, where: str, rid: str, column: str) -> float:
    """``float(v)`` for a number; anything else (null, text, a list, a bool) raises naming the place and the id."""
    if v is None:
        raise UserInputError(f"{where}: id {rid!r} has a null {column!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UserInputError(f"{where}: id {rid!r} has a {type(v).__name__} {column!r} ({str(v)[:40]!r}), not a number")
    return float(v)


def _read_jsonl(path: Path, id_column: str, score_column: str) -> dict[str, float]:
    from .records import iter_jsonl  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    out: dict[str, float] = {}
    for where, rec in iter_jsonl(path):
        if not isinstance(rec, dict) or id_column not in rec or score_column not in rec:
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise UserInputError(f"{where}: record lacks {id_column!r} or {score_column!r}: keys {keys}")
        _merge(out, {str(rec[id_column]): _score_value(rec[score_column], where, str(rec[id_column]), score_column)},
               where)
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
        write_parquet_atomic(pa.table(cols), path)
    else:
        with open_atomic(path) as f:
            for i in range(len(ids)):
                f.write(json.dumps({c: v[i] for c, v in cols.items()}) + "\n")
    return path


# ----------------------------------------------------------------------------------- top-k


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """An artifact's JSON (sorted keys, indent 2), atomically (:func:`~.jsonfile.write_json`)."""
    return write_json(path, obj, sort_keys=True, default=str)


def write_parquet_atomic(table, path: str | os.PathLike) -> Path:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def read_settings(output_dir: str | os.PathLike) -> dict:
    p = Path(output_dir) / SETTINGS_FILE
    if not p.exists():
        return {}

    return read_json(p, what="score settings; remove the directory or pass overwrite=True to start fresh")
