"""Check a proxy before trusting it: score a pool sample with the target and the proxy, print retention and a verdict.

The sample is scored with TracIn or K-FAC (:class:`~iprox_lightning.scoring.InfluenceScorer`) against a
**stratified validation sample**: ``val_per_task`` examples per validation task, drawn with ``seed``
(:func:`~iprox_lightning.data.splits.sample_per_task`; the ids are recorded). The table holds Spearman / Pearson /
Kendall and top-1/5/10% overlap, with response length partialled out, next to the free baselines (length sort, Layer
Extraction at the proxy's sparsity), then the same per validation task and a one-line verdict with the next step
(:func:`~iprox_lightning.analysis.verdict.check_verdict`).

Cost: validation gradients are computed once per model and kept under ``<output_dir>/cache/validation/`` by
fingerprint (model files, validation sample, tokenization, tracked layers), each model's score table under
``<output_dir>/cache/scores/`` as soon as it is done (:mod:`iprox_lightning.scoring.check_cache`): a re-run, a second
proxy or another ``--method`` reuses what it can, an interrupted check resumes. After the first batch a time
estimate for the rest is printed, a rough upper bound (that batch's seconds per padded token, times the tokens left:
the proxies run faster than the target's batch measured).

The work lives in :mod:`iprox_lightning.workflow.check`; this module is the command's arguments.
"""
from __future__ import annotations

from typing import Any

from ..analysis.verdict import FLOOR
from ..engine.settings import takes_settings
from ..scoring.config import METRIC_FIELDS, ScoringConfig


@takes_settings(ScoringConfig, "scoring", fields=(*METRIC_FIELDS, "feature_mode", "target_patterns"))
def check(
    target: str,
    proxy: str,
    pool: str = "builtin",
    validation: str = "builtin",
    tokenizer: str | None = None,
    sample: int = 200,
    val_per_task: int | None = 16,
    max_length: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    output_dir: str | None = None,
    output: str | None = None,
    layer_extraction: bool = True,
    min_spearman: float = FLOOR,
    proxy_validation: str | None = None,
    keep_validation_cache: bool = True,
    scoring: ScoringConfig | None = None,
) -> dict[str, Any]:
    """Score ``sample`` random pool examples with ``target`` and ``proxy`` against ``val_per_task`` validation
    examples per task; print the retention table, the per-task table and a verdict.

    Besides Spearman / Kendall / top-k overlap the row holds ``length_floor`` (how well ranking by
    response length alone, shortest first, matches the target) and ``spearman_length_partialled``
    (the proxy's retention that length does not explain) — TracIn rankings often follow length, and
    then raw retention flatters any proxy (see docs/BENCHMARKS.md). The pooled score is one cosine to the mean
    gradient of every validation example, so the largest task dominates it: each row also holds ``per_task``
    (:func:`~iprox_lightning.analysis.retention.per_task_retention` of the per-task scores: Spearman,
    length-partialled Spearman, Spearman among the 10% shortest responses, top-5% / top-10% overlap per validation
    task) and ``worst_task`` (the minimum over
    tasks); the length sort ranks every task by length. The verdict
    (:func:`~iprox_lightning.analysis.verdict.check_verdict`) says "use this proxy" when it beats every free baseline
    on every task, else which baseline does as well on which task, and the next step to try.

    Args:
        target: the target model (hub id, dir, ``.gguf``, ``builtin``).
        proxy: the proxy (saved IProX proxy dir, or any causal LM).
        pool: the candidate pool the sample is drawn from (any source ``SFTDataModule`` reads).
        validation: the validation sets (any source ``SFTDataModule`` reads; ``eval:<dir>`` for the paper's suites).
        tokenizer: defaults to the target's.
        sample: number of random pool examples to score.
        val_per_task: validation examples per task, drawn with ``seed`` (stratified; a task with fewer keeps all;
            ``None``: every validation example). The validation gradients cost about as much per example as
            scoring one pool example, once per model.
        max_length: token cap per example.
        batch_size: examples per batch.
        seed: seed of the pool sample and of the validation sample.
        output_dir: where the result (``check.json``) and the cache (``cache/``: validation gradients and score
            tables by fingerprint, reused by a later check) are written (default: the folder of ``output``, else
            ``outputs/check``).
        output: the result JSON (default ``<output_dir>/check.json``): ``rows`` (the table), ``verdict``, the
            validation sample (``seed``, ``val_per_task``, ids per task) and what was computed or reused.
        layer_extraction: also score the free baselines on the same sample — ``length sort`` (shortest
            response first, model-free) and, for an IProX proxy directory, Layer Extraction of the target at
            the proxy's achieved sparsity (same parameter budget) — as extra rows. A proxy worth using beats
            both, also with length partialled out.
        min_spearman: the verdict's floor: a task where the proxy's Spearman with the target is below it fails even
            when the proxy beats every baseline there (:func:`~iprox_lightning.analysis.verdict.check_verdict`
            says where its default, 0.4, comes from; ``-1``: off).
        proxy_validation: whose validation gradients the proxy's scores use: ``target`` (the target's, in the proxy's
            factor coordinates: :class:`~iprox_lightning.scoring.features.FactorSpaceView`, as ``pipeline`` scores a
            proxy by default), ``proxy`` (its own) or ``None`` (default): ``target`` for a saved IProX proxy that kept
            every block of the target, ``proxy`` for any other model. Layer Extraction always uses its own (its
            blocks are renumbered).
        keep_validation_cache: keep the validation gradient sums under ``<output_dir>/cache/validation/`` (most of
            the cache: one float32 gradient per task column and model, 0.42 GB each for SmolLM2-135M) for the next
            check of the same models; ``false`` deletes them at the end (the score tables, small, are kept, so the
            same check again is still free). ``train.py cache --under <output_dir>`` lists and clears caches.
    """
    from ..workflow.check import CheckSettings, run_check  # lazy: --help (it loads torch and the models)

    return run_check(CheckSettings(
        target=target, proxy=proxy, pool=pool, validation=validation, tokenizer=tokenizer, sample=sample,
        val_per_task=val_per_task, max_length=max_length, batch_size=batch_size, seed=seed, output_dir=output_dir,
        output=output, layer_extraction=layer_extraction, min_spearman=min_spearman,
        proxy_validation=proxy_validation, keep_validation_cache=keep_validation_cache, scoring=scoring))
