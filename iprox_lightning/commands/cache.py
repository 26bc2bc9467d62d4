"""List the caches this package writes, with their sizes, and clear them (GGUF copies, check and store caches)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def cache_entries(dirs: Optional[list[str]] = None) -> list[tuple[str, Path, int]]:
    """``(kind, path, bytes)`` of every cache entry: under ``$IPROX_CACHE`` (default ``~/.cache/iprox_lightning``)
    the float copies of GGUF files (``gguf/<name>-<key>``) and assembled model files (``models/``), and in each of
    ``dirs`` (a ``check`` output directory, a gradient store, a pipeline workdir: searched for ``cache/`` folders)
    the ``check`` / store caches."""
    from ..models.loading import cache_root

    root = cache_root()
    out: list[tuple[str, Path, int]] = []
    for kind, sub in (("gguf copy", "gguf"), ("model file", "models")):
        d = root / sub
        if d.is_dir():
            out += [(kind, p, _size(p)) for p in sorted(d.iterdir())]
    for given in dirs or ():
        d = Path(given)
        if not d.is_dir():
            from ..errors import InputNotFoundError

            raise InputNotFoundError(f"cache: {d} is not a directory (give a check output dir, a store or a workdir)")
        found = [d] if d.name == "cache" else sorted(p for p in d.rglob("cache") if p.is_dir())
        out += [("check/store cache", p, _size(p)) for p in found]
    return out


def cache(clear: bool = False, under: Optional[str] = None) -> list[str]:
    """Print every cache entry with its size and the total; with ``clear``, delete them. Nothing else is touched: a
    deleted entry is rebuilt when next needed (a GGUF copy on the next load, about a minute for SmolLM2).

    Where the caches live:

    * ``$IPROX_CACHE`` (default ``~/.cache/iprox_lightning``): ``gguf/`` holds the float (safetensors) copy of every
      ``.gguf`` file loaded, so the next load takes seconds (SmolLM2-135M: 0.5 GB, Gemma-3-270M: 1.1 GB);
      ``models/`` model files assembled by the tests (Gemma-3-270M's GGUF from its PyPI parts). Set ``IPROX_CACHE``
      to put them elsewhere.
    * ``check``: ``<output_dir>/cache/`` (validation gradient sums and score tables; ``--keep_validation_cache
      false`` drops the gradient sums, most of it, after the run).
    * ``query``: ``<store>/cache/`` (the validation gradients of each validation set queried).

    Args:
        clear: delete every entry listed (``--clear true``: the ``$IPROX_CACHE`` ones and those found ``under``).
        under: also list the ``cache/`` folders under this directory (a ``check`` output dir, a gradient store,
            a pipeline workdir, ``outputs``).
    """
    from ..models.loading import cache_root

    entries = cache_entries([under] if under else None)
    print(f"cache: $IPROX_CACHE = {cache_root()}" + ("" if entries else " (empty)"))
    width = max((len(k) for k, _, _ in entries), default=0)
    for kind, path, size in entries:
        print(f"  {kind:<{width}}  {_human(size):>9}  {path}")
    total = sum(s for _, _, s in entries)
    if entries:
        print(f"  total {_human(total)} in {len(entries)} entries")
    if clear:
        for _, path, _ in entries:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        print(f"cache: cleared {_human(total)}")
    return [str(p) for _, p, _ in entries]
