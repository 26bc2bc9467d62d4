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
    import time

    from ..io import gradient_store as gs
    from ..io.fingerprint import loader_digest, model_identity
    from ..scoring.config import ScoringConfig

    if isinstance(neighbours, bool) or not isinstance(neighbours, int) or neighbours < 0:
        raise UserInputError(f"query: neighbours must be an integer >= 0, got {neighbours!r}")
    t0 = time.perf_counter()
    info, out = _read_store(store, output_dir)
    _check_output_dir(out, overwrite)
    if pool is not None:
        from ..data.pool import check_output_is_not_input

        check_output_is_not_input(out, pool, "output_dir")
    from ..io.ownership import make_owned_dir

    make_owned_dir(out, "scores")
    fp, st, tok = info["fingerprint"], info["fingerprint"]["settings"], info.get("tokenization", {})
    model = model or info.get("model_source")
    net = _check_model(store, fp["model"], model, st)
    batch_size = batch_size or tok.get("batch_size", 8)
    val = _validation_loader(store, info, model, validation, pool, subtasks, val_per_task, batch_size)
    val_digest = loader_digest(val)
    metric = ScoringConfig.from_settings(st).build_metric()  # the store's settings, the rest at their defaults
    vnet, extra = None, {}
    if validation_model is not None:  # only then in the cache key: earlier caches keep matching
        vnet = _load_net(validation_model, st)
        extra["validation_model"] = model_identity(validation_model, vnet)
    cache_fp = gs.validation_cache_fingerprint(store, info, val_digest, batch_size=batch_size, subtasks=subtasks,
                                               **extra)
    names, S, counts, near, cache_event = _validation_gradients(
        store, info, metric, val, cache_fp, neighbours=neighbours, progress=progress, t0=t0,
        net=lambda: net if net is not None else _load_net(model, st), pairs_from=vnet)
    del vnet
    t_val = time.perf_counter() - t0
    table, wall = _write_scores(out, store, info, metric, names, S, counts, near, neighbours, t0, t_val, {
        "store": fp, "validation": val_digest, "subtasks": subtasks, **extra}, validation_model, cache_event)
    reused = "; validation gradients reused from the store's cache" if cache_event["action"] == "reused" else ""
    print(f"query: {len(table)} stored pool examples scored against {len(names)} validation task(s) "
          f"({int(counts.sum())} examples{reused}) in {wall:.1f} s -> {out / 'scores.parquet'}")
    if neighbours:
        print(f"query: the {neighbours} nearest stored pool examples of each of the {int(counts.sum())} validation "
              f"examples (cosine) -> {out / 'neighbours.jsonl'}")
    return str(out / "scores.parquet")


def _check_output_dir(out, overwrite: bool) -> None:
    """Refuse an output directory holding another kind of run (exact scoring's shards and settings, RDS+, ...): a
    query would replace its table and settings and leave its shards beside them. ``overwrite`` clears it first."""
    from ..errors import OutputExistsError
    from ..io.score_dir import SHARD_DIR, clear_output
    from ..io.scores import read_settings

    method = str((read_settings(out) or {}).get("method", "(store query)"))
    if (out / SHARD_DIR).exists() or not method.endswith("(store query)"):
        if not overwrite:
            raise OutputExistsError(f"output_dir {out} holds another run's scores ({out / 'settings.json'}: method "
                                    f"{method!r}); pass --overwrite true to clear it first, or choose another output_dir")
        clear_output(out)


def _write_scores(out, store: str, info: dict, metric, names: list[str], S, counts, near, neighbours: int, t0: float,
                  t_val: float, fingerprint: dict, validation_model: Optional[str], cache_event: dict):
    """Score the stored pool against the validation gradients ``S`` and write ``scores.parquet``, ``settings.json``
    (and ``neighbours.jsonl``) under the output directory's one-writer lock; ``(table, wall seconds)``."""
    import time

    from ..io import gradient_store as gs
    from ..io.score_dir import ScoreDirLock, write_settings
    from ..scoring.query import query_table

    st = info["fingerprint"]["settings"]
    with ScoreDirLock(out, what="query", hint="write into another output_dir"):
        table = query_table(gs.iter_shards(store), names, S, {"method": metric.name, "task_names": names})
        table.save(str(out / "scores.parquet"))
        wall = time.perf_counter() - t0
        write_settings(out, {
            "method": f"{metric.name} (store query)", "store": str(store), "pool": info.get("pool"),
            "fingerprint": fingerprint,
            "scorer": {"method": metric.name, **metric.settings(), "k": st.get("k"), "seed": st.get("seed"),
                       "dim": info["dim"], "store_dtype": info["dtype"], "task_names": names,
                       "val_counts": [int(c) for c in counts], "val_seconds": t_val, "wall_s": wall,
                       "validation_model": validation_model or "store",
                       "validation_cache": cache_event}})
        if neighbours:
            _write_neighbours(out, store, near, neighbours)
    return table, wall


