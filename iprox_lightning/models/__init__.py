"""Loading a model and its tokenizer from a hub id, a directory, a ``.gguf`` file or ``builtin``.

The names are imported on first use, so that :mod:`.hub` (the command line's error classes) loads without torch.
"""
from __future__ import annotations

from importlib import import_module

_HOMES = {"builtin_model": ".builtin", "builtin_tokenizer": ".builtin",  # public on purpose: the demo's tiny Llama
          "load_model": ".loading", "load_tokenizer": ".loading"}

__all__ = ["builtin_model", "builtin_tokenizer", "load_model", "load_tokenizer"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
