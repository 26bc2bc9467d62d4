"""Activation checkpointing of each decoder block in any mode, for the backward-pairs engine's passes (a gradient
store's build): they run the model in eval mode, where Hugging Face's checkpointing is off.

:func:`checkpointed_blocks` runs each decoder block's ``forward`` under ``torch.utils.checkpoint`` (non-reentrant):
the forward keeps only each block's inputs, and the backward recomputes one block at a time. The recompute runs the
block's tracked layers a second time; :func:`recomputing` says so, and the engine's hooks
(:class:`~iprox_lightning.engine.tracking.LayerTracker`) ignore that run: each layer's ``h`` is the one the forward
kept, and its ``δ`` arrives through the forward's own graph, so the pairs, and everything made of them, are the
unchecked run's (the recompute is the same computation).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch import nn

_STATE = threading.local()


def recomputing() -> bool:
    """Whether a checkpointed block is being recomputed in a backward (on this thread)."""
    return getattr(_STATE, "depth", 0) > 0


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run_checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = []

        def run(*a, **k):
            calls.append(1)
            if len(calls) == 1:  # the forward itself
                return forward(*a, **k)
            _STATE.depth = getattr(_STATE, "depth", 0) + 1  # the backward's recompute
            try:
                return forward(*a, **k)
            finally:
                _STATE.depth -= 1

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return run_checkpointed


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the context each decoder block of ``model`` (:func:`~.blocks.decoder_blocks`) runs checkpointed (see
    the module docstring); yields the number of blocks (0 with ``enabled=False``: nothing changes)."""
    if not enabled:
        yield 0
        return
    from .blocks import decoder_blocks

    _, blocks = decoder_blocks(model)
    saved = []
    for block in blocks:
        saved.append((block, block.__dict__.get("forward")))
        block.forward = _checkpointed(block.forward)
    try:
        yield len(saved)
    finally:
        for block, own in saved:
            if own is None:
                del block.forward
            else:
                block.forward = own
