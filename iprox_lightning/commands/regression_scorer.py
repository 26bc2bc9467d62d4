"""Baseline (the paper's Influence Scorer, MATES-style): a regression head learns the target's hold-out scores, then scores the pool."""
from __future__ import annotations

from pathlib import Path


def regression_scorer(
    backbone: str,
    target_scores: str,
    output: str,
    pool: str = "builtin",
    tokenizer: str | None = None,
    holdout_fraction: float = 0.01,
    epochs: int = 5,
    lr: float = 1e-5,
    weight_decay: float = 1e-2,
    pooling: str = "mean",
    trainable_blocks: int = 0,
    max_length: int = 512,
    batch_size: int = 8,
    seed: int = 0,
) -> dict:
    """Fit a regression head on ``backbone`` to the target's scores of a random ``holdout_fraction`` of the
    pool, then score the whole pool; writes ``output`` (Parquet score table, columns id, score).

    Only the hold-out ids need target scores (``target_scores`` may hold just those).

    Args:
        backbone: the small frozen model under the regression head (dir, ``.gguf``, hub id, ``builtin``).
        target_scores: the target's score table (only the hold-out ids are read).
        output: the score table to write (Parquet).
        pool: the candidate pool (any source SFTDataModule reads).
        tokenizer: tokenizer (default: the backbone's).
        holdout_fraction: share of the pool the head is fitted on (paper: 1%).
        epochs: training epochs of the head.
        lr: learning rate (Adam).
        weight_decay: weight decay.
        pooling: how token states are pooled for the head (``mean`` or ``last``).
        trainable_blocks: how many top blocks of the backbone are also trained.
        max_length: token cap per example.
        batch_size: examples per batch.
        seed: seed of the hold-out split and training.
    """
    from ..io.scores import read_scores, write_scores  # lazy: --help
    from ..data.sft import pool_sample_datamodule  # lazy: --help
    from ..baselines.regression_scorer import build_regression_lm, fit_regression_scorer, predict_scores  # lazy: --help

    dm = pool_sample_datamodule(pool, tokenizer or backbone, holdout_fraction, max_length=max_length,
                                batch_size=batch_size, seed=seed)
    targets = read_scores(target_scores)
    scorer = build_regression_lm(backbone, pooling=pooling, trainable_blocks=trainable_blocks)
    history = fit_regression_scorer(scorer, dm.dataloader("construction"), targets, epochs=epochs, lr=lr,
                                    weight_decay=weight_decay, seed=seed)
    scores = predict_scores(scorer, dm.dataloader("pool"))
    path = write_scores(scores, output)
    from ..io.jsonfile import write_json  # lazy: --help

    write_json(Path(str(path) + ".json"), {"baseline": "regression_scorer", "backbone": backbone,
                                           "holdout": len(dm.ids("construction")), "history": history})
    print(f"regression_scorer: fitted on {len(dm.ids('construction'))} hold-out examples, scored {len(scores)} pool "
          f"examples -> {path}")
    return {"output": str(path), "n": len(scores), "history": history}
