"""``InfluenceScoringModule``: influence scoring as a Lightning predict loop.

The math lives in ``influence.InfluenceScorer``; this module only wires it to a ``Trainer``:

* ``configure_model`` loads the model (``iprox_lightning.models.loading.load_model``: ``"builtin"``,
  hub id, local dir, ``.gguf`` file or saved IProX proxy dir) unless an ``nn.Module`` was given.
* ``on_predict_start`` computes the validation gradients (and, for ``method="kfac"``, the K-FAC
  factors on the first ``kfac_examples`` examples of ``datamodule.dataloader(kfac_split)``) once.
  Under DDP each rank takes every ``world_size``-th batch and the sums and example counts are
  all-reduced, so the prepared state is identical on every rank.
* ``predict_step`` returns ``{"id", "score", "task_scores", "task_names", "n_tokens", "zero_grad",
  "task"}`` for the examples of the batch, skipping ids in ``skip_ids`` (set by
  ``InfluenceWriter`` on resume).

Lightning predicts under ``torch.inference_mode()``; gradients are taken inside
``torch.inference_mode(False)`` + ``torch.enable_grad()`` on cloned inputs, so both
``Trainer(inference_mode=True)`` (default) and ``inference_mode=False`` work.

With a logger (``configs/score.yaml``: TensorBoard under ``outputs/logs/score``) the run logs, every
``trainer.log_every_n_steps`` batches and once more at the end (totals over all processes):
``scoring/examples`` (scored so far), ``scoring/tokens_per_s`` and ``scoring/examples_per_s`` (since the
first batch, preparation excluded), ``scoring/nonfinite`` and ``scoring/zero_grad`` (rows carrying those
flags), ``scoring/skipped_resumed``; at the start ``scoring/prepare_seconds`` and the scorer's settings.
"""
from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ..console import show_progress
from ..engine.fsdp import is_sharded, shard_frozen_per_block
from ..engine.host_memory import release_freed_host_memory
from ..engine.settings import takes_settings
from ..errors import UserInputError
from ..io.fingerprint import loader_digest, model_identity
from ..io.score_dir import checkpoint_pass_dir, read_pass_rows, write_pass_shard
from ..models.loading import load_model
from ..models.lora import (
    ADAPTER_GRADIENTS, adapter_weights, read_adapter_weights, scores_adapters, shared_base_key, use_adapter_weights,
)
from .config import ScoringConfig
from .features import progress_bar, trim_batch
from .influence import InfluenceScorer, check_checkpoints, checkpoint_sum
from .less import attach_optimizer_state

log = logging.getLogger(__name__)
ROW_KEYS = ("score", "task_scores", "zero_grad", "nonfinite")
"""What a checkpoint's score of a row is made of (:func:`~.influence.checkpoint_sum` sums them over checkpoints)."""


