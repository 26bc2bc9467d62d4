"""Report on finished score tables: retention, SA / 1-NND, FLOPs, plots, selections explained (--workdir: a pipeline run).

For a set of score tables already written by the scoring stage: retention of every proxy against the
target, optional SA / 1-NND of each selection (gradients of a reference model, randomly projected),
FLOPs per stage from the model shapes, plots (scatter, histograms) as PNG, all in one Markdown
report + JSON.

The work lives in :mod:`iprox_lightning.analysis.report`; this module is the command's arguments.
"""
from __future__ import annotations

from typing import Any


def report(
    workdir: str | None = None,
    target_scores: str | None = None,
    proxy_scores: dict[str, str] | None = None,
    output_dir: str | None = None,
    target_model: str | None = None,
    proxy_models: dict[str, str] | None = None,
    topk_fraction: float = 0.05,
    seq_len: int = 512,
    n_probe_examples: int | None = None,
    n_align_examples: int | None = None,
    n_val: int | None = None,
    gradient_model: str | None = None,
    pool: str = "builtin",
    validation: str = "builtin",
    tokenizer: str | None = None,
    max_length: int = 256,
    projection_dim: int = 64,
    max_examples: int | None = 2000,
    plots: bool = True,
) -> list[dict[str, Any]]:
    """One retention / SA / 1-NND / FLOPs table for a set of proxies, plus plots, as ``report.md``
    (heading, settings, table, column legend, plots, selections explained) and ``report.json``.

    Args:
        workdir: a pipeline run (or the stage-by-stage ``outputs``): finds the target's and every
            other score table, the models, the selections and the summary itself
            (:func:`iprox_lightning.analysis.report_doc.discover_workdir`); SA / 1-NND use the
            warmed-up target's gradients. Explicit arguments override what it finds.
        target_scores: the target's score table (Parquet/JSONL written by the scoring stage).
        proxy_scores: ``{name: score table}`` for each proxy (IProX variants, baselines, random).
        output_dir: where ``report.md``, ``report.json`` and the PNGs go (default
            ``<workdir>/report``, or ``outputs/report``).
        target_model: the target model dir, for the FLOPs columns and the target's cost row.
        proxy_models: ``{name: model dir}`` for the FLOPs columns (same names as ``proxy_scores``).
        topk_fraction: the selection size for SA / 1-NND (paper: 5%).
        seq_len: tokens per example in the FLOPs model.
        n_probe_examples: probe examples of the IPSVD stage in the FLOPs model (default: from the
            proxy's manifest).
        n_align_examples: alignment examples in the FLOPs model (default: manifest's steps × 4).
        n_val: validation examples in the FLOPs model (default: the validation set's size).
        gradient_model: if set, per-example gradients of this model (randomly projected to
            ``projection_dim`` per layer) on the pool and validation data give SA and 1-NND.
        pool: the candidate pool (for SA / 1-NND).
        validation: the validation sets (for SA / 1-NND and ``n_val``).
        tokenizer: tokenizer for SA / 1-NND (default: ``gradient_model``'s).
        max_length: token cap per example for SA / 1-NND.
        projection_dim: random projection size per layer for SA / 1-NND.
        max_examples: at most this many pool examples get gradients for SA / 1-NND.
        plots: also write the scatter and histogram PNGs.
    """
    from ..analysis.report import ReportSettings, run_report  # lazy: --help (it loads torch and matplotlib)

    return run_report(ReportSettings(
        workdir=workdir, target_scores=target_scores, proxy_scores=proxy_scores, output_dir=output_dir,
        target_model=target_model, proxy_models=proxy_models, topk_fraction=topk_fraction, seq_len=seq_len,
        n_probe_examples=n_probe_examples, n_align_examples=n_align_examples, n_val=n_val,
        gradient_model=gradient_model, pool=pool, validation=validation, tokenizer=tokenizer, max_length=max_length,
        projection_dim=projection_dim, max_examples=max_examples, plots=plots))
