"""Fail fast on model names that are neither local nor reachable.

``transformers`` treats any name that is not a local path as a Hugging Face hub id and, offline,
retries for about a minute before a long traceback. :func:`check_model_source` answers in a few
seconds instead: a local path, ``builtin`` or a hub id already in the local cache passes; a path-like
name that does not exist fails at once (``FileNotFoundError`` naming it); an uncached hub id fails
with :class:`SourceUnreachable` (a ``ConnectionError``) when the hub's host cannot be reached within ``timeout``
seconds. :func:`check_dataset_source` does the same for a data set id (``datasets.load_dataset`` would otherwise
retry for about half a minute). The command line prints a :class:`SourceUnreachable` as its one line, without a
traceback (``--debug`` shows it).
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..errors import InputNotFoundError, UserError


class SourceUnreachable(UserError, ConnectionError):
    """A model or data set named by a hub id that is neither local, nor cached, nor reachable; the message is one
    line naming it and the offline alternatives."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    """``owner/name`` or a legacy single name (``gpt2``), not a relative/absolute path."""
    return bool(_HUB_ID.match(name)) and not name.endswith((".json", ".gguf", ".safetensors", ".yaml"))


def _in_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache  # lazy: --help

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


def _hub_unreachable(offline_vars: tuple[str, ...], offline_note: str, timeout: float) -> str | None:
    """``None`` when the hub's host answers within ``timeout``; else why it cannot be used, for the error message
    (``"<host> cannot be reached within <timeout> s"``; with one of ``offline_vars`` set the hub is not tried:
    ``"the hub cannot be reached (<offline_note>)"``)."""
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in offline_vars)
    reachable, host = (False, "the hub") if offline else hub_reachable(timeout)
    if reachable:
        return None
    return f"{host} cannot be reached{f' ({offline_note})' if offline else f' within {timeout:g} s'}"


def check_model_source(name: str, what: str = "model", timeout: float = 3.0) -> None:
    """Raise at once when ``name`` cannot be loaded (see the module doc); return otherwise."""
    if name == "builtin" or Path(name).exists():
        return
    if not is_hub_id(name):
        raise InputNotFoundError(f"{what} {name!r}: no such file or directory (and not a hub id 'owner/name'); "
                                 "if it is a stage's output, run that stage first")
    if _in_cache(name):
        return
    why = _hub_unreachable(("HF_HUB_OFFLINE",), "HF_HUB_OFFLINE is set", timeout)
    if why:
        raise SourceUnreachable(
            f"{what} {name!r} is not a local path, not in the Hugging Face cache, and {why}: pass a local directory, a "
            "`.gguf` file or `builtin`, or download it first (with HF_HUB_OFFLINE=1 the cache is used)")


def _dataset_in_cache(repo_id: str) -> bool:
    """A data set id that ``datasets`` or the hub cache holds (a processed copy, or its card)."""
    try:
        import datasets  # lazy: --help

        owner_name = repo_id.replace("/", "___")
        if any(Path(datasets.config.HF_DATASETS_CACHE).glob(f"{owner_name}*")):
            return True
        from huggingface_hub import try_to_load_from_cache  # lazy: --help

        return isinstance(try_to_load_from_cache(repo_id, "README.md", repo_type="dataset"), str)
    except Exception:
        return False


def check_dataset_source(name: str, what: str = "data set", timeout: float = 3.0) -> None:
    """Raise :class:`SourceUnreachable` at once for a hub data set id that is not cached while the hub cannot be
    reached (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` set: the cache is all there is); return otherwise."""
    if _dataset_in_cache(name):
        return
    why = _hub_unreachable(("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"), "offline mode is set", timeout)
    if why:
        raise SourceUnreachable(
            f"{what} {name!r} is not a local file or directory, not in the Hugging Face cache, and {why}: pass a local "
            "JSONL / JSON / Parquet file or a directory of them, or download it first (with HF_HUB_OFFLINE=1 the cache "
            "is used)")
