"""``RankingFidelity``: does the proxy rank the pool like its target? Measured during Stage 2 on held-out pool examples.

What the proxy is for is ranking the pool like the target, which the held-out alignment loss need not follow. At the
start of ``fit`` the callback takes the datamodule's ``fidelity`` split (``datamodule.fidelity_dataloader(n)``: ``n``
seeded pool examples in no warm-up / probe / align split) and scores it once with the frozen target against the
datamodule's ``val_dataloader()``; after every validation run (and at step 0, through
:class:`~iprox_lightning.callbacks.keep_best.KeepBestFactors`) the current proxy scores the same examples the same
way, and the callback logs ``val/fidelity_spearman`` (Spearman of proxy vs target scores; NaN if a score is not
finite) and ``val/fidelity_loss = 1 − val/fidelity_spearman`` (lower is better: a ``keep_best`` monitor). Under
DDP/FSDP2 every rank runs the check identically on the full (unsharded) data — under FSDP2 the forwards are
collectives, so every rank must — and rank 0's Spearman is broadcast.

Contract — what it reads: ``trainer.datamodule.fidelity_dataloader(n)`` / ``.val_dataloader()``;
``pl_module.teacher``, ``pl_module.proxy``, ``pl_module.factors_finite()`` (``False`` → NaN, no scoring),
``pl_module.reshard()`` (FSDP2: free the gathered parameters after a scoring pass). What it takes: a
``scorer(model, loader, validation_batches, progress=False)`` returning a table with ``ids``, ``scores`` and
``settings`` (the product's :func:`~iprox_lightning.scoring.influence.tracin_scores`; passed in, not imported: Stage 2
does not depend on the scoring stage). What it returns: :meth:`step0_metrics` (the two metrics, for step 0) and
:meth:`report` (the manifest's ``"fidelity"`` record).
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from scipy.stats import spearmanr

from ..errors import UserInputError
from .keep_best import finite_or_none

log = logging.getLogger(__name__)

FIDELITY_SPEARMAN = "val/fidelity_spearman"
FIDELITY_LOSS = "val/fidelity_loss"


class RankingFidelity(Callback):
    """Spearman of the proxy's scores of ``examples`` held-out pool examples with the target's.

    Args:
        examples: ``n > 0``, the size of the datamodule's ``fidelity`` split.
        scorer: ``scorer(model, loader, validation_batches, progress=False) -> table`` (``ids``, ``scores``,
            ``settings``).
        description: how the scores are made, for the manifest.
    """

    def __init__(self, examples: int, scorer: Callable[..., Any], description: str = "") -> None:
        if examples <= 0:
            raise ValueError(f"RankingFidelity needs examples > 0, got {examples}")
        self.examples = examples
        self.scorer = scorer
        self.description = description
        self.history: list[dict[str, Any]] = []  # {"step", "spearman"}
        self._state: Optional[dict[str, Any]] = None  # {"loader", "val", "ids", "target", "validation_examples"}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._state = None  # the fidelity examples and the target's scores: taken anew by each fit

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for name, value in self.step0_metrics(trainer, pl_module).items():
            pl_module.log(name, value, sync_dist=True)  # identical on every rank (broadcast)

    def step0_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """The check now: ``{val/fidelity_spearman, val/fidelity_loss}`` (also recorded in :attr:`history`)."""
        rho = self.spearman(trainer, pl_module)
        # as logged (float32), so the history equals the held-out record's val/fidelity_spearman
        self.history.append({"step": int(trainer.global_step), "spearman": float(np.float32(rho))})
        return {FIDELITY_SPEARMAN: rho, FIDELITY_LOSS: 1.0 - rho}

    def spearman(self, trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> float:
        """Spearman of the current proxy's scores of the fidelity examples with the target's; NaN when a proxy
        factor or score is not finite. Rank 0's value on every rank."""
        state = self._target_state(trainer, pl_module)
        rho = float("nan")
        if pl_module.factors_finite():
            table = self._score(pl_module, pl_module.proxy, state)
            if list(table.ids) != state["ids"]:
                raise RuntimeError("fidelity check: the proxy scored other examples than the target")
            if np.all(np.isfinite(table.scores)):
                rho = float(spearmanr(table.scores, state["target"]).statistic)
        if trainer is not None:
            rho = float(trainer.strategy.broadcast(rho, src=0))
        return rho

    def _score(self, pl_module: pl.LightningModule, model, state: dict[str, Any]):
        val = state["val"]
        val_batches = itertools.chain.from_iterable(val) if isinstance(val, (list, tuple)) else val
        try:
            return self.scorer(model, state["loader"], val_batches, progress=False)
        finally:
            pl_module.reshard()

    def _target_state(self, trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> dict[str, Any]:
        """The fidelity examples and the target's scores of them (computed once per fit)."""
        if self._state is None:
            n = self.examples
            dm = trainer.datamodule if trainer is not None else None
            if dm is None or not hasattr(dm, "fidelity_dataloader") or not hasattr(dm, "val_dataloader"):
                raise UserInputError(f"ProxyAlignModule(fidelity_examples={n}) needs a datamodule with "
                                     "fidelity_dataloader(n) and val_dataloader() (SFTDataModule)")
            loader, val = dm.fidelity_dataloader(n), dm.val_dataloader()
            if val is None or (isinstance(val, (list, tuple)) and not val):
                raise UserInputError(f"ProxyAlignModule(fidelity_examples={n}) needs validation examples: the datamodule "
                                     "has no validation loader")
            state = {"loader": loader, "val": val}
            target = self._score(pl_module, pl_module.teacher, state)
            if not np.all(np.isfinite(target.scores)):
                raise ValueError("the target's TracIn scores of the fidelity examples are not finite")
            self._state = {**state, "ids": list(target.ids), "target": target.scores,
                           "validation_examples": int(target.settings.get("val_examples", 0))}
            log.info("fidelity check: %d held-out pool examples against %d validation examples",
                     len(target.ids), self._state["validation_examples"])
        return self._state

    def report(self) -> dict[str, Any]:
        """The manifest's record of the check."""
        state = self._state or {}
        return {"examples": len(state.get("ids", [])), "validation_examples": state.get("validation_examples"),
                "scores": self.description, "ids": state.get("ids", []),
                "history": [{"step": h["step"], "spearman": finite_or_none(h["spearman"])} for h in self.history]}
