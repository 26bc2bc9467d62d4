"""Console hygiene for the command line: one progress-bar style, and nothing printed that is not about this run.

* **One progress-bar style: tqdm.** Lightning picks ``RichProgressBar`` / ``RichModelSummary`` whenever
  ``rich`` is installed, while everything outside the Trainer loops (IPSVD probes and factors, K-FAC
  factors, validation gradients, transformers' weight loading and GGUF conversion, the baselines) uses
  tqdm. :func:`add_console_callbacks` gives every CLI Trainer :class:`ProgressBar` (Lightning's
  ``TQDMProgressBar`` without the logger's ``v_num``) and :class:`Summary` (the plain-text model summary
  without a FLOPs column and ``Total FLOPs: 0`` line: Lightning counts FLOPs only for modules with an
  ``example_input_array``, which these LLM modules do not have, so the count is always an unknown 0).
  A progress bar or summary callback the user configures is kept instead.
* **Tips.** Lightning (>= 2.6) prints two advertising tips on every ``Trainer`` ("💡 Tip: ... litlogger"
  and "... litmodels"), logged at INFO level through ``lightning.pytorch.utilities.rank_zero``;
  :func:`quiet_lightning_tips` drops exactly those records (everything else that logger says is kept).
* **A library-version warning.** Lightning 2.6's ``utilities/_pytree.py`` builds ``LeafSpec()``, which
  torch >= 2.10 marks deprecated (``FutureWarning``) on every fit/predict batch transfer; it is about
  Lightning's code, not this run, so :func:`quiet_lightning_tips` ignores exactly that warning from
  exactly that module.
* **Inside ``pipeline``** (:func:`quiet_stage`): each stage is one line the pipeline prints (what ran, how long,
  where it wrote), so Lightning's per-run info lines (``Seed set to``, ``GPU available``, ``TPU available``,
  ``LOCAL_RANK``, "Loading `train_dataloader` ...", the stages' own "saved ... to" lines) are raised to WARNING
  for the stage's duration through Lightning's own loggers, and transformers' progress bars are off
  (``transformers.utils.logging.disable_progress_bar``). Warnings still show. The pipeline also turns the model
  summary off and the progress bars off unless stderr is a terminal (:func:`interactive`); the project's own bars
  (IPSVD, validation gradients) follow the Trainer's ``enable_progress_bar``.
* **Off a terminal** (``nohup``, ``| tee``, a log file) Lightning's bar is off or ``\r``-noise: every CLI Trainer then
  also gets :class:`ProgressLinesCallback`, a line at most every minute per loop (training epoch, prediction:
  done/total, rate, ETA) — the same lines as every other long loop (:mod:`iprox_lightning.progress`).
* **transformers' progress bars for local files** (:func:`transformers_bars_off`): "Loading weights" and "Writing
  model shards" of a local model take a fraction of a second and print two bars each; hub downloads keep theirs.
"""
from __future__ import annotations

import logging
import sys
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar as _ProgressBarBase, TQDMProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from transformers.utils import logging as hf_logging

from .progress import ProgressLines, interval_s, is_terminal, touch

_TIP_PREFIX = "💡 Tip:"
_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP_PREFIX)


_FILTER = _DropTips()


def quiet_lightning_tips() -> None:
    """Drop Lightning's advertising tips and its torch-pytree deprecation warning (idempotent)."""
    for name in _LOGGERS:
        lg = logging.getLogger(name)
        if _FILTER not in lg.filters:
            lg.addFilter(_FILTER)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")


class ProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar without the logger's version number (``v_num``) among the metrics."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items

    # the bar moved: the progress heartbeat (iprox_lightning.progress) has nothing to add for an interval
    def on_train_batch_end(self, *args, **kwargs) -> None:
        touch()
        super().on_train_batch_end(*args, **kwargs)

    def on_validation_batch_end(self, *args, **kwargs) -> None:
        touch()
        super().on_validation_batch_end(*args, **kwargs)

    def on_predict_batch_end(self, *args, **kwargs) -> None:
        touch()
        super().on_predict_batch_end(*args, **kwargs)


