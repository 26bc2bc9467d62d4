"""Loading a model and its tokenizer from a hub id, a directory, a ``.gguf`` file or ``builtin``."""
from .builtin import builtin_model, builtin_tokenizer  # public on purpose: the demo's tiny Llama at any size (bench/)
from .loading import load_model, load_tokenizer

__all__ = ["builtin_model", "builtin_tokenizer", "load_model", "load_tokenizer"]
