"""``InfluenceWriter``: per-rank Parquet shards during prediction, one merged score table at the end.

The files (layout, columns, ``settings.json``, fingerprint) are defined and read/written only by
:mod:`iprox_lightning.io.scores`; this callback decides *when* to write them.

One run at a time: rank 0 holds an exclusive lock on ``output_dir`` (``.scoring.lock``,
:class:`~iprox_lightning.io.scores.ScoreDirLock`) from ``setup`` to the end of the merge; a second run started
into the same directory meanwhile stops with :class:`~iprox_lightning.io.scores.OutputLocked` naming the directory
and the holder's pid (two runs would mix their shards and settings). A crashed holder releases it with its process.

Resume: at ``on_predict_start`` the writer compares the directory's recorded fingerprint (model
identity, scoring settings, digests of the pool and of the validation set) with this run's. A match
resumes: the ids already present in ``shards/`` are handed to the module (``pl_module.skip_ids``) and
``predict_step`` skips them. A mismatch, or shards without a recorded fingerprint, stops with an error
naming what differs; ``overwrite=True`` clears the directory first. A shard left unreadable by a crash is
moved to ``shards/corrupt/``, its examples are scored again and the repair is logged in ``settings.json``
(``repairs``). The merge de-duplicates by id (custom samplers may repeat examples), keeping the first shard
in name order.
"""
from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from lightning.pytorch.callbacks import BasePredictionWriter

from ..io.scores import (  # noqa: F401  (re-exported: the historical import path)
    SCORES_FILE,
    SETTINGS_FILE,
    SHARD_DIR,
    OutputLocked,
    ScoreDirLock,
    check_fingerprint,
    clear_output,
    done_ids,
    merge_shards,
    predictions_to_arrow,
    read_settings,
    read_shards,
    shard_files,
    write_parquet_atomic,
    write_settings,
)

log = logging.getLogger(__name__)


class InfluenceWriter(BasePredictionWriter):
    """Write ``InfluenceScoringModule`` predictions as per-rank Parquet shards and merge them.

    Args:
        output_dir: where ``shards/``, ``scores.parquet`` and ``settings.json`` go.
        write_every_n_batches: flush a shard every this many predicted batches (per rank).
        merge: rank 0 merges the shards into ``scores.parquet`` at the end of prediction.
        flush_on_exception: on an exception (e.g. Ctrl-C) flush what is buffered before exiting.
        resume: skip ids already present in ``shards/`` when the fingerprint matches (``False``: refuse a
            non-empty directory).
        overwrite: delete an earlier run's shards, table and settings in ``output_dir`` first.

    Use with ``trainer.predict(module, datamodule=dm, return_predictions=False)``.
    """

    def __init__(
        self,
        output_dir: str,
        write_every_n_batches: int = 50,
        merge: bool = True,
        flush_on_exception: bool = True,
        resume: bool = True,
        overwrite: bool = False,
    ) -> None:
        super().__init__(write_interval="batch")
        if write_every_n_batches < 1:
            raise ValueError(f"write_every_n_batches must be >= 1, got {write_every_n_batches}")
        self.output_dir = Path(output_dir)
        self.write_every_n_batches = int(write_every_n_batches)
        self.merge = merge
        self.flush_on_exception = flush_on_exception
        self.resume = resume
        self.overwrite = overwrite
        self._buffer: list[dict] = []
        self._batches = 0
        self._seq = 0
        self._run = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._provenance: dict = {}
        self.rows_written = 0
        self.merged_path: str | None = None

    # ------------------------------------------------------------------ life cycle
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "predict":
            return
        self._rank = trainer.global_rank
        refused = None
        if trainer.global_rank == 0:  # one run at a time per directory (a second one would mix shards / settings)
            try:
                self._lock = ScoreDirLock(self.output_dir).acquire()
            except OutputLocked as e:
                refused = str(e)
        if trainer.world_size > 1:
            refused = trainer.strategy.broadcast(refused, src=0)
        if refused:
            raise OutputLocked(refused)
        if self.overwrite and trainer.global_rank == 0:
            clear_output(self.output_dir)
            log.info("InfluenceWriter: overwrite=True, cleared %s", self.output_dir)
        (self.output_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier()

    def _hint(self) -> str:
        return (f"to start fresh pass overwrite=True (CLI: --trainer.callbacks.overwrite true; pipeline: --force true) "
                f"or choose a new output_dir than {self.output_dir}")

    def on_predict_start(self, trainer, pl_module) -> None:
        prov = pl_module.scoring_provenance() if hasattr(pl_module, "scoring_provenance") and trainer.global_rank == 0 \
            else ({"fingerprint": {"settings": pl_module.scoring_config()}} if hasattr(pl_module, "scoring_config") else {})
        if trainer.world_size > 1 and hasattr(pl_module, "scoring_provenance"):
            prov = trainer.strategy.broadcast(prov, src=0)
        self._provenance = prov
        existing = shard_files(self.output_dir)
        if existing and not self.resume:
            raise FileExistsError(f"{self.output_dir / SHARD_DIR} already holds {len(existing)} shard(s) and "
                                  f"resume=False; {self._hint()}")
        if "fingerprint" in prov:
            check_fingerprint(self.output_dir, prov["fingerprint"], hint=self._hint())
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            _, _, repairs = read_shards(self.output_dir, ["id"])  # moves unreadable shards aside, logs it
            s = read_settings(self.output_dir)
            if repairs:
                s["repairs"] = list(s.get("repairs", [])) + repairs
            s.update(prov)
            if "fingerprint" in prov:
                s["config"] = prov["fingerprint"].get("settings")
            write_settings(self.output_dir, s)
        trainer.strategy.barrier()
        done = done_ids(self.output_dir)
        if hasattr(pl_module, "skip_ids"):
            pl_module.skip_ids = set(done)
        if done and trainer.global_rank == 0:
            log.info("InfluenceWriter: resuming, %d ids already scored in %s", len(done), self.output_dir)

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        if prediction is None:
            return
        self._buffer.append(prediction)
        self._batches += 1
        if self._batches % self.write_every_n_batches == 0:
            self.flush()

    def flush(self) -> str | None:
        """Write the buffered rows as one shard (atomic rename). Returns the shard path, if any."""
        table = predictions_to_arrow(self._buffer)
        self._buffer = []
        if table is None:
            return None
        name = f"rank{getattr(self, '_rank', 0):03d}-{self._run}-{self._seq:05d}.parquet"
        self._seq += 1
        final = write_parquet_atomic(table, self.output_dir / SHARD_DIR / name)
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
            from lightning.pytorch.utilities import rank_zero_info

            rank_zero_info(f"InfluenceWriter: saved the scores to {self.merged_path}")
        trainer.strategy.barrier()
        self.merged_path = str(self.output_dir / SCORES_FILE) if self.merge else None
        self._unlock()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:
            if self.flush_on_exception:
                self.flush()
            else:
                self._buffer = []
        finally:
            self._unlock()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._unlock()

    def _unlock(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
            self._lock = None
