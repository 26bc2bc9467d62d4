"""Loading a model and its tokenizer from a hub id, a directory, a ``.gguf`` file or ``builtin``."""
from .loading import load_model, load_tokenizer

__all__ = ["load_model", "load_tokenizer"]
