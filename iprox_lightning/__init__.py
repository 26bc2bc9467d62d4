"""iprox_lightning — influence-preserving proxies (IProX) for gradient-based data selection.

Stages: warm-up (``WarmupModule``) -> Stage 1 IPSVD (``IPSVDCallback`` / ``compress_model``)
-> Stage 2 alignment (``ProxyAlignModule``) -> scoring (``InfluenceScoringModule`` +
``InfluenceWriter`` / ``tracin_scores``) -> ``select`` -> fine-tuning (``FinetuneModule``)
-> evaluation (``EvaluationModule``).

The public names are imported on first use (:func:`__getattr__`): ``import iprox_lightning`` and
``python train.py --help`` load neither torch nor Lightning until a name that needs them is used.
"""
from __future__ import annotations

from .lazy import lazy_names

_HOMES = {
    'per_example_loss': '.engine.batch',
    'sft_loss': '.engine.batch',
    'IPSVDCallback': '.callbacks',
    'EvalDataModule': '.evaluation',
    'EvaluationModule': '.evaluation',
    'compress_model': '.compression.apply',
    'count_parameters': '.compression.apply',
    'load_proxy': '.compression.apply',
    'save_proxy': '.compression.apply',
    'export_proxy': '.io.proxy',
    'ipsvd_factors': '.compression.ipsvd',
    'random_factors': '.compression.ipsvd',
    'svd_factors': '.compression.ipsvd',
    'weighted_objective': '.compression.ipsvd',
    'alignment_losses': '.alignment.losses',
    'factor_projections': '.alignment.losses',
    'gradient_alignment_loss': '.alignment.losses',
    'LowRankLinear': '.engine.lowrank',
    'CausalLMModule': '.modules',
    'FinetuneModule': '.modules',
    'ProxyAlignModule': '.modules',
    'WarmupModule': '.modules',
    'load_model': '.models.loading',
    'load_tokenizer': '.models.loading',
    'find_target_linears': '.engine.target_layers',
    'tiny_causal_lm': '.models.tiny',
    'InfluenceScoringModule': '.scoring',
    'InfluenceWriter': '.scoring',
    'ScoreTable': '.scoring',
    'multi_checkpoint_scores': '.scoring',
    'tracin_scores': '.scoring',
    'select': '.selection.select',
    'LayerTracker': '.engine.tracking',
    'requires_grad_inputs': '.engine.tracking',
}
"""Each public name and the module (relative to this package) it lives in."""


__getattr__, __dir__ = lazy_names(__name__, _HOMES, subpackages=True)  # a public name, or a subpackage (ipx.scoring)


__version__ = "0.1.0"

__all__ = [
    "InfluenceScoringModule", "InfluenceWriter", "ScoreTable", "multi_checkpoint_scores", "select", "tracin_scores",
    "CausalLMModule", "FinetuneModule", "ProxyAlignModule", "WarmupModule", "alignment_losses",
    "factor_projections", "gradient_alignment_loss",
    "EvalDataModule", "EvaluationModule",
    "IPSVDCallback", "LayerTracker", "LowRankLinear", "compress_model", "count_parameters",
    "export_proxy", "find_target_linears", "ipsvd_factors", "load_model", "load_proxy", "load_tokenizer",
    "per_example_loss", "random_factors", "requires_grad_inputs", "save_proxy", "sft_loss",
    "svd_factors", "tiny_causal_lm", "weighted_objective",
]
