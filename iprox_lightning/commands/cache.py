"""List the caches this package writes, with their sizes, and clear them (GGUF copies, check and store caches)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple, Optional

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
    from ..io.ownership import is_sidecar, owned_kind

    out: list[Entry] = []
    for sub, kind in (("gguf", "gguf copy"), ("models", "model file")):
        d = root / sub
        try:
            children = sorted(d.iterdir()) if d.is_dir() else []  # each entry is judged by its own marker
        except OSError:
            children = []
        for p in children:
            if is_sidecar(p) and owned_kind(p.parent / p.name[1:-len(".iprox.json")]) is not None:
                continue  # the marker of a file entry, listed with it
            got = owned_kind(p)
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
    from ..io.ownership import CACHE_KINDS, owned_kind

    out: list[Entry] = []
    for dirpath, dirnames, _ in os.walk(top, onerror=lambda e: None, followlinks=False):
        keep = []
        for d in sorted(dirnames):
            full = Path(dirpath) / d
            if str(full) in _PSEUDO:
                continue
            try:
                kind = owned_kind(full)
                if kind in CACHE_KINDS:
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


def cache_entries(dirs: Optional[list[str]] = None) -> list[Entry]:
    """Every cache entry, the package's and what it found but did not write: under ``$IPROX_CACHE`` (default
    ``~/.cache/iprox_lightning``) the float copies of GGUF files (``gguf/<name>-<key>``) and assembled model files
    (``models/``), and below each of ``dirs`` (a ``check`` output directory, a gradient store, a pipeline workdir) the
    ``check`` / store caches. An entry is the package's when it holds its marker (:mod:`iprox_lightning.io.ownership`);
    anything else is listed as "not ours, kept"."""
    from ..errors import InputNotFoundError
    from ..models.loading import cache_root

    out = _root_entries(cache_root())
    for given in dirs or ():
        d = Path(given)
        if not d.is_dir():
            raise InputNotFoundError(f"cache: --under {d} is not a directory (give a check output dir, a store or a "
                                     "workdir)")
        out += _under_entries(d)
    return out


def cache(clear: bool = False, under: Optional[str] = None) -> list[str]:
    """Print every cache entry with its size and the total; with ``clear``, delete the package's. Only an entry that
    holds the package's marker (``.iprox-dir.json``, written when the package created it) is deleted; anything else
    found where caches live (a user's ``models/my-finetune`` under ``$IPROX_CACHE``, a symbolic link, a folder named
    ``cache`` the package did not write) is listed as "not ours, kept" and never touched. A deleted entry is rebuilt
    when next needed (a GGUF copy on the next load, about a minute for SmolLM2).

    Caches written by a version before markers hold none: they are listed as not ours (those under ``--under``
    when they look like a check / store cache) and kept; delete them by hand (``rm -r <path>``) if they are yours to
    drop.

    Where the caches live:

    * ``$IPROX_CACHE`` (default ``~/.cache/iprox_lightning``): ``gguf/`` holds the float (safetensors) copy of every
      ``.gguf`` file loaded, so the next load takes seconds (SmolLM2-135M: 0.5 GB, Gemma-3-270M: 1.1 GB);
      ``models/`` model files assembled by the tests (Gemma-3-270M's GGUF from its PyPI parts). Set ``IPROX_CACHE``
      to put them elsewhere.
    * ``check``: ``<output_dir>/cache/`` (validation gradient sums and score tables; ``--keep_validation_cache
      false`` drops the gradient sums, most of it, after the run).
    * ``query``: ``<store>/cache/`` (the validation gradients of each validation set queried).

    Args:
        clear: delete every entry listed as the package's (``--clear true``: the ``$IPROX_CACHE`` ones and those
            found ``under``).
        under: also list the check / store caches below this directory (a ``check`` output dir, a gradient store,
            a pipeline workdir, ``outputs``); the directory itself is never an entry.
    """
    from ..io.ownership import owned_kind, remove_owned
    from ..models.loading import cache_root

    entries = cache_entries([under] if under else None)
    ours = [e for e in entries if e.ours]
    print(f"cache: $IPROX_CACHE = {cache_root()}" + ("" if entries else " (empty)"))
    width = max((len(e.kind) for e in entries), default=0)
    for e in entries:
        print(f"  {e.kind:<{width}}  {_human(e.size):>9}  {e.path}" + (f"  ({e.why})" if e.why else ""))
    total = sum(e.size for e in ours)
    if entries:
        kept = len(entries) - len(ours)
        print(f"  total {_human(total)} in {len(ours)} entries" + (f"; {kept} not ours, kept" if kept else ""))
    from ..io.ownership import CACHE_KINDS

    if under and owned_kind(under) in CACHE_KINDS:
        print(f"cache: {under} is itself a {owned_kind(under)}; --under lists what is below it (give its parent to "
              "list it)")
    if clear:
        for e in ours:
            try:
                remove_owned(e.path)
            except FileNotFoundError:
                pass
        print(f"cache: cleared {_human(total)}" + (f"; kept {len(entries) - len(ours)} entries not written by "
                                                    "iprox_lightning" if len(entries) > len(ours) else ""))
    return [str(e.path) for e in ours]
