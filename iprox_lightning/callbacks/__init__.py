"""Lightning callbacks of IProX."""
from .ipsvd import IPSVDCallback
from .keep_best import KeepBestFactors
from .ranking_fidelity import RankingFidelity

__all__ = ["IPSVDCallback", "KeepBestFactors", "RankingFidelity"]
