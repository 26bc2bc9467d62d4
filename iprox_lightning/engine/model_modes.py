"""Train/eval mode of models: saved and restored around a block (:func:`eval_mode`), or kept off (:func:`keep_eval`)."""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(*models: nn.Module) -> Iterator[None]:
    """Put ``models`` in eval mode (dropout off) for the block; each gets its own train/eval flag back after it,
    also when the block raises. (Only the top module's flag is saved, as ``model.train(was_training)`` did.)"""
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, was in zip(models, was_training):
            m.train(was)


def keep_eval(*models: nn.Module) -> None:
    """Put each of ``models`` that is in train mode into eval mode, and leave it there (Stage 2 steps with dropout
    off: it undoes the ``train()`` Lightning calls at each epoch start)."""
    for m in models:
        if m.training:
            m.eval()