class InfluenceScoringModule(L.LightningModule):
    """Score a candidate pool against validation sets with TracIn or K-FAC influence.

    The scoring settings (``method``, ``normalize``, ``per_task``, ``damping``, ``damping_mode``,
    ``kfac_examples``, ``feature_mode``, ``target_patterns``) are the fields of
    :class:`~iprox_lightning.scoring.influence.ScoringConfig`, given as keywords (YAML ``init_args``, the command line)
    or whole as ``scoring=ScoringConfig(...)`` (:func:`~iprox_lightning.engine.settings.takes_settings`); the built config is
    ``self.config``: the scorer gets it unchanged and ``InfluenceWriter`` writes it verbatim into the score table's
    settings.

    Args:
        model: ``"builtin"``, a hub id, a local directory, a ``.gguf`` file, a saved proxy directory,
            or (from Python) an already built ``nn.Module``.
        kfac_split: data-module split the factors are estimated on (``datamodule.dataloader(split)``).
        factors_dir: a directory for the fitted K-FAC / EK-FAC factors: factors fitted before on the same model, factor
            data and settings are loaded from it instead of fitted again, new ones are saved there (``None``: fit).
        dtype: model dtype when loading (``"float32"``, ``"bfloat16"``, ...).
        attn_implementation: attention kernel when loading (one backward only, so ``"sdpa"`` is fine).
        gguf_file: GGUF file name inside ``model`` when ``model`` is a directory.
        trust_remote_code: passed to the loader.
        validation_model: a dense model (the target a proxy ``model`` was built from; a hub id, directory, ``.gguf``
            file or ``nn.Module``) whose validation gradients the pool is scored against, in ``model``'s coordinates
            (factor-space projections for factorised layers:
            :class:`~iprox_lightning.scoring.features.FactorSpaceView`); loaded for the preparation only.
            ``None``: ``model``'s own.
        checkpoints: score at several checkpoints and sum the scores (LESS; multi-checkpoint TracIn, K-FAC, ...): a
            list of ``{path, weight}``, each loaded like ``model`` (an adapter directory with its base) and scored
            against its own validation gradients; a row's score is ``Σ_c weight_c · score_c``
            (:func:`~.influence.checkpoint_sum`). ``weight`` omitted: the learning rate in the checkpoint's
            ``optimizer_state.safetensors``. ``model`` is then not read. Adapters over one base share it (each
            holds only its adapter tensors).
        checkpoints_in_turn: score ``checkpoints`` one at a time, a pass over the pool each (the first's last):
            one checkpoint's scorer held at a time, the same scores bit for bit (not fingerprinted); each pass's rows
            kept beside the writer's shards (``checkpoint_passes/``), so a stopped run resumes.
        validation_batch_size: the validation pass's batch (``None``: the data's); with ``validation_model`` the
            target's backward (``plan --fit`` chooses it). Scores differ by rounding only: not fingerprinted.
    """

    @takes_settings(ScoringConfig, "scoring")
    def __init__(
        self,
        model: Union[str, nn.Module] = "builtin",
        *,
        kfac_split: str = "pool",
        factors_dir: Optional[str] = None,
        dtype: str = "float32",
        attn_implementation: Optional[str] = "sdpa",
        gguf_file: Optional[str] = None,
        trust_remote_code: bool = False,
        validation_model: Union[str, nn.Module, None] = None,
        checkpoints: Optional[list] = None,
        checkpoints_in_turn: bool = False,
        validation_batch_size: Optional[int] = None,
        scoring: Optional[ScoringConfig] = None,
    ) -> None:
        # not super(): the hyper-parameters are given whole (ProxyAlignModule.__init__ says why)
        L.LightningModule.__init__(self)
        self.config = scoring
        self.metric = self.config.build_metric()
        hparams = {} if isinstance(model, nn.Module) else {"model": model}
        hparams.update(self.config.to_dict())
        hparams.update(kfac_split=kfac_split, factors_dir=factors_dir, dtype=dtype,
                       attn_implementation=attn_implementation, gguf_file=gguf_file,
                       trust_remote_code=trust_remote_code)
        if isinstance(validation_model, str):
            hparams["validation_model"] = validation_model
        if validation_batch_size is not None:  # (hyper-parameters as before the option when it is not given)
            if isinstance(validation_batch_size, bool) or not isinstance(validation_batch_size, int) \
                    or validation_batch_size < 1:
                raise UserInputError(f"validation_batch_size must be an integer >= 1 (or null: the data's batch), "
                                     f"got {validation_batch_size!r}")
            hparams["validation_batch_size"] = validation_batch_size
        self.validation_batch_size = validation_batch_size

        self.checkpoints = check_checkpoints(checkpoints)
        if self.checkpoints is not None:  # (hyper-parameters as before the option when it is not given)
            hparams["checkpoints"] = self.checkpoints
            hparams["model"] = model = self.checkpoints[0]["path"]
        if not isinstance(checkpoints_in_turn, bool):
            raise UserInputError(f"checkpoints_in_turn must be true or false, got {checkpoints_in_turn!r}")
        if checkpoints_in_turn:  # (hyper-parameters as before the option when it is off)
            if self.checkpoints is None:
                raise UserInputError("checkpoints_in_turn scores the checkpoints of `checkpoints` one at a time: give "
                                     "checkpoints (a list of {path, weight}) or leave checkpoints_in_turn off")
            hparams["checkpoints_in_turn"] = True
        self.checkpoints_in_turn = checkpoints_in_turn
        self.save_hyperparameters(hparams)
        self.validation_model = validation_model
        self._vnet: nn.Module | None = None  # validation_model once loaded
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.net: nn.Module | None = model if isinstance(model, nn.Module) else None
        self.scorer: InfluenceScorer | None = None  # the first checkpoint's with several
        self.scorers: list[tuple[float, InfluenceScorer]] = []  # (weight, scorer) of each checkpoint
        # each checkpoint's adapter tensors where checkpoints share their model's base (else None: its own model)
        self.checkpoint_adapters: list[dict[str, torch.Tensor] | None] = []
        self._checkpoint_nets: list[nn.Module] = []  # each checkpoint's model (shared ones: the same)
        # checkpoints_in_turn: each later checkpoint's scores of this process's rows, by id (from its own pass)
        self.checkpoint_rows: list[tuple[list[str], dict[str, Any]]] = []
        # checkpoints_in_turn: (output directory, batches per shard) where the passes keep their rows, set by the
        # writer (InfluenceWriter): a stopped run resumes them; None: kept in memory only
        self.checkpoint_passes: Optional[tuple[str, int]] = None
        self.skip_ids: set[str] = set()
        self.n_scored = 0
        self.n_skipped = 0
        self.n_tokens = 0
        self.n_nonfinite = 0
        self.n_zero_grad = 0
        self._t_first: float | None = None
        self._log_step = 0

    # ------------------------------------------------------------------ model and data
    def configure_model(self) -> None:
        """Load the model (idempotent); under ``ModelParallelStrategy`` (FSDP2) shard it per decoder block, each block
        gathered for its forward and again for its backward (:func:`~iprox_lightning.engine.fsdp.apply_fully_shard`;
        the engine's hooks take activations and their gradients, never a parameter)."""
        if self.net is None:
            hp = self.hparams
            self.net, _ = load_model(hp.model, gguf_file=hp.gguf_file, dtype=hp.dtype,
                                     attn_implementation=hp.attn_implementation,
                                     trust_remote_code=hp.trust_remote_code, tokenizer=False,
                                     merge_adapters=False)
            self.net.eval()
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not is_sharded(self.net):
            self._identity = self.model_identity()  # (of the whole weights: a shard hashes as its shape only)
            shard_frozen_per_block(self.net, mesh)

    def setup(self, stage: str) -> None:
        check_predict_examples(self, stage)

    def _loaders(self):
        """The validation loader and, for a metric fitted on data, the factor loader, from the trainer's data module."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None:
            raise RuntimeError("InfluenceScoringModule needs validation data: pass a data module with "
                               "validation_dataloader() / val_dataloader() (trainer.predict(module, datamodule=dm))")
        val = dm.validation_dataloader() if hasattr(dm, "validation_dataloader") else dm.val_dataloader()
        if self.validation_batch_size is not None:
            val = _rebatched(val, self.validation_batch_size)
        fac = None
        if self.metric.needs_factor_data:
            fac = dm.dataloader(self.hparams.kfac_split) if hasattr(dm, "dataloader") else dm.predict_dataloader()
        return val, fac

    def scoring_config(self) -> dict[str, Any]:
        """The settings that must not change between a run and its resumption: the model's name, the
        :class:`ScoringConfig`, the factor split and the loading dtype."""
        out = {"model": self.model_name, **self.config.to_dict(), "kfac_split": self.hparams.kfac_split,
               "dtype": self.hparams.dtype}
        if scores_adapters(self.hparams.get("model", self.net)):  # a peft adapter: its adapters' gradients
            out.update(ADAPTER_GRADIENTS)
        if self.checkpoints is not None:  # the paths' identities are the fingerprint's model
            out["checkpoint_weights"] = [c["weight"] for c in self.checkpoints]
        if self.validation_model is not None:  # only when set: earlier runs' fingerprints stay as they were
            vm = self.validation_model
            out["validation_model"] = vm if isinstance(vm, str) else type(vm).__name__
        return out

    def scoring_provenance(self) -> dict[str, Any]:
        """What produced this run's scores: ``{"fingerprint": {model, settings, pool, validation}, "scoring":
        the ScoringConfig verbatim, "data": {...}}``. The fingerprint holds the model's identity (files of a local dir / file, else a hash of
        the loaded weights), :meth:`scoring_config`, and content digests of the scored pool (the trainer's
        predict data) and of the validation set; ``data`` counts and lists the examples the data module
        dropped (no response token left after truncation). Used by ``InfluenceWriter`` to refuse resuming
        or reusing an output directory produced from different inputs."""
        fp: dict[str, Any] = {"model": self.model_identity(), "settings": self.scoring_config()}
        if self.validation_model is not None:
            fp["validation_model"] = self.validation_model_identity()
        loaders = self.trainer.predict_dataloaders if self._trainer is not None else None
        if loaders is not None:
            loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
            digests = [loader_digest(dl, iterate=False) for dl in loaders]  # never re-iterate the live loader
            fp["pool"] = digests if len(digests) != 1 else digests[0]
        val, _ = self._loaders()
        fp["validation"] = loader_digest(val)
        out: dict[str, Any] = {"fingerprint": fp, "scoring": self.config.to_dict()}
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and hasattr(dm, "dropped_report"):
            out["data"] = dm.dropped_report(("pool", "validation"))
        if dm is not None and hasattr(dm, "pool_provenance"):
            out["pool"] = dm.pool_provenance()  # select checks the pool it copies records from against this
        return out

    def model_identity(self) -> Any:
        """The files of a local model dir / file, else a hash of the loaded weights."""
        if self.net is None and not (isinstance(self.hparams.get("model"), str) and Path(self.hparams.model).exists()):
            self.configure_model()
        if getattr(self, "_identity", None) is not None:
            return self._identity

        if self.checkpoints is not None:
            return [model_identity(c["path"], self.net if j == 0 else None) for j, c in enumerate(self.checkpoints)]
        return model_identity(self.hparams.get("model", self.net), self.net)

    def validation_model_identity(self) -> Any:
        """:meth:`model_identity` of ``validation_model`` (loaded here, and kept for the preparation, when it is
        neither a local path nor a module)."""
        vm = self.validation_model
        if isinstance(vm, str) and not Path(vm).exists() and self._vnet is None:
            self._vnet = self._load_validation_model()

        return model_identity(vm, self._vnet)

    # ------------------------------------------------------------------ prediction
    def on_predict_start(self) -> None:
        if self.net is None:
            self.configure_model()
        t0 = time.perf_counter()
        vmodel, self._vnet = self._vnet or self._load_validation_model(), None
        if vmodel is not None:
            vmodel.to(next(self.net.parameters()).device)
        if self.checkpoints is None:
            self.scorer = self._prepare(self.net, self.metric, self.hparams.get("model", self.net), vmodel)
            self.scorers = [(1.0, self.scorer)]
        elif self.checkpoints_in_turn:  # each later checkpoint's pass first (loaded, or its adapters put in place,
            # prepared, passed over this process's pool and dropped), then the first's scorer for the live loop
            self.checkpoint_rows = [self._pass_at_checkpoint(j, vmodel) for j in range(1, len(self.checkpoints))]
            self.scorer = self._prepare(self.net, self.metric, self.checkpoints[0]["path"], vmodel)
            self.scorers = [(self.checkpoints[0]["weight"], self.scorer)]
            if any(names != self.scorer.task_names for names, _ in self.checkpoint_rows):
                raise RuntimeError("checkpoints scored different validation tasks")
        else:  # one scorer per checkpoint, each with its model (or adapters), metric and validation gradients
            self.scorers = []
            self.checkpoint_adapters = self._checkpoint_models()
            try:
                for j, c in enumerate(self.checkpoints):
                    net = self._use_checkpoint(j)
                    metric = self.metric if j == 0 else self.config.build_metric()
                    self.scorers.append((c["weight"], self._prepare(net, metric, c["path"], vmodel)))
            finally:
                self._at_rest()
            self.scorer = self.scorers[0][1]
        del vmodel  # only the preparation needs it
        st = self.scorer.settings()
        prepare_s = time.perf_counter() - t0
        log.info("influence scoring prepared in %.1fs: %s", prepare_s, st)
        self.n_scored = self.n_skipped = self.n_tokens = self.n_nonfinite = self.n_zero_grad = 0
        self._t_first, self._log_step = None, 0
        if self.logger is not None:
            metrics = {f"scoring/{k}": float(v) for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for t, c in zip(self.scorer.task_names, self.scorer.val_counts):
                metrics[f"scoring/val_examples/{t}"] = float(c)
            metrics["scoring/prepare_seconds"] = prepare_s
            self.logger.log_metrics(metrics, step=0)

    def _pass_at_checkpoint(self, j: int, vmodel: Optional[nn.Module]) -> tuple[list[str], dict[str, Any]]:
        """``checkpoints_in_turn``: checkpoint ``j``'s model (its adapters put in place over the first's base where
        they share it, :func:`~iprox_lightning.models.lora.shared_base_key`; else loaded whole), its scorer prepared
        and a pass over this process's pool (the rows not resumed), then both dropped: ``(task names, {"row": {id:
        row}, "score": [N], "task_scores": [N, K], "zero_grad": [N], "nonfinite": [N]})``."""
        c = self.checkpoints[j]
        first_key = None if is_sharded(self.net) else shared_base_key(self.checkpoints[0]["path"])
        shared = first_key is not None and shared_base_key(c["path"]) == first_key
        with torch.inference_mode(False):
            if shared:
                first = adapter_weights(self.net)
                use_adapter_weights(self.net, read_adapter_weights(self.net, c["path"]))
                net = self.net
            else:
                net = self._load(c["path"])
        try:
            scorer = self._prepare(net, self.config.build_metric(), c["path"], vmodel)
            names = list(scorer.task_names)
            store = None if self.checkpoint_passes is None else checkpoint_pass_dir(self.checkpoint_passes[0], j)
            kept = read_pass_rows(store, names) if store is not None else None  # a stopped run's rows of this pass
            parts: list[dict] = [] if kept is None else [{"id": kept.pop("ids"), **kept}]
            pending: list[dict] = []  # rows not written to the pass's shards yet
            run, seq = f"{os.getpid()}-{time.time_ns()}", 0
            loaders = self.trainer.predict_dataloaders
            loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
            pool = _Chained(_replay(dl, "checkpoints_in_turn") for dl in loaders)
            pool = progress_bar(pool, show_progress(self.trainer), f"checkpoint {j + 1}/{len(self.checkpoints)}")
            try:
                for batch in scorer.rows_to_score(pool, self.skip_ids.union(*(p["id"] for p in parts))):
                    with torch.inference_mode(False), torch.enable_grad():
                        out = scorer.score_batch(batch)
                    parts.append({k: out[k] for k in ("id", *ROW_KEYS)})
                    if store is not None:
                        pending.append({**out, "task_names": names})
                        if len(pending) >= self.checkpoint_passes[1]:
                            write_pass_shard(store, pending, self.trainer.global_rank, run, seq)
                            pending, seq = [], seq + 1
            finally:  # (on a stop too: what was scored is kept)
                if pending:
                    write_pass_shard(store, pending, self.trainer.global_rank, run, seq)
        finally:
            if shared:
                with torch.inference_mode(False):
                    use_adapter_weights(self.net, first)
        del scorer, net
        gc.collect()  # (the scorer's validation gradients freed now, before the next checkpoint's are made)
        release_freed_host_memory()
        ids = [i for p in parts for i in p["id"]]
        rows = {"row": {i: r for r, i in enumerate(ids)},
                **{k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0) for k in ROW_KEYS}}
        log.info("checkpoint %d/%d scored in turn: %d rows (%d from an earlier run)", j + 1, len(self.checkpoints),
                 len(ids), len(parts[0]["id"]) if kept is not None else 0)
        return names, rows

    def _rows_at(self, j: int, ids: list[str]) -> dict:
        """``checkpoints_in_turn``: the rows ``ids`` as checkpoint ``j`` (``>= 1``) scored them in its pass (each
        taken once)."""
        _, rows = self.checkpoint_rows[j - 1]
        missing = [i for i in ids if i not in rows["row"]]
        if missing:
            raise RuntimeError(f"example {missing[0]!r} was not scored in checkpoint {j + 1}'s pass: the pool batches "
                               "differ between passes (checkpoints_in_turn needs a deterministic pool loader)")
        at = [rows["row"].pop(i) for i in ids]
        return {"id": list(ids), **{k: rows[k][at] for k in ROW_KEYS}}

    def _checkpoint_models(self) -> list[dict[str, torch.Tensor] | None]:
        """Each checkpoint's model: ``self.net`` for the first; a later adapter directory over the base of an earlier
        one (:func:`~iprox_lightning.models.lora.shared_base_key`: the same base files and adapter settings) shares
        that checkpoint's model and holds its own adapter tensors, which this returns (each such checkpoint's, the
        first's too: the ones in place); any other checkpoint is loaded whole (:meth:`_load`: a dense checkpoint, or
        an adapter over another base). A sharded model (FSDP2) is not shared: each checkpoint loads, sharded as it is."""
        shared: dict[str, nn.Module] = {}  # shared_base_key -> the model its checkpoints share
        owner: list[nn.Module] = []
        adapters: list[dict[str, torch.Tensor] | None] = []
        with torch.inference_mode(False):  # (as :meth:`_load`: tensors the backward can use)
            for j, c in enumerate(self.checkpoints):
                key = None if is_sharded(self.net) else shared_base_key(c["path"])
                if key is not None and key in shared:
                    net = shared[key]
                    adapters.append(read_adapter_weights(net, c["path"]))
                else:
                    net = self.net if j == 0 else self._load(c["path"])
                    if key is not None:
                        shared[key] = net
                    adapters.append(adapter_weights(net) if key is not None else None)
                owner.append(net)
        self._checkpoint_nets = owner
        # a model no later checkpoint shares keeps its adapters as they are: nothing to swap
        users = {id(n): sum(o is n for o in owner) for n in owner}
        return [a if users[id(n)] > 1 else None for a, n in zip(adapters, owner)]

    def _at_rest(self) -> None:
        """Each shared model with its first checkpoint's adapters in place, as loaded (between batches, and after a
        run: the next run's :meth:`_checkpoint_models` reads them from the model, wherever it was moved since)."""
        first: dict[int, int] = {}
        for j, net in enumerate(self._checkpoint_nets):
            first.setdefault(id(net), j)
        for j in first.values():
            self._use_checkpoint(j)

    def _use_checkpoint(self, j: int) -> nn.Module:
        """Checkpoint ``j``'s model, with its adapters in place where it shares its base."""
        net = self._checkpoint_nets[j]
        if self.checkpoint_adapters[j] is not None:
            with torch.inference_mode(False):
                use_adapter_weights(net, self.checkpoint_adapters[j])
        return net

    def _load(self, source: str) -> nn.Module:
        """A checkpoint's model, loaded as ``model`` is (:meth:`configure_model`; sharded per decoder block as it is
        under FSDP2); outside inference mode (this runs in ``on_predict_start``, under the Trainer's
        ``inference_mode``: its weights would be inference tensors, which the backward cannot save)."""
        hp = self.hparams
        with torch.inference_mode(False):
            net, _ = load_model(source, gguf_file=hp.gguf_file, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                                trust_remote_code=hp.trust_remote_code, tokenizer=False, merge_adapters=False)
            net = net.to(next(self.net.parameters()).device).eval()
            mesh = getattr(self, "_device_mesh", None)
            if mesh is not None and is_sharded(self.net):
                shard_frozen_per_block(net, mesh)
        return net

    def _prepare(self, net: nn.Module, metric, source: Any, vmodel: Optional[nn.Module]) -> InfluenceScorer:
        """The scorer of one model (a checkpoint): its metric fitted (factors; LESS: the optimiser state saved with
        ``source``) and its validation gradients, all-reduced under several processes."""
        scorer = InfluenceScorer(net, self.config, metric=attach_optimizer_state(metric, source))
        val, fac = self._loaders()
        strategy = self.trainer.strategy
        world, rank = self.trainer.world_size, self.trainer.global_rank
        reduce = (lambda t: strategy.reduce(t, reduce_op="sum")) if world > 1 else None
        fac_fp = None
        if fac is not None and self.hparams.factors_dir:
            identity = self.model_identity() if self.checkpoints is None else model_identity(source, net)
            fac_fp = {"model": identity, "data": loader_digest(fac), "kfac_split": self.hparams.kfac_split,
                      "load_dtype": self.hparams.dtype}
        with torch.inference_mode(False), torch.enable_grad():
            scorer.fit(val, fac, shard=(rank, world), reduce=reduce, gather=_gather_objects if world > 1 else None,
                       progress=show_progress(self.trainer), factors_dir=self.hparams.factors_dir,
                       factors_fingerprint=fac_fp, validation_model=vmodel)
            if scorer.pending_groups:  # column groups: a pass over this rank's pool per earlier group
                loaders = self.trainer.predict_dataloaders
                loaders = loaders if isinstance(loaders, (list, tuple)) else [loaders]
                scorer.earlier_passes(_Chained(_replay(dl) for dl in loaders), skip_ids=self.skip_ids)
        return scorer

    def _load_validation_model(self) -> Optional[nn.Module]:
        """``validation_model`` loaded like ``model`` (same dtype and kernel)."""
        vm = self.validation_model
        if vm is None or isinstance(vm, nn.Module):
            return vm

        hp = self.hparams
        with torch.inference_mode(False):  # (as :meth:`_load`)
            net, _ = load_model(vm, dtype=hp.dtype, attn_implementation=hp.attn_implementation,
                                trust_remote_code=hp.trust_remote_code, tokenizer=False)
        return net.eval()

    def predict_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> dict:
        if self._t_first is None:
            self._t_first = time.perf_counter()
        out = self._score(batch)
        self._log_step += 1
        every = getattr(self._trainer, "log_every_n_steps", 50) if self._trainer is not None else 50
        if self.logger is not None and every and self._log_step % every == 0:
            self.logger.log_metrics(self.scoring_counters(), step=self._log_step)
        return out

    def on_predict_end(self) -> None:
        self.checkpoint_rows = []  # (rows a limited live loop did not reach)
        self.checkpoint_passes = None  # (set by this run's writer)
        if self.logger is not None:
            self.logger.log_metrics(self.scoring_counters(reduce=True), step=max(self._log_step, 1))

    def scoring_counters(self, reduce: bool = False) -> dict[str, float]:
        """What the scoring run logs: examples scored, tokens/s and examples/s since the first batch, rows
        flagged non-finite or zero-gradient, resumed ids skipped (``reduce``: summed over processes)."""
        counts = [self.n_scored, self.n_tokens, self.n_nonfinite, self.n_zero_grad, self.n_skipped]
        if reduce and self._trainer is not None and self.trainer.world_size > 1:
            t = self.trainer.strategy.reduce(torch.tensor(counts, dtype=torch.float64, device=self.device), reduce_op="sum")
            counts = [int(v) for v in t.tolist()]
        n, tok, nonfinite, zero, skipped = counts
        dt = time.perf_counter() - self._t_first if self._t_first is not None else 0.0
        return {"scoring/examples": float(n), "scoring/tokens_per_s": tok / dt if dt > 0 else 0.0,
                "scoring/examples_per_s": n / dt if dt > 0 else 0.0, "scoring/nonfinite": float(nonfinite),
                "scoring/zero_grad": float(zero), "scoring/skipped_resumed": float(skipped)}

    def _score(self, batch: dict) -> dict:
        ids = [str(i) for i in batch["id"]]
        keep = torch.tensor([i not in self.skip_ids for i in ids], dtype=torch.bool)
        self.n_skipped += int((~keep).sum())
        names = self.scorer.task_names
        if not bool(keep.any()):
            self.scorer.take_part(batch)  # (shard_layers: the other ranks' pairs of this rank's weights)
            return _empty_result(names)
        if not bool(keep.all()):
            batch = trim_batch(batch, keep.to(batch["input_ids"].device))
        with torch.inference_mode(False), torch.enable_grad():
            out = self.scorer.score_batch(batch)
            if self.checkpoints is not None and len(self.checkpoints) > 1:  # several: Σ_c w_c · score_c
                if self.checkpoints_in_turn:  # the later checkpoints' rows from their passes
                    parts = [out] + [self._rows_at(j, out["id"]) for j in range(1, len(self.checkpoints))]
                else:
                    try:
                        parts = [out] + [self._score_at(j, batch) for j in range(1, len(self.scorers))]
                    finally:
                        self._at_rest()
                if any(p["id"] != out["id"] for p in parts) or any(sc.task_names != names for _, sc in self.scorers):
                    raise RuntimeError("checkpoints scored different rows or validation tasks")
                out["score"], out["task_scores"], out["zero_grad"], out["nonfinite"] = checkpoint_sum(
                    [c["weight"] for c in self.checkpoints], *([p[k] for p in parts] for k in ROW_KEYS))
        self.n_scored += len(out["id"])
        self.n_tokens += int(np.asarray(out["n_tokens"]).sum())
        self.n_nonfinite += int(np.asarray(out.get("nonfinite", ())).sum())
        self.n_zero_grad += int(np.asarray(out.get("zero_grad", ())).sum())
        out["task_names"] = list(names)
        return out

    def _score_at(self, j: int, batch: dict) -> dict:
        """The batch scored by checkpoint ``j``'s scorer, its adapters in place."""
        self._use_checkpoint(j)
        return self.scorers[j][1].score_batch(batch)

    def forward(self, *args, **kwargs):
        return self.net(*args, **kwargs)


