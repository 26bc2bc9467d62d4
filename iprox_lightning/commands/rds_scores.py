"""Baseline scores: RDS+ (cosine of position-weighted mean-pooled final hidden states to each validation task)."""
from __future__ import annotations

from pathlib import Path


def rds_scores(
    model: str,
    output_dir: str,
    pool: str = "builtin",
    validation: str = "builtin",
    tokenizer: str | None = None,
    max_length: int = 512,
    batch_size: int = 8,
    seed: int = 0,
    builtin_size: int = 2000,
    device: str = "auto",
    overwrite: bool = False,
) -> str:
    """Score every pool example with RDS+ (forward passes only) and write ``<output_dir>/scores.parquet`` (the
    influence-score format: ``select`` takes it with any rule) and ``settings.json`` (model, pool and validation
    identity).

    Args:
        model: the model whose representations are compared (paper: the warmed-up target).
        output_dir: where ``scores.parquet`` and ``settings.json`` go.
        pool: the candidate pool (any source SFTDataModule reads).
        validation: the validation sets (a file with a ``category`` column, ``builtin``, ``eval:<dir>``).
        tokenizer: tokenizer (default: the model's).
        max_length: token cap per example.
        batch_size: examples per forward pass.
        seed: seed of the data module's splits.
        builtin_size: size of the built-in pool (``pool: builtin``).
        device: where the forward passes run (``auto``: a GPU where one is visible, else the CPU).
        overwrite: replace the scores of an ``output_dir`` that holds another run's (another selector's table or
            other settings); the same settings again are re-written.
    """
    from ..baselines.rds_run import write_rds_scores  # lazy: --help

    return write_rds_scores(model, Path(output_dir), pool=pool, validation=validation, tokenizer=tokenizer,
                            max_length=max_length, batch_size=batch_size, seed=seed, builtin_size=builtin_size,
                            device=device, overwrite=overwrite)
