"""Influence scoring: gradient features from hooks, TracIn / K-FAC scores, the Lightning
prediction module and writer. See ``influence.py`` for the definitions."""
from .features import (
    LayerMetric,
    VirtualLinear,
    backward_pairs,
    choose_mode,
    feature_costs,
    layer_features,
    tracked_modules,
    virtual_linears,
)
from .influence import InfluenceScorer, KFACFactors, ScoreTable, multi_checkpoint_scores, tracin_scores
from .module import InfluenceScoringModule
from .writer import InfluenceWriter, done_ids, merge_shards

__all__ = [
    "LayerMetric", "VirtualLinear", "backward_pairs", "choose_mode", "feature_costs", "layer_features",
    "tracked_modules", "virtual_linears", "InfluenceScorer", "KFACFactors", "ScoreTable",
    "multi_checkpoint_scores", "tracin_scores", "InfluenceScoringModule", "InfluenceWriter", "done_ids", "merge_shards",
]
