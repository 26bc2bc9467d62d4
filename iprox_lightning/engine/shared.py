"""A copy of a model that shares its tensors (:func:`shared_copy`), and the undoing of that sharing (:func:`unshare`).

Stage 2's proxy starts as the teacher itself: Stage 1 (``IPSVDCallback``) reads the dense weights and swaps the
targeted layers for ``LowRankLinear`` factors, so a dense copy of the whole model is never made. The layers left
dense (embeddings, norms, LM head, spared layers) are then given tensors of their own (:func:`unshare`), as a deep
copy has, so nothing Stage 2 or a precision / device conversion does to one model reaches the other.
"""
from __future__ import annotations

import copy

from torch import nn


def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``model``'s own tensors (the same objects): new
    modules, configs and attributes, no new tensor storage."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def unshare(model: nn.Module, other: nn.Module | None) -> int:
    """Give every parameter and buffer of ``model`` that is one of ``other``'s (:func:`shared_copy`) a copy of its
    own, in place (tied parameters stay tied); returns how many tensors were copied."""
    if other is None:
        return 0
    theirs = {id(t) for t in list(other.parameters()) + list(other.buffers())}
    copies: dict[int, object] = {}
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for key, t in getattr(module, kind).items():
                if t is None or id(t) not in theirs:
                    continue
                if id(t) not in copies:
                    if kind == "_parameters":
                        copies[id(t)] = nn.Parameter(t.detach().clone(), requires_grad=t.requires_grad)
                    else:
                        copies[id(t)] = t.clone()
                getattr(module, kind)[key] = copies[id(t)]
    return len(copies)
