"""Baseline scores: RDS+ (cosine of position-weighted mean-pooled final hidden states to each validation task)."""
from __future__ import annotations

import time
from pathlib import Path

from ..errors import OutputExistsError


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
    from ..baselines.rds import rds_table  # lazy: --help
    from ..engine.batch import resolve_device  # lazy: --help
    from ..data import SFTDataModule  # lazy: --help
    from ..io.fingerprint import loader_digest, source_identity  # lazy: --help
    from ..io.score_dir import write_settings  # lazy: --help
    from ..models.loading import load_model  # lazy: --help

    from ..data.pool import check_output_is_not_input  # lazy: --help
    from ..io.scores import read_settings  # lazy: --help

    out = Path(output_dir)
    check_output_is_not_input(out, pool, "output_dir")
    old = read_settings(out) or None
    settings = {"method": "rds+", "max_length": max_length}
    other_run = old is not None and (old.get("fingerprint") or {}).get("settings") != settings
    if other_run and overwrite:
        from ..io.ownership import check_owned  # lazy: --help

        check_owned(out, "scores", option="--overwrite true", what="its scores would be replaced")
    if other_run and not overwrite:
        raise OutputExistsError(f"output_dir {out} holds another run's scores ({out / 'settings.json'}: method "
                                f"{old.get('method')!r}); pass --overwrite true to replace them, or choose another "
                                "output_dir")
    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer or model, max_length=max_length,
                       batch_size=batch_size, seed=seed, builtin_size=builtin_size)
    dm.setup("predict")
    dm.setup("validate")
    net, _ = load_model(model, tokenizer=False)
    net.to(resolve_device(device))
    t0 = time.perf_counter()
    table = rds_table(dm.predict_dataloader(), dm.validation_dataloader(), net)
    wall = time.perf_counter() - t0
    from ..io.ownership import make_owned_dir  # lazy: --help

    make_owned_dir(out, "scores")
    path = table.save(str(out / "scores.parquet"))
    write_settings(out, {"method": "rds+", **table.settings, "wall_s": wall, "pool": dm.pool_provenance(),
                         "fingerprint": {
        "model": source_identity(model), "settings": settings,
        "pool": loader_digest(dm.predict_dataloader()), "validation": loader_digest(dm.validation_dataloader())}})
    print(f"rds_scores: RDS+ scores of {len(table)} pool examples against {len(table.task_names)} validation "
          f"task(s) in {wall:.1f} s -> {path}")
    return path
