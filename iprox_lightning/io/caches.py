"""The caches the package writes (GGUF copies and model files under ``$IPROX_CACHE``, check and store caches below a
directory), each the package's only when it holds its marker (:mod:`iprox_lightning.io.ownership`): listed with their
sizes, and the package's cleared (``train.py cache``; ``commands/cache.py`` holds the command's arguments)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional

from ..errors import InputNotFoundError
from . import ownership  # by module: a test replaces ownership.owned_kind


_PSEUDO = ("/proc", "/sys", "/dev")
"""Never walked by ``--under /``: kernel file systems, which hold no cache (and change while they are read)."""


class Entry(NamedTuple):
    kind: str  # the marker's kind, or "not ours, kept"
    path: Path
    size: int
    ours: bool
    why: str = ""


def _size(path: Path) -> int:
    """Bytes under ``path`` (links not followed); a file that vanishes while it is counted counts 0."""
    try:
        if not path.is_dir() or path.is_symlink():
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for dirpath, _, files in os.walk(path, onerror=lambda e: None):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _older_cache(path: Path) -> bool:
    """Whether an unmarked folder named ``cache`` holds what a check / store cache of a version before markers held
    (``validation/*.safetensors`` or ``scores/*.parquet``): listed as not ours, to delete by hand."""
    try:
        return (any(path.glob("validation/*.safetensors")) or any(path.glob("scores/*.parquet")))
    except OSError:
        return False


def _root_entries(root: Path) -> list[Entry]:
    out: list[Entry] = []
    for sub, kind in (("gguf", "gguf copy"), ("models", "model file")):
        d = root / sub
        try:
            children = sorted(d.iterdir()) if d.is_dir() else []  # each entry is judged by its own marker
        except OSError:
            children = []
        for p in children:
            if ownership.is_sidecar(p) and ownership.owned_kind(p.parent / p.name[1:-len(".iprox.json")]) is not None:
                continue  # the marker of a file entry, listed with it
            got = ownership.owned_kind(p)
            if not os.path.lexists(p):
                continue  # vanished while listed
            if got == kind:
                out.append(Entry(kind, p, _size(p), True))
            else:
                out.append(Entry("not ours, kept", p, _size(p), False,
                                 "a symbolic link" if p.is_symlink() else f"no {kind} marker"))
    return out


def _under_entries(top: Path) -> list[Entry]:
    """The marked check / store caches below ``top`` (never ``top`` itself), and unmarked folders named ``cache``
    that look like an older version's, listed as not ours."""
    out: list[Entry] = []
    for dirpath, dirnames, _ in os.walk(top, onerror=lambda e: None, followlinks=False):
        keep = []
        for d in sorted(dirnames):
            full = Path(dirpath) / d
            if str(full) in _PSEUDO:
                continue
            try:
                kind = ownership.owned_kind(full)
                if kind in ownership.CACHE_KINDS:
                    out.append(Entry(kind, full, _size(full), True))
                    continue  # nothing of ours to find inside a cache
                if kind is None and d == "cache" and not full.is_symlink() and _older_cache(full):
                    out.append(Entry("not ours, kept", full, _size(full), False,
                                     "no marker: an older version's cache? delete it by hand"))
                    continue
            except FileNotFoundError:  # a temporary folder that vanished during the walk
                continue
            keep.append(d)
        dirnames[:] = keep
    return out


def cache_entries(root: Path, dirs: Optional[list[str]] = None) -> list[Entry]:
    """Every cache entry, the package's and what it found but did not write: under ``$IPROX_CACHE`` (default
    ``~/.cache/iprox_lightning``: ``root``) the float copies of GGUF files (``gguf/<name>-<key>``) and assembled model files
    (``models/``), and below each of ``dirs`` (a ``check`` output directory, a gradient store, a pipeline workdir) the
    ``check`` / store caches. An entry is the package's when it holds its marker (:mod:`iprox_lightning.io.ownership`);
    anything else is listed as "not ours, kept"."""
    out = _root_entries(root)
    for given in dirs or ():
        d = Path(given)
        if not d.is_dir():
            raise InputNotFoundError(f"cache: --under {d} is not a directory (give a check output dir, a store or a "
                                     "workdir)")
        out += _under_entries(d)
    return out


def list_caches(root: Path, under: Optional[str] = None, clear: bool = False) -> list[str]:
    """Print every cache entry (under ``root``, ``$IPROX_CACHE``, and below ``under``) with its size and the total;
    with ``clear`` delete the package's (:func:`iprox_lightning.commands.cache.cache` says which). Returns the
    package's entries."""
    entries = cache_entries(root, [under] if under else None)
    ours = [e for e in entries if e.ours]
    print(f"cache: $IPROX_CACHE = {root}" + ("" if entries else " (empty)"))
    width = max((len(e.kind) for e in entries), default=0)
    for e in entries:
        print(f"  {e.kind:<{width}}  {_human(e.size):>9}  {e.path}" + (f"  ({e.why})" if e.why else ""))
    total = sum(e.size for e in ours)
    if entries:
        kept = len(entries) - len(ours)
        print(f"  total {_human(total)} in {len(ours)} entries" + (f"; {kept} not ours, kept" if kept else ""))
    if under and ownership.owned_kind(under) in ownership.CACHE_KINDS:
        print(f"cache: {under} is itself a {ownership.owned_kind(under)}; --under lists what is below it (give its "
              "parent to list it)")
    if clear:
        for e in ours:
            try:
                ownership.remove_owned(e.path)
            except FileNotFoundError:
                pass
        print(f"cache: cleared {_human(total)}" + (f"; kept {len(entries) - len(ours)} entries not written by "
                                                    "iprox_lightning" if len(entries) > len(ours) else ""))
    return [str(e.path) for e in ours]
