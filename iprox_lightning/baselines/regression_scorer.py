"""Regression-scorer baseline: the paper's Influence Scorer baseline (MATES-style regression head; Yu et al.
2024, Gu et al. 2024). Not influence scoring itself (that is :mod:`iprox_lightning.scoring.influence`): a
learned model that predicts the target's influence scores.

The target model scores a small hold-out of the pool (1 % in the paper); a small backbone LM with
a regression head learns to predict those scores and then scores the whole pool. As in the paper
(Appendix A.1): the backbone is the off-the-shelf proxy, every backbone layer is frozen (only the
head trains, unless ``trainable_blocks > 0`` unfreezes the last blocks), Adam with weight decay
``1e-2`` (L2, ``torch.optim.Adam``), learning rate ``1e-5``, 5 epochs.

Model: ``ŷ(z) = w · pool(h_L(z)) + b`` with ``h_L`` the backbone's last hidden states (after its
final norm) and ``pool`` the mean over real tokens (``"mean"``) or the last real token
(``"last"``). Targets are z-scored with the training mean / std (stored as buffers) and the loss is
the MSE on the z-scored targets; predictions are mapped back to the target scale, so they live in
the same units as the target scores (rankings are what selection uses).

Plain functions: :func:`fit_regression_scorer`, :func:`predict_scores` (the ``regression_scorer`` command,
:mod:`iprox_lightning.commands.regression_scorer`, runs them).
"""
from __future__ import annotations

import logging
import random
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..analysis.retention import pearson, spearman
from ..engine.batch import check_batch
from ..engine.blocks import decoder_blocks
from ..errors import UserInputError
from ..models.loading import load_model
from ..progress import progress as progress_of

log = logging.getLogger(__name__)

POOLINGS = ("mean", "last")


