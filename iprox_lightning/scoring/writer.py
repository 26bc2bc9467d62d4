"""``InfluenceWriter``: per-rank Parquet shards during prediction, one merged score table at the end.

The files (layout, columns, ``settings.json``, fingerprint) are defined and read/written only by
:mod:`iprox_lightning.io.scores`; this callback decides *when* to write them.

One run at a time: rank 0 holds an exclusive lock on ``output_dir`` (``.scoring.lock``,
:class:`~iprox_lightning.io.score_dir.ScoreDirLock`) from ``setup`` to the end of the merge; a second run started
into the same directory meanwhile stops with :class:`~iprox_lightning.io.scores.OutputLocked` naming the directory
and the holder's pid (two runs would mix their shards and settings). A crashed holder releases it with its process.

Resume: at ``on_predict_start`` the writer compares the directory's recorded fingerprint (model
identity, scoring settings, digests of the pool and of the validation set) with this run's. A match
resumes: the ids already present in ``shards/`` are handed to the module (``pl_module.skip_ids``) and
``predict_step`` skips them. A mismatch, or shards without a recorded fingerprint, stops with an error
naming what differs; ``overwrite=True`` clears the directory first. A shard left unreadable by a crash is
moved to ``shards/corrupt/``, its examples are scored again and the repair is logged in ``settings.json``
(``repairs``). With ``checkpoints_in_turn`` each earlier checkpoint's pass writes shards of its own
(``checkpoint_passes/``, every ``write_every_n_batches`` batches), read back on resume and removed after the merge. The merge de-duplicates by id (custom samplers may repeat examples), keeping the first shard
in name order.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

from lightning.pytorch.utilities import rank_zero_info

from ..io.score_dir import (
    SHARD_DIR, OutputLocked, ScoreDirLock, check_fingerprint, clear_output, done_ids, drop_checkpoint_passes,
    merge_shards, repair_shards, shard_files, write_settings,
)
from ..io.scores import SCORES_FILE, SETTINGS_FILE, predictions_to_arrow, read_settings, write_parquet_atomic
from .shard_writer import BufferedShardWriter

log = logging.getLogger(__name__)


@runtime_checkable
class ScoringModule(Protocol):
    """What :class:`InfluenceWriter` reads from the module whose predictions it writes (``InfluenceScoringModule`` is
    one): the provenance fingerprinted into ``settings.json`` (rank 0's, broadcast), the ids already scored (set on
    resume, skipped by the module) and the scorer whose settings the merge records. A module without them has its
    predictions written and merged with no fingerprint and no resume."""

    skip_ids: set[str]
    scorer: Any

    def scoring_provenance(self) -> dict[str, Any]: ...


class InfluenceWriter(BufferedShardWriter):
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

    shard_dir = SHARD_DIR

    def __init__(
        self,
        output_dir: str,
        write_every_n_batches: int = 50,
        merge: bool = True,
        flush_on_exception: bool = True,
        resume: bool = True,
        overwrite: bool = False,
    ) -> None:
        super().__init__(output_dir, write_every_n_batches, overwrite=overwrite, flush_on_exception=flush_on_exception)
        self.merge = merge
        self.resume = resume
        self._provenance: dict = {}
        self.merged_path: str | None = None

    # ------------------------------------------------------------------ shards (BufferedShardWriter)
    def make_lock(self) -> ScoreDirLock:
        return ScoreDirLock(self.output_dir)

    def clear_output(self) -> None:
        clear_output(self.output_dir)
        log.info("InfluenceWriter: overwrite=True, cleared %s", self.output_dir)

    def write_shard(self, parts, rank, run, seq):
        table = predictions_to_arrow(parts)
        if table is None:
            return None
        name = f"rank{rank:03d}-{run}-{seq:05d}.parquet"
        return write_parquet_atomic(table, self.output_dir / SHARD_DIR / name), table.num_rows

    # ------------------------------------------------------------------ life cycle
    def _hint(self) -> str:
        return (f"to start fresh pass overwrite=True (CLI: --trainer.callbacks.overwrite true; pipeline: --force true) "
                f"or choose a new output_dir than {self.output_dir}")

    def on_predict_start(self, trainer, pl_module) -> None:
        scoring = isinstance(pl_module, ScoringModule)
        if not scoring:  # another module's predictions: written and merged, with no fingerprint or resume
            prov = {}
        elif trainer.world_size > 1:  # rank 0's provenance (digests of the data it read) for every rank
            prov = trainer.strategy.broadcast(pl_module.scoring_provenance() if trainer.global_rank == 0 else None,
                                              src=0)
        else:
            prov = pl_module.scoring_provenance()
        self._provenance = prov
        existing = shard_files(self.output_dir)
        if existing and not self.resume:
            raise FileExistsError(f"{self.output_dir / SHARD_DIR} already holds {len(existing)} shard(s) and "
                                  f"resume=False; {self._hint()}")
        if "fingerprint" in prov:
            check_fingerprint(self.output_dir, prov["fingerprint"], hint=self._hint())
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            repairs = repair_shards(self.output_dir)  # moves unreadable shards aside, logs it (before done_ids)
            s = read_settings(self.output_dir)
            if repairs:
                s["repairs"] = list(s.get("repairs", [])) + repairs
            s.update(prov)
            if "fingerprint" in prov:
                s["config"] = prov["fingerprint"].get("settings")
            write_settings(self.output_dir, s)
        trainer.strategy.barrier()
        done = done_ids(self.output_dir)
        if scoring:
            pl_module.skip_ids = set(done)
        if hasattr(pl_module, "checkpoint_passes"):  # checkpoints_in_turn: its earlier passes kept here too
            pl_module.checkpoint_passes = (str(self.output_dir), self.write_every_n_batches)
        if done and trainer.global_rank == 0:
            log.info("InfluenceWriter: resuming, %d ids already scored in %s", len(done), self.output_dir)

    def on_predict_end(self, trainer, pl_module) -> None:
        self.flush()
        trainer.strategy.barrier()
        if self.merge and trainer.global_rank == 0:
            extra = {}
            if isinstance(pl_module, ScoringModule) and pl_module.scorer is not None:
                extra["scorer"] = pl_module.scorer.settings()
            self.merged_path = merge_shards(self.output_dir, extra)
            drop_checkpoint_passes(self.output_dir)  # (checkpoints_in_turn: the sums are in the table now)

            rank_zero_info(f"InfluenceWriter: saved the scores to {self.merged_path}")
        trainer.strategy.barrier()
        self.merged_path = str(self.output_dir / SCORES_FILE) if self.merge else None
        self._unlock()
