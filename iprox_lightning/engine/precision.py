"""Trainer precisions outside Lightning's Trainer: the same arithmetic for the few paths that run a model by hand.

``bf16-mixed`` runs the forward under ``torch.autocast`` (matmuls in bfloat16, the weights and their gradients
float32); ``bf16-true`` casts the weights to bfloat16 and runs everything in it; ``32-true`` (``None``) changes
nothing. Lightning's ``Trainer(precision=...)`` does this for every stage it runs; the store query
(``scoring/store_query.py``) computes its validation gradients by hand, under :func:`precision_context` so that a store
built under a precision is queried under the same one. What stays float32/64 in every precision:
``docs/GUIDE.md`` (Precision).
"""
from __future__ import annotations

import contextlib

import torch

from ..errors import UserInputError

# the Trainer precisions the stages run and test (docs/GUIDE.md, Precision); "32" is Lightning's old spelling
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


def check_precision(precision: str | None, owner: str) -> str | None:
    """``precision`` (``None``: the default, float32) or a one-line :class:`UserInputError` naming ``owner``."""
    if precision is None or precision in PRECISIONS:
        return precision
    raise UserInputError(f"{owner}: precision must be one of {list(PRECISIONS)}, got {precision!r}")


def precision_context(precision: str | None, model: torch.nn.Module):
    """A context in which ``model``'s forward and backward run as the Trainer's ``precision`` runs them: autocast to
    bfloat16 for ``bf16-mixed``; for ``bf16-true`` the model is cast to bfloat16 (in place, once) and no autocast;
    nothing for ``32-true`` / ``None``."""
    if precision == "bf16-mixed":
        device = next(model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    return contextlib.nullcontext()
