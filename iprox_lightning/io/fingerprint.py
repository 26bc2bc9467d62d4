"""Fingerprints: what produced an artifact, as short digests that can be compared and diffed.

* :func:`digest` — SHA-256 of a canonical JSON encoding of any JSON-like value (16 hex chars).
* :func:`source_identity` — a model or data source given by name: ``builtin`` / a hub id as is; a
  file by name, size and content hash (size + mtime above ``HASH_LIMIT`` bytes); a directory by the
  identity of each file in it (config, manifest, weights, tokenizer).
* :func:`module_identity` — an in-memory ``nn.Module``: a hash of its parameter and buffer bytes.
* :func:`examples_digest` — the content of a tokenized data set (ids, tasks, token ids, prompt
  lengths): a changed pool or validation set, tokenizer, template or ``max_length`` changes it.
* :func:`diff` — the differences between two fingerprints as ``"field: old -> new"`` lines, which the
  mismatch errors print.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

HASH_LIMIT = 256 * 2**20  # files above this size are identified by size + mtime, not content


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any, n: int = 16) -> str:
    """Short SHA-256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()[:n]


def file_identity(path: str | os.PathLike) -> dict:
    p = Path(path)
    st = p.stat()
    if st.st_size <= HASH_LIMIT:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return {"size": st.st_size, "sha256": h.hexdigest()[:16]}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def source_identity(source: Any) -> Any:
    """Identity of a model / data source named by a string (see the module docstring)."""
    if not isinstance(source, (str, os.PathLike)):
        return source if isinstance(source, (int, float, bool, type(None))) else type(source).__name__
    p = Path(source)
    if p.is_file():
        return {"path": str(p), **file_identity(p)}
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        return {"path": str(p), "files": {str(f.relative_to(p)): file_identity(f) for f in files}}
    return str(source)


def module_identity(module) -> str:
    """Hash of a module's parameter and buffer bytes (names, shapes, dtypes, values)."""
    import torch

    h = hashlib.sha256()
    for name, t in list(module.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        if getattr(t, "is_meta", False):
            continue
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        try:
            h.update(t.cpu().contiguous().view(torch.uint8).numpy().tobytes())
        except (RuntimeError, TypeError):  # sharded / exotic tensors: shape and dtype only
            pass
    return h.hexdigest()[:16]


def examples_digest(items: Iterable[Mapping]) -> dict:
    """``{"n": count, "ids": digest of the ids, "content": digest of ids + tasks + tokens}`` of data-set
    items (``SFTDataset`` items: ``id``, ``task``, ``input_ids``, ``prompt_len``; or collated batches)."""
    import numpy as np

    h_ids, h_all, n = hashlib.sha256(), hashlib.sha256(), 0
    for it in items:
        ids = it["id"]
        batched = isinstance(ids, (list, tuple))
        rows = range(len(ids)) if batched else [None]
        for r in rows:
            i = str(ids[r] if batched else ids)
            task = it.get("task")
            task = (task[r] if batched and task is not None else task)
            toks = it["input_ids"][r] if batched else it["input_ids"]
            toks = np.asarray(toks.cpu() if hasattr(toks, "cpu") else toks, dtype=np.int64)
            if batched and "attention_mask" in it:
                toks = toks[np.asarray(it["attention_mask"][r].cpu()).astype(bool)]
            extra = it.get("prompt_len")
            if extra is None and "labels" in it:  # collated batch: the label mask stands for prompt_len
                lab = np.asarray(it["labels"][r].cpu() if batched else it["labels"])
                extra = int((lab == -100).sum())
            h_ids.update(i.encode() + b"\0")
            h_all.update(f"{i}\0{task}\0{extra}\0".encode())
            h_all.update(toks.tobytes())
            n += 1
    return {"n": n, "ids": h_ids.hexdigest()[:16], "content": h_all.hexdigest()[:16]}


def loader_digest(loader) -> dict:
    """:func:`examples_digest` of a data loader: of its ``dataset`` items when it has a map-style data
    set (every example once, whatever the sampler), else of its batches."""
    ds = getattr(loader, "dataset", None)
    if ds is not None and hasattr(ds, "__len__") and hasattr(ds, "__getitem__"):
        try:
            return examples_digest(ds[i] for i in range(len(ds)))
        except (KeyError, TypeError, IndexError):
            pass
    return examples_digest(loader)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b[0].c": leaf}`` of a nested dict/list."""
    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k in obj:
            out.update(flatten(obj[k], f"{prefix}.{k}" if prefix else str(k)))
        if not obj and prefix:
            out[prefix] = {}
    elif isinstance(obj, (list, tuple)) and any(isinstance(x, (Mapping, list, tuple)) for x in obj):
        for j, x in enumerate(obj):
            out.update(flatten(x, f"{prefix}[{j}]"))
    else:
        out[prefix] = list(obj) if isinstance(obj, tuple) else obj
    return out


def diff(old: Any, new: Any, limit: int = 8) -> list[str]:
    """``["field: old -> new", ...]`` for every leaf that differs between two nested fingerprints."""
    a, b = flatten(old), flatten(new)
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k, "<absent>") != b.get(k, "<absent>"):
            lines.append(f"{k}: {_short(a.get(k, '<absent>'))} -> {_short(b.get(k, '<absent>'))}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


class FingerprintMismatch(ValueError):
    """An existing artifact was produced from different inputs than the current run's."""
