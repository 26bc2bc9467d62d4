"""Baseline proxy: Layer Extraction (ShortGPT) of the target, saved as a smaller model to score like any model."""
from __future__ import annotations


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
    from ..baselines.layer_extraction import run_layer_extraction  # lazy: --help
    from ..data.pool import check_output_is_not_input  # lazy: --help
    from ..data.sft import pool_sample_datamodule  # lazy: --help
    from ..io.output_guard import check_output_not_input  # lazy: --help

    check_output_not_input(output_dir, {"model": model, "tokenizer": tokenizer}, "output_dir")
    check_output_is_not_input(output_dir, pool, "output_dir")

    dm = pool_sample_datamodule(pool, tokenizer or model, sample_fraction, max_length=max_length, batch_size=batch_size,
                                seed=seed)
    info = run_layer_extraction(model, output_dir, dm.dataloader("construction"), sparsity=sparsity, dtype=dtype)
    print(f"layer extraction: kept {len(info['kept_blocks'])} of {info['num_layers_before']} blocks -> {output_dir}")
    return info
