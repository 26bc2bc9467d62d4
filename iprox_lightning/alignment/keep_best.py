"""``KeepBestFactors``: record every held-out result of Stage 2 and keep the factors with the best one
(ModelCheckpoint's idea, kept in memory: only the proxy's low-rank factors change during alignment).

Contract — what it reads:

* ``trainer.callback_metrics``: the ``val/*`` metrics, at ``on_validation_end`` (after every callback and the module
  have logged theirs, as ``ModelCheckpoint`` reads them); Lightning's sanity check is never a candidate;
* ``pl_module.factor_parameters()``: the trainable factors, copied when a result is the best so far and copied back
  at ``on_fit_end`` (before the module's own ``on_fit_end`` saves the proxy);
* step 0 (``evaluate_step0=True``): ``pl_module.heldout_metrics()`` — the module's held-out ``val/*`` metrics over the
  full validation loader(s), or ``None`` without one — plus ``step0_metrics(trainer, pl_module)`` of every other
  callback that has it (the ranking-fidelity check), logged to the loggers and recorded at the current step before
  the first optimiser step, so the un-aligned factors are a candidate too.

What it returns: :meth:`report` — ``{"best": {"value", "step"} | None, "validation_history": [...]}`` (strict JSON:
NaN → ``None``), what the proxy manifest records. ``monitor=None`` records without keeping anything.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


@runtime_checkable
class Step0Metrics(Protocol):
    """Another callback whose metrics of the un-aligned factors join the step-0 candidate (``RankingFidelity``)."""

    def step0_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]: ...


def finite_or_none(value: Any) -> Any:
    """``None`` for a non-finite float (strict JSON), else ``value``."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class KeepBestFactors(Callback):
    """Keep the factors with the lowest held-out ``monitor`` (``None``: only record the held-out results).

    Args:
        monitor: a logged ``val/*`` metric, lower is better; ``None`` keeps nothing.
        evaluate_step0: evaluate the un-aligned factors before the first optimiser step (a candidate at step 0).
    """

    def __init__(self, monitor: Optional[str] = "val/loss", evaluate_step0: bool = True) -> None:
        self.monitor = monitor
        self.evaluate_step0 = evaluate_step0
        self.history: list[dict[str, float]] = []
        self.best: Optional[dict[str, Any]] = None  # {"value", "step", "factors"}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.evaluate_step0:
            return
        metrics = pl_module.heldout_metrics()
        if metrics is None:
            return  # no validation loader: nothing to compare against
        for cb in trainer.callbacks:
            if cb is not self and isinstance(cb, Step0Metrics):
                metrics.update(cb.step0_metrics(trainer, pl_module))
        # float32 like the values Lightning logs later, so the candidates compare on one footing
        metrics = {k: float(np.float32(v)) for k, v in metrics.items()}
        step = int(trainer.global_step)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        self.record(step, metrics, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return  # a partial look (num_sanity_val_steps batches): never a candidate
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            self.record(int(trainer.global_step), metrics, pl_module)

    def record(self, step: int, metrics: dict[str, float], pl_module: pl.LightningModule) -> None:
        """One held-out result: into :attr:`history`; with a ``monitor`` a candidate (never a non-finite one)."""
        self.history.append({"step": step, **metrics})
        if self.monitor is None:
            return
        if self.monitor not in metrics:
            raise KeyError(f"ProxyAlignModule(monitor={self.monitor!r}): not among the logged held-out "
                           f"metrics {sorted(metrics)}")
        value = metrics[self.monitor]
        if math.isfinite(value) and (self.best is None or value < self.best["value"]):
            factors = [p.detach().clone() for p in pl_module.factor_parameters()]
            self.best = {"value": value, "step": step, "factors": factors}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.best is None:
            return
        with torch.no_grad():
            for p, q in zip(pl_module.factor_parameters(), self.best["factors"]):
                p.copy_(q)
        log.info("restored the best held-out factors: %s = %.6g at step %d", self.monitor, self.best["value"],
                 self.best["step"])

    def report(self) -> dict[str, Any]:
        return {"best": ({"value": self.best["value"], "step": self.best["step"]} if self.best is not None else None),
                "validation_history": [{k: finite_or_none(v) for k, v in h.items()} for h in self.history]}
