"""Loading a model and its tokenizer from a hub id, a directory, a ``.gguf`` file or ``builtin``.

The names are imported on first use, so that :mod:`.hub` (the command line's error classes) loads without torch.
"""
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {"builtin_model": ".builtin", "builtin_tokenizer": ".builtin",  # public on purpose: the demo's tiny Llama
          "load_model": ".loading", "load_tokenizer": ".loading"}

__all__ = ["builtin_model", "builtin_tokenizer", "load_model", "load_tokenizer"]


__getattr__, __dir__ = lazy_names(__name__, _HOMES)
