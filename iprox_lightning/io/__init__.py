"""One home for each on-disk artifact: the proxy directory (:mod:`.proxy`), the score table
(:mod:`.scores`) and the scoring directory it is merged in (:mod:`.score_dir`: lock, shards, merge, settings) and the selection file (:mod:`.selection`), each with a
schema version and a fingerprint of what produced it (:mod:`.fingerprint`); and the SFT record format that
pool files and selections share (:mod:`.records`). Every other module reads and writes these artifacts
through here; this package imports nothing from the rest of ``iprox_lightning`` but the layer helpers
(:mod:`~iprox_lightning.engine.target_layers`, :mod:`~iprox_lightning.engine.lowrank`) and the user-error classes
(:mod:`~iprox_lightning.errors`)."""
from .fingerprint import FingerprintMismatch, digest, diff
from .scores import SCHEMA_VERSION, read_scores, read_table, write_scores

__all__ = ["FingerprintMismatch", "digest", "diff", "SCHEMA_VERSION", "read_scores", "read_table", "write_scores"]