def check_predict_examples(module: L.LightningModule, stage: str) -> None:
    """:func:`check_examples_per_process` on the predict loader of ``module``'s trainer (a module's ``setup``)."""
    if stage != "predict" or module._trainer is None or module.trainer.world_size <= 1:
        return
    dm = getattr(module.trainer, "datamodule", None)
    loader = dm.predict_dataloader() if dm is not None and hasattr(dm, "predict_dataloader") else None
    ds = getattr(loader, "dataset", None)
    n = len(ds) if ds is not None and hasattr(ds, "__len__") else None
    check_examples_per_process(n, module.trainer.world_size)


def check_examples_per_process(n: int | None, world_size: int) -> None:
    """Distributed scoring gives each process every ``world_size``-th example and needs at least one per
    process (Lightning's predict sampler asserts it, a bare ``AssertionError`` on the rank left without one); fewer
    examples than processes is a clear error."""
    if n is not None and world_size > 1 and 0 < n < world_size:
        raise UserInputError(f"the pool to score has {n} example(s) but the run has {world_size} processes: distributed "
                         f"scoring needs at least one example per process; run with at most {n} device(s) "
                         f"(--devices {n}; for predict --trainer.devices {n})")


def _empty_result(task_names: list[str]) -> dict:
    return {"id": [], "score": np.zeros(0), "task_scores": np.zeros((0, len(task_names))), "n_tokens": np.zeros(0, np.int64),
            "zero_grad": np.zeros(0, bool), "nonfinite": np.zeros(0, bool), "task": None, "task_names": list(task_names)}


