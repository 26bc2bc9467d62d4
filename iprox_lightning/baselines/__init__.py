"""The paper's baselines: Layer Extraction (ShortGPT), the regression scorer (the paper's Influence Scorer,
MATES-style regression head), random selection, and RDS+ (representation-based selection, Ivison et al. 2025)."""
from .regression_scorer import RegressionLM, build_regression_lm, fit_regression_scorer, predict_scores
from .layer_extraction import (
    block_importance, blocks_to_keep, decoder_blocks, layer_extraction_proxy, remove_blocks, run_layer_extraction,
    save_layer_extraction,
)
from .rds import embed as rds_embed, rds_table
from .random_selection import random_score, random_scores, random_subset, write_random_scores

# public for the benchmarks (bench/effect.py's length-matched controls)
from .random_selection import length_matched_subset

__all__ = [
    "RegressionLM", "build_regression_lm", "fit_regression_scorer", "predict_scores",
    "block_importance", "blocks_to_keep", "decoder_blocks", "layer_extraction_proxy", "remove_blocks",
    "run_layer_extraction", "save_layer_extraction", "random_score", "random_scores", "random_subset",
    "write_random_scores", "rds_embed", "rds_table",
    "length_matched_subset",
]
