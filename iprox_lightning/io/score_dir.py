"""A scoring output directory: its lock, its shards, their merge into the score table, its settings.

Layout::

    shards/rank000-<run>-00000.parquet   # per-rank shards, written atomically (temp file + os.replace)
    shards/corrupt/...                    # unreadable shards moved aside on resume (their ids re-scored) by
                                          # :func:`repair_shards`, the resuming writer's first step
    scores.parquet                        # merged: one row per id, sorted by id (the table: :mod:`.scores`)
    settings.json                         # schema_version, fingerprint, scoring settings, merge summary
    .scoring.lock                         # held (flock) by the run writing here: a second run is refused

``settings.json`` holds ``fingerprint`` (below), ``scoring`` (the run's ``ScoringConfig`` verbatim,
:class:`iprox_lightning.scoring.influence.ScoringConfig`), ``config`` (the fingerprinted settings: the model's name,
the ``ScoringConfig``, the factor split, the loading dtype), ``data`` (examples dropped by truncation), ``scorer``
(the scorer's settings and preparation statistics), ``merge`` and ``repairs``.

The **fingerprint** in ``settings.json`` records what produced the rows: the model's identity, the
scoring settings, and digests of the scored pool and of the validation set's content
(:mod:`iprox_lightning.io.fingerprint`). Resuming into a directory whose fingerprint differs — or that
holds shards but no fingerprint — raises :class:`FingerprintMismatch` naming every field that differs;
``overwrite=True`` (``--trainer.callbacks.overwrite true``) or a new directory starts fresh.
"""
from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import InputNotFoundError, UserError, UserInputError
from .fingerprint import FingerprintMismatch, diff
from .jsonfile import Fields, read_json
from .ownership import check_owned
from .scores import (
    SCHEMA_VERSION, SCORES_FILE, SETTINGS_FILE, flag_counts, predictions_to_arrow, read_settings, write_json_atomic,
    write_parquet_atomic,
)

log = logging.getLogger(__name__)


SHARD_DIR = "shards"


CORRUPT_DIR = "corrupt"


LOCK_FILE = ".scoring.lock"

PASSES_DIR = "checkpoint_passes"
"""``checkpoints_in_turn``: each earlier checkpoint's pass over the pool as shards of its own
(``<output_dir>/checkpoint_passes/checkpoint_<j>/shards/``, the score shards' layout), read back where a stopped run
resumes and removed once the table is merged; under the directory's fingerprint like the score shards."""


def write_settings(output_dir: str | os.PathLike, settings: Mapping) -> Path:
    return write_json_atomic(Path(output_dir) / SETTINGS_FILE, {**settings, "schema_version": SCHEMA_VERSION})


class OutputLocked(UserError, RuntimeError):
    """Another scoring run is writing into the same output directory."""


MAX_PID = 2**22
"""The largest process id (Linux's ``pid_max`` limit); a lock file's larger pid is no process."""


class ScoreDirLock:
    """An exclusive lock on an output directory (a scoring run's; the pipeline's workdir), held for a whole run.

    ``<output_dir>/.scoring.lock`` is locked with ``flock`` (released by the kernel when the holder exits, so a
    crashed run never leaves a stale lock) and records the holder's pid, host and start time for the error a
    second run gets. The file is left in place after release, emptied; with ``remove`` (the pipeline's workdir) it
    is removed instead, and a run that locked a file removed meanwhile locks the new one (the inode checked after
    ``flock``), so two runs never hold two different files. A lock file still naming a holder when the lock is taken
    was left by a run that stopped without releasing it (killed): one line says so. Where the file system has no
    ``flock`` the run goes on unlocked, with a warning."""

    def __init__(self, output_dir: str | os.PathLike, lock_file: str = LOCK_FILE, what: str = "scoring run",
                 hint: str = "score into another output_dir", remove: bool = False):
        self.dir = Path(output_dir)
        self.path = self.dir / lock_file
        self.what, self.hint, self.remove = what, hint, remove
        self._fd: int | None = None

    def holder(self) -> str:
        """Who holds (or last held) the lock, from the lock file (read with its checks: a damaged or edited file,
        a pid that is no process id, says so instead of failing)."""
        try:
            if not self.path.stat().st_size:
                return "holder unknown"
            info = read_json(self.path, what="lock file")
            fields = Fields(self.path)
            pid = fields.get(info, "pid", "int", minimum=1)
            if pid > MAX_PID:
                raise fields.fail("pid", f"is {pid}, not a process id (at most {MAX_PID})")
            host = fields.get(info, "host", "str", default="?")
            started = fields.get(info, "started", "str", default="?")
        except (OSError, UserInputError) as e:
            return f"holder unknown: {e}"
        alive = ""
        if host == socket.gethostname():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = ", no longer running (a process it started may still hold the lock)"
            except OSError:
                pass
        return f"pid {pid} on host {host}, started {started}{alive}"

    def acquire(self) -> "ScoreDirLock":
        self.dir.mkdir(parents=True, exist_ok=True)
        while True:
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
            try:
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the holder removed the file between our open and flock: lock the one there now
        if os.fstat(fd).st_size:  # the last holder never released it: killed, or its machine went down
            print(f"{self.path}: a stale lock ({self.holder()}) left by a {self.what} that stopped without releasing "
                  "it; taken over", flush=True)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return

        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            if self.remove:  # still held: a run that opens it now finds it gone once it gets the lock (acquire)
                self.path.unlink(missing_ok=True)
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


def repair_shards(output_dir: str | os.PathLike) -> list[dict]:
    """Move the unreadable shards of ``output_dir`` (truncated by a crash) to ``shards/corrupt/``, each logged; returns
    what was moved (``settings.json``'s ``repairs``). Run where a scoring run resumes (``InfluenceWriter``), before its
    ids are read: their examples are then scored again, once."""
    return read_shards(output_dir, ["id"])[2]


