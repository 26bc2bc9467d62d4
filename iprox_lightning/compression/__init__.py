"""Stage 1, IPSVD: probes, factors, ranks, the plan, applying it to a model, and the ``IPSVDCallback``."""
# public on purpose: Stage 1 as a function (compress a model from its probes), its health check, the probes and
# the rank a sparsity gives; the benchmarks (bench/layer_diagnosis.py, bench/speed.py) compress through these
# (bench/stage1_equivalence.py: ``compress`` with its config, on one process or across ranks with ``TorchExchange``)
from .apply import compress, compress_model
from .config import CompressionConfig
from .health import proxy_health
from .probes import collect_probes
from .ranks import rank_for_sparsity
from .schedule import TorchExchange

__all__ = [
    "CompressionConfig", "TorchExchange", "collect_probes", "compress", "compress_model", "proxy_health",
    "rank_for_sparsity",
]