def _validation_loader(store: str, info: dict, model: str, validation: str, pool: Optional[str], subtasks: bool,
                       val_per_task: Optional[int], batch_size: int):
    """The validation examples tokenized as the store's pool was (its tokenizer, length and built-in size), each
    subtask its own task when ``subtasks``; a ``pool`` given is checked to be the one stored."""
    from ..data import SFTDataModule
    from ..io.fingerprint import FingerprintMismatch, diff, loader_digest

    tok = info.get("tokenization", {})
    dm = SFTDataModule(pool=pool or [], validation=validation, tokenizer=tok.get("tokenizer", model),
                       max_length=tok.get("max_length", 512), batch_size=batch_size,
                       val_per_task=val_per_task, builtin_size=tok.get("builtin_size", 2000))
    if pool is not None:
        lines = diff(info["fingerprint"].get("pool"), loader_digest(dm.dataloader("pool")))
        if lines:
            raise FingerprintMismatch(f"the store {store} holds another pool than {pool!r} (store -> now):\n  "
                                      + "\n  ".join(lines) + "\nbuild a store of this pool")
    records = dm.validation_records
    if subtasks:
        records = [{**r, "category": f"{r['category']}.{r['subtask']}"} if r.get("subtask") else r for r in records]
    return dm.records_dataloader(records)


def _read_store(store: str, output_dir: str):
    """``(store.json's info, the output directory)``, refusing an unfinished store, an output inside the store and a
    K-FAC store of the earlier eigenbasis layout."""
    from pathlib import Path

    from ..io import gradient_store as gs
    from ..scoring.store import BASIS

    info = gs.read_info(store)
    if not info.get("complete"):
        raise gs.StoreFormatError(f"{store}: the store's build has not finished ({Path(store) / gs.STORE_FILE}: "
                                  "'complete' is false); run the same build_store command again to finish it")
    gs.verify_contents(store, info)  # the shards, projections and factors the build recorded, unchanged
    out = Path(output_dir)
    if out.resolve() == Path(store).resolve():
        raise UserInputError(f"output_dir {output_dir} is the store itself; write the scores elsewhere")
    from ..io.output_guard import check_output_not_input
    from ..scoring.metrics import InfluenceMetric

    check_output_not_input(out, {"store": store}, "output_dir")
    st = info["fingerprint"]["settings"]
    fitted = getattr(InfluenceMetric.registry.get(st.get("method")), "factor_passes", 0) > 0  # its class says
    if fitted and st.get("basis") != BASIS:
        raise gs.StoreFormatError(f"{store}: this {st['method']} store was built by an earlier version, which projected "
                                  "the gradients in the K-FAC factors' eigenbases; queries now project in the weights' "
                                  "coordinates and would not match it. Rebuild it (the same build_store command with "
                                  "--overwrite true)")
    return info, out


def _load_net(model: str, st: dict):
    from ..models.loading import load_model

    net, _ = load_model(model, dtype=st.get("dtype", "float32"), attn_implementation="sdpa", tokenizer=False,
                        merge_adapters=st.get("gradients") != "adapters")  # as the store was built
    return net.eval()


def _check_model(store: str, stored: dict, model: str, st: dict):
    """Refuse ``model`` unless it is the one the store was built with (``stored``: the store fingerprint's model);
    the loaded model when telling needed loading it (a hub id), else ``None`` (a file or directory: identified by
    its files, loaded only if gradients are computed)."""
    from pathlib import Path

    from ..io.fingerprint import FingerprintMismatch, diff, model_identity

    net = None if Path(model).exists() else _load_net(model, st)
    lines = diff(stored, model_identity(model, net))
    if lines:
        raise FingerprintMismatch(f"the store {store} was built with another model than {model!r}; its gradients "
                                  "would not match this model's validation gradients. What differs (store -> now):\n  "
                                  + "\n  ".join(lines))
    return net


