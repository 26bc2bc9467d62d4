"""The paper's baselines: Layer Extraction (ShortGPT), Influence Scorer (MATES-style), random selection."""
from .influence_scorer import (
    RegressionLM,
    build_regression_lm,
    fit_influence_scorer,
    predict_scores,
)
from .layer_extraction import (
    block_importance,
    blocks_to_keep,
    decoder_blocks,
    layer_extraction_proxy,
    remove_blocks,
    run_layer_extraction,
    save_layer_extraction,
)
from .random_selection import random_score, random_scores, random_subset, write_random_scores

__all__ = [
    "RegressionLM", "build_regression_lm", "fit_influence_scorer", "predict_scores",
    "block_importance", "blocks_to_keep", "decoder_blocks", "layer_extraction_proxy", "remove_blocks",
    "run_layer_extraction", "save_layer_extraction", "random_score", "random_scores", "random_subset",
    "write_random_scores",
]
