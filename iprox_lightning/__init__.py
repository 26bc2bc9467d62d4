"""iprox_lightning — influence-preserving proxies (IProX) for gradient-based data selection."""
from .batch import per_example_loss, sft_loss
from .lowrank import LowRankLinear
from .models.targets import find_target_linears
from .models.tiny import tiny_causal_lm
from .tracking import LayerTracker, requires_grad_inputs

__version__ = "0.1.0"