def _validation_gradients(store: str, info: dict, metric, val, cache_fp: str, *, neighbours: int, progress: bool,
                          t0: float, net, pairs_from=None):
    """``(task names, per-task sums S, counts, (vectors, ids, tasks) or None, cache event)`` of the validation
    batches ``val``: from the store's query cache under ``cache_fp`` when this validation set was queried before,
    else projected through the model ``net()`` (``pairs_from``: the gradients of that dense model, in ``net``'s
    coordinates) and kept there (the per-example vectors only for ``neighbours``)."""
    import logging
    import time
    from pathlib import Path

    import torch

    from ..io import gradient_store as gs
    from ..scoring.features import progress_bar
    from ..scoring.query import task_sums

    cached = gs.load_validation_gradients(store, cache_fp, vectors=bool(neighbours))
    if cached is not None:
        near = (cached["vectors"], cached["ids"], cached["tasks"]) if neighbours else None
        return cached["task_names"], cached["sums"], cached["counts"], near, {
            "action": "reused", "fingerprint": cache_fp, "path": cached["path"], "seconds_saved": cached["seconds"]}
    from ..engine.precision import precision_context

    st = info["fingerprint"]["settings"]
    model = net()
    # the store's precision (its pool gradients were computed under it): the validation gradients under the same one
    with precision_context(st.get("precision"), model if pairs_from is None else pairs_from):
        projector = _projector(store, info, st, metric, model, pairs_from)
        batches = (projector.project_batch(b) for b in progress_bar(val, progress, "validation gradients"))
        parts = list(batches) if neighbours else None  # per-example vectors only for neighbours: else D·n_tasks memory
        names, S, counts = task_sums(parts if parts is not None else batches)
    near = None
    if neighbours:
        near = (torch.cat([pt["vectors"] for pt in parts]), [i for pt in parts for i in pt["id"]],
                [t for pt in parts for t in pt["task"]])
    seconds = time.perf_counter() - t0
    cache_event = {"action": "computed", "fingerprint": cache_fp, "seconds": seconds}
    try:
        cache_event["path"] = str(gs.save_validation_gradients(
            store, cache_fp, task_names=names, sums=S, counts=counts, seconds=seconds,
            **({"vectors": near[0], "ids": near[1], "tasks": near[2]} if neighbours else {})))
    except OSError as e:  # e.g. a read-only store: the query goes on, a re-query computes them again
        logging.getLogger(__name__).warning(
            "query: cannot keep the validation gradients in %s (%s); a re-query will compute them again",
            Path(store) / gs.CACHE_DIR, e)
    return names, S, counts, near, cache_event


def _write_neighbours(out, store: str, near, neighbours: int) -> None:
    """``<out>/neighbours.jsonl``: each validation example's ``neighbours`` most similar stored pool examples."""
    import json

    from ..io import gradient_store as gs
    from ..scoring.query import nearest

    Q, vids, vtasks = near
    nn_ids, nn_sims = nearest(gs.iter_shards(store), Q, neighbours)
    rows = [{"id": i, "task": t, "neighbours": [{"id": n, "cosine": float(c)} for n, c in zip(ids, sims)]}
            for i, t, ids, sims in zip(vids, vtasks, nn_ids, nn_sims)]
    from ..io.atomic import write_text_atomic

    write_text_atomic(out / "neighbours.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _projector(store: str, info: dict, st: dict, metric, net, pairs_from=None):
    """The store's projections and factors, exactly as built, on ``net``."""
    from pathlib import Path

    import torch

    from ..io import gradient_store as gs
    from ..scoring.projection import GradientProjector, LayerProjection, ProjectionMismatch

    loaded = gs.load_projections(store)
    projections = {row["key"]: LayerProjection(row["key"], row["out"], row["in"], *loaded[row["key"]])
                   for row in info["layout"]}
    p = next(net.parameters())
    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    if metric.needs_factor_data:
        from ..io.factors import load_factors

        metric.load_state_dict(load_factors(Path(store) / info["factors"], method=metric.name), list(projections),
                               dtype=dtype)
    try:
        return GradientProjector(net, metric=None if metric.name == "tracin" or not metric.symmetric else metric,
                                 target_patterns=st.get("target_patterns"), projections=projections, dtype=dtype,
                                 pairs_from=pairs_from, loss_reduction=metric.loss_reduction)
    except ProjectionMismatch as e:
        def name(w):
            return "nothing" if w is None else f"{w[0]} ({w[1]} x {w[2]})"

        raise gs.StoreFormatError(
            f"{Path(store) / gs.STORE_FILE}: field 'layout[{e.index}]' is {name(e.have)}, but the model's tracked "
            f"weight there is {name(e.want)}: the layout does not list the model's weights in their order (an edited "
            "record, or the store of another model)") from None
