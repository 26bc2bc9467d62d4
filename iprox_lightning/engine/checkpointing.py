"""Activation checkpointing of a causal LM's decoder blocks for passes that hook into the blocks' layers: Stage 2's
two forwards (``ProxyAlignModule(activation_checkpointing=True)``) and a gradient store's passes
(``build_store --gradient_checkpointing``), which run the model in eval mode, where Hugging Face's checkpointing is off
(warm-up and fine-tune use Hugging Face's own: :mod:`iprox_lightning.training.memory_levers`).

:func:`checkpointed_blocks` runs each decoder block (:func:`~iprox_lightning.engine.blocks.decoder_blocks`) under
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the forward keeps only each block's inputs, and a backward
recomputes the block's saved tensors when it reaches the block. Non-reentrant checkpointing keeps the forward's
autograd graph (only its saved tensors are dropped), so

* tensor hooks registered on a layer's output in the forward fire in the backward as without checkpointing
  (the backward-pairs engine, :class:`~iprox_lightning.engine.tracking.LayerTracker`, sees the same ``δ``);
* every backward recomputes what it needs again (PyTorch keys the recomputed tensors by the backward's graph task),
  so ``torch.autograd.grad(..., create_graph=True)`` and a second backward through its graph work: Stage 2's double
  backward recomputes each block once per backward (two extra block forwards per step for the proxy).

The recomputation calls the blocks' submodules again, so their forward hooks fire a second time;
:func:`recomputing` tells such a hook that it runs inside a recomputation (the trackers then do nothing: the pairs
belong to the original forward). The models run in eval mode (no dropout), so the recomputation gives the forward's
values bit for bit on the same device.

Nothing is patched outside the ``with`` block: the blocks' ``forward`` is restored on exit (a backward after it still
recomputes through the original ``forward``), module paths and state dicts are untouched, and FSDP2's hooks on the
blocks (``fully_shard``) wrap the checkpointed call as they wrap the plain one.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .blocks import decoder_blocks

__all__ = ["checkpointed_blocks", "recomputing"]

_state = threading.local()  # (the recomputation runs in the thread that runs the backward, as do the hooks it fires)


def recomputing() -> bool:
    """Whether the calling code runs inside a checkpointed block's recomputation (during a backward)."""
    return getattr(_state, "depth", 0) > 0


class _Recomputation:
    """Marks a recomputation (re-enterable: each backward of a double backward recomputes with the same context)."""

    def __enter__(self):
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc):
        _state.depth -= 1


def _contexts():
    return contextlib.nullcontext(), _Recomputation()


def _checkpointed_forward(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)


_MISSING = object()


@contextlib.contextmanager
def checkpointed_blocks(model: nn.Module, enabled: bool = True):
    """Within the block, every decoder block of ``model`` runs checkpointed (see the module docstring); yields the
    number of blocks (0 with ``enabled=False``: nothing changes)."""
    if not enabled:
        yield 0
        return
    _, blocks = decoder_blocks(model)
    saved = []
    for block in blocks:
        own = block.__dict__.get("forward", _MISSING)
        saved.append(own)
        block.forward = functools.partial(_checkpointed_forward, block.forward)
    try:
        yield len(blocks)
    finally:
        for block, own in zip(blocks, saved):
            if own is _MISSING:
                del block.forward
            else:
                block.forward = own
