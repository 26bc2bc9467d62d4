"""``ProxyAlignModule``: Stage 2 of IProX — train only the proxy's low-rank factors so its gradients
follow the target's (paper §4.2). The math lives in :mod:`iprox_lightning.alignment.losses`:

``L = L_GA + λ_KL · L_KL`` with
``L_GA = mean_ℓ [1 − cos(∇_{A_ℓ} L_proxy, sg(∇_{W_ℓ} L) B_ℓᵀ) + 1 − cos(∇_{B_ℓ} L_proxy, A_ℓᵀ sg(∇_{W_ℓ} L))]`` and
``L_KL = τ² · mean over response tokens of KL(softmax(f_target/τ) ‖ softmax(f_proxy/τ))``.

Models:

* ``self.teacher`` — the target, loaded from ``target``; frozen (``requires_grad=False``), always in
  eval mode, kept **outside** the module tree: it is in no ``state_dict``/checkpoint, in no optimiser,
  and DDP never wraps it (under FSDP2 the module shards it per decoder block itself,
  :func:`~iprox_lightning.alignment.fsdp.shard_teacher`); ``.to()``/``.cuda()``/``.half()`` of this module move it
  along.
* ``self.proxy`` — a copy of the target sharing its tensors (no dense copy of the model is made; then compressed in
  place by :class:`~iprox_lightning.callbacks.IPSVDCallback`, which calls ``configure_model()`` in its
  ``setup("fit")``; the next ``configure_model()`` gives its remaining tensors their own copies), or a saved proxy
  directory given as ``proxy``. Only the ``A``/``B`` factors of its
  :class:`~iprox_lightning.engine.lowrank.LowRankLinear` layers train; every other tensor (biases, norms,
  embeddings, LM head, layers kept dense) is frozen and stays bit-identical. Both models run in eval
  mode (dropout off) so their gradients are comparable.

One training step: teacher forward+backward (hooks project ``∇_W L`` to ``(P_A, P_B)`` without forming
it) → proxy forward → ``autograd.grad(L_proxy, factors, create_graph=True)`` → ``L`` → **one** backward
(Lightning's automatic optimisation). Attention must support double backward (eager attention; the
loader's default).

Distributed semantics (DDP): each rank aligns on its local micro-batch — its own teacher projections,
its own proxy gradients, its own cosines — and the single backward all-reduces (averages) the gradient
of its local ``L``. The step therefore equals single-process training on the **mean of the per-micro-batch
losses** ``(L(b_0) + … + L(b_{N-1}))/N`` — the same as gradient accumulation over the micro-batches — and
not ``L`` of the concatenated batch (cosines of summed gradients do not decompose over examples).
Ranks end with identical factors.

Held-out checks, ``keep_best`` and the ranking-fidelity check are callbacks the module configures from its options
(``configure_callbacks``): :class:`~iprox_lightning.alignment.keep_best.KeepBestFactors` records every validation
run (not Lightning's sanity check) and, with ``keep_best``, keeps the factors with the lowest ``monitor`` and
restores them at the end of ``fit``; the un-aligned factors are a candidate too (step 0: :meth:`heldout_metrics`
over the **full** validation loader(s), ``limit_val_batches`` respected, batch-size weighted means reduced over
ranks like Lightning's ``sync_dist`` epoch means; when ``keep_best`` (with ``align``) is on or ``fidelity_examples >
0``, and a validation loader exists). ``fidelity_examples = n > 0`` adds
:class:`~iprox_lightning.alignment.fidelity.RankingFidelity`: Spearman of the proxy's TracIn scores of
``n`` held-out pool examples with the frozen target's (``val/fidelity_spearman``, ``val/fidelity_loss = 1 − ρ``),
the scores made by ``fidelity_scorer``; with ``fidelity_per_task`` also per validation task (``val/fidelity_<task>``)
and the worst task (``val/fidelity_worst``, ``val/fidelity_worst_loss = 1 − worst``: the ``monitor`` that keeps the
factors whose worst task ranks best). The module reads their reports (``report()``) into the manifest.

FSDP2 (``ModelParallelStrategy``): :mod:`iprox_lightning.alignment.fsdp`. At scale: ``activation_checkpointing`` and
``micro_batch_size`` (:class:`AlignConfig`; under FSDP2 it aligns on the global batch, every rank's rows, not on the
mean of the per-rank losses, with the accumulation buffers sharded: :class:`~iprox_lightning.alignment.fsdp.FactorShards`).

Task-aware terms (issue 22; opt-in, off by default; the math: :mod:`iprox_lightning.alignment.task`), trained on the
validation examples the data module sets apart (``SFTDataModule(val_train_fraction=f)``: the ``val_train`` split,
disjoint from the ``validation`` examples that monitor and ``keep_best``; the manifest records which):
``val_grad_weight = w`` adds ``w · L_val`` (per task, ``1 − cos`` of the proxy's and the projected target's summed
validation gradients in factor space, on ``val_examples_per_task`` examples of each task per step);
``score_weight = w`` adds ``w · L_score`` (agreement of the proxy's and the target's TracIn scores of the alignment
batch per task, ``score_loss`` ``pearson`` | ``listwise``, the proxy's validation directions refreshed every
``score_refresh_every`` steps); ``task_reduction`` (``mean`` | ``max``) reduces both over tasks. Training ``L_GA``
on the validation examples themselves is the data module's ``mix_val_train``. Logged: ``align/l_val_grad``,
``align/val_grad_cos/<task>``, ``align/l_score``, ``align/score_loss/<task>`` (``align/loss`` is the total).

Ablations: ``kl_weight=0`` (no KL anchor), ``align=False`` (IPSVD only: fit trains nothing and only
saves the proxy), SVD instead of IPSVD init is ``IPSVDCallback(method="svd")``.

At the end of ``fit`` the aligned proxy is written to ``save_dir`` with
:func:`iprox_lightning.compression.apply.save_proxy` (rank 0), its manifest extended with the alignment settings.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..compression.apply import read_manifest, save_proxy
from ..io.output_guard import check_output_not_input
from ..models.loading import PROXY_MANIFEST
from .losses import AlignmentOutput, accumulated_alignment_losses, alignment_losses, proxy_factor_layers
from .task import (
    SCORE_LOSSES, TASK_REDUCTIONS, TaskDirections, projected_directions, proxy_directions, task_alignment_losses,
    task_directions,
)
from .keep_best import KeepBestFactors
from .fidelity import FIDELITY_LOSS, FIDELITY_SPEARMAN, FIDELITY_WORST, FIDELITY_WORST_LOSS, RankingFidelity
from ..errors import PROXY_VALIDATIONS, UserInputError, check_choice
from ..engine.lowrank import LowRankLinear
from ..engine.model_modes import keep_eval
from ..engine.shared import shared_copy, unshare
from ..engine.target_layers import is_compressed
from ..engine.settings import takes_settings
from ..scoring.influence import tracin_scores
from ..training.causal_lm import full_state_dict, is_sharded, linear_warmup_decay, resolve_model
from .fsdp import (
    ProxyBlocks, factor_shards, reshard_proxy, shard_proxy, shard_teacher, sharded_modules, unshard_proxy, unsharded_copy,
)

log = logging.getLogger(__name__)

# ``fidelity_scorer=None``: the product's TracIn (:func:`~iprox_lightning.scoring.influence.tracin_scores`; the
# alignment wing sits above the scoring wing); a callable passed from Python (or a YAML class/function path that
# jsonargparse resolves) replaces it
DEFAULT_FIDELITY_SCORES = "tracin (default ScoringConfig), score = cos(g(z), mean validation gradient)"


def _is_proxy_dir(source: Any) -> bool:
    return isinstance(source, str) and (Path(source) / PROXY_MANIFEST).is_file()


def _check_same_blocks(teacher: nn.Module, proxy: nn.Module, source: Any, align: bool) -> None:
    """Stage 2 pairs proxy and teacher layers by module path, so an aligned proxy must keep every decoder block of
    its target (a proxy built with ``drop_blocks`` renumbers the kept blocks: block ``i`` of it is not the
    target's block ``i``)."""
    n_t = getattr(getattr(teacher, "config", None), "num_hidden_layers", None)
    n_p = getattr(getattr(proxy, "config", None), "num_hidden_layers", None)
    if align and n_t is not None and n_p is not None and n_t != n_p:
        raise UserInputError(f"ProxyAlignModule: the proxy {source!r} has {n_p} decoder blocks and the target {n_t}; "
                             "alignment pairs layers by path, so a proxy with dropped blocks cannot be aligned "
                             "(use align: false, or build the proxy without drop_blocks)")


@dataclass(frozen=True)
class AlignConfig:
    """The settings of Stage 2 (the alignment objective and its optimisation), checked when built.

    ``ProxyAlignModule`` builds it from its options (same names) and keeps it as ``module.config``; it is
    written verbatim into the ``"alignment"`` block of the proxy manifest.

    Args:
        lr: AdamW learning rate over the factors (paper grid {1e-5, 5e-5, 1e-4}).
        weight_decay: AdamW weight decay (paper: 0.01).
        kl_weight: λ_KL, the weight of the logits anchor (paper grid {0, 0.1, 0.01, 0.001}); 0 disables it.
        temperature: τ of the KL term.
        align: ``False`` → the IPSVD-only ablation: no alignment step, ``fit`` just saves the proxy.
        grad_through_projection: keep the projections ``sg(∇_W L)·Bᵀ``, ``Aᵀ·sg(∇_W L)`` differentiable in the
            factors (the paper's formula; keeps each layer's per-token ``h``/``δ`` for the step) — ``False`` treats
            them as constants (memory of the projections only).
        layers: restrict alignment to these proxy layer paths (default: every ``LowRankLinear``).
        warmup_ratio: share of the steps with a linear learning-rate warm-up.
        lr_schedule: ``"constant"`` (default: the paper states no schedule) or ``"linear"`` (decay to 0).
        keep_best: after every validation run, compare the held-out ``monitor`` (a logged ``val/*`` metric, lower is
            better; default ``val/loss`` = held-out ``L_GA + λ_KL·L_KL``) with the best so far and keep a copy of
            the factors that reached it; at the end of ``fit`` the best factors are restored before saving (the
            manifest records the step, the value and every validation result). The un-aligned factors are a
            candidate too: evaluated on the full validation loader before the first step, they are recorded at step
            0. Without a validation loader nothing is kept and the last factors are saved.
        monitor: the held-out metric of ``keep_best``: ``val/loss`` (default), another logged ``val/*`` metric, or
            ``val/fidelity_loss`` (``1 −`` the ranking fidelity; needs ``fidelity_examples > 0``), or
            ``val/fidelity_worst_loss`` (``1 −`` the worst task's; needs ``fidelity_per_task`` too). With a task
            term on (``val_grad_weight`` / ``score_weight``), ``keep_best`` needs a ``val/fidelity*`` monitor:
            ``val/loss`` does not contain the task terms.
        fidelity_examples: ``n > 0`` → measure the proxy's ranking fidelity at step 0 and after every validation
            run: the Spearman correlation of its TracIn scores with the frozen target's (scored once) on ``n``
            held-out pool examples in no other split (the datamodule's ``fidelity_dataloader(n)``), against the
            datamodule's validation examples; logged as ``val/fidelity_spearman`` and ``val/fidelity_loss`` and
            recorded in the manifest. One check costs a forward+backward of the proxy over the validation and the
            ``n`` fidelity examples. ``0`` (default): off.
        fidelity_per_task: with ``fidelity_examples > 0``, also score against each validation task (the batch's
            ``task``, e.g. ``mmlu``/``bbh``/``tydiqa``) in the same pass and log ``val/fidelity_<task>`` (Spearman
            per task), ``val/fidelity_worst`` (the minimum) and ``val/fidelity_worst_loss = 1 −`` it; ``monitor:
            val/fidelity_worst_loss`` keeps the factors whose worst task ranks best. ``False`` (default): pooled
            only.
        val_grad_weight: ``w > 0`` adds ``w · L_val``: per task ``t``, ``1 − cos(ḡ_proxy,t, P(ḡ_target,t))`` of the
            summed per-example gradients of a batch of the task's validation examples, over the whole factor space
            (:func:`~iprox_lightning.alignment.task.task_gradient_alignment`); the examples are the datamodule's
            ``val_train`` split (``SFTDataModule(val_train_fraction > 0)``), never the monitoring ones. ``0``: off.
        val_examples_per_task: examples of each task in the ``L_val`` batch of a step (``datamodule.task_batches``).
        val_grad_chunk: rows of that batch per pass (default 4): the same loss and gradient as one graph, with the
            double backward and the target's pairs bounded by the chunk (one more plain proxy pass and one more
            target pass; :func:`~iprox_lightning.alignment.task.task_gradient_alignment`). ``None``: one graph (12
            rows on SmolLM2-135M took 22 GB).
        score_weight: ``w > 0`` adds ``w · L_score``: agreement of the proxy's TracIn scores of the alignment batch
            with the target's, per task (:func:`~iprox_lightning.alignment.task.score_alignment_loss`), against
            validation directions from the ``val_train`` examples. Its per-example features ride on the passes of
            ``L_GA``. ``0``: off.
        score_loss: ``"pearson"`` (``1 −`` Pearson correlation over the batch, default) or ``"listwise"`` (ListNet:
            KL of the softmax of the standardised scores; the top of the batch weighs most).
        score_refresh_every: the proxy's validation directions of ``L_score`` are recomputed (one forward+backward
            of the proxy over the ``val_train`` examples) every this many steps (the target's: once per fit).
        task_reduction: ``"mean"`` (default) or ``"max"`` (the worst task) over tasks, for both terms.
        proxy_validation: whose validation gradients the proxy's scores use inside Stage 2 — in the score term's
            reference directions and the fidelity check: ``"proxy"`` (default: its own, as the paper scores a proxy)
            or ``"target"`` (the target's, projected into the proxy's factor space: ``v^P_t = P(v^T_t)``,
            :func:`~iprox_lightning.alignment.task.projected_directions`, re-made every step at no extra pass; the
            fidelity scorer is then called with ``validation_model=<the target>``), which is how ``pipeline``
            scores a proxy by default (``--proxy_validation target``).
        activation_checkpointing: checkpoint the decoder blocks of both forwards (the same losses and gradients, more
            time; measured on CPU, the step's peak does not fall: GUIDE "Stage 2 at scale"). ``False``: off.
        micro_batch_size: rows per pass; the batch's loss and gradient accumulated exactly (2 target, 2 proxy
            passes each; FSDP2: the global batch's; no task terms). ``None``: the whole batch.
        reshard_proxy: FSDP2: gather the proxy one decoder block at a time, not whole for the step (the same
            losses; more all-gathers; :class:`~iprox_lightning.alignment.fsdp.ProxyBlocks`). Not with checkpointing.
    """

    lr: float = 5e-5
    weight_decay: float = 0.01
    kl_weight: float = 0.1
    temperature: float = 2.0
    align: bool = True
    grad_through_projection: bool = True
    layers: Optional[tuple[str, ...]] = None
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"
    keep_best: bool = True
    monitor: str = "val/loss"
    fidelity_examples: int = 0
    fidelity_per_task: bool = False
    val_grad_weight: float = 0.0
    val_examples_per_task: int = 2
    val_grad_chunk: Optional[int] = 4
    score_weight: float = 0.0
    score_loss: str = "pearson"
    score_refresh_every: int = 10
    task_reduction: str = "mean"
    proxy_validation: str = "proxy"
    activation_checkpointing: bool = False
    micro_batch_size: Optional[int] = None
    reshard_proxy: bool = False

    @property
    def task_terms(self) -> bool:
        """Whether a term trained on the ``val_train`` examples is on."""
        return bool(self.val_grad_weight or self.score_weight)

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.kl_weight < 0:
            raise UserInputError(f"kl_weight must be >= 0, got {self.kl_weight}")
        if self.temperature <= 0:
            raise UserInputError(f"temperature must be > 0, got {self.temperature}")
        if isinstance(self.fidelity_examples, bool) or not isinstance(self.fidelity_examples, int) \
                or self.fidelity_examples < 0:
            raise UserInputError(f"fidelity_examples must be an int >= 0, got {self.fidelity_examples!r}")
        for name in ("val_grad_weight", "score_weight"):
            if not getattr(self, name) >= 0:
                raise UserInputError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("val_examples_per_task", "score_refresh_every", "val_grad_chunk"):
            v = getattr(self, name)
            if name == "val_grad_chunk" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserInputError(f"{name} must be an int >= 1, got {v!r}")
        if self.score_loss not in SCORE_LOSSES:
            raise UserInputError(f"score_loss must be one of {SCORE_LOSSES}, got {self.score_loss!r}")
        check_choice("proxy_validation", self.proxy_validation, PROXY_VALIDATIONS)
        if self.task_reduction not in TASK_REDUCTIONS:
            raise UserInputError(f"task_reduction must be one of {TASK_REDUCTIONS}, got {self.task_reduction!r}")
        if self.keep_best and self.monitor.startswith("val/fidelity") and self.fidelity_examples == 0:
            raise UserInputError(f"monitor={self.monitor!r} needs fidelity_examples > 0 (the held-out pool examples the "
                             "ranking fidelity is measured on)")
        if not isinstance(self.fidelity_per_task, bool):
            raise UserInputError(f"fidelity_per_task must be true or false, got {self.fidelity_per_task!r}")
        if self.fidelity_per_task and self.fidelity_examples == 0:
            raise UserInputError("fidelity_per_task needs fidelity_examples > 0 (the held-out pool examples the per-task "
                             "ranking fidelity is measured on)")
        if self.keep_best and self.monitor in (FIDELITY_WORST, FIDELITY_WORST_LOSS) and not self.fidelity_per_task:
            raise UserInputError(f"monitor={self.monitor!r} needs fidelity_per_task: true")
        if self.keep_best and self.task_terms and not self.monitor.startswith("val/fidelity"):
            # the held-out val/* losses are L_GA + λ_KL·L_KL: the task terms trade them for the ranking, so keep_best
            # would keep the factors from before the terms acted (measured: the +score1 row of issue 22 kept step 0)
            raise UserInputError(
                f"keep_best with monitor={self.monitor!r} cannot judge the task terms (val_grad_weight="
                f"{self.val_grad_weight}, score_weight={self.score_weight}): that held-out metric is L_GA + λ_KL·L_KL, "
                "which they trade for the per-task ranking. Use monitor: val/fidelity_worst_loss (with "
                "fidelity_examples > 0 and fidelity_per_task: true) or val/fidelity_loss, or keep_best: false")
        if not isinstance(self.activation_checkpointing, bool):
            raise UserInputError(f"activation_checkpointing must be true or false, got {self.activation_checkpointing!r}")
        if self.micro_batch_size is not None:
            if isinstance(self.micro_batch_size, bool) or not isinstance(self.micro_batch_size, int) \
                    or self.micro_batch_size < 1:
                raise UserInputError(f"micro_batch_size must be an int >= 1 or null, got {self.micro_batch_size!r}")
            if self.task_terms:
                raise UserInputError(f"micro_batch_size={self.micro_batch_size} cannot be combined with the task terms "
                                     f"(val_grad_weight={self.val_grad_weight}, score_weight={self.score_weight}): "
                                     "set micro_batch_size: null, or turn the task terms off")
        if not isinstance(self.reshard_proxy, bool):
            raise UserInputError(f"reshard_proxy must be true or false, got {self.reshard_proxy!r}")
        if self.reshard_proxy and self.activation_checkpointing:
            # a checkpointed block's recomputation runs outside FSDP2's hooks: its parameters are not gathered then
            raise UserInputError("reshard_proxy: true cannot be combined with activation_checkpointing: true (the "
                                 "recomputed blocks would read freed parameters): turn one of them off")
        if self.reshard_proxy and self.task_terms:
            raise UserInputError(f"reshard_proxy: true cannot be combined with the task terms (val_grad_weight="
                                 f"{self.val_grad_weight}, score_weight={self.score_weight}): turn one of them off")
        if self.keep_best and self.monitor == FIDELITY_WORST:
            raise UserInputError(f"monitor={FIDELITY_WORST!r} is higher-is-better and keep_best keeps the lowest value: "
                             f"use {FIDELITY_WORST_LOSS!r} (= 1 − the worst task's Spearman)")


class ProxyAlignModule(L.LightningModule):
    """Stage 2 alignment of a low-rank proxy to its target (see the module docstring).

    The alignment settings (``lr``, ``kl_weight``, ... ``task_reduction``) are the fields of :class:`AlignConfig`,
    given as keywords (YAML ``init_args``, the command line) or whole as ``alignment=AlignConfig(...)``
    (:func:`~iprox_lightning.engine.settings.takes_settings`); the built config is ``module.config``.

    Args:
        target: the (warmed-up) target model — hub id, directory, ``.gguf`` or ``"builtin"``; or an ``nn.Module``.
        proxy: a saved proxy directory (or module) to start from; ``None``: a copy of the target sharing its tensors
            (:func:`~iprox_lightning.engine.shared.shared_copy`; its own once compressed) that
            ``IPSVDCallback`` compresses before training.
        save_dir: where the aligned proxy is saved at the end of ``fit``.
        dtype: dtype of both models when loaded by name (under ``trainer.precision: bf16-true``: bfloat16, which the
            run converts them to anyway).
        log_layer_cosines: log every layer's cosines (``align/cos_A/<layer>``, ``align/cos_B/<layer>``).
        fidelity_scorer: how the fidelity check scores examples: ``scorer(model, loader, validation_batches,
            progress=False)`` returning a table with ``ids``, ``scores``, ``settings``; ``None``: the product's
            TracIn (:func:`~iprox_lightning.scoring.influence.tracin_scores`, default ``ScoringConfig``).
    """

    @takes_settings(AlignConfig, "alignment")
    def __init__(
        self,
        target: Union[str, nn.Module] = "builtin",
        proxy: Optional[Union[str, nn.Module]] = None,
        *,
        save_dir: Optional[str] = None,
        dtype: str = "float32",
        log_layer_cosines: bool = True,
        fidelity_scorer: Optional[Callable] = None,
        alignment: Optional[AlignConfig] = None,
    ) -> None:
        # not super(): Lightning's save_hyperparameters reads the init arguments from the frame of an __init__ that
        # has a __class__ cell, by the names of the public signature, which here are the AlignConfig fields the
        # frame does not hold (takes_settings); the hyper-parameters are given whole below instead
        L.LightningModule.__init__(self)
        if save_dir:  # before any training: the proxy never replaces its target (or the proxy it starts from)
            check_output_not_input(save_dir, {"target": target, "proxy": proxy}, "save_dir")
        self.config = config = alignment
        # the hyper-parameters (checkpoints, hparams.yaml): the module's own arguments and the settings, flat as the
        # CLI and YAML give them (a nn.Module target / proxy and the scorer are not hyper-parameters)
        hparams = {k: v for k, v in (("target", target), ("proxy", proxy)) if not isinstance(v, nn.Module)}
        hparams.update(save_dir=save_dir, dtype=dtype, log_layer_cosines=log_layer_cosines)
        hparams.update({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()})
        self.save_hyperparameters(hparams)
        # plain attributes (never registered submodules, even when given as nn.Module)
        object.__setattr__(self, "target_source", target)
        object.__setattr__(self, "proxy_source", proxy)
        object.__setattr__(self, "_teacher", None)  # outside the module tree: no state_dict, no DDP/FSDP
        object.__setattr__(self, "_teacher_skeleton", None)  # FSDP2: the sharded teacher's modules, meta parameters
        self.proxy: Optional[nn.Module] = None
        self.tokenizer: Any = None
        self.ipsvd_report: Any = None  # set by IPSVDCallback after compressing; goes into the saved manifest
        # the held-out record / keep_best and the ranking-fidelity check: callbacks (configure_callbacks)
        self.best_factors = KeepBestFactors(monitor=config.monitor if config.keep_best else None,
                                         evaluate_step0=(config.keep_best and config.align)
                                         or bool(config.fidelity_examples))
        self.ranking_fidelity: Optional[RankingFidelity] = None
        self._task_batches: Any = None  # the task terms' inputs (each fit anew): val_train batches, directions
        self.directions: Optional[TaskDirections] = None
        if config.fidelity_examples:
            scorer = fidelity_scorer if fidelity_scorer is not None else tracin_scores
            self.ranking_fidelity = RankingFidelity(config.fidelity_examples, scorer, description=(
                DEFAULT_FIDELITY_SCORES if fidelity_scorer is None else getattr(scorer, "__qualname__", str(scorer))),
                per_task=config.fidelity_per_task, target_validation=config.proxy_validation == "target")

    def configure_callbacks(self) -> list[L.Callback]:
        """The fidelity check (which logs its metrics at the end of each validation epoch) and the held-out
        record / ``keep_best`` (which reads every ``val/*`` metric at the end of the validation run)."""
        return [cb for cb in (self.ranking_fidelity, self.best_factors) if cb is not None]

    @property
    def validation_history(self) -> list[dict[str, float]]:
        """Every held-out result of the fits so far (``{"step", "val/...": value}``, step 0 included)."""
        return self.best_factors.history

    # ------------------------------------------------------------------------------------- models
    @property
    def teacher(self) -> Optional[nn.Module]:
        """The frozen target (eval mode, no grad); not a registered submodule."""
        return self._teacher

    @property
    def aligns(self) -> bool:
        """Whether Stage 2 trains the factors (``align``; ``False``: the IPSVD-only proxy is saved as built)."""
        return self.config.align

    def configure_model(self) -> None:
        """Build teacher and proxy (idempotent) and (re)apply the trainable set: only ``LowRankLinear``
        factors. Safe to call again after ``IPSVDCallback`` swapped layers (Lightning does)."""
        if self.proxy is None:
            # bf16-true converts both models to bfloat16: loaded so, the float32 model never exists (the same values)
            dtype = "bfloat16" if self._trainer is not None and self.trainer.precision == "bf16-true" else self.hparams.dtype
            teacher, tok = resolve_model(self.target_source, dtype)
            teacher.eval().requires_grad_(False)
            object.__setattr__(self, "_teacher", teacher)
            if self.proxy_source is None:  # the teacher's tensors, shared until IPSVDCallback compresses the proxy
                proxy = shared_copy(teacher)
            else:
                proxy, ptok = resolve_model(self.proxy_source, dtype)
                tok = tok if tok is not None else ptok
                _check_same_blocks(teacher, proxy, self.proxy_source, self.config.align)
            self.tokenizer = tok
            if hasattr(proxy, "config"):
                proxy.config.use_cache = False
            self.proxy = proxy
        elif is_compressed(self.proxy):  # compressed: its other tensors become its own (Stage 2 as with a copy)
            unshare(self.proxy, self._teacher)
        self._set_trainable()
        if self._device_mesh is not None and not is_sharded(self.proxy) and any(
                isinstance(m, LowRankLinear) for m in self.proxy.modules()):
            shard_proxy(self.proxy, self._device_mesh, per_block=self.config.reshard_proxy)
            # after Stage 1 (which ran on the whole teacher): its skeleton rebuilds the saved proxy
            object.__setattr__(self, "_teacher_skeleton", shard_teacher(self._teacher, self._device_mesh))

    def on_fit_start(self) -> None:
        # The proxy runs in eval mode (no dropout; alignment_step switches it before every forward). Hand it
        # to the fit loop in train mode so Lightning's "modules in eval mode at the start of training" check,
        # meant for accidental eval mode, stays quiet for this intentional one.
        if self.proxy is not None:
            self.proxy.train()
        self._task_batches, self.directions = None, None
        if not self.config.align and self._trainer is not None:
            # IPSVD-only: nothing trains, so Lightning's sanity validation (a double backward per batch) has nothing
            # to check; the proxy's health line (IPSVDCallback) is its look at held-out data
            self.trainer.num_sanity_val_steps = 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.reshard()  # FSDP2: drop the stale unsharded factors after the optimiser step

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.reshard()

    def reshard(self) -> None:
        """FSDP2: free the proxy's gathered parameters (a no-op for an unsharded proxy)."""
        reshard_proxy(self.proxy)

    def _set_trainable(self) -> None:
        self.proxy.eval()
        self.proxy.requires_grad_(False)
        only = set(self.config.layers) if self.config.layers is not None else None
        for name, m in self.proxy.named_modules():
            if isinstance(m, LowRankLinear) and (only is None or name in only):
                m.A.requires_grad_(True)
                m.B.requires_grad_(True)

    def factor_parameters(self) -> list[nn.Parameter]:
        """The trainable ``A``/``B`` of the aligned layers, in model order."""
        return [p for m in proxy_factor_layers(self.proxy, self.config.layers).values() for p in (m.A, m.B)]

    def factors_finite(self) -> bool:
        """Whether every trainable factor is finite (an FSDP2-sharded proxy's count as finite: not checked)."""
        return is_sharded(self.proxy) or all(bool(torch.isfinite(p.detach()).all()) for p in self.factor_parameters())

    def _apply(self, fn, *args, **kwargs):
        # ``.to(device)``, ``.cuda()``, ``.double()`` … also reach the unregistered teacher
        super()._apply(fn, *args, **kwargs)
        if self._teacher is not None:
            self._teacher._apply(fn, *args, **kwargs)
        return self

    # ------------------------------------------------------------------------------------- steps
    def alignment_step(self, batch: dict, *, create_graph: bool = True) -> AlignmentOutput:
        """``L_GA + λ_KL·L_KL`` on ``batch`` (see :func:`iprox_lightning.alignment.losses.alignment_losses`)."""
        keep_eval(self.proxy, self._teacher)
        cfg = self.config
        # FSDP2 with micro-batches: the global batch's objective, its accumulation buffers sharded as the factors
        shards = None if cfg.micro_batch_size is None else factor_shards(self.proxy, self._device_mesh, cfg.layers)
        per_block = cfg.reshard_proxy and bool(sharded_modules(self.proxy))
        if not per_block:
            unshard_proxy(self.proxy)  # FSDP2: the teacher pass projects with the factors the proxy forward uses
        common = dict(kl_weight=cfg.kl_weight, temperature=cfg.temperature,
                      grad_through_projection=cfg.grad_through_projection, create_graph=create_graph,
                      layers=cfg.layers, checkpointing=cfg.activation_checkpointing)
        # reshard_proxy: one block gathered at a time, again where the double backward's graph reads it
        with (ProxyBlocks(self.proxy) if per_block else contextlib.nullcontext()) as blocks:
            if cfg.micro_batch_size is not None:
                return accumulated_alignment_losses(self._teacher, self.proxy, batch, cfg.micro_batch_size,
                                                    shards=shards, blocks=blocks, **common)
            return alignment_losses(self._teacher, self.proxy, batch, blocks=blocks, **common)

    @staticmethod
    def _output_metrics(out: AlignmentOutput, prefix: str, per_layer: bool) -> dict[str, torch.Tensor]:
        """The metrics of one batch's :class:`AlignmentOutput` under ``prefix/`` (what is logged)."""
        cos_a, cos_b = out.mean_cosines()
        d = {f"{prefix}/l_ga": out.l_ga, f"{prefix}/loss": out.loss.detach(), f"{prefix}/l_kl": out.l_kl,
             f"{prefix}/cos_A_mean": cos_a, f"{prefix}/cos_B_mean": cos_b,
             f"{prefix}/proxy_sft": out.proxy_sft, f"{prefix}/teacher_sft": out.teacher_sft}
        if per_layer:
            d.update({f"{prefix}/cos_A/{n}": c for n, c in out.cos_a.items()})
            d.update({f"{prefix}/cos_B/{n}": c for n, c in out.cos_b.items()})
        return d

    def _log_output(self, out: AlignmentOutput, prefix: str, batch_size: int, per_layer: bool) -> None:
        on_step = prefix == "align"
        sync = prefix != "align"
        d = self._output_metrics(out, prefix, per_layer)
        self.log(f"{prefix}/l_ga", d.pop(f"{prefix}/l_ga"), prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 batch_size=batch_size, sync_dist=sync)
        self.log_dict(d, on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=sync)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        if not self.config.align:
            return -1  # IPSVD-only ablation: skip the epoch, on_fit_end still saves
        return None

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if self.config.task_terms:
            return self._task_training_step(batch)
        out = self.alignment_step(batch, create_graph=True)
        self._log_output(out, "align", batch["input_ids"].shape[0], self.hparams.log_layer_cosines)
        return out.loss

    # ------------------------------------------------------------------------------------- task terms
    def _val_train(self):
        """The datamodule serving the ``val_train`` examples (checked)."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is None or not hasattr(dm, "task_batches") or not getattr(dm, "val_train_fraction", 0):
            raise ValueError("ProxyAlignModule: val_grad_weight / score_weight > 0 train on validation examples set "
                             "apart from the monitoring ones: use SFTDataModule(val_train_fraction > 0)")
        return dm

    def _to_device(self, batch: dict) -> dict:
        return self.trainer.strategy.batch_to_device(batch)

    def _refresh_directions(self) -> TaskDirections:
        """The score term's validation directions: the target's once per fit, the proxy's every
        ``score_refresh_every`` steps (over every ``val_train`` example), or with ``proxy_validation="target"`` the
        target's projected by the current factors at every step (no pass)."""
        d = self.directions
        step = int(self.global_step)
        by_target = self.config.proxy_validation == "target"
        every = 1 if by_target else self.config.score_refresh_every  # the target's projection costs no pass
        if d is not None and d.proxy_step is not None and step - d.proxy_step < every:
            return d
        layers = list(proxy_factor_layers(self.proxy, self.config.layers))
        batches = None
        if d is None or not by_target:
            batches = [self._to_device(b) for b in self._val_train().val_train_dataloader()]
        if d is None:
            d = task_directions(self._teacher, batches, layers)
            log.info("score-space alignment: target directions of %d tasks from %d validation examples",
                     len(d.tasks), d.examples)
        if by_target:
            d.proxy, d.proxy_sq = projected_directions(self.proxy, d, layers)
        else:
            d.proxy, d.proxy_sq = proxy_directions(self.proxy, batches, d.tasks, layers)
        d.proxy_step = step
        self.directions = d
        return d

    def _task_training_step(self, batch: dict) -> torch.Tensor:
        cfg = self.config
        keep_eval(self.proxy, self._teacher)
        unshard_proxy(self.proxy)
        val_batch = None
        if cfg.val_grad_weight:
            if self._task_batches is None:
                self._task_batches = self._val_train().task_batches(cfg.val_examples_per_task)
            val_batch = self._to_device(next(self._task_batches))
        directions = self._refresh_directions() if cfg.score_weight else None
        out = task_alignment_losses(
            self._teacher, self.proxy, batch, val_batch=val_batch, val_grad_weight=cfg.val_grad_weight,
            val_grad_chunk=cfg.val_grad_chunk, directions=directions, score_weight=cfg.score_weight, score_loss=cfg.score_loss,
            task_reduction=cfg.task_reduction, kl_weight=cfg.kl_weight, temperature=cfg.temperature,
            grad_through_projection=cfg.grad_through_projection, create_graph=True, layers=cfg.layers,
            checkpointing=cfg.activation_checkpointing)
        size = batch["input_ids"].shape[0]
        self._log_output(out, "align", size, self.hparams.log_layer_cosines)
        extra: dict[str, torch.Tensor] = {}
        if out.l_val_grad is not None:
            extra["align/l_val_grad"] = out.l_val_grad
            extra.update({f"align/val_grad_cos/{t}": c for t, c in out.val_grad_cos.items()})
        if out.l_score is not None:
            extra["align/l_score"] = out.l_score
            extra.update({f"align/score_loss/{t}": v for t, v in out.score_per_task.items() if torch.isfinite(v)})
        self.log_dict(extra, on_step=True, on_epoch=False, batch_size=size)
        return out.loss

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        # cosines on held-out data need gradients: leave inference mode; clone inference tensors
        with torch.inference_mode(False), torch.enable_grad():
            batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            out = self.alignment_step(batch, create_graph=False)
        self._log_output(out, "val", batch["input_ids"].shape[0], self.hparams.log_layer_cosines)

    def _val_loaders(self) -> list:
        """The fit loop's validation loaders (set up as Lightning does, e.g. with the distributed sampler)."""
        trainer = self.trainer
        if not trainer.enable_validation:
            return []
        # Internal on purpose: before the first validation run Lightning has not built its validation loaders, and no
        # public call builds them inside fit (trainer.validate cannot run inside fit; the datamodule's own loader
        # would miss the distributed sampler Lightning injects). setup_data() is what the fit loop's first
        # validation run calls itself, so the loaders are the ones it will use.
        if trainer.val_dataloaders is None:
            trainer.validating = True
            trainer.fit_loop.epoch_loop.val_loop.setup_data()
            trainer.training = True
        loaders = trainer.val_dataloaders
        if loaders is None:
            return []
        if isinstance(loaders, dict):
            return list(loaders.values())
        return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]

    def heldout_metrics(self) -> Optional[dict[str, float]]:
        """The ``val/*`` metrics of :meth:`validation_step` over the full validation loader(s), computed here
        (outside Lightning's loop): batch-size weighted means, summed over ranks — Lightning's ``sync_dist``
        epoch mean; ``/dataloader_idx_k`` suffixes with several loaders. ``None`` without a validation loader."""
        loaders = self._val_loaders()
        limits = list(self.trainer.num_val_batches) or [float("inf")] * len(loaders)
        if not loaders or not sum(limits):
            return None
        sums: dict[str, list[float]] = {}
        for i, (loader, limit) in enumerate(zip(loaders, limits)):
            suffix = f"/dataloader_idx_{i}" if len(loaders) > 1 else ""
            for j, batch in enumerate(loader):
                if j >= limit:
                    break
                batch = self.trainer.strategy.batch_to_device(batch, dataloader_idx=i)
                with torch.enable_grad():
                    out = self.alignment_step(batch, create_graph=False)
                self.reshard()
                size = batch["input_ids"].shape[0]
                for k, v in self._output_metrics(out, "val", self.hparams.log_layer_cosines).items():
                    acc = sums.setdefault(k + suffix, [0.0, 0.0])
                    acc[0] += float(v) * size
                    acc[1] += size
        names = sorted(sums)
        if not names:
            return None
        total = torch.tensor([sums[k] for k in names], dtype=torch.float64, device=self.device)
        total = self.trainer.strategy.reduce(total, reduce_op="sum")
        return {k: float(s / w) for k, (s, w) in zip(names, total.tolist())}

    # ------------------------------------------------------------------------------------- optim
    def configure_optimizers(self):
        params = self.factor_parameters()
        ids = {id(p) for p in params}
        extra = [n for n, p in self.proxy.named_parameters() if p.requires_grad and id(p) not in ids]
        if extra:
            raise RuntimeError(f"ProxyAlignModule: only LowRankLinear factors may train, but {extra[:5]} require grad")
        if self._teacher is not None and any(p.requires_grad for p in self._teacher.parameters()):
            raise RuntimeError("ProxyAlignModule: the teacher must be frozen")
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        if not self.config.align or (self.config.lr_schedule == "constant" and self.config.warmup_ratio == 0):
            return opt  # IPSVD-only: no step is taken, so a scheduler would only warn that it stepped first
        total = self.trainer.estimated_stepping_batches
        sched = linear_warmup_decay(opt, int(total), self.config.warmup_ratio, self.config.lr_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------------------------- saving
    def on_fit_end(self) -> None:
        # KeepBestFactors (a callback: Lightning runs it first) has restored the best factors
        if self.hparams.save_dir:
            self.save_proxy(self.hparams.save_dir)

    def save_proxy(self, save_dir: str) -> Path:
        """Write the proxy directory (:func:`iprox_lightning.compression.apply.save_proxy`) on rank 0."""
        path = Path(save_dir)
        zero = self.trainer.is_global_zero if self._trainer is not None else True
        full = full_state_dict(self.proxy)  # collective under FSDP2 (full tensors on rank 0)
        if zero:
            proxy = self.proxy if full is None else unsharded_copy(
                self._teacher if self._teacher_skeleton is None else self._teacher_skeleton, self.proxy, full)
            manifest = self.ipsvd_report
            if manifest is None and _is_proxy_dir(self.proxy_source):
                manifest = {k: v for k, v in read_manifest(self.proxy_source).items()
                            if k not in ("format_version", "layers", "dtype", "params_after")}
            extra: dict[str, Any] = {"alignment": self._alignment_record()}
            if isinstance(self.target_source, str) and not (isinstance(manifest, dict) and manifest.get("target_model")):
                extra["target_model"] = self.target_source
            save_proxy(proxy, self.tokenizer, path, manifest, **extra)

            rank_zero_info(f"ProxyAlignModule: saved the {'aligned ' if self.config.align else ''}proxy to {path}")
        if self._trainer is not None:
            self.trainer.strategy.barrier("save_proxy")
        return path

    def _alignment_record(self) -> dict[str, Any]:
        """The manifest's ``"alignment"`` block: the settings, the steps, the callbacks' reports."""
        held_out = self.best_factors.report()
        extra: dict[str, Any] = {}
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if getattr(dm, "val_train_fraction", 0) and hasattr(dm, "validation_split_record"):
            extra["validation_split"] = dm.validation_split_record()  # which validation examples trained / monitored
        if self.directions is not None:
            extra["task_directions"] = {"tasks": list(self.directions.tasks), "examples": self.directions.examples}
        return {**asdict(self.config), **extra, "aligned": bool(self.config.align),
                "steps": int(self.global_step) if self._trainer is not None else 0,
                "best": held_out["best"], "validation_history": held_out["validation_history"],
                "fidelity": self.ranking_fidelity.report() if self.ranking_fidelity is not None else None}
