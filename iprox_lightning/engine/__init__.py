"""The engine every stage runs on: one forward and backward with each targeted layer's inputs and output
gradients handed to small trackers (``tracking``), the SFT batch and loss (``batch``), which layers are targeted
(``target_layers``), the low-rank layer (``lowrank``), block surgery (``blocks``), train/eval modes, damping and the
settings machinery."""
# public on purpose: the SFT batch's ignored label, per-example loss and scored-token mask, the low-rank layer and
# the targeted layers — what a caller building batches or proxies by hand needs (bench/speed.py)
from .batch import IGNORE_INDEX, per_example_loss, shifted_token_mask, unfused_head  # unfused_head: bench/speed.py
from .lowrank import LowRankLinear
from .target_layers import find_target_linears

__all__ = [
    "IGNORE_INDEX", "LowRankLinear", "find_target_linears", "per_example_loss", "shifted_token_mask", "unfused_head",
]
