"""The memory levers of warm-up and fine-tune that keep the step the same: micro-batches with the loss weighted by
response tokens, and FSDP2's CPU offload.

``micro_batch_size`` (:class:`~iprox_lightning.training.causal_lm.CausalLMModule`): each batch the data module gives
(``data.batch_size`` per device, the paper's batch) is split into micro-batches of at most that many examples; each
micro-batch's forward and backward runs in turn (only its activations live at a time) and the optimiser steps once
per batch. Each micro-batch's summed response-token cross-entropy is divided by the response tokens of the whole
batch on every rank (:func:`response_tokens`, one ``all_reduce`` of a scalar), so the accumulated gradient is the
gradient of the token-mean over the whole batch, whatever the micro-batch: the effective batch, the number of
optimiser steps and the learning-rate schedule do not change with it (Lightning's ``accumulate_grad_batches`` would
instead average per-micro-batch means, and count one step per ``accumulate_grad_batches`` loader batches).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.distributed.fsdp import CPUOffloadPolicy

from ..engine.batch import shifted_token_mask


def response_tokens(batch: Mapping[str, Any]) -> torch.Tensor:
    """The response tokens the SFT loss scores in ``batch`` (position ``t`` predicts ``labels[:, t + 1]``)."""
    return shifted_token_mask(batch["labels"]).sum()


def cpu_offload_policy():
    """FSDP2's ``CPUOffloadPolicy``: the sharded weights, their gradients and the AdamW moments live in host memory
    (the optimiser steps there); each block's weights are copied to the device for its forward and backward.
    Pinned host memory when CUDA is present."""
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def enable_checkpointing(model) -> None:
    """Hugging Face activation checkpointing (non-reentrant ``torch.utils.checkpoint`` per decoder block, in training
    mode): through ``activation_checkpointing_enable`` where the installed transformers has it (its
    ``gradient_checkpointing_enable`` is deprecated there), else ``gradient_checkpointing_enable``."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
