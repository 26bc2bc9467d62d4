"""The cache of ``train.py check``: validation gradients and score tables, each under the fingerprint of what made it.

A proxy check scores the same validation sample with several models (target, proxy, Layer Extraction) and is often
run again (another proxy, another pool sample, after an interruption). Two things are kept under
``<check output dir>/cache/``:

* ``validation/<fingerprint>.safetensors`` (+ ``.json``) — a model's **raw validation gradient sums** per task
  (``InfluenceScorer.V`` after :meth:`~.influence.InfluenceScorer.collect_validation`, before the metric maps
  them, so TracIn and K-FAC share them) with the task names and counts. Fingerprint: the model's identity
  (:func:`~iprox_lightning.io.fingerprint.source_identity`: its files' content, or size + mtime above 256 MiB),
  the tokenized validation sample (ids, tasks, tokens: :func:`~iprox_lightning.io.fingerprint.loader_digest`, so
  the sample, tokenizer, template and ``max_length`` are in it), the tracked layers, per-task grouping and dtype.
* ``scores/<fingerprint>.parquet`` — a model's finished score table on the pool sample. Fingerprint: the
  validation fingerprint plus the pool sample's digest, the :class:`~.influence.ScoringConfig` and the batch size.

Anything changed gives another fingerprint, so an old result is never reused for new settings; files are written
atomically (temp file + ``os.replace``), so an interrupted check leaves whole files or none. :attr:`CheckCache.events`
lists what was computed and what was reused (``check`` prints and records it).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..io.fingerprint import digest, file_identity
from ..io.atomic import write_text_atomic as _atomic_write_text
from ..io.jsonfile import read_json
from ..io.tensor_cache import TensorCache
from .influence import InfluenceScorer, ScoreTable

FORMAT = 1

log = logging.getLogger(__name__)


class CheckCache:
    """Validation gradients and score tables under ``root`` (``<output_dir>/cache``), by fingerprint."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.files = TensorCache(self.root, kind="check cache")  # validation/<fp>.safetensors + .json
        self.events: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ fingerprints
    @staticmethod
    def validation_fingerprint(model_identity: Any, validation_digest: Any, scorer_settings: dict) -> str:
        """What the raw validation gradient sums depend on (not the metric: TracIn and K-FAC share them)."""
        return digest({"format": FORMAT, "model": model_identity, "validation": validation_digest,
                       **scorer_settings})

    @staticmethod
    def scores_fingerprint(validation_fp: str, pool_digest: Any, scoring_config: dict, batch_size: int) -> str:
        return digest({"format": FORMAT, "validation": validation_fp, "pool_sample": pool_digest,
                       "scoring": scoring_config, "batch_size": batch_size})

    # ------------------------------------------------------------------ validation gradients
    def validation_path(self, fp: str) -> Path:
        return self.files.path("validation", fp)

    def load_validation(self, scorer: InfluenceScorer, fp: str, who: str) -> bool:
        """Put the cached validation gradient sums ``fp`` into ``scorer`` (as ``collect_validation`` would);
        ``False`` when there are none (or they do not fit the scorer's tracked layers)."""
        entry = self.files.load("validation", fp, device=str(scorer.device))
        if entry is None:
            return False
        tensors, meta = entry
        keys = [v.key for v in scorer.linears]
        if sorted(keys) != sorted(meta["keys"]) or any(f"V{j}" not in tensors for j in range(len(keys))):
            return False
        by_key = {k: tensors[f"V{j}"] for j, k in enumerate(meta["keys"])}
        scorer.put_validation_sums({k: by_key[k] for k in keys}, meta["task_names"], meta["val_counts"])
        scorer.stats["val_seconds"] = 0.0
        scorer.stats["val_cached"] = fp
        self.events.append({"model": who, "what": "validation gradients", "action": "reused", "fingerprint": fp,
                            "path": str(self.validation_path(fp)), "seconds_saved": meta.get("seconds")})
        return True

    def save_validation(self, scorer: InfluenceScorer, fp: str, who: str) -> Path:
        """Write ``scorer``'s raw validation gradient sums (call before ``finalize``, which maps them)."""
        keys = list(scorer.V)
        path = self.files.save("validation", fp, {f"V{j}": scorer.V[k] for j, k in enumerate(keys)}, {
            "format": FORMAT, "keys": keys, "task_names": scorer.task_names,
            "val_counts": [int(c) for c in scorer.val_counts], "seconds": scorer.stats.get("val_seconds"),
            "model": who})
        self.events.append({"model": who, "what": "validation gradients", "action": "computed", "fingerprint": fp,
                            "path": str(path), "seconds": scorer.stats.get("val_seconds")})
        return path

    # ------------------------------------------------------------------ score tables
    def scores_path(self, fp: str) -> Path:
        return self.root / "scores" / f"{fp}.parquet"

    def load_scores(self, fp: str, who: str) -> ScoreTable | None:
        path = self.scores_path(fp)
        meta = path.with_suffix(".json")
        if not (path.is_file() and meta.is_file()):
            return None

        try:  # a cut, damaged or edited entry is computed again, as for the validation gradients
            settings = read_json(meta, what="check cache entry")
            if settings.get("sha256") != file_identity(path, hash_limit=None)["sha256"]:
                raise ValueError("the table is not the one written (sha256 differs or is missing)")
            table = ScoreTable.load(str(path))
        except Exception as e:
            log.warning("check cache: %s is unreadable (%s: %s); scoring again", path, type(e).__name__, e)
            return None
        table.settings = settings.get("settings", {})
        self.events.append({"model": who, "what": "scores", "action": "reused", "fingerprint": fp, "path": str(path),
                            "seconds_saved": settings.get("seconds")})
        return table

    def save_scores(self, table: ScoreTable, fp: str, who: str, seconds: float) -> Path:
        path = self.scores_path(fp)
        self.files.ensure_root()
        table.save(str(path))

        _atomic_write_text(path.with_suffix(".json"), json.dumps(
            {"format": FORMAT, "model": who, "seconds": seconds, "settings": table.settings,
             "sha256": file_identity(path, hash_limit=None)["sha256"]}, indent=1, default=str))
        self.events.append({"model": who, "what": "scores", "action": "computed", "fingerprint": fp,
                            "path": str(path), "seconds": seconds})
        return path


def padded_tokens(lengths: list[int], batch_size: int) -> int:
    """Tokens a padded batch loop over examples of these ``lengths`` (in order) processes: ``Σ_batches B · max len``
    — the unit ``check`` extrapolates its time estimate in."""
    return int(sum(len(lengths[i:i + batch_size]) * max(lengths[i:i + batch_size])
                   for i in range(0, len(lengths), batch_size)))


def batch_tokens(batch) -> int:
    """Padded tokens of one batch (``input_ids.numel()``)."""
    ids = batch["input_ids"]
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else int(sum(len(x) for x in ids))
