"""Training the target: the causal-LM module behind warm-up and fine-tuning."""
# public on purpose: the optimizer's parameter groups and the frozen embeddings/head of warm-up and fine-tuning, for
# tools that build the same training step by hand (bench/plan_memtracker.py)
from .causal_lm import decay_param_groups, freeze_embeddings_and_head

__all__ = ["decay_param_groups", "freeze_embeddings_and_head"]
