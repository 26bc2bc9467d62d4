"""``IPSVDCallback``: Stage 1 of IProX inside a Lightning ``fit`` — compress the proxy before
alignment training starts, so the new factors are what the optimiser trains.

It acts in ``setup(stage="fit")``: after the datamodule's ``setup`` and before ``configure_model``,
strategy wrapping (DDP/FSDP) and ``configure_optimizers`` (Lightning's ``BaseFinetuning`` and
``ModelPruning`` change models at the same point). Steps:

1. ``pl_module.configure_model()`` if the module has one (contract: idempotent; it builds
   ``pl_module.proxy`` — and for ``ProxyAlignModule`` a frozen ``pl_module.teacher``);
2. the model ``getattr(pl_module, model_attr)`` (fallback ``pl_module.model``) is skipped if it
   already holds ``LowRankLinear`` layers (resumed / loaded proxy);
3. probes from ``trainer.datamodule.probe_dataloader()`` (fallback ``pl_module.probe_dataloader()``); with
   ``rank_weighting="influence"`` also the validation examples, ``trainer.datamodule.val_dataloader()`` (fallback
   ``pl_module.val_dataloader()``), for the influence weights of the rank allocation;
4. :func:`~iprox_lightning.compression.apply.compress` (with ``drop_blocks``: the least important blocks removed
   first) with :class:`~iprox_lightning.compression.apply.CompressionConfig` ``callback.config``, in place, on the
   strategy's root device, with the weights as the run holds them: the precision plugin's conversion is applied
   first (``bf16-true``: bfloat16 teacher and proxy; ``32-true`` and ``bf16-mixed`` keep float32 weights, the latter's
   master weights) and the teacher is moved to the device with the proxy (``ProxyAlignModule``'s proxy shares the
   teacher's tensors until it is compressed: no dense copy of the model is made);
   ``probe_group_layers = k``: the probes of ``k`` layers at a time (:mod:`~iprox_lightning.compression.schedule`);
5. the health check (the proxy against its teacher on a few alignment batches);
6. under a multi-process strategy (DDP, FSDP) every rank runs step 4 on the whole probe loader (read unsplit, so its
   factors are those of one process) and decomposes its share of the layers, largest first; the ranks gather each
   other's spectra, records and factors, so every rank starts bit-identical and holds the same report; rank 0 runs
   the health check and sends its result to the others; a failure on any rank stops every rank at once;
   per-layer rank / objective / time and the parameter counts go to the logger;
   with ``save_dir`` rank 0 writes the proxy directory (:func:`~iprox_lightning.compression.apply.save_proxy`).

The :class:`~iprox_lightning.compression.apply.CompressionReport` is kept as ``callback.report`` and
``pl_module.ipsvd_report``.
"""
from __future__ import annotations

import logging
from itertools import chain, islice
from typing import Any, Iterable, Optional, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..console import show_progress
from ..errors import UserInputError
from . import health
from .apply import (
    CompressionConfig,
    CompressionReport,
    compress,
    is_compressed,
    lowrank_layers,
    save_proxy,
)
from ..engine.settings import takes_settings
from .schedule import Exchange, StageOneFailed, TorchExchange

log = logging.getLogger(__name__)


# What the callback reads from the module and the datamodule it runs with, declared (each optional: the callback does
# without what is missing, or says what it needs).
@runtime_checkable
class TeacherHolder(Protocol):
    """A module that keeps the uncompressed target beside the proxy it trains (``ProxyAlignModule``): the health check
    compares the proxy with ``teacher``; ``aligns``: Stage 2 pairs proxy and teacher layers by path (so no block may
    be dropped)."""

    teacher: Optional[torch.nn.Module]

    @property
    def aligns(self) -> bool: ...


@runtime_checkable
class HasTokenizer(Protocol):
    """Saved beside the proxy with ``save_dir``."""

    tokenizer: Any


@runtime_checkable
class ProbeSource(Protocol):
    """The probe batches of Stage 1 (``SFTDataModule``; else the LightningModule may have them)."""

    def probe_dataloader(self) -> Iterable: ...


@runtime_checkable
class SplitSource(Protocol):
    """A datamodule with named splits (``SFTDataModule``): the health check reads a few ``align`` batches."""

    def dataloader(self, split: str) -> Iterable: ...


