"""``FinetuneModule``: full fine-tuning of the target on the selected subset (paper: 4 epochs, lr 1e-5).

The selected subset comes from the data module (``SFTDataModule(train_split="selected",
selected=<file written by select>)``); the 4 epochs are a Trainer setting (``max_epochs: 4``).
Unlike the warm-up, every parameter is trained by default (``freeze_embeddings=False``).
"""
from __future__ import annotations

from typing import Optional, Union

from torch import nn

from .causal_lm import CausalLMModule


class FinetuneModule(CausalLMModule):
    """Full fine-tuning of the target on the selected data (paper defaults: lr 1e-5, wd 0.01)."""

    def __init__(
        self,
        model: Union[str, nn.Module] = "builtin",
        lr: float = 1e-5,
        weight_decay: float = 0.01,
        freeze_embeddings: bool = False,
        save_dir: Optional[str] = None,
        warmup_ratio: float = 0.03,
        lr_schedule: str = "linear",
        gradient_checkpointing: bool = False,
        dtype: str = "float32",
        fsdp_reshard_after_forward: bool = True,
    ) -> None:
        super().__init__(model=model, lr=lr, weight_decay=weight_decay, freeze_embeddings=freeze_embeddings,
                         save_dir=save_dir, warmup_ratio=warmup_ratio, lr_schedule=lr_schedule,
                         gradient_checkpointing=gradient_checkpointing, dtype=dtype,
                         fsdp_reshard_after_forward=fsdp_reshard_after_forward)
