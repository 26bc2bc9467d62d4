"""Fingerprints: what produced an artifact, as short digests that can be compared and diffed.

* :func:`digest` — SHA-256 of a canonical JSON encoding of any JSON-like value (16 hex chars).
* :func:`source_identity` — a model or data source given by name: ``builtin`` / a hub id as is; a
  file by name, size and content hash (size + mtime above ``HASH_LIMIT`` bytes); a directory by the
  identity of each file in it (config, manifest, weights, tokenizer), a peft adapter directory also by its base
  model's identity (a changed base never reuses a result of the old one).
* :func:`module_identity` — an in-memory ``nn.Module``: a hash of its parameter and buffer bytes.
* :func:`examples_digest` — the content of a tokenized data set (ids, tasks, token ids, prompt
  lengths): a changed pool or validation set, tokenizer, template or ``max_length`` changes it.
* :func:`diff` — the differences between two fingerprints as ``"field: old -> new"`` lines, which the
  mismatch errors print.
* :func:`sort_safetensors_metadata` — a safetensors file's metadata in key order, so the same tensors and metadata
  are the same bytes (and the same content hash) whichever process wrote them.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

from ..errors import UserInputError
from .jsonfile import Fields, read_json

HASH_LIMIT = 256 * 2**20  # files above this size are identified by size + mtime, not content


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest(obj: Any, n: int = 16) -> str:
    """Short SHA-256 of the canonical JSON of ``obj``."""
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()[:n]


def file_identity(path: str | os.PathLike, hash_limit: int | None = HASH_LIMIT) -> dict:
    """``{"size", "sha256"}`` (16 hex chars) of a file; above ``hash_limit`` bytes ``{"size", "mtime_ns"}``
    (``hash_limit=None``: always hashed)."""
    p = Path(path)
    st = p.stat()
    if hash_limit is None or st.st_size <= hash_limit:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return {"size": st.st_size, "sha256": h.hexdigest()[:16]}
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def source_identity(source: Any, _depth: int = 0) -> Any:
    """Identity of a model / data source named by a string (see the module docstring); a peft adapter directory's
    includes its base model's (``"base"``)."""
    if not isinstance(source, (str, os.PathLike)):
        return source if isinstance(source, (int, float, bool, type(None))) else type(source).__name__
    p = Path(source)
    if p.is_file():
        return {"path": str(p), **file_identity(p)}
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        out = {"path": str(p), "files": {str(f.relative_to(p)): file_identity(f) for f in files}}
        if is_adapter_dir(p):  # a peft adapter is its files and its base model's
            out["base"] = _adapter_base_identity(p, _depth)
        return out
    return str(source)


ADAPTER_CONFIG = "adapter_config.json"
"""The settings file of a peft adapter directory (``models/lora.py``), which names its base model."""


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a peft adapter directory (it holds :data:`ADAPTER_CONFIG`)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | os.PathLike) -> str:
    """The base model a peft adapter directory names (``base_model_name_or_path`` of its ``adapter_config.json``): a
    path relative to the working directory or, failing that, to the adapter directory; else a hub id as given."""
    cfg = Path(path) / ADAPTER_CONFIG
    base = Fields(cfg).get(read_json(cfg, what="a peft adapter's settings"), "base_model_name_or_path", "str")
    if not base:
        raise UserInputError(f"{cfg}: base_model_name_or_path is empty; name the adapter's base model there")
    if not Path(base).exists() and (Path(path) / base).exists():
        return str(Path(path) / base)
    return base


def _adapter_base_identity(path: Path, depth: int) -> Any:
    """The identity of the base model a peft adapter directory names (:func:`adapter_base`), itself an adapter at
    most 4 deep."""
    base = adapter_base(path)
    if depth >= 4:
        raise UserInputError(f"{path / ADAPTER_CONFIG}: its base model is an adapter of an adapter more than 4 deep "
                             f"({base})")
    return source_identity(base, _depth=depth + 1)


def model_identity(model: Any, net: Any = None) -> Any:
    """A model's identity for a fingerprint: the files of a local directory / file (:func:`source_identity`); else its
    name and a hash of its weights (``net``: the model as loaded; a module given as ``model`` is hashed itself)."""
    if isinstance(model, (str, os.PathLike)):
        if Path(model).exists():
            return source_identity(model)
        return {"name": str(model), "weights": module_identity(net) if net is not None else None}
    return {"name": type(model).__name__, "weights": module_identity(model)}


