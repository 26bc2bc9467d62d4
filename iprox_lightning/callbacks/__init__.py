"""Lightning callbacks of IProX."""
from ..compression.callback import IPSVDCallback
from ..alignment.keep_best import KeepBestFactors
from ..alignment.fidelity import RankingFidelity

__all__ = ["IPSVDCallback", "KeepBestFactors", "RankingFidelity"]
