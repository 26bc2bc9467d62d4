"""Score a validation set from a gradient store (and find each validation example's nearest pool examples)."""
from __future__ import annotations

from typing import Optional

from ..errors import UserInputError


def query(
    store: str,
    validation: str,
    output_dir: str,
    model: Optional[str] = None,
    pool: Optional[str] = None,
    subtasks: bool = True,
    neighbours: int = 0,
    val_per_task: Optional[int] = None,
    batch_size: Optional[int] = None,
    progress: bool = False,
    validation_model: Optional[str] = None,
    overwrite: bool = False,
) -> str:
    """Score every stored pool example against the validation set with one matrix product (TracIn cosine in the
    store's metric, per task, LESS max over subtasks) and write ``<output_dir>/scores.parquet`` + ``settings.json``,
    the score table ``select`` reads. Only the validation examples' gradients are computed (with the store's saved
    projections and factors); the pool is never read again. A store built with another model (or, when ``pool`` is
    given, another pool) is refused. The validation gradients are kept in the store (``<store>/cache/``, under the
    fingerprint of the store, the tokenized validation set and the batch size): a re-query of the same validation set
    (another output directory, ``neighbours``) reads them instead of running the model (``settings.json``:
    ``scorer.validation_cache.action`` is ``reused``).

    Args:
        store: the gradient store directory (``python train.py build_store``).
        validation: the validation sets (a file with a ``category`` column, ``builtin``, ``eval:<dir>``).
        output_dir: where ``scores.parquet`` and ``settings.json`` (and ``neighbours.jsonl``) go.
        model: the model (default: the one the store was built with); its identity must match the store's.
        pool: the pool, to check it is the one stored (optional: ``select`` checks the pool it copies from anyway).
        subtasks: score each subtask of a validation record (``eval:`` sources: MMLU subject, BBH task, TyDiQA
            language) as its own column ``<task>.<subtask>``, so ``select --rule max --task <task>`` is LESS's max.
        neighbours: also write, per validation example, its ``neighbours`` most similar pool examples (cosine of the
            stored vectors) to ``neighbours.jsonl`` (0: none).
        val_per_task: keep at most this many validation examples per task.
        batch_size: validation examples per backward pass (default: the store's).
        progress: show a progress bar over the validation batches.
        validation_model: a proxy's store queried with the validation gradients of this dense model (the target the
            proxy was built from: hub id, directory, ``.gguf``), projected into the proxy's factor space and then by
            the store's projections (:class:`~iprox_lightning.scoring.features.FactorSpaceView`): the validation
            examples pay the target's backward, the pool stays the proxy's. Default: the store's own model.
        overwrite: clear an ``output_dir`` that holds another kind of run (exact scoring's shards and settings, RDS+)
            before writing; without it such a directory is refused (a store query's own directory is re-written).
    """
    if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
        raise UserInputError(f"query: neighbours must be an integer >= 0, got {neighbours!r}")
    from ..scoring.store_query import QuerySettings, run_query  # lazy: --help (it loads torch and the model)

    return run_query(QuerySettings(
        store=store, validation=validation, output_dir=output_dir, model=model, pool=pool, subtasks=subtasks,
        neighbours=neighbours, val_per_task=val_per_task, batch_size=batch_size, progress=progress,
        validation_model=validation_model, overwrite=overwrite))
