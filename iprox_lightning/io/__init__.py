"""One home for each on-disk artifact: the proxy directory (:mod:`.proxy`), the score table
(:mod:`.scores`) and the scoring directory it is merged in (:mod:`.score_dir`: lock, shards, merge), the
selection file (:mod:`.selection`), each with a schema version and a fingerprint of what produced it (:mod:`.fingerprint`); and the SFT record format that
pool files and selections share (:mod:`.records`). Every other module reads and writes these artifacts
through here; this package imports nothing from the rest of ``iprox_lightning`` but the layer helpers
(:mod:`~iprox_lightning.engine.target_layers`, :mod:`~iprox_lightning.engine.lowrank`) and the user-error classes
(:mod:`~iprox_lightning.errors`)."""
import warnings

# ``python -m iprox_lightning.io.proxy`` runs the module once more as __main__ after this package imported it; the
# warning runpy gives for that is noise on the command line's one-line output (the module defines no state to split)
warnings.filterwarnings("ignore", message=r"'iprox_lightning\.io\.proxy' found in sys\.modules", category=RuntimeWarning)

from .fingerprint import FingerprintMismatch, digest, diff  # noqa: E402
from .scores import SCHEMA_VERSION, read_scores, read_table, write_scores  # noqa: E402

# public for the benchmarks: a saved proxy's manifest and tensor shapes, a score table's task columns, the
# selection file, and a gradient store's info and shards (bench/layer_diagnosis.py reads stores it did not build)
from .gradient_store import iter_shards, read_info  # noqa: E402
from .proxy import PROXY_MANIFEST, read_manifest, tensor_shapes  # noqa: E402
from .scores import task_names_of  # noqa: E402
from .selection import write_selection  # noqa: E402

__all__ = ["FingerprintMismatch", "digest", "diff", "SCHEMA_VERSION", "read_scores", "read_table", "write_scores", "iter_shards", "read_info", "PROXY_MANIFEST", "read_manifest",
           "tensor_shapes", "task_names_of", "write_selection"]
