"""The score table: the only reader and writer of score shards, the merged table and its settings.

Layout of a scoring output directory::

    shards/rank000-<run>-00000.parquet   # per-rank shards, written atomically (temp file + os.replace)
    shards/corrupt/...                    # unreadable shards moved aside on resume (their ids re-scored)
    scores.parquet                        # merged: one row per id, sorted by id
    settings.json                         # schema_version, fingerprint, scoring settings, merge summary
    .scoring.lock                         # held (flock) by the run writing here: a second run is refused

``settings.json`` holds ``fingerprint`` (below), ``scoring`` (the run's ``ScoringConfig`` verbatim,
:class:`iprox_lightning.scoring.influence.ScoringConfig`), ``config`` (the fingerprinted settings: the model's name,
the ``ScoringConfig``, the factor split, the loading dtype), ``data`` (examples dropped by truncation), ``scorer``
(the scorer's settings and preparation statistics), ``merge`` and ``repairs``.

Columns (:data:`SCHEMA_VERSION` 2): ``id``, ``score``, ``score_max`` (LESS max over validation tasks),
``score/<task>`` per validation task, ``n_tokens`` (response tokens), ``zero_grad`` (no gradient: score
0), ``nonfinite`` (the example's gradient was NaN/inf: scores NaN), ``task`` (the example's own task).

The **fingerprint** in ``settings.json`` records what produced the rows: the model's identity, the
scoring settings, and digests of the scored pool and of the validation set's content
(:mod:`iprox_lightning.io.fingerprint`). Resuming into a directory whose fingerprint differs — or that
holds shards but no fingerprint — raises :class:`FingerprintMismatch` naming every field that differs;
``overwrite=True`` (``--trainer.callbacks.overwrite true``) or a new directory starts fresh.

Also here: :func:`read_scores` / :func:`write_scores` (``id -> score`` tables in Parquet or JSONL, for
external or hand-made tables) and the one top-k rule of the package (:func:`topk_count`,
:func:`topk_order`): highest score first, ties broken by id (or position), ``k = max(1, round(f·n))``.
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import InputNotFoundError, UserError, UserInputError
from .fingerprint import FingerprintMismatch, diff

log = logging.getLogger(__name__)

SCHEMA_VERSION = 2
SHARD_DIR = "shards"
CORRUPT_DIR = "corrupt"
SCORES_FILE = "scores.parquet"
SETTINGS_FILE = "settings.json"
LOCK_FILE = ".scoring.lock"
FLAG_COLUMNS = ("zero_grad", "nonfinite")
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


# ----------------------------------------------------------------------------------- small helpers
def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)
    return path


def write_parquet_atomic(table, path: str | os.PathLike) -> Path:
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def read_settings(output_dir: str | os.PathLike) -> dict:
    p = Path(output_dir) / SETTINGS_FILE
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserInputError(f"{p}: malformed JSON ({e.msg} at line {e.lineno}); remove the directory or pass "
                             "overwrite=True to start fresh") from None


def write_settings(output_dir: str | os.PathLike, settings: Mapping) -> Path:
    return write_json_atomic(Path(output_dir) / SETTINGS_FILE, {**settings, "schema_version": SCHEMA_VERSION})


# ----------------------------------------------------------------------------------- one writer at a time
class OutputLocked(UserError, RuntimeError):
    """Another scoring run is writing into the same output directory."""


class ScoreDirLock:
    """An exclusive lock on an output directory (a scoring run's; the pipeline's workdir), held for a whole run.

    ``<output_dir>/.scoring.lock`` is locked with ``flock`` (released by the kernel when the holder exits, so a
    crashed run never leaves a stale lock) and records the holder's pid, host and start time for the error a
    second run gets. The file is left in place after release (removing it would let two runs lock two different
    files). Where the file system has no ``flock`` the run goes on unlocked, with a warning."""

    def __init__(self, output_dir: str | os.PathLike, lock_file: str = LOCK_FILE, what: str = "scoring run",
                 hint: str = "score into another output_dir"):
        self.dir = Path(output_dir)
        self.path = self.dir / lock_file
        self.what, self.hint = what, hint
        self._fd: int | None = None

    def holder(self) -> str:
        """Who holds (or last held) the lock, from the lock file."""
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        if not info.get("pid"):
            return "holder unknown"
        host = info.get("host", "?")
        alive = ""
        if host == socket.gethostname():
            try:
                os.kill(int(info["pid"]), 0)
            except ProcessLookupError:
                alive = ", no longer running (a process it started may still hold the lock)"
            except (OSError, ValueError):
                pass
        return f"pid {info['pid']} on host {host}, started {info.get('started', '?')}{alive}"

    def acquire(self) -> "ScoreDirLock":
        import fcntl

        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputLocked(
                f"{self.dir} is being written by another {self.what} ({self.holder()}; lock file {self.path}): two "
                f"runs into one directory would mix their outputs. Wait for it to finish, or {self.hint}") from None
        except OSError as e:  # e.g. a network file system without flock
            os.close(fd)
            log.warning("%s: cannot lock (%s); make sure no other scoring run writes into this directory", self.path, e)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        import fcntl

        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "ScoreDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------------- columns
def arrow_table(ids, scores, task_names, task_scores, n_tokens, zero_grad, nonfinite=None, tasks=None):
    """The score table's Arrow layout (the only place the column list is defined)."""
    import pyarrow as pa

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
    import pyarrow.compute as pc

    return {f: int(pc.sum(table.column(f)).as_py() or 0) for f in FLAG_COLUMNS if f in table.column_names}