class RegressionLM(nn.Module):
    """A (frozen) causal-LM backbone + a linear regression head on pooled last hidden states."""

    def __init__(self, lm: nn.Module, *, pooling: str = "mean", trainable_blocks: int = 0) -> None:
        super().__init__()
        if pooling not in POOLINGS:
            raise UserInputError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        self.backbone = getattr(lm, "base_model", lm)  # the decoder without the LM head
        hidden = int(lm.config.hidden_size)
        self.head = nn.Linear(hidden, 1)
        self.register_buffer("target_mean", torch.zeros((), dtype=torch.float64))
        self.register_buffer("target_std", torch.ones((), dtype=torch.float64))
        self.backbone.requires_grad_(False)
        self.trainable_blocks = int(trainable_blocks)
        if self.trainable_blocks > 0:
            _, blocks = decoder_blocks(lm)
            if self.trainable_blocks > len(blocks):
                raise UserInputError(f"trainable_blocks={trainable_blocks} but the backbone has {len(blocks)} blocks")
            for blk in list(blocks)[-self.trainable_blocks :]:
                blk.requires_grad_(True)

    @property
    def backbone_frozen(self) -> bool:
        return not any(p.requires_grad for p in self.backbone.parameters())

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled last hidden states ``[B, hidden]`` (float32)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.backbone_frozen):
            h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        h = h.float()
        mask = attention_mask.to(h.dtype)
        if self.pooling == "mean":
            return (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        last = (attention_mask.sum(1) - 1).clamp(min=0)
        return h[torch.arange(h.shape[0], device=h.device), last]

    def head_forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Prediction on the z-scored target scale, ``[B]``."""
        return self.head(feats.to(self.head.weight.dtype)).squeeze(-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head_forward(self.features(input_ids, attention_mask))

    def to_target_scale(self, z: torch.Tensor) -> torch.Tensor:
        return z.double() * self.target_std + self.target_mean

    def set_target_stats(self, values: Sequence[float]) -> None:
        v = torch.as_tensor(list(values), dtype=torch.float64)
        if v.numel() == 0:
            raise ValueError("no training target")
        std = float(v.std(unbiased=False)) if v.numel() > 1 else 0.0
        self.target_mean.fill_(float(v.mean()))
        self.target_std.fill_(std if std > 0 else 1.0)

    def standardize(self, y: torch.Tensor) -> torch.Tensor:
        return ((y.double() - self.target_mean) / self.target_std).float()


def build_regression_lm(backbone: str | nn.Module, *, pooling: str = "mean", trainable_blocks: int = 0,
                        dtype: str = "float32") -> RegressionLM:
    """A :class:`RegressionLM` on ``backbone`` (hub id / dir / .gguf / ``"builtin"`` via ``load_model``, or a module)."""
    lm, _ = load_model(backbone, dtype=dtype, tokenizer=False) if not isinstance(backbone, nn.Module) else (backbone, None)
    return RegressionLM(lm, pooling=pooling, trainable_blocks=trainable_blocks)


def lookup_targets(ids: Sequence[str], targets: Mapping[str, float], where: str = "target scores") -> torch.Tensor:
    """Targets of ``ids`` as a float64 tensor; ``KeyError`` naming the first missing id."""
    missing = [i for i in ids if str(i) not in targets]
    if missing:
        raise KeyError(f"{len(missing)} example id(s) have no entry in {where}, e.g. {missing[0]!r}")
    return torch.tensor([float(targets[str(i)]) for i in ids], dtype=torch.float64)


def _device_of(m: nn.Module) -> torch.device:
    return next(m.parameters()).device


def fit_regression_scorer(
    scorer: RegressionLM,
    batches: Sequence[Mapping],
    targets: Mapping[str, float],
    *,
    epochs: int = 5,
    lr: float = 1e-5,
    weight_decay: float = 1e-2,
    seed: int = 0,
    eval_batches: Sequence[Mapping] | None = None,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Train the head (and unfrozen blocks) on ``(example, target score)`` pairs; returns per-epoch history.

    ``batches`` must be re-iterable (a list or a DataLoader); their ids are looked up in
    ``targets``. With a frozen backbone the pooled features are computed once and cached (the
    result is identical: the backbone is deterministic in eval mode). Batch order is shuffled
    each epoch with ``seed``. History rows: ``{"epoch", "train_mse"}`` plus ``"eval_spearman"`` /
    ``"eval_pearson"`` (against ``targets``) when ``eval_batches`` are given.
    """
    dev = _device_of(scorer)
    batches = list(batches)
    for b in batches:
        check_batch(b)
    all_ids = [str(i) for b in batches for i in b["id"]]
    scorer.set_target_stats(lookup_targets(all_ids, targets).tolist())
    params = [p for p in scorer.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    rng = random.Random(seed)
    scorer.eval()  # no dropout in the backbone; the head has none
    cached = eval_cached = None
    if scorer.backbone_frozen:
        with torch.no_grad():
            cached = [scorer.features(b["input_ids"].to(dev), b["attention_mask"].to(dev)) for b in batches]
            if eval_batches is not None:
                eval_batches = list(eval_batches)
                eval_cached = [(list(map(str, b["id"])), scorer.features(b["input_ids"].to(dev), b["attention_mask"].to(dev)))
                               for b in eval_batches]
    ys = [scorer.standardize(lookup_targets([str(i) for i in b["id"]], targets)).to(dev) for b in batches]
    history = []

    bar = progress_of(total=epochs * len(batches), desc="regression scorer", unit="batch", enabled=progress)
    try:
        for epoch in range(epochs):
            order = list(range(len(batches)))
            rng.shuffle(order)
            tot, n = 0.0, 0
            for j in order:
                if cached is not None:
                    pred = scorer.head_forward(cached[j])
                else:
                    b = batches[j]
                    pred = scorer(b["input_ids"].to(dev), b["attention_mask"].to(dev))
                loss = F.mse_loss(pred, ys[j])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                tot += loss.item() * len(ys[j])
                n += len(ys[j])
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(mse=f"{tot / n:.4f}")
            row = {"epoch": float(epoch), "train_mse": tot / max(n, 1)}
            if eval_batches is not None:
                row.update(_eval_agreement(scorer, eval_batches, eval_cached, targets))
            history.append(row)
            log.info("regression scorer epoch %d: %s", epoch, row)
    finally:
        if bar is not None:
            bar.close()
    return history


def _eval_agreement(scorer: RegressionLM, eval_batches, eval_cached, targets: Mapping[str, float]) -> dict[str, float]:
    """Spearman and Pearson of the scorer's predictions on ``eval_batches`` (from their cached backbone features
    when there are any) against ``targets``."""
    if eval_cached is not None:
        with torch.no_grad():
            pred = {i: float(v) for ids_, f in eval_cached
                    for i, v in zip(ids_, scorer.to_target_scale(scorer.head_forward(f)).tolist())}
    else:
        pred = predict_scores(scorer, eval_batches, progress=False)
    ids = sorted(pred)
    t = lookup_targets(ids, targets).numpy()
    p = [pred[i] for i in ids]
    return {"eval_spearman": spearman(p, t), "eval_pearson": pearson(p, t)}


@torch.no_grad()
def predict_scores(scorer: RegressionLM, batches: Iterable[Mapping], *, progress: bool = True) -> dict[str, float]:
    """Score every example of ``batches``: ``{id: predicted score}`` on the target-score scale."""
    dev = _device_of(scorer)
    scorer.eval()
    out: dict[str, float] = {}

    it = progress_of(batches, desc="scoring with regression scorer", unit="batch", enabled=progress)
    for b in it:
        check_batch(b)
        z = scorer(b["input_ids"].to(dev), b["attention_mask"].to(dev))
        for i, s in zip(b["id"], scorer.to_target_scale(z).cpu().tolist()):
            out[str(i)] = float(s)
    return out
