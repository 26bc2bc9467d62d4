"""Stage 1, IPSVD: probes, factors, ranks, the plan, applying it to a model, and the ``IPSVDCallback``."""
# public on purpose: Stage 1 as a function (compress a model from its probes), its health check, the probes and
# the rank a sparsity gives; the benchmarks (bench/layer_diagnosis.py, bench/speed.py) compress through these
from .apply import compress_model
from .health import proxy_health
from .probes import collect_probes
from .ranks import rank_for_sparsity

__all__ = [
    "collect_probes", "compress_model", "proxy_health", "rank_for_sparsity",
]
