"""Lightning callbacks of IProX."""
from .ipsvd import IPSVDCallback

__all__ = ["IPSVDCallback"]
