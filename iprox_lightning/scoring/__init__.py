"""Influence scoring: gradient features from the backward-pairs engine, influence metrics (TracIn, K-FAC),
scores, the Lightning prediction module and writer. See ``influence.py`` for the definitions.

The names are imported on first use, so that a module of the wing (``scoring.features`` for ``train.py plan``) loads
without Lightning."""
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {
    "VirtualLinear": ".features", "choose_mode": ".features", "feature_costs": ".features",
    "layer_features": ".features", "tracked_modules": ".features", "virtual_linears": ".features",
    "InfluenceScorer": ".influence", "ScoreTable": ".influence", "ScoringConfig": ".influence",
    "influence_scores": ".influence", "multi_checkpoint_scores": ".influence", "tracin_scores": ".influence",
    "KFAC": ".metrics", "InfluenceMetric": ".metrics", "KFACFactors": ".metrics", "LayerMetric": ".metrics",
    "TracIn": ".metrics", "influence_metric": ".metrics",
    "InfluenceScoringModule": ".module",
    "InfluenceWriter": ".writer", "done_ids": ".writer", "merge_shards": ".writer",
    # public for the benchmarks (bench/speed.py times the engine's pieces and the store's projection;
    # bench/neighbours.py the store's blocked nearest neighbours)
    "trim_batch": ".features", "GradientProjector": ".projection", "nearest": ".query",
}

__all__ = [
    "LayerMetric", "VirtualLinear", "choose_mode", "feature_costs", "layer_features",
    "tracked_modules", "virtual_linears", "InfluenceScorer", "KFACFactors", "ScoreTable", "ScoringConfig",
    "InfluenceMetric", "TracIn", "KFAC", "influence_metric", "influence_scores",
    "multi_checkpoint_scores", "tracin_scores", "InfluenceScoringModule", "InfluenceWriter", "done_ids", "merge_shards",
    "trim_batch", "GradientProjector", "nearest",
]

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
