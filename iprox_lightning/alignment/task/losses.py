"""Both task terms composed beside ``L_GA`` in one step: :func:`task_alignment_losses`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

import torch
from torch import nn

from ..losses import AlignmentOutput, alignment_losses, proxy_factor_layers
from ...engine.tracking import PairTracker
from .common import FactorPairTracker, TaskDirections, _dense_modules
from .gradient import task_gradient_alignment
from .score import ExampleScoreTracker, score_alignment_loss


@dataclass
class TaskAlignmentOutput(AlignmentOutput):
    """:func:`task_alignment_losses`: :class:`~iprox_lightning.alignment.losses.AlignmentOutput` with ``loss`` the total
    ``L_GA + λ_KL·L_KL + w_val·L_val + w_score·L_score`` and the terms that were on (``None`` otherwise)."""

    l_val_grad: Optional[torch.Tensor] = None
    l_score: Optional[torch.Tensor] = None
    val_grad_cos: dict[str, torch.Tensor] = field(default_factory=dict)
    score_per_task: dict[str, torch.Tensor] = field(default_factory=dict)


def task_alignment_losses(
    teacher: nn.Module,
    proxy: nn.Module,
    batch: Mapping,
    *,
    val_batch: Optional[Mapping] = None,
    val_grad_weight: float = 0.0,
    val_grad_chunk: Optional[int] = None,
    directions: Optional[TaskDirections] = None,
    score_weight: float = 0.0,
    score_loss: str = "pearson",
    task_reduction: str = "mean",
    kl_weight: float = 0.1,
    temperature: float = 2.0,
    grad_through_projection: bool = True,
    create_graph: bool = True,
    layers: Optional[Iterable[str]] = None,
    checkpointing: bool = False,
) -> TaskAlignmentOutput:
    """``L_GA + λ_KL·L_KL`` on ``batch`` (:func:`~iprox_lightning.alignment.losses.alignment_losses`) plus
    ``val_grad_weight · L_val`` on ``val_batch`` (:func:`task_gradient_alignment`, ``val_grad_chunk`` rows per
    create-graph backward) and ``score_weight · L_score`` on
    ``batch`` against ``directions`` (:func:`score_alignment_loss`; its features ride on the passes of ``L_GA``).
    A term whose weight is 0 is not computed. The caller runs one backward of ``loss``. ``checkpointing``: the
    ``L_GA`` passes run their decoder blocks checkpointed (:func:`~iprox_lightning.alignment.losses.alignment_losses`)."""
    proxy_tr: list[PairTracker] = []
    teacher_tr: list[PairTracker] = []
    if score_weight:
        if directions is None or directions.proxy_sq is None:
            raise ValueError("task_alignment_losses: score_weight > 0 needs the task directions (target and proxy)")
        if not create_graph:
            raise ValueError("task_alignment_losses: the score term is a training loss (create_graph=True)")
        lowrank = proxy_factor_layers(proxy, layers)
        pairs = FactorPairTracker(lowrank)
        features = ExampleScoreTracker(_dense_modules(teacher, lowrank), directions.target)
        proxy_tr, teacher_tr = [pairs], [features]
    base = alignment_losses(teacher, proxy, batch, kl_weight=kl_weight, temperature=temperature,
                            grad_through_projection=grad_through_projection, create_graph=create_graph,
                            layers=layers, teacher_trackers=teacher_tr, proxy_trackers=proxy_tr,
                            checkpointing=checkpointing)
    loss = base.loss
    out = TaskAlignmentOutput(**{f: getattr(base, f) for f in AlignmentOutput.__dataclass_fields__})
    if score_weight:
        s = score_alignment_loss(pairs, features, directions, batch, kind=score_loss, reduction=task_reduction)
        loss = loss + score_weight * s.loss
        out.l_score, out.score_per_task = s.loss.detach(), s.per_task
    if val_grad_weight:
        if val_batch is None:
            raise ValueError("task_alignment_losses: val_grad_weight > 0 needs a batch of validation examples")
        v = task_gradient_alignment(teacher, proxy, val_batch, layers=layers, reduction=task_reduction,
                                    grad_through_projection=grad_through_projection, create_graph=create_graph,
                                    chunk_size=val_grad_chunk)
        loss = loss + val_grad_weight * v.loss
        out.l_val_grad, out.val_grad_cos = v.loss.detach(), v.cos
    out.loss = loss
    return out