def module_identity(module) -> str:
    """Hash of a module's parameter and buffer bytes (names, shapes, dtypes, values)."""
    h = hashlib.sha256()
    for name, t in list(module.state_dict().items()):
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach()
        if getattr(t, "is_meta", False):
            continue
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        try:
            # the array itself (the buffer protocol), not ``.tobytes()``: a copy of the largest weight (the embedding:
            # 1.96 GiB at the 8B width) would be the store build's and the scorer's peak
            h.update(t.cpu().contiguous().view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # sharded / exotic tensors: shape and dtype only
            pass
    return h.hexdigest()[:16]


def examples_digest(items: Iterable[Mapping]) -> dict:
    """``{"n": count, "ids": digest of the ids, "content": digest of ids + tasks + tokens}`` of data-set
    items (``SFTDataset`` items: ``id``, ``task``, ``input_ids``, ``prompt_len``; or collated batches)."""
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


def _item_bytes(obj) -> bytes:
    """Canonical bytes of an arbitrary data-set item (dicts, sequences, tensors, arrays, scalars)."""
    if hasattr(obj, "detach"):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        return f"nd{obj.dtype}{obj.shape}".encode() + np.ascontiguousarray(obj).tobytes()
    if isinstance(obj, Mapping):
        return b"{" + b"".join(str(k).encode() + b":" + _item_bytes(obj[k]) + b"," for k in sorted(obj, key=str)) + b"}"
    if isinstance(obj, (list, tuple)):
        return b"[" + b"".join(_item_bytes(x) + b"," for x in obj) + b"]"
    return repr(obj).encode()


def loader_digest(loader, *, iterate: bool = True) -> dict:
    """Digest of the examples behind a data loader: of its map-style ``dataset`` items (every example
    once, whatever the sampler; :func:`examples_digest` for the project's items, a canonical byte dump of
    any other item), else — when ``iterate`` — of its batches. A live loader the trainer is iterating must
    not be iterated again (``iterate=False``: an iterable data set is then recorded as not fingerprinted)."""
    ds = getattr(loader, "dataset", None)
    if ds is not None and hasattr(ds, "__len__") and hasattr(ds, "__getitem__"):
        n = len(ds)
        try:
            return examples_digest(ds[i] for i in range(n))
        except (KeyError, TypeError, IndexError, AttributeError):
            h_all = hashlib.sha256()
            h_ids = hashlib.sha256()
            for i in range(n):
                it = ds[i]
                h_all.update(_item_bytes(it))
                if isinstance(it, Mapping) and "id" in it:
                    h_ids.update(str(it["id"]).encode() + b"\0")
            return {"n": n, "ids": h_ids.hexdigest()[:16], "content": h_all.hexdigest()[:16]}

    if not iterate or isinstance(loader, Iterator):  # a one-shot iterator must not be consumed here
        return {"n": None, "content": "not fingerprinted (iterable data set)"}
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


class FingerprintMismatch(UserInputError):
    """An existing artifact was produced from different inputs than the current run's."""


def sort_safetensors_metadata(path: str | os.PathLike) -> None:
    """Rewrite, in place, the header of the safetensors file ``path`` with its ``__metadata__`` in key order.

    The safetensors writer keeps the metadata in a hash map whose order differs with every map, so two saves of the
    same tensors and metadata differ in their header bytes (measured: 12 saves in one process, 12 different files),
    and a file digest (a proxy's ``weights.sha256``, the identity downstream stages are fingerprinted with) would say
    an identical re-built artifact changed. The header is compact JSON of the same length whatever the order, so the
    sorted one takes its place byte for byte; the tensor entries keep their order.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        text = raw.rstrip(b" ")
        header = json.loads(text)
        meta = header.get("__metadata__")
        if not meta:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        out = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(out) != len(text):  # not the writer's compact form: leave the file as written
            return
        f.seek(8)
        f.write(out + raw[len(text):])


def tensors_digest(tensors: Mapping[str, Any]) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in name order (a saved entry's content check)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        v = tensors[k].detach().cpu().contiguous()
        h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
        h.update(v.reshape(-1).view(torch.uint8).numpy())  # (no copy: the buffer protocol)
    return h.hexdigest()
