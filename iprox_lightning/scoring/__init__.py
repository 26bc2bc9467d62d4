"""Influence scoring: gradient features from the backward-pairs engine, influence metrics (TracIn, K-FAC),
scores, the Lightning prediction module and writer. See ``influence.py`` for the definitions.

The names are imported on first use, so that :mod:`.config` (the scoring settings, which the commands' signatures and
their ``--help`` read) loads without torch, and ``scoring.features`` (for ``train.py plan``) without Lightning."""
from __future__ import annotations

from ..lazy import lazy_names

_HOMES = {
    **dict.fromkeys(("VirtualLinear", "choose_mode", "feature_costs", "layer_features", "tracked_modules",
                     "virtual_linears", "trim_batch"), ".features"),
    **dict.fromkeys(("InfluenceScorer", "ScoreTable", "influence_metric", "influence_scores",
                     "multi_checkpoint_scores", "tracin_scores"), ".influence"),
    "ScoringConfig": ".config",
    **dict.fromkeys(("KFAC", "InfluenceMetric", "KFACFactors", "LayerMetric", "TracIn"), ".metrics"),
    "InfluenceScoringModule": ".module",
    **dict.fromkeys(("InfluenceWriter", "done_ids", "merge_shards"), ".writer"),
    # public for the benchmarks (bench/speed.py times the engine's pieces and the store's projection;
    # bench/neighbours.py the store's blocked nearest neighbours)
    "GradientProjector": ".projection", "nearest": ".query",
    # bench/plan_proxy.py: the query's validation sums and table measured against the plan
    "task_sums": ".query", "query_table": ".query",
    # bench/plan_scoring.py: the store build's measured peak
    "GradientStoreModule": ".store", "GradientStoreWriter": ".store",
}

__all__ = [
    "LayerMetric", "VirtualLinear", "choose_mode", "feature_costs", "layer_features",
    "tracked_modules", "virtual_linears", "InfluenceScorer", "KFACFactors", "ScoreTable", "ScoringConfig",
    "InfluenceMetric", "TracIn", "KFAC", "influence_metric", "influence_scores",
    "multi_checkpoint_scores", "tracin_scores", "InfluenceScoringModule", "InfluenceWriter", "done_ids", "merge_shards",
    "trim_batch", "GradientProjector", "nearest", "GradientStoreModule", "GradientStoreWriter", "task_sums",
    "query_table",
]

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