def _replay(loader, what: str = "column groups (validation_gradients.column_groups > 1)"):
    """A loader of the same batches as the trainer's predict ``loader`` (this rank's share), iterated apart from it:
    Lightning's batch-sampler wrapper holds one shared iterator, which iterating the live loader would consume."""
    inner = getattr(loader.batch_sampler, "_batch_sampler", None) if isinstance(loader, DataLoader) else None
    if inner is None:
        raise RuntimeError(f"{what} need(s) the predict data as a torch DataLoader with a batch sampler, got "
                           f"{type(loader).__name__}")
    return DataLoader(loader.dataset, batch_sampler=inner, collate_fn=loader.collate_fn, num_workers=loader.num_workers)


def _rebatched(loader, batch_size: int) -> DataLoader:
    """The examples of ``loader`` (a torch DataLoader over a map-style data set) in batches of ``batch_size``, in the
    data set's order, collated as ``loader`` collates them (``validation_batch_size``)."""
    ds = getattr(loader, "dataset", None)
    if not isinstance(loader, DataLoader) or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise UserInputError("validation_batch_size re-batches the validation examples: it needs the data module's "
                             f"validation loader as a torch DataLoader over a map-style data set, got "
                             f"{type(loader).__name__}; leave validation_batch_size unset and batch it there")
    return DataLoader(ds, batch_size=batch_size, shuffle=False, collate_fn=loader.collate_fn,
                      num_workers=loader.num_workers)


class _Chained:
    """The batches of several loaders, one after another, re-iterable (each iteration walks them again)."""

    def __init__(self, loaders) -> None:
        self.loaders = list(loaders)

    def __iter__(self):
        return itertools.chain.from_iterable(self.loaders)


def _gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out

