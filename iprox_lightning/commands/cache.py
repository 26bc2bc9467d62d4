"""List the caches this package writes, with their sizes, and clear them (GGUF copies, check and store caches).

The listing lives in :mod:`iprox_lightning.io.caches`; this module is the command's arguments."""
from __future__ import annotations

from typing import Optional


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
    from ..io.caches import list_caches  # lazy: --help (the io package loads torch)
    from ..models.loading import cache_root  # lazy: --help

    return list_caches(cache_root(), under, clear)
