"""Lightning modules of the training side: warm-up, Stage 2 alignment, fine-tuning."""
from ..training.causal_lm import CausalLMModule
from ..training.finetune import FinetuneModule
from ..alignment.module import AlignConfig, ProxyAlignModule
from ..training.warmup import WarmupModule

__all__ = ["CausalLMModule", "WarmupModule", "FinetuneModule", "ProxyAlignModule", "AlignConfig"]