class Summary(ModelSummary):
    """Lightning's plain-text model summary, without FLOPs when they are unknown (counted as 0: the module
    has no ``example_input_array``)."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:
        if total_flops:
            return ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                          total_training_modes, total_flops, **summarize_kwargs)

        cols = [c for c in summary_data if c[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0, *cols)
        lines = table.splitlines()
        if lines and lines[-1].rstrip().endswith("Total Flops"):
            lines = lines[:-1]
        logging.getLogger("lightning.pytorch.callbacks.model_summary").info("\n" + "\n".join(lines))


def add_console_callbacks(config: dict[str, Any]) -> dict[str, Any]:
    """Add :class:`ProgressBar` and :class:`Summary` to a Trainer's keyword arguments ``config`` unless it
    disables them (``enable_progress_bar`` / ``enable_model_summary`` false) or already holds a progress
    bar / model summary callback. Off a terminal no bar at all (``\r``-separated noise in a log: issue 65), whatever
    the config says: the progress lines speak there. Returns ``config`` (modified in place)."""
    cbs = config.get("callbacks")
    cbs = [] if cbs is None else (list(cbs) if isinstance(cbs, (list, tuple)) else [cbs])
    if not interactive():
        config["enable_progress_bar"] = False
        cbs = [c for c in cbs if not isinstance(c, _ProgressBarBase)]
    if config.get("enable_progress_bar", True) is not False and not any(isinstance(c, _ProgressBarBase) for c in cbs):
        cbs.append(ProgressBar())
    if config.get("enable_model_summary", True) is not False and not any(isinstance(c, ModelSummary) for c in cbs):
        cbs.append(Summary())
        # the callback is in the list: Lightning's own default is off (else it says it is "skipping" its default)
        config["enable_model_summary"] = False
    if not interactive() and interval_s() > 0 and not any(isinstance(c, ProgressLinesCallback) for c in cbs):
        cbs.append(ProgressLinesCallback())
    config["callbacks"] = cbs
    return config


def progress_lines() -> list:
    """``[ProgressLinesCallback()]`` off a terminal (and lines not turned off), else ``[]``: for a Trainer built
    outside the command line's LightningCLI (``build_store``)."""
    return [ProgressLinesCallback()] if not interactive() and interval_s() > 0 else []


def _examples(loaders) -> int | None:
    """Examples in a dataloader (or a list of them: summed), ``None`` where a loader's dataset has no length."""
    try:
        loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
        return int(sum(len(dl.dataset) for dl in loaders))
    except (TypeError, AttributeError):
        return None


def _batch_examples(batch) -> int:
    """Examples in one batch: the rows of its ``input_ids`` (or of the tensor itself), else 1."""
    x = batch.get("input_ids") if isinstance(batch, dict) else batch
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape else 1


class ProgressLinesCallback(Callback):
    """Off a terminal, one progress line per loop at most every ``interval`` seconds (:mod:`iprox_lightning.progress`),
    counted in examples (a fine-tune on a small selection has one batch per epoch: batches said nothing): a whole
    fit over its epochs (warm-up, alignment, fine-tuning; the epoch in the line) and each prediction run (scoring, a
    store build: the examples of all predict loaders). Rank 0 only; nothing on a terminal (the bar is there)."""

    def __init__(self, interval: float | None = None, file=None, clock=None) -> None:
        self.interval, self.file, self.clock = interval, file, clock
        self._lines: ProgressLines | None = None
        self._desc = ""

    def _start(self, trainer, desc: str, total: int | None) -> None:
        self._stop()
        if not trainer.is_global_zero or is_terminal(self.file if self.file is not None else sys.stderr):
            return
        kwargs = {"clock": self.clock} if self.clock is not None else {}
        self._lines = ProgressLines(total=total, desc=desc, unit="example", file=self.file, interval=self.interval,
                                    **kwargs)

    def _step(self, batch) -> None:
        if self._lines is not None:
            self._lines.update(_batch_examples(batch))

    def _stop(self) -> None:
        if self._lines is not None:
            self._lines.close()
            self._lines = None

    def on_train_start(self, trainer, pl_module) -> None:
        per_epoch = _examples(trainer.train_dataloader)
        limit = trainer.limit_train_batches  # an int is a number of batches, a float a share of the epoch
        full = (limit is None or (isinstance(limit, float) and limit == 1.0)) and not (trainer.max_steps and trainer.max_steps > 0)
        epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        total = per_epoch * epochs if per_epoch is not None and epochs and full else None
        self._desc = f"{type(pl_module).__name__} fit"
        self._start(trainer, self._desc, total)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._lines is not None:
            epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
            self._lines.desc = f"{self._desc}, epoch {trainer.current_epoch + 1}{epochs}"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._step(batch)

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_predict_start(self, trainer, pl_module) -> None:
        self._start(trainer, f"{type(pl_module).__name__} predict", _examples(trainer.predict_dataloaders))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._step(batch)

    def on_predict_end(self, trainer, pl_module) -> None:
        self._stop()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop()


LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")
"""The loggers Lightning's info lines go through (``rank_zero_info``, the seed line); :func:`quiet_stage` raises them."""


def interactive() -> bool:
    """Whether progress bars help: stderr is a terminal (not a log file, a pipe or a test's capture)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def transformers_bars_off() -> Iterator[None]:
    """transformers' (and huggingface_hub's) tqdm bars off inside the block, restored after."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextmanager
def quiet_stage() -> Iterator[None]:
    """Lightning's per-run info lines and transformers' progress bars off inside the block (see the module doc);
    warnings and errors still show. Levels are restored after."""
    saved = [(lg, lg.level) for lg in map(logging.getLogger, LIGHTNING_LOGGERS)]
    for lg, _ in saved:
        lg.setLevel(logging.WARNING)
    try:
        with transformers_bars_off():
            yield
    finally:
        for lg, level in saved:
            lg.setLevel(level)


def show_progress(trainer) -> bool:
    """The project's own progress bars inside a Trainer run: on rank 0 when the Trainer shows its progress bar."""
    return bool(trainer.is_global_zero and getattr(trainer, "progress_bar_callback", None) is not None)
