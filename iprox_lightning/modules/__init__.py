"""Lightning modules of the training side: warm-up, Stage 2 alignment, fine-tuning."""
from .causal_lm import CausalLMModule
from .finetune import FinetuneModule
from .proxy_align import AlignConfig, ProxyAlignModule
from .warmup import WarmupModule

__all__ = ["CausalLMModule", "WarmupModule", "FinetuneModule", "ProxyAlignModule", "AlignConfig"]