def done_ids(output_dir: str | os.PathLike) -> set[str]:
    """Example ids already written to the readable shards of ``output_dir``; a query: an unreadable shard is left where
    it is and its ids are not done (:func:`repair_shards` moves it aside where a run resumes)."""
    out: set[str] = set()
    for f in shard_files(output_dir):
        try:
            t = pq.read_table(f, columns=["id"])
        except Exception:  # pyarrow raises several types for truncated files; repaired by repair_shards
            continue
        out.update(t.column("id").to_pylist())
    return out


def merge_shards(output_dir: str | os.PathLike, settings: Optional[dict] = None) -> str:
    """Merge ``output_dir/shards/*.parquet`` into ``output_dir/scores.parquet`` (one row per id, first
    occurrence kept, rows sorted by id) and update ``settings.json``. Returns the path."""
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
    """Remove a scoring output (shards, merged table, settings) so a run starts fresh; only from a directory the
    package marked as a scoring output (:mod:`.ownership`), else :class:`~iprox_lightning.errors.OutputExistsError`."""
    out = Path(output_dir)
    if any(os.path.lexists(out / n) for n in (SHARD_DIR, PASSES_DIR, SCORES_FILE, SETTINGS_FILE)):
        check_owned(out, "scores", option="overwrite", what="scores would be cleared")
    shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
    drop_checkpoint_passes(out)
    for name in (SCORES_FILE, SETTINGS_FILE):
        (out / name).unlink(missing_ok=True)


def checkpoint_pass_dir(output_dir: str | os.PathLike, j: int) -> Path:
    """Where checkpoint ``j``'s pass of a ``checkpoints_in_turn`` run keeps its shards (:data:`PASSES_DIR`)."""
    return Path(output_dir) / PASSES_DIR / f"checkpoint_{j}"


def pass_shard_files(output_dir: str | os.PathLike) -> list[str]:
    """Every earlier checkpoint's pass shards in ``output_dir`` (:data:`PASSES_DIR`), in name order."""
    return sorted(glob.glob(os.path.join(str(output_dir), PASSES_DIR, "checkpoint_*", SHARD_DIR, "rank*.parquet")))


def read_pass_rows(pass_dir: str | os.PathLike, task_names: Sequence[str]) -> dict[str, Any]:
    """The rows a checkpoint's pass wrote to ``pass_dir`` (:func:`checkpoint_pass_dir`; an unreadable shard, truncated
    by a stop, is skipped with a warning and left where it is: its rows are scored again; every rank reads the
    directory): ``{"ids", "score" [N], "task_scores" [N, K], "zero_grad" [N], "nonfinite" [N]}``, one row per id (the
    first written), the columns of ``task_names`` (a shard with others is refused)."""
    files, tables = [], []
    for f in shard_files(pass_dir):
        try:
            tables.append(pq.read_table(f))
            files.append(f)
        except Exception as e:  # pyarrow raises several types for truncated files
            log.warning("checkpoint pass shard %s is unreadable (%s): its rows will be scored again", f,
                        type(e).__name__)
    want = [f"score/{t}" for t in task_names]
    for f, t in zip(files, tables):
        if [c for c in t.column_names if c.startswith("score/")] != want:
            raise UserInputError(f"checkpoint pass shard {f} has other score columns than this run's tasks "
                                 f"{list(task_names)}")
    if not tables:
        return {"ids": [], "score": np.zeros(0), "task_scores": np.zeros((0, len(want))),
                "zero_grad": np.zeros(0, bool), "nonfinite": np.zeros(0, bool)}
    table = pa.concat_tables(tables)
    first: dict[str, int] = {}
    for r, i in enumerate(table.column("id").to_pylist()):
        first.setdefault(i, r)
    rows = np.fromiter(first.values(), dtype=np.int64, count=len(first))

    def col(name: str) -> np.ndarray:
        return table.column(name).to_numpy(zero_copy_only=False)[rows]

    return {"ids": list(first), "score": col("score").astype(np.float64),
            "task_scores": np.stack([col(c).astype(np.float64) for c in want], axis=1) if want
            else np.zeros((len(rows), 0)),
            "zero_grad": col("zero_grad").astype(bool), "nonfinite": col("nonfinite").astype(bool)}


def write_pass_shard(pass_dir: str | os.PathLike, predictions: Sequence[dict], rank: int, run: str, seq: int) -> None:
    """One shard of a checkpoint's pass (``predict_step``-shaped rows with ``task_names``) in ``pass_dir``
    (:func:`checkpoint_pass_dir`), named as the score shards are."""
    table = predictions_to_arrow(predictions)
    if table is not None:
        write_parquet_atomic(table, Path(pass_dir) / SHARD_DIR / f"rank{rank:03d}-{run}-{seq:05d}.parquet")


def drop_checkpoint_passes(output_dir: str | os.PathLike) -> None:
    """Remove the earlier checkpoints' pass shards (:data:`PASSES_DIR`) of ``output_dir`` once its table is merged."""
    shutil.rmtree(Path(output_dir) / PASSES_DIR, ignore_errors=True)


def check_fingerprint(output_dir: str | os.PathLike, fingerprint: Mapping, *, hint: str) -> None:
    """Refuse to resume into ``output_dir`` unless its recorded fingerprint equals ``fingerprint``.

    Raises :class:`FingerprintMismatch` when the directory holds shards (an earlier checkpoint's pass's too) or a
    merged table that were produced from different inputs, or whose inputs are unknown (no ``settings.json``
    fingerprint)."""
    out = Path(output_dir)
    n_shards = len(shard_files(out)) + len(pass_shard_files(out))
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
