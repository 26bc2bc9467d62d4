"""``RankingFidelity``: does the proxy rank the pool like its target? Measured during Stage 2 on held-out pool examples.

What the proxy is for is ranking the pool like the target, which the held-out alignment loss need not follow. At the
start of ``fit`` the callback takes the datamodule's ``fidelity`` split (``datamodule.fidelity_dataloader(n)``: ``n``
seeded pool examples in no warm-up / probe / align split) and scores it once with the frozen target against the
datamodule's ``val_dataloader()``; after every validation run (and at step 0, through
:class:`~iprox_lightning.alignment.keep_best.KeepBestFactors`) the current proxy scores the same examples the same
way, and the callback logs ``val/fidelity_spearman`` (Spearman of proxy vs target scores; NaN if a score is not
finite) and ``val/fidelity_loss = 1 − val/fidelity_spearman`` (lower is better: a ``keep_best`` monitor). Under
DDP/FSDP2 every rank runs the check identically on the full (unsharded) data — under FSDP2 the forwards are
collectives, so every rank must — and rank 0's Spearman is broadcast.

``per_task=True`` (``ProxyAlignModule(fidelity_per_task=True)``): a proxy is used one target task at a time, and a
pooled Spearman can hold while one task's ranking is lost. The same scoring pass then also gives each validation
task's scores (the table's ``task_names`` / ``task_scores``: the cosine with that task's mean validation gradient),
and the callback logs, besides the pooled metrics, ``val/fidelity_<task>`` (Spearman of the proxy's vs the target's
scores against that task), ``val/fidelity_worst`` (their minimum; NaN if any is NaN) and
``val/fidelity_worst_loss = 1 − val/fidelity_worst`` (lower is better: the ``keep_best`` monitor that keeps the factors
whose worst task ranks best). The math: :func:`per_task_spearman`, :func:`worst_task_rho`.

Contract — what it reads: ``trainer.datamodule.fidelity_dataloader(n)`` / ``.val_dataloader()``;
``pl_module.teacher``, ``pl_module.proxy``, ``pl_module.factors_finite()`` (``False`` → NaN, no scoring),
``pl_module.reshard()`` (FSDP2: free the gathered parameters after a scoring pass). What it takes: a
``scorer(model, loader, validation_batches, progress=False)`` (with ``target_validation`` the proxy's call adds
``validation_model=pl_module.teacher``) returning a table with ``ids``, ``scores`` and ``settings`` (the product's :func:`~iprox_lightning.scoring.influence.tracin_scores`; passed in, not imported: Stage 2
does not depend on the scoring stage). What it returns: :meth:`step0_metrics` (the two metrics, for step 0) and
:meth:`report` (the manifest's ``"fidelity"`` record).
"""
from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterable, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.callbacks import Callback
from scipy.stats import spearmanr

from ..errors import UserInputError
from .keep_best import finite_or_none

log = logging.getLogger(__name__)


@runtime_checkable
class FidelityData(Protocol):
    """What the check reads from the datamodule (``SFTDataModule``): ``n`` held-out pool examples and the validation
    sets the scores are taken against."""

    def fidelity_dataloader(self, n: int) -> Iterable: ...

    def val_dataloader(self) -> Any: ...

FIDELITY_SPEARMAN = "val/fidelity_spearman"
FIDELITY_LOSS = "val/fidelity_loss"
FIDELITY_WORST = "val/fidelity_worst"
FIDELITY_WORST_LOSS = "val/fidelity_worst_loss"
FIDELITY_TASK = "val/fidelity_{}"  # per task (per_task=True)
_RESERVED = ("spearman", "loss", "worst", "worst_loss")  # task names that would collide with the metrics above


def per_task_spearman(proxy_scores: np.ndarray, target_scores: np.ndarray, task_names: list[str]) -> dict[str, float]:
    """``{task: Spearman(proxy_scores[:, k], target_scores[:, k])}`` (``[N, K]`` score columns, one per task, the
    same examples in the same order); NaN for a task whose proxy scores are not all finite."""
    proxy_scores, target_scores = np.asarray(proxy_scores, np.float64), np.asarray(target_scores, np.float64)
    out = {}
    for k, task in enumerate(task_names):
        p = proxy_scores[:, k]
        out[task] = float(spearmanr(p, target_scores[:, k]).statistic) if np.all(np.isfinite(p)) else float("nan")
    return out


def worst_task_rho(rhos: dict[str, float]) -> float:
    """The minimum over tasks of ``rhos`` (NaN when any task's value is NaN: a task that cannot be judged is never
    counted as served)."""
    values = np.asarray(list(rhos.values()), np.float64)
    return float("nan") if values.size == 0 or not np.all(np.isfinite(values)) else float(values.min())


