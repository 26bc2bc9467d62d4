"""``InfluenceWriter``: per-rank Parquet shards during prediction, one merged score table at the end.

Layout of ``output_dir``::

    shards/rank000-<run>-00000.parquet   # written every N batches (temp file + os.replace)
    scores.parquet                        # merged by rank 0: one row per example id
    settings.json                         # the run's scoring settings + merge summary

Columns: ``id``, ``score``, ``score_max`` (LESS max over validation tasks), ``score/<task>`` per
validation task, ``n_tokens`` (response tokens), ``zero_grad`` (flag), ``task`` (the example's
own task/category when the batch carried one).

Resume: at ``setup`` the writer reads the ids already present in ``shards/`` and hands them to the
module (``pl_module.skip_ids``); ``predict_step`` skips them, so re-running the same command after
an interruption scores only what is missing. The merge de-duplicates by id (Lightning's
distributed predict sampler does not pad, but custom samplers may repeat examples), keeping the
first shard in name order. A resumed run must use the same scoring settings (checked against
``settings.json``).
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter

log = logging.getLogger(__name__)

SHARD_DIR = "shards"
SCORES_FILE = "scores.parquet"
SETTINGS_FILE = "settings.json"


def _atomic_write_bytes_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def shard_files(output_dir: str | os.PathLike) -> list[str]:
    """Complete shard files of ``output_dir`` in name order (temp files are ignored)."""
    return sorted(glob.glob(os.path.join(str(output_dir), SHARD_DIR, "rank*.parquet")))


def done_ids(output_dir: str | os.PathLike) -> set[str]:
    """Example ids already written to the shards of ``output_dir``."""
    import pyarrow.parquet as pq

    out: set[str] = set()
    for f in shard_files(output_dir):
        out.update(pq.read_table(f, columns=["id"]).column("id").to_pylist())
    return out


def predictions_to_arrow(preds: Sequence[dict]):
    """Arrow table of ``predict_step`` outputs (see ``InfluenceScoringModule``)."""
    import pyarrow as pa

    preds = [p for p in preds if len(p["id"])]
    if not preds:
        return None
    names = list(preds[0]["task_names"])
    ids = [i for p in preds for i in p["id"]]
    ts = np.concatenate([np.asarray(p["task_scores"], dtype=np.float64).reshape(len(p["id"]), len(names)) for p in preds])
    cols = {
        "id": pa.array(ids, pa.string()),
        "score": pa.array(np.concatenate([np.asarray(p["score"], dtype=np.float64) for p in preds])),
        "score_max": pa.array(ts.max(axis=1) if names else np.zeros(len(ids))),
    }
    for k, t in enumerate(names):
        cols[f"score/{t}"] = pa.array(ts[:, k])
    cols["n_tokens"] = pa.array(np.concatenate([np.asarray(p["n_tokens"], dtype=np.int64) for p in preds]))
    cols["zero_grad"] = pa.array(np.concatenate([np.asarray(p["zero_grad"], dtype=bool) for p in preds]))
    tasks = [t for p in preds for t in (p["task"] if p.get("task") is not None else [None] * len(p["id"]))]
    cols["task"] = pa.array([None if t is None else str(t) for t in tasks], pa.string())
    return pa.table(cols)


def merge_shards(output_dir: str | os.PathLike, settings: Optional[dict] = None) -> str:
    """Merge ``output_dir/shards/*.parquet`` into ``output_dir/scores.parquet`` (one row per id,
    first occurrence kept, rows sorted by id) and update ``settings.json``. Returns the path."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out_dir = Path(output_dir)
    files = shard_files(out_dir)
    if not files:
        raise FileNotFoundError(f"no score shards in {out_dir / SHARD_DIR}: nothing was scored")
    tables = [pq.read_table(f) for f in files]
    cols = tables[0].column_names
    for f, t in zip(files, tables):
        if t.column_names != cols:
            raise ValueError(f"shard {f} has columns {t.column_names}, expected {cols} (mixed runs in one output_dir?)")
    table = pa.concat_tables(tables)
    ids = table.column("id").to_pylist()
    first: dict[str, int] = {}
    for j, i in enumerate(ids):
        first.setdefault(i, j)
    n_dup = len(ids) - len(first)
    order = sorted(first, key=str)
    table = table.take(pa.array([first[i] for i in order], pa.int64()))
    path = out_dir / SCORES_FILE
    tmp = out_dir / f".{SCORES_FILE}.tmp-{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    s = _read_settings(out_dir)
    s.update(settings or {})
    s["merge"] = {
        "rows": table.num_rows, "shards": len(files), "duplicates_dropped": n_dup,
        "zero_grad": int(pc.sum(table.column("zero_grad")).as_py() or 0), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    _atomic_write_bytes_json(out_dir / SETTINGS_FILE, s)
    return str(path)


def _read_settings(out_dir: Path) -> dict:
    p = out_dir / SETTINGS_FILE
    return json.loads(p.read_text()) if p.exists() else {}


class InfluenceWriter(BasePredictionWriter):
    """Write ``InfluenceScoringModule`` predictions as per-rank Parquet shards and merge them.

    Args:
        output_dir: where ``shards/``, ``scores.parquet`` and ``settings.json`` go.
        write_every_n_batches: flush a shard every this many predicted batches (per rank).
        merge: rank 0 merges the shards into ``scores.parquet`` at the end of prediction.
        flush_on_exception: on an exception (e.g. Ctrl-C) flush what is buffered before exiting.
        resume: skip ids already present in ``shards/`` (set ``False`` to refuse a non-empty dir).

    Use with ``trainer.predict(module, datamodule=dm, return_predictions=False)``.
    """

    def __init__(
        self,
        output_dir: str,
        write_every_n_batches: int = 50,
        merge: bool = True,
        flush_on_exception: bool = True,
        resume: bool = True,
    ) -> None:
        super().__init__(write_interval="batch")
        if write_every_n_batches < 1:
            raise ValueError(f"write_every_n_batches must be >= 1, got {write_every_n_batches}")
        self.output_dir = Path(output_dir)
        self.write_every_n_batches = int(write_every_n_batches)
        self.merge = merge
        self.flush_on_exception = flush_on_exception
        self.resume = resume
        self._buffer: list[dict] = []
        self._batches = 0
        self._seq = 0
        self._run = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.rows_written = 0
        self.merged_path: str | None = None

    # ------------------------------------------------------------------ life cycle
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "predict":
            return
        (self.output_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier()
        existing = shard_files(self.output_dir)
        if existing and not self.resume:
            raise FileExistsError(f"{self.output_dir / SHARD_DIR} already holds {len(existing)} shard(s) and resume=False")
        config = pl_module.scoring_config() if hasattr(pl_module, "scoring_config") else {}
        old = _read_settings(self.output_dir).get("config")
        if existing and old is not None and config:
            diff = {k: (old.get(k), v) for k, v in config.items() if old.get(k) != v}
            if diff:
                raise ValueError(f"{self.output_dir / SETTINGS_FILE}: cannot resume with different settings "
                                 f"(field: (previous, now)) {diff}; use a new output_dir")
        done = done_ids(self.output_dir) if existing else set()
        if hasattr(pl_module, "skip_ids"):
            pl_module.skip_ids = set(done)
        if done and trainer.global_rank == 0:
            log.info("InfluenceWriter: resuming, %d ids already scored in %s", len(done), self.output_dir)
        trainer.strategy.barrier()
        if trainer.global_rank == 0 and config:
            s = _read_settings(self.output_dir)
            s["config"] = config
            _atomic_write_bytes_json(self.output_dir / SETTINGS_FILE, s)
        self._rank = trainer.global_rank

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        if prediction is None:
            return
        self._buffer.append(prediction)
        self._batches += 1
        if self._batches % self.write_every_n_batches == 0:
            self.flush()

    def flush(self) -> str | None:
        """Write the buffered rows as one shard (atomic rename). Returns the shard path, if any."""
        import pyarrow.parquet as pq

        table = predictions_to_arrow(self._buffer)
        self._buffer = []
        if table is None:
            return None
        name = f"rank{getattr(self, '_rank', 0):03d}-{self._run}-{self._seq:05d}.parquet"
        self._seq += 1
        final = self.output_dir / SHARD_DIR / name
        tmp = final.with_name(f".{name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, final)
        self.rows_written += table.num_rows
        return str(final)

    def on_predict_end(self, trainer, pl_module) -> None:
        self.flush()
        trainer.strategy.barrier()
        if self.merge and trainer.global_rank == 0:
            extra = {}
            scorer = getattr(pl_module, "scorer", None)
            if scorer is not None:
                extra["scorer"] = scorer.settings()
            self.merged_path = merge_shards(self.output_dir, extra)
            log.info("InfluenceWriter: merged scores -> %s", self.merged_path)
        trainer.strategy.barrier()
        self.merged_path = str(self.output_dir / SCORES_FILE) if self.merge else None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.flush_on_exception:
            self.flush()
        else:
            self._buffer = []
