"""Command-line entries of the paper's baselines (``python train.py <command> --config ...``).

* ``layer_extraction`` — ShortGPT-style Layer Extraction proxy from the (warmed-up) target, saved as
  a Hugging Face directory that ``configs/score.yaml`` scores like any model;
* ``influence_scorer`` — MATES-style: a small backbone + regression head learns the target's scores
  on a 1% hold-out and then scores the pool (writes a score table);
* ``random_scores`` — seeded random scores (random selection through the same ``select`` step).

The off-the-shelf proxy baseline needs no command: point ``configs/score.yaml`` at any causal LM.
"""
from __future__ import annotations

import json
from pathlib import Path


def _data(pool: str, validation: str | None, tokenizer: str, max_length: int, batch_size: int, seed: int,
          construction_fraction: float = 0.01):
    from ..data import SFTDataModule

    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer, max_length=max_length,
                       batch_size=batch_size, seed=seed, construction_fraction=construction_fraction)
    dm.setup("predict")
    return dm


def layer_extraction(
    model: str,
    output_dir: str,
    pool: str = "builtin",
    tokenizer: str | None = None,
    sparsity: float = 0.3,
    sample_fraction: float = 0.01,
    max_length: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    dtype: str = "float32",
) -> dict:
    """Block importance ``1 − E[cos(h_i, h_{i+1})]`` on a random ``sample_fraction`` of the pool (the
    IProX construction split), keep the top ``(1 − sparsity)`` share of blocks, save the smaller dense model.

    Args:
        model: the (warmed-up) target to extract layers from.
        output_dir: where the smaller model is saved (score it with configs/score.yaml).
        pool: the candidate pool (any source SFTDataModule reads).
        tokenizer: tokenizer (default: the model's).
        sparsity: share of blocks' parameters to remove (ShortGPT drops whole blocks).
        sample_fraction: share of the pool used to measure block importance.
        max_length: token cap per example.
        batch_size: examples per batch.
        seed: seed of the sample.
        dtype: dtype of the saved model.
    """
    from .layer_extraction import run_layer_extraction

    dm = _data(pool, None, tokenizer or model, max_length, batch_size, seed, construction_fraction=sample_fraction)
    info = run_layer_extraction(model, output_dir, dm.dataloader("construction"), sparsity=sparsity, dtype=dtype)
    print(f"layer extraction: kept {len(info['kept_blocks'])} of {info['num_layers_before']} blocks -> {output_dir}")
    return info


def influence_scorer(
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
    from ..analysis.score_table import read_scores, write_scores
    from .influence_scorer import build_regression_lm, fit_influence_scorer, predict_scores

    dm = _data(pool, None, tokenizer or backbone, max_length, batch_size, seed, construction_fraction=holdout_fraction)
    targets = read_scores(target_scores)
    scorer = build_regression_lm(backbone, pooling=pooling, trainable_blocks=trainable_blocks)
    history = fit_influence_scorer(scorer, dm.dataloader("construction"), targets, epochs=epochs, lr=lr,
                                   weight_decay=weight_decay, seed=seed)
    scores = predict_scores(scorer, dm.dataloader("pool"))
    path = write_scores(scores, output)
    Path(str(path) + ".json").write_text(json.dumps({"baseline": "influence_scorer", "backbone": backbone,
                                                     "holdout": len(dm.ids("construction")), "history": history}, indent=2))
    print(f"influence_scorer: fitted on {len(dm.ids('construction'))} hold-out examples, scored {len(scores)} pool "
          f"examples -> {path}")
    return {"output": str(path), "n": len(scores), "history": history}


def random_scores(output: str, pool: str = "builtin", seed: int = 0) -> str:
    """Seeded random scores for every pool example (random selection via ``select``).

    Args:
        output: the score table to write (Parquet).
        pool: the candidate pool (any source SFTDataModule reads).
        seed: seed of the random scores.
    """
    from ..data.pool import read_pool
    from .random_selection import write_random_scores

    recs = read_pool(pool)
    path = str(write_random_scores(sorted(r["id"] for r in recs), output, seed=seed))
    print(f"random_scores: wrote seeded (seed {seed}) random scores for {len(recs)} pool examples to {path}")
    return path
