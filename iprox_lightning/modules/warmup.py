"""``WarmupModule``: the warm-up fine-tuning of the target before compression (paper §5 / App. A:
a random 5% of the pool, 1 epoch, lr 1e-5, weight decay 0.01, embeddings and LM head frozen).

Full fine-tuning with the response-token SFT loss (:class:`~iprox_lightning.modules.causal_lm.CausalLMModule`);
the warmed-up model is written with ``save_pretrained`` (safetensors) + tokenizer into ``save_dir`` at the
end of ``fit`` — the directory the next stage (build-proxy) loads as its target. The epoch count is a
Trainer setting (``max_epochs: 1``).
"""
from __future__ import annotations

from typing import Optional, Union

from torch import nn

from .causal_lm import CausalLMModule


class WarmupModule(CausalLMModule):
    """Warm-up full fine-tuning; defaults are the paper's (lr 1e-5, wd 0.01, embeddings/LM head frozen)."""

    def __init__(
        self,
        model: Union[str, nn.Module] = "builtin",
        lr: float = 1e-5,
        weight_decay: float = 0.01,
        freeze_embeddings: bool = True,
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
