"""Tiny randomly initialised causal LMs of real architectures, built offline from configs.

Used by the tests and the built-in demo: no download, a few hundred thousand parameters.
"""
from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM, Gemma3TextConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, PretrainedConfig,
    Qwen2Config, Qwen3Config,
)

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3", "gpt2")


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int = 128,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    attn_implementation: str = "eager",
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = 2,
) -> PretrainedConfig:
    """A tiny config of the named architecture (see ``ARCHITECTURES``)."""
    head_dim = hidden_size // num_heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    if arch == "llama":
        cfg = LlamaConfig(**common, head_dim=head_dim)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common, head_dim=head_dim)
    elif arch == "mistral":
        cfg = MistralConfig(**common, head_dim=head_dim, sliding_window=None)
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(**common, head_dim=head_dim, sliding_window=64, query_pre_attn_scalar=head_dim)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj
        cfg = Phi3Config(**common)
    elif arch == "gpt2":  # Conv1D layers (transposed weights), fused c_attn
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            n_positions=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            pad_token_id=pad_token_id,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {ARCHITECTURES}")
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_causal_lm(arch: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """A randomly initialised tiny causal LM (eager attention, so double backward works)."""
    cfg = tiny_config(arch, **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation, dtype=dtype)
    model.eval()
    return model
