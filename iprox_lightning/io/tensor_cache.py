"""Tensors kept under the fingerprint of what made them: ``<root>/<kind>/<fingerprint>.safetensors`` plus a JSON
sidecar ``<fingerprint>.json`` (names, counts, timings: whatever the user of the cache records).

Both files are written atomically (temp file + ``os.replace``), the JSON last, so an entry exists exactly when both
files do and an interrupted run leaves whole entries or none. Safetensors only: nothing is ever unpickled. An entry
that cannot be read counts as absent (it is computed again and replaced). The fingerprint says everything the
tensors depend on, so a changed input never finds an old entry. Used by ``train.py check``
(:class:`~iprox_lightning.scoring.check_cache.CheckCache`: validation gradient sums) and ``train.py query``
(:func:`iprox_lightning.io.gradient_store.validation_cache`: projected validation gradients).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from safetensors.torch import load_file, save_file

from .fingerprint import tensors_digest
from .jsonfile import read_json
from .ownership import make_owned_dir

log = logging.getLogger(__name__)


from .atomic import atomic_path, write_text_atomic as atomic_write_text  # noqa: E402,F401  (check_cache's name)


class TensorCache:
    """Entries ``(tensors, meta)`` under ``root``, by kind and fingerprint (see the module doc)."""

    def __init__(self, root: str | os.PathLike, kind: str = "check cache") -> None:
        self.root = Path(root)
        self.kind = kind  # the marker's kind (io/ownership.py): what ``train.py cache`` lists and may clear

    def ensure_root(self) -> None:
        """Create ``root`` marked as :attr:`kind` (an existing, non-empty unmarked root stays unmarked: not ours)."""
        make_owned_dir(self.root, self.kind)

    def path(self, kind: str, fp: str) -> Path:
        """The entry's tensors file (its JSON: the same path with suffix ``.json``)."""
        return self.root / kind / f"{fp}.safetensors"

    def exists(self, kind: str, fp: str) -> bool:
        p = self.path(kind, fp)
        return p.is_file() and p.with_suffix(".json").is_file()

    def load(self, kind: str, fp: str, device: str = "cpu") -> tuple[dict[str, Any], dict] | None:
        """``(tensors, meta)`` of an entry, or ``None`` when it is absent or unreadable."""
        if not self.exists(kind, fp):
            return None
        path = self.path(kind, fp)
        try:
            meta = read_json(path.with_suffix(".json"), what="cache entry")
            tensors = load_file(str(path), device=device)
            if meta.get("content_sha256") != tensors_digest(tensors):
                raise ValueError("its tensors are not the ones written (content_sha256 differs or is missing)")
        except Exception as e:  # a damaged or changed entry: computed again and replaced
            log.warning("cache entry %s is unreadable (%s: %s); computing it again", path, type(e).__name__, e)
            return None
        return tensors, meta

    def save(self, kind: str, fp: str, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
        """Write an entry (the tensors, then the JSON); returns the tensors file."""
        path = self.path(kind, fp)
        self.ensure_root()
        with atomic_path(path) as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        atomic_write_text(path.with_suffix(".json"), json.dumps({**dict(meta), "content_sha256": tensors_digest(tensors)},
                                                                indent=1))
        return path
