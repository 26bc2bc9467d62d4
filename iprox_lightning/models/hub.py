"""Fail fast on model names that are neither local nor reachable.

``transformers`` treats any name that is not a local path as a Hugging Face hub id and, offline,
retries for about a minute before a long traceback. :func:`check_model_source` answers in a few
seconds instead: a local path, ``builtin`` or a hub id already in the local cache passes; a path-like
name that does not exist fails at once (``FileNotFoundError`` naming it); an uncached hub id fails
with ``ConnectionError`` when the hub's host cannot be reached within ``timeout`` seconds.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    """``owner/name`` or a legacy single name (``gpt2``), not a relative/absolute path."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".json", ".gguf", ".safetensors", ".yaml"))


def _in_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str) or isinstance(
            try_to_load_from_cache(repo_id, "tokenizer_config.json"), str)
    except Exception:  # malformed id etc.: let transformers report it
        return False


def hub_reachable(timeout: float = 3.0) -> tuple[bool, str]:
    """``(reachable, host)`` of ``$HF_ENDPOINT`` (default huggingface.co) by a TCP connect."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True, host
    except OSError:
        return False, host


def check_model_source(name: str, what: str = "model", timeout: float = 3.0) -> None:
    """Raise at once when ``name`` cannot be loaded (see the module doc); return otherwise."""
    if name == "builtin" or Path(name).exists():
        return
    if not is_hub_id(name):
        raise FileNotFoundError(f"{what} {name!r}: no such file or directory (and not a hub id 'owner/name'); "
                                "if it is a stage's output, run that stage first")
    if _in_cache(name):
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    reachable, host = (False, "the hub") if offline else hub_reachable(timeout)
    if not reachable:
        raise ConnectionError(
            f"{what} {name!r} is not a local path, not in the Hugging Face cache, and {host} cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if offline else f' within {timeout:g} s'}: pass a local directory, a "
            "`.gguf` file or `builtin`, or download it first")
