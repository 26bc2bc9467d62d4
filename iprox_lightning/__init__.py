"""iprox_lightning — influence-preserving proxies (IProX) for gradient-based data selection.

Stages: warm-up (``WarmupModule``) -> Stage 1 IPSVD (``IPSVDCallback`` / ``compress_model``)
-> Stage 2 alignment (``ProxyAlignModule``) -> scoring (``InfluenceScoringModule`` +
``InfluenceWriter`` / ``tracin_scores``) -> ``select`` -> fine-tuning (``FinetuneModule``)
-> evaluation (``EvaluationModule``).
"""
from .engine.batch import per_example_loss, sft_loss
from .callbacks import IPSVDCallback
from .evaluation import EvalDataModule, EvaluationModule
from .compression.apply import compress_model, count_parameters, load_proxy, save_proxy
from .io.proxy import export_proxy
from .compression.ipsvd import ipsvd_factors, random_factors, svd_factors, weighted_objective
from .alignment.losses import alignment_losses, factor_projections, gradient_alignment_loss
from .engine.lowrank import LowRankLinear
from .modules import CausalLMModule, FinetuneModule, ProxyAlignModule, WarmupModule
from .models.loading import load_model, load_tokenizer
from .engine.target_layers import find_target_linears
from .models.tiny import tiny_causal_lm
from .scoring import InfluenceScoringModule, InfluenceWriter, ScoreTable, multi_checkpoint_scores, tracin_scores
from .selection.select import select
from .engine.tracking import LayerTracker, requires_grad_inputs

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
