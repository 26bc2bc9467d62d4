"""``BufferedShardWriter``: the bookkeeping shared by the prediction writers that write per-rank shards
(:class:`~.writer.InfluenceWriter`: Parquet score shards; :class:`~.store.GradientStoreWriter`: safetensors gradient
store shards).

Per rank: predictions are buffered batch by batch and written as one shard every ``write_every_n_batches`` batches,
at the end of prediction and (``flush_on_exception``) when the run stops on an exception; shards are named
``rank<rank>-<run>-<seq>`` (``run``: this writer's start time and a random tag, so a resumed run never overwrites an
earlier run's shards). Rank 0 holds the output directory's lock from ``setup`` to the end (a second run into the same
directory is refused on every rank). A subclass says how a shard is written (:meth:`write_shard`) and which lock and
clearing apply (:meth:`make_lock`, :meth:`clear_output`); the file formats stay in :mod:`iprox_lightning.io`.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter

from ..errors import UserInputError
from ..io.ownership import make_owned_dir
from ..io.score_dir import OutputLocked


class BufferedShardWriter(BasePredictionWriter):
    """Buffer ``predict_step`` outputs and write them as per-rank shards (see the module doc).

    Args:
        output_dir: the output directory (shards go to ``<output_dir>/<shard_dir>/``).
        write_every_n_batches: write a shard every this many predicted batches (per rank).
        overwrite: clear an earlier run's output (:meth:`clear_output`) in ``setup``.
        flush_on_exception: on an exception (e.g. Ctrl-C) write what is buffered before exiting.
    """

    shard_dir = "shards"
    owned_kind = "scores"  # the marker of the output directory it creates (io/ownership.py)

    def __init__(self, output_dir: str, write_every_n_batches: int = 50, overwrite: bool = False,
                 flush_on_exception: bool = True) -> None:
        super().__init__(write_interval="batch")
        if write_every_n_batches < 1:
            raise UserInputError(f"write_every_n_batches must be >= 1, got {write_every_n_batches}")
        self.output_dir = Path(output_dir)
        self.write_every_n_batches = int(write_every_n_batches)
        self.overwrite = overwrite
        self.flush_on_exception = flush_on_exception
        self._buffer: list[dict] = []
        self._batches = self._seq = 0
        self._run = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self._rank = 0
        self._lock: Any = None
        self.rows_written = 0

    # ------------------------------------------------------------------ what a subclass defines
    def make_lock(self):
        """The (not yet acquired) lock on ``output_dir`` rank 0 holds for the run (a ``ScoreDirLock``)."""
        raise NotImplementedError

    def clear_output(self) -> None:
        """Delete an earlier run's output (``overwrite=True``; rank 0, in ``setup``)."""
        raise NotImplementedError

    def write_shard(self, parts: list[dict], rank: int, run: str, seq: int) -> tuple[Path, int] | None:
        """Write the buffered predictions ``parts`` as shard number ``seq`` of this rank and run; ``(path, rows)``,
        or ``None`` when they hold no row (nothing written)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ life cycle
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "predict":
            return
        self._rank = trainer.global_rank
        refused = None
        if trainer.global_rank == 0:  # one run at a time per directory (a second one would mix its shards in)
            make_owned_dir(self.output_dir, self.owned_kind)  # marked when created (or found empty): ours to clear
            try:
                self._lock = self.make_lock().acquire()
            except OutputLocked as e:
                refused = str(e)
        if trainer.world_size > 1:
            refused = trainer.strategy.broadcast(refused, src=0)
        if refused:
            raise OutputLocked(refused)
        if self.overwrite and trainer.global_rank == 0:
            self.clear_output()
        (self.output_dir / self.shard_dir).mkdir(parents=True, exist_ok=True)
        trainer.strategy.barrier()

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0):
        if not prediction:  # (None, or {}: a batch with nothing left to write)
            return
        self._buffer.append(prediction)
        self._batches += 1
        if self._batches % self.write_every_n_batches == 0:
            self.flush()

    def flush(self) -> str | None:
        """Write the buffered rows as one shard (atomically). Returns the shard path, if any."""
        parts, self._buffer = self._buffer, []
        written = self.write_shard(parts, self._rank, self._run, self._seq) if parts else None
        if written is None:
            return None
        path, rows = written
        self._seq += 1
        self.rows_written += rows
        return str(path)

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
        if self._lock is not None:
            self._lock.release()
            self._lock = None