# ----------------------------------------------------------------------------------- shards
def shard_files(output_dir: str | os.PathLike) -> list[str]:
    """Complete shard files of ``output_dir`` in name order (temp files and moved-aside ones ignored)."""
    return sorted(glob.glob(os.path.join(str(output_dir), SHARD_DIR, "rank*.parquet")))


def _quarantine(path: str, error: Exception) -> dict:
    src = Path(path)
    dest_dir = src.parent / CORRUPT_DIR
    dest_dir.mkdir(exist_ok=True)
    dest = dest_dir / src.name
    shutil.move(str(src), dest)
    msg = str(error).splitlines()[0][:200]
    log.warning("score shard %s is unreadable (%s: %s): moved to %s; its examples will be scored again",
                src, type(error).__name__, msg, dest)
    return {"shard": str(src), "moved_to": str(dest), "error": f"{type(error).__name__}: {msg}",
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def read_shards(output_dir: str | os.PathLike, columns: Sequence[str] | None = None, *, repair: bool = True):
    """``(files, tables, repairs)``: every readable shard; an unreadable one (truncated by a crash) is
    moved to ``shards/corrupt/`` and listed in ``repairs`` (``repair=False``: raise naming the file)."""
    import pyarrow.parquet as pq

    files, tables, repairs = [], [], []
    for f in shard_files(output_dir):
        try:
            t = pq.read_table(f, columns=list(columns) if columns else None)
        except Exception as e:  # pyarrow raises several types for truncated files
            if not repair:
                raise UserInputError(f"score shard {f} is unreadable ({type(e).__name__}: {e})") from None
            repairs.append(_quarantine(f, e))
            continue
        files.append(f)
        tables.append(t)
    return files, tables, repairs


def done_ids(output_dir: str | os.PathLike) -> set[str]:
    """Example ids already written to the readable shards of ``output_dir``."""
    _, tables, _ = read_shards(output_dir, ["id"])
    return {i for t in tables for i in t.column("id").to_pylist()}


def merge_shards(output_dir: str | os.PathLike, settings: Optional[dict] = None) -> str:
    """Merge ``output_dir/shards/*.parquet`` into ``output_dir/scores.parquet`` (one row per id, first
    occurrence kept, rows sorted by id) and update ``settings.json``. Returns the path."""
    import pyarrow as pa

    out_dir = Path(output_dir)
    files, tables, repairs = read_shards(out_dir)
    if not files:
        raise InputNotFoundError(f"no score shards in {out_dir / SHARD_DIR}: nothing was scored")
    cols = tables[0].column_names
    for f, t in zip(files, tables):
        if t.column_names != cols:
            raise UserInputError(f"shard {f} has columns {t.column_names}, expected {cols} (mixed runs in one output_dir?)")
    table = pa.concat_tables(tables)
    ids = table.column("id").to_pylist()
    first: dict[str, int] = {}
    for j, i in enumerate(ids):
        first.setdefault(i, j)
    n_dup = len(ids) - len(first)
    order = sorted(first, key=str)
    table = table.take(pa.array([first[i] for i in order], pa.int64()))
    path = write_parquet_atomic(table, out_dir / SCORES_FILE)
    s = read_settings(out_dir)
    s.update(settings or {})
    if repairs:
        s["repairs"] = list(s.get("repairs", [])) + repairs
    s["merge"] = {"rows": table.num_rows, "shards": len(files), "duplicates_dropped": n_dup, **flag_counts(table),
                  "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_settings(out_dir, s)
    return str(path)


def clear_output(output_dir: str | os.PathLike) -> None:
    """Remove a scoring output (shards, merged table, settings) so a run starts fresh."""
    out = Path(output_dir)
    shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
    for name in (SCORES_FILE, SETTINGS_FILE):
        (out / name).unlink(missing_ok=True)


def check_fingerprint(output_dir: str | os.PathLike, fingerprint: Mapping, *, hint: str) -> None:
    """Refuse to resume into ``output_dir`` unless its recorded fingerprint equals ``fingerprint``.

    Raises :class:`FingerprintMismatch` when the directory holds shards or a merged table that were
    produced from different inputs, or whose inputs are unknown (no ``settings.json`` fingerprint)."""
    out = Path(output_dir)
    n_shards = len(shard_files(out))
    has_table = (out / SCORES_FILE).exists()
    if not n_shards and not has_table:
        return
    what = f"{n_shards} shard(s)" if n_shards else SCORES_FILE
    old = read_settings(out).get("fingerprint")
    if old is None:
        raise FingerprintMismatch(
            f"{out} already holds {what} but {out / SETTINGS_FILE} records no fingerprint, so it cannot be told "
            f"whether they come from this model, pool, validation set and settings; {hint}")
    lines = diff(old, dict(fingerprint))
    if lines:
        raise FingerprintMismatch(
            f"{out} holds {what} produced from different inputs; refusing to resume or reuse them. What differs "
            f"(previous -> now):\n  " + "\n  ".join(lines) + f"\n{hint}")


# ----------------------------------------------------------------------------------- the scored pool
def scored_pool(table_path: str | os.PathLike) -> dict:
    """The ``"pool"`` entry of the settings next to a merged score table (sources, records digest, ``builtin_size``,
    ``field_map``); ``{}`` for other tables and for tables scored before it was recorded."""
    p = Path(table_path)
    if p.name != SCORES_FILE:
        return {}
    info = read_settings(p.parent).get("pool")
    return dict(info) if isinstance(info, Mapping) else {}


def check_scored_pool(table_path: str | os.PathLike, scored: Mapping, records: Sequence[Mapping], pool_name: Any,
                      *, allow_mismatch: bool = False) -> str:
    """Compare the pool ``select`` copies records from with the one that was scored (:func:`scored_pool`); returns
    ``"match"``, ``"not recorded"`` or ``"mismatch allowed"``. A mismatch raises ``ValueError`` saying what differs
    and how to override: the ids would pick records that did not earn the scores."""
    from .records import records_digest

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
    import pyarrow.parquet as pq

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
    import pyarrow as pa
    import pyarrow.compute as pc

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
    import pyarrow.parquet as pq

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
    from .records import iter_jsonl

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
        import pyarrow as pa

        write_parquet_atomic(pa.table(cols), path)
    else:
        with open(path, "w", encoding="utf-8") as f:
            for i in range(len(ids)):
                f.write(json.dumps({c: v[i] for c, v in cols.items()}) + "\n")
    return path


# ----------------------------------------------------------------------------------- top-k
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
