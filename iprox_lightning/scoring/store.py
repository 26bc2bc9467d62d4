"""Building a gradient store as a Lightning predict loop: ``GradientStoreModule`` (projected gradients of each batch,
:class:`~.projection.GradientProjector`) and ``GradientStoreWriter`` (per-rank safetensors shards,
:mod:`iprox_lightning.io.gradient_store`). Under DDP each rank projects its share of the pool and writes its own
shards; the metric's factors are fitted with all-reduced statistics and saved once. Under ``ModelParallelStrategy``
(FSDP2, ``build_store --strategy fsdp``) the model is sharded per decoder block as the scorer's is
(:func:`~iprox_lightning.engine.fsdp.apply_fully_shard`: the hooks take activations and their gradients, never a
parameter), and every rank makes the same steps (each forward gathers the blocks from every rank): a rank with a
batch fewer, or a batch of only resumed rows or none with a response token, makes an idle step.
``python train.py build_store`` (:mod:`iprox_lightning.commands.build_store`) runs it.

Resume: the writer compares the directory's fingerprint with this run's (a mismatch stops naming what differs), moves
unreadable shards aside, reloads the saved projections and factors, and hands the ids already stored to the module,
which skips them: a killed build continues and every example is stored once.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
from torch import nn

from ..console import show_progress
from ..engine.batch import to_device
from ..engine.checkpointing import checkpointed_blocks
from ..engine.fsdp import is_sharded, shard_frozen_per_block
from ..engine.model_modes import eval_mode
from ..engine.settings import takes_settings
from ..engine.tracking import backward_pairs
from ..errors import UserInputError
from ..io import gradient_store as gs
from ..io.factors import copy_factors
from ..io.fingerprint import loader_digest, model_identity
from ..io.score_dir import ScoreDirLock
from ..models.loading import load_model
from ..models.lora import ADAPTER_GRADIENTS, scores_adapters
from .config import STORE_FIELDS, ScoringConfig
from .features import has_response_tokens, tracked_modules, trim_batch, virtual_linears
from .layer_shards import idle_batch
from .less import attach_optimizer_state
from .metrics import fit_or_load
from .module import check_predict_examples
from .projection import GradientProjector, LayerProjection, make_projections, pca_projections
from .shard_writer import BufferedShardWriter

log = logging.getLogger(__name__)

PROJECTIONS = ("gaussian", "pca")
BASIS = "weight"
"""``store.json`` ``fingerprint.settings.basis`` of a K-FAC / EK-FAC store: its vectors project the whitened gradient
in the weights' own coordinates (:mod:`.projection`; stores without it projected in the factors' eigenbases, which a
query no longer reproduces)."""


class GradientStoreModule(L.LightningModule):
    """Projected per-example gradients of the pool (see :mod:`.projection`).

    The metric's settings (``method``, ``damping``, ``damping_mode``, ``kfac_examples``: with ``projection="pca"``
    also the second moments' examples, ``loss_reduction``, ``fisher``, ``damping_target``, ``options``) and
    ``target_patterns`` are :class:`~.influence.ScoringConfig` fields (:data:`STORE_FIELDS`), given as keywords or
    whole as ``scoring=ScoringConfig(...)``; the built config is ``self.config``. The precision is the Trainer's
    (``trainer.precision``), recorded in the store's settings so that ``query`` computes the validation gradients
    under the same one.

    Args:
        model: ``"builtin"``, a hub id, a local directory, a ``.gguf`` file, a saved proxy directory, or an ``nn.Module``.
        k: projection rows per side of each tracked weight (``k_out·k_in`` numbers per weight; a side with ``k >= its
            dimension`` is not projected, so a large ``k`` stores exact gradients).
        seed: seed of the projections.
        kfac_split: data-module split the factors are fitted on.
        projection: ``"gaussian"`` (seeded ``N(0, 1/k)`` rows: unbiased inner products, sampling noise) or ``"pca"``
            (the ``k`` leading eigenvectors of each layer's input and output-gradient second moments, fitted on
            ``kfac_examples`` of ``kfac_split``: the ``k × k`` block of largest energy, no noise; TracIn only —
            K-FAC / EK-FAC up-weight exactly the directions it drops). Saved in the store either way.
        dtype: model dtype when loading.
        attn_implementation: attention kernel when loading.
        factors_dir: a directory of saved factors shared with other runs (a scoring run's ``factors_dir``, other
            stores'): factors (or PCA moments) fitted there before on the same model, factor data and fit settings
            are loaded instead of fitted, new ones are saved there; the store keeps a copy of the file it used, so a
            query needs nothing but the store. ``None``: the store's own directory.
        gradient_checkpointing: activation checkpointing of each decoder block in the projection passes and the
            factors' fit (:mod:`~iprox_lightning.engine.checkpointing`): the forward keeps each block's input, the backward
            recomputes one block at a time. The same vectors (not part of the store's fingerprint); the tracked
            layers' inputs are kept either way.
    """

    @takes_settings(ScoringConfig, "scoring", fields=STORE_FIELDS)
    def __init__(self, model: Union[str, nn.Module] = "builtin", k: int = 16, seed: int = 0, *,
                 kfac_split: str = "pool", dtype: str = "float32", attn_implementation: Optional[str] = "sdpa",
                 projection: str = "gaussian", factors_dir: Optional[str] = None,
                 gradient_checkpointing: bool = False, scoring: Optional[ScoringConfig] = None) -> None:
        # not super(): the hyper-parameters are given whole (ProxyAlignModule.__init__ says why)
        L.LightningModule.__init__(self)
        if k < 1:
            raise UserInputError(f"GradientStoreModule: k (projection size) must be >= 1, got {k}")
        if projection not in PROJECTIONS:
            raise UserInputError(f"GradientStoreModule: projection must be one of {PROJECTIONS}, got {projection!r}")
        if projection == "pca" and scoring.method != "tracin":
            raise UserInputError(f"GradientStoreModule: projection='pca' keeps each layer's largest-variance "
                                 f"directions, which {scoring.method} down-weights; use it with method='tracin' (or "
                                 "projection='gaussian')")
        self.config = scoring
        self.metric = scoring.build_metric()
        hparams = {} if isinstance(model, nn.Module) else {"model": model}
        hparams.update(k=k, seed=seed, kfac_split=kfac_split, dtype=dtype, attn_implementation=attn_implementation,
                       projection=projection, factors_dir=factors_dir, **scoring.to_dict())
        if gradient_checkpointing:  # (hyper-parameters as before the option when it is off)
            hparams["gradient_checkpointing"] = True
        self.save_hyperparameters(hparams)
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.net: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.projector: GradientProjector | None = None
        self.skip_ids: set[str] = set()
        self.stats: dict[str, Any] = {}
        self._identity: Any = None  # the whole weights' identity, taken before sharding
        self._steps = self._max_steps = 0  # under FSDP2: this rank's steps, and the most any rank makes
        self._last: dict | None = None  # the last batch seen (a batch for the idle steps)

    def configure_model(self) -> None:
        """Load the model (idempotent); under ``ModelParallelStrategy`` (FSDP2) shard it per decoder block as
        :meth:`~.module.InfluenceScoringModule.configure_model` does."""
        if self.net is None:
            hp = self.hparams
            self.net, _ = load_model(hp.model, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                                     tokenizer=False, merge_adapters=False)
            self.net.eval()
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not is_sharded(self.net):
            self._identity = self.model_identity()  # (of the whole weights: a shard hashes as its shape only)
            shard_frozen_per_block(self.net, mesh)

    def model_identity(self) -> Any:
        if self._identity is not None:
            return self._identity
        if self.net is None and not (isinstance(self.hparams.get("model"), str) and Path(self.hparams.model).exists()):
            self.configure_model()
        return model_identity(self.hparams.get("model", self.net), self.net)

    def settings(self) -> dict:
        """What the vectors depend on besides the model and the pool (the store's fingerprinted settings)."""
        hp, patterns = self.hparams, self.config.target_patterns
        out = {"k": hp.k, "seed": hp.seed, "method": self.metric.name, **self.metric.settings(),
               "kfac_split": hp.kfac_split if self.metric.needs_factor_data else None,
               "target_patterns": None if patterns is None else list(patterns), "dtype": hp.dtype}
        if self.metric.needs_factor_data:  # projected in the weights' coordinates (:mod:`.projection`)
            out["basis"] = BASIS

        if scores_adapters(hp.get("model", self.net)):  # a peft adapter: its adapters' gradients
            out.update(ADAPTER_GRADIENTS)
        if hp.projection == "pca":  # (a gaussian store's fingerprint is as before the option)
            out.update(projection="pca", kfac_examples=self.config.kfac_examples, kfac_split=hp.kfac_split)
        precision = str(self.trainer.precision) if self._trainer is not None else None
        if precision not in (None, "32-true"):  # (a float32 store's fingerprint is as before the option)
            out["precision"] = precision  # the query computes its validation gradients under the same one
        return out

    def provenance(self) -> dict:
        """``{"fingerprint": {model, settings, pool}, "pool": records provenance, "data": dropped report}``."""
        fp: dict[str, Any] = {"model": self.model_identity(), "settings": self.settings()}
        loaders = self.trainer.predict_dataloaders if self._trainer is not None else None
        if loaders is not None:
            loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
            fp["pool"] = loader_digest(loaders[0], iterate=False)
        out: dict[str, Any] = {"fingerprint": fp}
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "pool_provenance"):
            out["pool"] = dm.pool_provenance()
        if dm is not None and hasattr(dm, "dropped_report"):
            out["data"] = dm.dropped_report(("pool",))
        return out

    def prepare(self, store_dir: str | None = None, *, save: bool = True) -> None:
        """Fit (or load from ``store_dir``) the metric and build (or load) the projections. Idempotent."""
        if self.projector is not None:
            return
        if self.net is None:
            self.configure_model()

        hp, patterns = self.hparams, self.config.target_patterns
        modules = tracked_modules(self.net, None if patterns is None else list(patterns))
        linears = virtual_linears(modules)
        projections = None
        if store_dir is not None and (Path(store_dir) / gs.PROJECTION_FILE).exists():
            loaded = gs.load_projections(store_dir)
            projections = {v.key: LayerProjection(v.key, v.out_features, v.in_features, *loaded.get(v.key, (None, None)))
                           for v in linears}
        p = next(self.net.parameters())
        dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
        if self.metric.needs_factor_data:
            self.stats.update(self._fit_factors(self.metric, modules, linears, store_dir, dtype, save))
        elif not self.metric.fitted:  # fitted on no data (LESS: the checkpoint's optimiser state, read from the model)
            attach_optimizer_state(self.metric, hp.get("model", self.net))
            self.stats.update(self.metric.fit(self.net, modules, [v.key for v in linears], None, dtype=dtype))
        if projections is None and hp.projection == "pca":
            c = self.config  # the second moments of K-FAC's first pass, on the store's examples and loss
            moments = ScoringConfig(method="kfac", damping=c.damping, damping_mode=c.damping_mode,
                                    kfac_examples=c.kfac_examples, loss_reduction=c.loss_reduction,
                                    kfac_dtype=c.kfac_dtype, kfac_partitions=c.kfac_partitions,
                                    kfac_offload=c.kfac_offload).build_metric()
            # the moments only make the projections, which the store saves: they are not kept in the store (as
            # large as K-FAC factors), only in a shared factors_dir, where other stores and scoring runs reuse them
            st = self._fit_factors(moments, modules, linears, None, dtype, save)
            self.stats.update({("pca_moments" if k == "factors" else k): v for k, v in st.items()})
            projections = self._same_on_every_rank(pca_projections(linears, hp.k, moments.eigens))
        elif projections is None:
            projections = make_projections(linears, hp.k, hp.seed)
        self.projector = GradientProjector(self.net, metric=self.metric if self.metric.name != "tracin" else None,
                                           target_patterns=patterns, projections=projections, dtype=dtype,
                                           loss_reduction=self.metric.loss_reduction)

    def _fit_factors(self, metric, modules, linears, store_dir: str | None, dtype: torch.dtype, save: bool) -> dict:
        """Fit ``metric``'s factors on ``kfac_split`` (all-reduced under DDP), or load the ones saved for the same
        model and data in the shared ``factors_dir`` or ``store_dir``, and keep a copy in ``store_dir``; returns the
        fit statistics. ``store_dir=None``: only the shared directory, if any, saves them."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or not hasattr(dm, "dataloader"):
            raise RuntimeError(f"method={self.metric.name!r} / projection={self.hparams.projection!r} "
                               "needs a data module with dataloader(split) for its factors")

        hp = self.hparams
        fac = dm.dataloader(hp.kfac_split)
        world = self.trainer.world_size
        strategy = self.trainer.strategy
        reduce = (lambda t: strategy.reduce(t, reduce_op="sum")) if world > 1 else None
        shared = hp.get("factors_dir")
        if shared and store_dir is not None and save:  # a resumed store's own copy serves a shared dir that lost it
            own = gs.read_info(store_dir, required=False).get("factors")
            if own and (Path(store_dir) / own).exists():
                copy_factors(Path(store_dir) / own, shared)

        with torch.inference_mode(False), torch.enable_grad(), checkpointed_blocks(
                self.net, enabled=bool(hp.get("gradient_checkpointing"))):
            stats = fit_or_load(
                metric, self.net, modules, [v.key for v in linears], fac, factors_dir=shared or store_dir,
                fingerprint={"model": self.model_identity(), "data": loader_digest(fac), "kfac_split": hp.kfac_split,
                             "load_dtype": hp.dtype},
                dtype=dtype, shard=(self.trainer.global_rank, world), reduce=reduce,
                progress=show_progress(self.trainer), save=save)
        if shared and store_dir is not None:  # the store's own copy: a query reads only the store
            stats["factors"] = str(copy_factors(stats["factors"], store_dir) if save else
                                   Path(store_dir) / Path(stats["factors"]).name)
        return stats

    def _same_on_every_rank(self, projections: dict[str, LayerProjection]) -> dict[str, LayerProjection]:
        """Rank 0's projections on every rank (eigenvectors of one all-reduced matrix may still differ in the last
        bits, or in sign, between devices; every rank's vectors must share one basis)."""
        if self._trainer is None or self.trainer.world_size <= 1:
            return projections
        mats = self.trainer.strategy.broadcast({k: (p.P_out, p.P_in) for k, p in projections.items()}, src=0)
        return {k: LayerProjection(p.key, p.out_features, p.in_features, *mats[k]) for k, p in projections.items()}

    def setup(self, stage: str) -> None:
        check_predict_examples(self, stage)  # fewer pool examples than processes: one line, not rank 1's assert

    def on_predict_start(self) -> None:
        self.prepare()
        self._steps = self._max_steps = 0
        self._last = None
        if is_sharded(self.net) and self.trainer.world_size > 1:  # the most batches any rank has (before any step)
            mine = torch.tensor(float(sum(self.trainer.num_predict_batches)), device=self.device)
            self._max_steps = int(self.trainer.strategy.reduce(mine, reduce_op="max").item())

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        """The batch's projected rows; ``{}`` where every row is stored already (a resumed build: nothing to write,
        and no ``None``, which Lightning takes for a forgotten return and warns about)."""
        self._steps += 1
        self._last = batch
        lockstep = is_sharded(self.net)
        ids = [str(i) for i in batch["id"]]
        keep = torch.tensor([i not in self.skip_ids for i in ids], dtype=torch.bool)
        if not bool(keep.any()):
            if lockstep:
                self._idle_step(batch)
            return {}
        if not bool(keep.all()):
            batch = trim_batch(batch, keep.to(batch["input_ids"].device))

        net = self.projector.pairs_from if self.projector.pairs_from is not None else self.net
        with checkpointed_blocks(net, enabled=bool(self.hparams.get("gradient_checkpointing"))):
            if lockstep and not bool(has_response_tokens(batch).any()):  # the projector makes no step for it
                self._idle_step(batch)
            return self.projector.project_batch(batch)

    def on_predict_epoch_end(self) -> None:
        """Under FSDP2: the idle steps of a rank with fewer batches than another (each forward gathers the blocks
        from every rank), before any other collective."""
        while self._max_steps and self._steps < self._max_steps:
            self._steps += 1
            with checkpointed_blocks(self.net, enabled=bool(self.hparams.get("gradient_checkpointing"))):
                self._idle_step(self._last)

    def _idle_step(self, batch: dict) -> None:
        """A step that stores nothing (FSDP2: every rank's forward and backward gather the same blocks): ``batch``
        with every attended token a label, through the model with no tracker."""
        b = to_device(batch, next(self.net.parameters()).device)
        with eval_mode(self.net), torch.inference_mode(False), torch.enable_grad():
            backward_pairs(self.net, idle_batch(b), [], loss_fn=self.projector.loss_fn)

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)


class GradientStoreWriter(BufferedShardWriter):
    """Write ``GradientStoreModule`` predictions as per-rank safetensors shards of a gradient store.

    Args:
        output_dir: the store directory.
        store_dtype: ``"float16"`` | ``"bfloat16"`` | ``"float32"`` storage of the vectors.
        write_every_n_batches: write a shard every this many batches (per rank).
        overwrite: delete an earlier store in ``output_dir`` first.
        extra_info: more entries for ``store.json`` (e.g. how the pool was tokenized, for queries).
    """

    shard_dir = gs.SHARD_DIR

    def __init__(self, output_dir: str, store_dtype: str = "float16", write_every_n_batches: int = 50,
                 overwrite: bool = False, extra_info: Optional[dict] = None) -> None:
        gs.storage_dtype(store_dtype)
        super().__init__(output_dir, write_every_n_batches, overwrite=overwrite)
        self.store_dtype = store_dtype
        self.extra_info = dict(extra_info or {})

    def _hint(self) -> str:
        return f"to start fresh pass overwrite=True (CLI: --overwrite true) or choose another directory than {self.output_dir}"

    # ------------------------------------------------------------------ shards (BufferedShardWriter)
    owned_kind = "gradient store"

    def make_lock(self):
        return ScoreDirLock(self.output_dir, gs.LOCK_FILE, "store build", "build into another directory")

    def clear_output(self) -> None:
        gs.clear_store(self.output_dir)

    def write_shard(self, parts, rank, run, seq):
        vectors = torch.cat([p["vectors"] for p in parts]).to(gs.storage_dtype(self.store_dtype))
        nonfinite = np.concatenate([p["nonfinite"] for p in parts]) | ~torch.isfinite(vectors).all(1).numpy()
        path = gs.write_shard(self.output_dir, gs.shard_name(rank, run, seq), ids=[i for p in parts for i in p["id"]],
                              tasks=[t for p in parts for t in p["task"]], vectors=vectors,
                              n_tokens=np.concatenate([p["n_tokens"] for p in parts]),
                              zero_grad=np.concatenate([p["zero_grad"] for p in parts]) & ~nonfinite, nonfinite=nonfinite)
        return path, len(vectors)

    # ------------------------------------------------------------------ life cycle
    def on_predict_start(self, trainer, pl_module) -> None:
        prov = pl_module.provenance() if trainer.global_rank == 0 else None
        if trainer.world_size > 1:
            prov = trainer.strategy.broadcast(prov, src=0)
        prov["fingerprint"]["store_dtype"] = self.store_dtype  # vectors of one store share one storage dtype
        gs.check_store_fingerprint(self.output_dir, prov["fingerprint"], hint=self._hint())
        trainer.strategy.barrier()
        pl_module.prepare(str(self.output_dir), save=trainer.global_rank == 0)
        if trainer.global_rank == 0:
            repairs = gs.repair_shards(self.output_dir)
            old = gs.read_info(self.output_dir, required=False)
            proj = pl_module.projector
            if not (self.output_dir / gs.PROJECTION_FILE).exists():
                gs.save_projections(self.output_dir, {k: (p.P_out, p.P_in) for k, p in proj.projections.items()})
            info = {**old, **self.extra_info, **prov, "dtype": self.store_dtype, "dim": proj.dim, "complete": False,
                    "layout": [{"key": k, "out": p.out_features, "in": p.in_features, "k_out": p.k_out, "k_in": p.k_in,
                                "offset": proj.layout[k][0]} for k, p in proj.projections.items()],
                    "model_source": pl_module.model_name, "factors": pl_module.stats.get("factors"),
                    "repairs": list(old.get("repairs", [])) + repairs}
            info["factors"] = None if info["factors"] is None else Path(info["factors"]).name
            gs.write_info(self.output_dir, info)
        trainer.strategy.barrier()
        pl_module.skip_ids = gs.done_ids(self.output_dir)
        if pl_module.skip_ids and trainer.global_rank == 0:
            log.info("GradientStoreWriter: resuming, %d ids already stored in %s", len(pl_module.skip_ids),
                     self.output_dir)

    def on_predict_end(self, trainer, pl_module) -> None:
        self.flush()
        trainer.strategy.barrier()
        if trainer.global_rank == 0:
            info = gs.read_info(self.output_dir)
            rows = sum(len(s["ids"]) for s in gs.iter_shards(self.output_dir, vectors=False))
            info.update(complete=True, rows=rows, shards=len(gs.shard_files(self.output_dir)),
                        finished=time.strftime("%Y-%m-%d %H:%M:%S"), **gs.store_size(self.output_dir, rows))
            info["contents"] = gs.contents_manifest(self.output_dir, info)
            gs.write_info(self.output_dir, info)
        trainer.strategy.barrier()
        self._unlock()