class RankingFidelity(Callback):
    """Spearman of the proxy's scores of ``examples`` held-out pool examples with the target's.

    Args:
        examples: ``n > 0``, the size of the datamodule's ``fidelity`` split.
        scorer: ``scorer(model, loader, validation_batches, progress=False) -> table`` (``ids``, ``scores``,
            ``settings``).
        description: how the scores are made, for the manifest.
        per_task: also the Spearman per validation task and its minimum (module docstring); the scorer's table must
            then hold ``task_names`` and ``task_scores``.
        target_validation: score the proxy against the target's validation gradients (the scorer is called with
            ``validation_model=pl_module.teacher``, as the product's TracIn takes it), how ``pipeline`` scores a proxy
            by default; ``False``: against its own.
    """

    def __init__(self, examples: int, scorer: Callable[..., Any], description: str = "", per_task: bool = False,
                 target_validation: bool = False) -> None:
        if examples <= 0:
            raise ValueError(f"RankingFidelity needs examples > 0, got {examples}")
        self.examples = examples
        self.scorer = scorer
        self.description = description
        self.per_task = per_task
        self.target_validation = target_validation
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
        """The check now: ``{val/fidelity_spearman, val/fidelity_loss}`` and, with ``per_task``,
        ``val/fidelity_<task>``, ``val/fidelity_worst``, ``val/fidelity_worst_loss`` (also recorded in
        :attr:`history`)."""
        rho, tasks = self.spearmans(trainer, pl_module)
        # as logged (float32), so the history equals the held-out record's val/fidelity_spearman
        entry: dict[str, Any] = {"step": int(trainer.global_step), "spearman": float(np.float32(rho))}
        metrics = {FIDELITY_SPEARMAN: rho, FIDELITY_LOSS: 1.0 - rho}
        if self.per_task:
            worst = worst_task_rho(tasks)
            entry.update(tasks={t: float(np.float32(v)) for t, v in tasks.items()}, worst=float(np.float32(worst)))
            metrics.update({FIDELITY_TASK.format(t): v for t, v in tasks.items()})
            metrics.update({FIDELITY_WORST: worst, FIDELITY_WORST_LOSS: 1.0 - worst})
        self.history.append(entry)
        return metrics

    def spearman(self, trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> float:
        """Spearman of the current proxy's scores of the fidelity examples with the target's; NaN when a proxy
        factor or score is not finite. Rank 0's value on every rank."""
        return self.spearmans(trainer, pl_module)[0]

    def spearmans(self, trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> tuple[float, dict[str, float]]:
        """``(pooled Spearman, {task: Spearman})`` of the current proxy (the per-task dict empty unless ``per_task``);
        NaN where a proxy factor or score is not finite. Rank 0's values on every rank."""
        state = self._target_state(trainer, pl_module)
        rho = float("nan")
        tasks = {t: float("nan") for t in state.get("task_names", [])}
        if pl_module.factors_finite():
            table = self._score(pl_module, pl_module.proxy, state, pl_module.teacher if self.target_validation else None)
            if list(table.ids) != state["ids"]:
                raise RuntimeError("fidelity check: the proxy scored other examples than the target")
            if np.all(np.isfinite(table.scores)):
                rho = float(spearmanr(table.scores, state["target"]).statistic)
            if self.per_task:
                if list(table.task_names) != state["task_names"]:
                    raise RuntimeError(f"fidelity check: the proxy was scored against tasks {list(table.task_names)}, "
                                       f"the target against {state['task_names']}")
                tasks = per_task_spearman(table.task_scores, state["target_tasks"], state["task_names"])
        if trainer is not None:
            rho, tasks = trainer.strategy.broadcast((rho, tasks), src=0)
        return float(rho), dict(tasks)

    def _score(self, pl_module: pl.LightningModule, model, state: dict[str, Any], validation_model=None):
        val = state["val"]
        val_batches = itertools.chain.from_iterable(val) if isinstance(val, (list, tuple)) else val
        extra = {} if validation_model is None else {"validation_model": validation_model}
        try:
            return self.scorer(model, state["loader"], val_batches, progress=False, **extra)
        finally:
            pl_module.reshard()

    def _target_state(self, trainer: Optional[pl.Trainer], pl_module: pl.LightningModule) -> dict[str, Any]:
        """The fidelity examples and the target's scores of them (computed once per fit)."""
        if self._state is None:
            n = self.examples
            dm = trainer.datamodule if trainer is not None else None
            if not isinstance(dm, FidelityData):
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
            if self.per_task:
                self._state.update(self._target_tasks(target))
            log.info("fidelity check: %d held-out pool examples against %d validation examples",
                     len(target.ids), self._state["validation_examples"])
        return self._state

    def _target_tasks(self, target) -> dict[str, Any]:
        """The target's per-task scores (``per_task``), checked: a task per column, finite, no reserved name."""
        names = list(getattr(target, "task_names", None) or [])
        scores = getattr(target, "task_scores", None)
        if not names or scores is None:
            raise ValueError("fidelity_per_task needs per-task scores: the fidelity scorer's table has no task_names / "
                             "task_scores (the default TracIn scorer has them)")
        clash = [t for t in names if t in _RESERVED]
        if clash:
            raise ValueError(f"fidelity_per_task: validation task name(s) {clash} would collide with the metrics "
                             f"val/fidelity_{{{', '.join(_RESERVED)}}}; rename the task(s)")
        scores = np.asarray(scores, np.float64)
        if not np.all(np.isfinite(scores)):
            raise ValueError("the target's per-task TracIn scores of the fidelity examples are not finite")
        return {"task_names": names, "target_tasks": scores}

    def report(self) -> dict[str, Any]:
        """The manifest's record of the check."""
        state = self._state or {}
        history = []
        for h in self.history:
            entry = {"step": h["step"], "spearman": finite_or_none(h["spearman"])}
            if "tasks" in h:
                entry.update(tasks={t: finite_or_none(v) for t, v in h["tasks"].items()},
                             worst=finite_or_none(h["worst"]))
            history.append(entry)
        out = {"examples": len(state.get("ids", [])), "validation_examples": state.get("validation_examples"),
               "scores": self.description, "ids": state.get("ids", []), "history": history}
        if self.per_task:
            out["tasks"] = state.get("task_names", [])
        if self.target_validation:  # only when on: earlier manifests keep their form
            out["proxy_validation"] = "target"
        return out
