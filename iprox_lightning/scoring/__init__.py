"""Influence scoring: gradient features from the backward-pairs engine, influence metrics (TracIn, K-FAC),
scores, the Lightning prediction module and writer. See ``influence.py`` for the definitions."""
from .features import VirtualLinear, choose_mode, feature_costs, layer_features, tracked_modules, virtual_linears
from .influence import (
    InfluenceScorer, ScoreTable, ScoringConfig, influence_scores, multi_checkpoint_scores, tracin_scores,
)
from .metrics import KFAC, InfluenceMetric, KFACFactors, LayerMetric, TracIn, influence_metric
from .module import InfluenceScoringModule
from .writer import InfluenceWriter, done_ids, merge_shards

# public for the benchmarks (bench/speed.py times the engine's pieces and the store's projection; bench/neighbours.py
# the store's blocked nearest neighbours)
from .features import trim_batch
from .projection import GradientProjector
from .query import nearest

__all__ = [
    "LayerMetric", "VirtualLinear", "choose_mode", "feature_costs", "layer_features",
    "tracked_modules", "virtual_linears", "InfluenceScorer", "KFACFactors", "ScoreTable", "ScoringConfig",
    "InfluenceMetric", "TracIn", "KFAC", "influence_metric", "influence_scores",
    "multi_checkpoint_scores", "tracin_scores", "InfluenceScoringModule", "InfluenceWriter", "done_ids", "merge_shards",
    "trim_batch", "GradientProjector", "nearest",
]
