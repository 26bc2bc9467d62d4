"""The engine every stage runs on: one forward and backward with each targeted layer's inputs and output
gradients handed to small trackers (``tracking``), the SFT batch and loss (``batch``), which layers are targeted
(``target_layers``), the low-rank layer (``lowrank``), block surgery (``blocks``), train/eval modes, damping and the
settings machinery."""
# public on purpose: the SFT batch's ignored label, per-example loss and scored-token mask, the low-rank layer and
# the targeted layers — what a caller building batches or proxies by hand needs (bench/speed.py); imported on first
# use, so that engine.settings (the commands' signatures, their --help) loads without torch
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {"IGNORE_INDEX": ".batch", "per_example_loss": ".batch", "shifted_token_mask": ".batch",
          "unfused_head": ".batch",  # unfused_head: bench/speed.py
          "LowRankLinear": ".lowrank", "find_target_linears": ".target_layers"}

__all__ = [
    "IGNORE_INDEX", "LowRankLinear", "find_target_linears", "per_example_loss", "shifted_token_mask", "unfused_head",
]

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
