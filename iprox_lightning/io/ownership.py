"""What the package wrote, and so may delete: the marker of every cache and output directory it creates.

A directory the package creates (a cache under ``$IPROX_CACHE`` or ``<dir>/cache``, a score or store directory, a
proxy, a dense export, a saved model, a pipeline workdir) holds :data:`MARKER`, a small JSON file written when the
directory is created::

    {"kind": "proxy export", "iprox_lightning": "0.1.0", "format": 1, "dir": {"dev": 2049, "ino": 1234567}, ...}

``dir`` is the directory's identity (``os.stat``: device and inode) when it was marked. A marker counts only in the
directory it was written in: copied (``cp -r``, a backup restore, another file system) or hard-linked (``cp -al``)
into another directory, its ``dir`` no longer matches, so the copy is not the package's. A directory reached
through a symbolic link, or a marker that is a link, never counts either. A file entry (a model file under
``$IPROX_CACHE/models``) has a sidecar marker ``.<name>.iprox.json`` recording the file's identity.

:func:`owned_kind` says whether a path is the package's and of which kind; ``cache --clear`` and every
``overwrite`` delete or replace only a path it names with the expected kind (:func:`check_owned`). A directory
written by a version before markers (0.x before issue 61) has none and is treated as not the package's: it is kept,
and the message says to delete it by hand.

The package marks a directory only when it creates it or finds it empty (:func:`make_owned_dir`): an existing
directory holding anything is written into but never becomes the package's to delete.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable

from ..errors import OutputExistsError, UserError
from .atomic import write_text_atomic
from .jsonfile import read_json

MARKER = ".iprox-dir.json"
"""The marker file in a directory the package created."""
FORMAT = 1

CACHE_KINDS = ("gguf copy", "model file", "check cache", "store cache")
"""Kinds ``train.py cache`` lists and clears."""
KINDS = CACHE_KINDS + ("scores", "gradient store", "proxy", "proxy export", "model", "pipeline workdir", "report",
                       "check output", "evaluation")


def _version() -> str:
    try:  # the installed package's version, without importing the package's root (io sits below it)
        return version("iprox_lightning")
    except PackageNotFoundError:
        return "unknown"


def _identity(st: os.stat_result) -> dict:
    return {"dev": int(st.st_dev), "ino": int(st.st_ino)}


def sidecar(path: str | os.PathLike) -> Path:
    """The marker of a file entry: ``.<name>.iprox.json`` beside it."""
    p = Path(path)
    return p.with_name(f".{p.name}.iprox.json")


def is_sidecar(path: str | os.PathLike) -> bool:
    n = Path(path).name
    return n.startswith(".") and n.endswith(".iprox.json")


def _record(kind: str, st: os.stat_result, what: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown owned kind {kind!r}; one of {KINDS}")
    return json.dumps({"kind": kind, "iprox_lightning": _version(), "format": FORMAT, what: _identity(st),
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "what": "written by iprox_lightning; `python train.py cache` and --overwrite delete only "
                               "directories holding this file"}, indent=1) + "\n"


def mark(path: str | os.PathLike, kind: str) -> Path:
    """Write the marker of ``kind`` into the directory ``path`` (which the caller just created or found empty)."""
    p = Path(path)
    return write_text_atomic(p / MARKER, _record(kind, os.stat(p), "dir"))


def mark_file(path: str | os.PathLike, kind: str) -> Path:
    """Write the sidecar marker of the file ``path`` (which the package just wrote)."""
    p = Path(path)
    return write_text_atomic(sidecar(p), _record(kind, os.stat(p), "file"))


def _is_empty_dir(p: Path) -> bool:
    try:
        return not any(os.scandir(p))
    except FileNotFoundError:
        return True


def make_owned_dir(path: str | os.PathLike, kind: str) -> bool:
    """Create the directory ``path`` (and its parents) marked as ``kind``; a directory that exists and is empty is
    marked too, one that is already marked is left as it is. An existing directory holding anything else is not
    marked (it is not the package's to delete). Returns whether ``path`` is the package's (of any kind) now."""
    p = Path(path)
    if owned_kind(p) is not None:
        return True
    if p.is_symlink():
        return False
    if not p.exists():
        p.mkdir(parents=True, exist_ok=True)
    if p.is_dir() and _is_empty_dir(p):
        mark(p, kind)
        return True
    return False


def _read_marker(marker: Path, target_st: os.stat_result, what: str) -> str | None:
    try:
        mst = os.lstat(marker)
    except OSError:
        return None

    if not stat.S_ISREG(mst.st_mode) or mst.st_size > 4096:
        return None

    try:
        data = read_json(marker, what="the package's marker")
    except (OSError, UserError):  # damaged or unreadable: not the package's
        return None
    if not isinstance(data, dict) or data.get("kind") not in KINDS or data.get(what) != _identity(target_st):
        return None
    return data["kind"]


def owned_kind(path: str | os.PathLike) -> str | None:
    """The kind the package marked ``path`` with, or ``None`` when it is not the package's: no marker (or a
    damaged one), a marker copied or linked from another directory or file, or ``path`` a symbolic link."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode):
        return _read_marker(p / MARKER, st, "dir")
    if stat.S_ISREG(st.st_mode):
        return _read_marker(sidecar(p), st, "file")
    return None


def check_owned(path: str | os.PathLike, kinds: str | Iterable[str], *, option: str, what: str = "") -> None:
    """Raise :class:`OutputExistsError` naming ``path`` unless the package marked it as one of ``kinds`` (an absent
    path passes: nothing to delete). ``option`` names what would delete it (``--overwrite true``)."""
    p = Path(path)
    if not os.path.lexists(p):
        return
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    got = owned_kind(p)
    if got in kinds:
        return
    if p.is_symlink():
        why = "it is a symbolic link (the package deletes nothing through a link); name the directory itself"
    elif got is not None:
        why = f"it is a {got} the package wrote, not a {' or '.join(kinds)}; choose another output"
    else:
        why = (f"it holds no {MARKER} marker, so the package did not write it (or an older version did, before "
               "markers) and keeps it; choose another output, or delete it by hand if it is yours to drop")
    raise OutputExistsError(f"{option}: refusing to replace {p}{f' ({what})' if what else ''}: {why}")


def remove_owned(path: str | os.PathLike) -> None:
    """Delete an entry :func:`owned_kind` names (a directory with its marker, or a file and its sidecar)."""
    p = Path(path)
    if owned_kind(p) is None:  # checked again right before deleting
        raise OutputExistsError(f"{p} is not marked as written by iprox_lightning; not deleted")
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink()
        sidecar(p).unlink(missing_ok=True)
