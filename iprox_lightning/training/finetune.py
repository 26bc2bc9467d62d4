"""``FinetuneModule``: full fine-tuning of the target on the selected subset (paper: 4 epochs, lr 1e-5).

The selected subset comes from the data module (``SFTDataModule(train_split="selected",
selected=<file written by select>)``); the 4 epochs are a Trainer setting (``max_epochs: 4``).
Unlike the warm-up, every parameter is trained by default (``freeze_embeddings=False``); every other
option is :class:`~iprox_lightning.training.causal_lm.CausalLMModule`'s.
"""
from __future__ import annotations

from typing import Any

from .causal_lm import CausalLMModule


class FinetuneModule(CausalLMModule):
    """Full fine-tuning of the target on the selected data (paper defaults: lr 1e-5, wd 0.01)."""

    def __init__(self, *, freeze_embeddings: bool = False, **kwargs: Any) -> None:
        """
        Args:
            freeze_embeddings: freeze input embeddings and LM head (default: train every parameter).
            **kwargs: the other options of :class:`~iprox_lightning.training.causal_lm.CausalLMModule`.
        """
        super().__init__(freeze_embeddings=freeze_embeddings, **kwargs)
