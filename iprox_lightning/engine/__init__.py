"""The engine every stage runs on: one forward and backward with each targeted layer's inputs and output
gradients handed to small trackers (``tracking``), the SFT batch and loss (``batch``), which layers are targeted
(``target_layers``), the low-rank layer (``lowrank``), block surgery (``blocks``), train/eval modes, damping and the
settings machinery."""
