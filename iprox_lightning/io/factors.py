"""Saved influence-metric factors: the only reader and writer of factor files (K-FAC eigenbases and eigenvalues,
EK-FAC's corrected eigenvalues), so they are fitted once and reused.

A factor file is ``<factors_dir>/<method>-<digest>.safetensors``: the metric's :meth:`state_dict` tensors (safetensors,
never a pickle) and, in the metadata, ``schema_version``, ``method`` and the ``fingerprint`` (JSON) whose digest names
the file: the model's identity, the digest of the factor data, the metric's fit settings (``kfac_examples``), the tracked
weights and the dtypes. A run with the same inputs finds the file and loads it; any changed input gives another name,
so an old result is never reused for a changed setting (damping is applied after loading, so it is not part of it).
A file whose recorded fingerprint does not match its name's (edited, or copied over) is refused naming what differs,
and so is one whose tensors are not the ones written (``content_sha256`` in the metadata: a digest of every tensor's
name, dtype, shape and bytes).
An EK-FAC fit reads the K-FAC file of the same inputs for its eigenbases, or writes one beside its own, so K-FAC and
EK-FAC runs on one model and factor data make one K-FAC pass between them (:func:`~iprox_lightning.scoring.metrics.fit_or_load`).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from .atomic import atomic_path
from .fingerprint import FingerprintMismatch, diff, digest, tensors_digest
from .gradient_store import StoreFormatError, load_tensors, save_tensors

SCHEMA_VERSION = 1


def factors_path(factors_dir: str | os.PathLike, method: str, fingerprint: Mapping) -> Path:
    """Where the factors of ``method`` fitted under ``fingerprint`` live in ``factors_dir``."""
    return Path(factors_dir) / f"{method}-{digest(dict(fingerprint))}.safetensors"


def save_factors(path: str | os.PathLike, tensors: Mapping[str, Any], *, method: str, fingerprint: Mapping) -> Path:
    """Write a factor file atomically (see the module docstring)."""
    return save_tensors(path, tensors, {"schema_version": str(SCHEMA_VERSION), "method": method,
                                        "fingerprint": json.dumps(dict(fingerprint), sort_keys=True, default=str),
                                        "content_sha256": tensors_digest(tensors)})


def load_factors(path: str | os.PathLike, *, method: str, fingerprint: Mapping | None = None) -> dict:
    """The tensors of a factor file, after checking its version, method and (when given) fingerprint."""
    tensors, meta = load_tensors(path)
    if meta.get("schema_version") != str(SCHEMA_VERSION):
        raise StoreFormatError(f"{path}: metadata field 'schema_version' is {meta.get('schema_version')!r}, this "
                               f"version reads {SCHEMA_VERSION}")
    if meta.get("method") != method:
        raise StoreFormatError(f"{path}: holds {meta.get('method')!r} factors, not {method!r}")
    if meta.get("content_sha256") != tensors_digest(tensors):
        raise StoreFormatError(f"{path}: its tensors are not the ones written (metadata field 'content_sha256' "
                               + ("missing: a file of an earlier version" if "content_sha256" not in meta else "differs")
                               + "); remove the file to fit the factors again")
    if fingerprint is not None:
        try:
            old = json.loads(meta.get("fingerprint", ""))
        except json.JSONDecodeError:
            raise StoreFormatError(f"{path}: metadata field 'fingerprint' is malformed") from None
        lines = diff(old, json.loads(json.dumps(dict(fingerprint), default=str)))
        if lines:
            raise FingerprintMismatch(f"{path} holds factors fitted on other inputs (file -> now):\n  "
                                      + "\n  ".join(lines) + "\nremove the file to fit them again")
    return tensors


def copy_factors(path: str | os.PathLike, into: str | os.PathLike) -> Path:
    """A factor file copied into directory ``into`` under its own name (atomically, the directory made if needed), for
    a store that keeps its own copy or a shared ``factors_dir`` that lost one; an existing copy is left as it is (the
    name is the fingerprint's digest, so it holds the same factors)."""
    dst = Path(into) / Path(path).name
    if not dst.exists():
        with atomic_path(dst) as tmp:
            shutil.copyfile(path, tmp)
    return dst