class IPSVDCallback(Callback):
    @takes_settings(CompressionConfig, "compression", positional=("sparsity",))
    def __init__(
        self,
        *,
        model_attr: str = "proxy",
        save_dir: Optional[str] = None,
        compress_on_device: bool = True,
        health_batches: int = 4,
        probe_group_layers: Optional[int] = None,
        compression: Optional[CompressionConfig] = None,
    ) -> None:
        """Stage 1 inside ``fit``: compress ``pl_module.<model_attr>`` in ``setup`` (module docstring).

        The compression settings (``sparsity``, ``method``, ... ``rank_weight_mix``) are the fields of
        :class:`~iprox_lightning.compression.apply.CompressionConfig`, given as keywords (YAML ``init_args``, the command line)
        or whole as ``compression=CompressionConfig(...)`` (:func:`~iprox_lightning.engine.settings.takes_settings`); the
        built config is ``self.config``.

        Args:
            model_attr: the LightningModule attribute holding the model to compress (fallback ``model``).
            save_dir: where rank 0 saves the compressed proxy right away (before any alignment).
            compress_on_device: move the model to the strategy's root device before compressing.
            health_batches: batches of the alignment split (data Stage 1 never saw) on which the proxy is compared
                with the uncompressed teacher right after compression (loss, KL, top-1 agreement; logged, kept in
                the report and the manifest, loud when KL > 1 nat/token); 0 disables the check.
            probe_group_layers: collect the probes of this many layers at a time (per process) instead of every
                layer in one pass: the probe columns held are one group's (``train.py plan`` counts them); the factors
                are the single pass's (:func:`~iprox_lightning.compression.apply.compress`). ``None``: one pass.
        """
        if probe_group_layers is not None and (isinstance(probe_group_layers, bool) or
                                               not isinstance(probe_group_layers, int) or probe_group_layers < 1):
            raise UserInputError(f"IPSVDCallback probe_group_layers must be an integer >= 1 or null (every layer in "
                                 f"one pass), got {probe_group_layers!r}")
        super().__init__()
        self.config = compression
        self.model_attr = model_attr
        self.save_dir = save_dir
        self.compress_on_device = compress_on_device
        self.health_batches = health_batches
        self.probe_group_layers = probe_group_layers
        self.report: CompressionReport | None = None

    # -------------------------------------------------------------------------------------------
    def _target(self, pl_module: pl.LightningModule) -> torch.nn.Module:
        model = getattr(pl_module, self.model_attr, None)
        if model is None:
            model = getattr(pl_module, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise AttributeError(
                f"IPSVDCallback: {type(pl_module).__name__} has no model in attribute {self.model_attr!r} "
                "(nor 'model'); build it in __init__ or configure_model(), or set model_attr"
            )
        return model

    @staticmethod
    def _probe_loader(trainer: pl.Trainer, pl_module: pl.LightningModule):
        for source in (trainer.datamodule, pl_module):
            if isinstance(source, ProbeSource):
                return source.probe_dataloader()
        raise AttributeError(
            "IPSVDCallback needs probe batches: give the datamodule (or the LightningModule) a "
            "probe_dataloader() method returning batches in the project's format"
        )

    @staticmethod
    def _validation_loader(trainer: pl.Trainer, pl_module: pl.LightningModule):
        """The validation batches of the influence weights (per task): the datamodule's, else the module's."""
        dm = trainer.datamodule
        owners = [o for o in (dm, pl_module) if o is not None and is_overridden("val_dataloader", o)]
        for owner in owners:
            loader = owner.val_dataloader()
            if isinstance(loader, (list, tuple)):  # Lightning allows several loaders: one stream of batches
                loader = list(chain.from_iterable(loader)) if loader else None
            if loader:
                return loader
        raise ValueError("IPSVDCallback(rank_weighting='influence') needs validation examples (the per-task validation "
                         "gradients): give the datamodule validation sets (SFTDataModule(validation=...)) or the "
                         "module a val_dataloader()")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        pl_module.configure_model()  # a LightningModule hook (idempotent): builds the proxy (and teacher)
        model = self._target(pl_module)
        if is_compressed(model):
            rank_zero_info(f"IPSVDCallback: {type(model).__name__} already holds "
                           f"{len(lowrank_layers(model))} LowRankLinear layers; skipping compression")
            return
        self._check_drop_blocks(pl_module)
        # the weights as the run holds them (bf16-true: bfloat16; the strategy converts again later, a no-op then)
        trainer.precision_plugin.convert_module(pl_module)
        if self.compress_on_device:
            model.to(trainer.strategy.root_device)
            teacher = pl_module.teacher if isinstance(pl_module, TeacherHolder) else None
            if teacher is not None:
                teacher.to(trainer.strategy.root_device)
        if _distributed(trainer):
            self.report = self._stage_one_sharded(trainer, pl_module, model)
        else:
            self.report = self._stage_one(trainer, pl_module, model)
        pl_module.ipsvd_report = self.report
        self._log(trainer)
        if self.save_dir and trainer.is_global_zero:
            tok = next((s.tokenizer for s in (pl_module, trainer.datamodule)
                        if isinstance(s, HasTokenizer) and s.tokenizer is not None), None)
            save_proxy(model, tok, self.save_dir, self.report)
        trainer.strategy.barrier("ipsvd")

    def _stage_one(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: torch.nn.Module,
                   exchange: Optional[Exchange] = None) -> CompressionReport:
        """Stage 1 in this process: probes, factors (``compress``; ``exchange``: this rank's share), its summary line,
        then (one process) the health check."""
        try:
            loader = self._probe_loader(trainer, pl_module)
        except AttributeError:
            if self.config.method == "ipsvd":
                raise
            loader = None  # svd / random need no probes (the report then has no objective)

        validation = (self._validation_loader(trainer, pl_module) if self.config.rank_weighting == "influence"
                      else None)
        report = compress(model, loader, self.config, progress=show_progress(trainer), val_dataloader=validation,
                          probe_group_layers=self.probe_group_layers, exchange=exchange)
        rank_zero_info(f"IPSVDCallback: {report.summary()}")
        if exchange is None:
            self._health(trainer, pl_module, model, report)
        return report

    def _stage_one_sharded(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: torch.nn.Module
                           ) -> CompressionReport:
        """Stage 1 under a multi-process strategy: every rank runs ``compress`` on the whole probe loader with a
        :class:`~iprox_lightning.compression.schedule.TorchExchange` (its share of the decompositions; the others'
        spectra, records and factors gathered), then rank 0's health check goes to every rank. A failure on any rank
        is sent to the others, which raise at once instead of waiting for the process group's timeout."""
        exchange = TorchExchange(trainer.strategy.root_device)
        try:
            report = self._stage_one(trainer, pl_module, model, exchange)
        except BaseException as e:  # noqa: BLE001 (re-raised: the other ranks told first)
            exchange.fail(e)
            raise
        health, failure = None, None
        if trainer.is_global_zero:
            try:
                self._health(trainer, pl_module, model, report)
                health = report.health
            except BaseException as e:  # noqa: BLE001 (re-raised below, once the other ranks are told)
                failure = e
        sent = trainer.strategy.broadcast(
            {"health": health, "failure": None if failure is None else f"{type(failure).__name__}: {failure}"}, src=0)
        if failure is not None:
            raise failure
        if sent["failure"] is not None:
            raise StageOneFailed(f"IPSVDCallback: the health check failed on rank 0 ({sent['failure']})")
        report.health = sent["health"]
        return report

    def _check_drop_blocks(self, pl_module: pl.LightningModule) -> None:
        """Stage 2 pairs each proxy layer with the teacher layer of the same path; with blocks dropped the proxy's
        blocks are renumbered (its block 2 may be the teacher's block 3), so alignment would compare the wrong
        layers. Refuse that pairing before compressing; the IPSVD-only proxy (``align: false``) is fine."""
        if not self.config.drop_blocks or not isinstance(pl_module, TeacherHolder) or pl_module.teacher is None:
            return
        if pl_module.aligns:
            raise ValueError(
                f"IPSVDCallback(drop_blocks={self.config.drop_blocks}): {type(pl_module).__name__} aligns the proxy "
                "with the target layer by layer path, but dropping blocks renumbers the proxy's blocks, so block i of "
                "the proxy would be aligned with block i of the target; build this proxy without alignment "
                "(align: false) or set drop_blocks: 0")

    def _health(self, trainer: pl.Trainer, pl_module: pl.LightningModule, model: torch.nn.Module,
                report: CompressionReport) -> None:
        teacher = pl_module.teacher if isinstance(pl_module, TeacherHolder) else None
        dm = trainer.datamodule
        if not self.health_batches or teacher is None or not isinstance(dm, SplitSource):
            return

        try:
            batches = list(islice(iter(dm.dataloader("align")), self.health_batches))
        except (KeyError, ValueError) as e:  # a datamodule without an alignment split
            log.info("IPSVDCallback: no health check (%s)", e)
            return
        h = health.proxy_health(teacher, model, batches)  # (looked up on call: tests replace it)
        h["batches"] = len(batches)
        report.health = h
        aligning = pl_module.aligns
        warn, msg = health_message(h, allocation=report.allocation, mode=report.mode, aligning=aligning)
        if warn:
            log.warning("%s", msg)
        else:
            rank_zero_info(msg)

    def _log(self, trainer: pl.Trainer) -> None:
        if trainer.logger is None or self.report is None or not trainer.is_global_zero:
            return
        rep = self.report
        metrics = {
            "ipsvd/params_before": float(rep.params_before),
            "ipsvd/params_after": float(rep.params_after),
            "ipsvd/params_requested": float(rep.params_requested),
            "ipsvd/achieved_sparsity": rep.achieved_sparsity,
            "ipsvd/time_probes_s": rep.time_probes_s,
            "ipsvd/time_factors_s": rep.time_factors_s,
        }
        if rep.block_drop is not None:
            metrics["ipsvd/blocks_dropped"] = float(len(rep.block_drop.dropped))
        for k, v in (rep.health or {}).items():
            metrics[f"ipsvd/health/{k}"] = float(v)
        if rep.rank_weighting is not None:
            metrics["ipsvd/rank_weighting_time_s"] = rep.rank_weighting.time_s
            metrics.update({f"ipsvd/rank_weight/{n}": w for n, w in rep.rank_weighting.weights.items()})
        for lr in rep.layers:
            metrics[f"ipsvd/rank/{lr.name}"] = float(lr.rank if lr.rank is not None else min(lr.in_features, lr.out_features))
            if lr.objective is not None:
                metrics[f"ipsvd/objective/{lr.name}"] = lr.objective
                metrics[f"ipsvd/relative_objective/{lr.name}"] = lr.relative_objective
            metrics[f"ipsvd/time_s/{lr.name}"] = lr.time_s
        trainer.logger.log_metrics(metrics, step=0)


def _distributed(trainer: pl.Trainer) -> bool:
    """A multi-process run whose process group is up (Lightning starts it before the ``setup`` hooks)."""
    return (trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized())


HEALTH_KL = 1.0  # nat/token on held-out examples: above it the Stage-1 proxy has lost much of the target's function


def health_message(h: dict, *, allocation: str | None, mode: str | None, aligning: bool) -> tuple[bool, str]:
    """``(warn?, text)`` of Stage 1's health line. Above :data:`HEALTH_KL` without Stage 2 to follow it is a warning
    whose advice names only the settings not already in use; with Stage 2 next it is information (Stage 1 leaves
    ~2 nat/token at ρ = 0.5 with the shipped settings, and Stage 2 is what aligns the proxy: not a problem to warn of
    on the happy path)."""
    msg = (f"IPSVDCallback: proxy health on {h['examples']} held-out examples: loss {h['proxy_loss']:.3f} "
           f"(target {h['target_loss']:.3f}), KL {h['kl']:.3f} nat/token, top-1 agreement {h['top1_agreement']:.3f}")
    if h["kl"] <= HEALTH_KL:
        return False, msg
    if aligning:
        return False, msg + " (Stage 2 aligns the proxy next)"
    tips = [t for t, used in (("allocation='global'", allocation == "global"), ("mode='exact'", mode == "exact"))
            if not used] + ["keep_dense for fragile layers", "a lower sparsity", "alignment (align: true)"]
    return True, (f"{msg} — the proxy has lost much of the target's function and no alignment follows; its gradients "
                  f"will follow the target's poorly (try {', '.join(tips[:-1])} or {tips[-1]})")
