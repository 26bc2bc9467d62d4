"""``WarmupModule``: the warm-up fine-tuning of the target before compression (paper §5 / App. A:
a random 5% of the pool, 1 epoch, lr 1e-5, weight decay 0.01, embeddings and LM head frozen).

Full fine-tuning with the response-token SFT loss (:class:`~iprox_lightning.training.causal_lm.CausalLMModule`,
whose options and defaults — the paper's — it takes unchanged); the warmed-up model is written with
``save_pretrained`` (safetensors) + tokenizer into ``save_dir`` at the end of ``fit`` — the directory the next
stage (build-proxy) loads as its target. The epoch count is a Trainer setting (``max_epochs: 1``).
"""
from __future__ import annotations

from .causal_lm import CausalLMModule


class WarmupModule(CausalLMModule):
    """Warm-up full fine-tuning; defaults are the paper's (lr 1e-5, wd 0.01, embeddings/LM head frozen)."""
