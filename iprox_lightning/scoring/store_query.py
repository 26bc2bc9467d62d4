"""``train.py query``'s work (:func:`run_query`): read a finished gradient store, check the model (and pool) are the
ones stored, compute the validation gradients with the store's projections, factors and precision (or read them from
the store's cache), score every stored pool example by one matrix product (:func:`~.query.query_table`) and write
the score table ``select`` reads (and the nearest neighbours). ``commands/query.py`` holds the command's
arguments."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..data import SFTDataModule
from ..data.pool import check_output_is_not_input
from ..engine.precision import precision_context
from ..errors import OutputExistsError, UserInputError
from ..io import gradient_store as gs
from ..io.atomic import write_text_atomic
from ..io.factors import load_factors
from ..io.fingerprint import FingerprintMismatch, diff, loader_digest, model_identity
from ..io.output_guard import check_output_not_input
from ..io.ownership import make_owned_dir
from ..io.score_dir import SHARD_DIR, ScoreDirLock, clear_output, write_settings
from ..io.scores import read_settings
from ..models.loading import load_model
from .config import ScoringConfig
from .features import progress_bar
from .metrics import InfluenceMetric
from .projection import GradientProjector, LayerProjection, ProjectionMismatch
from .query import nearest, query_table, task_sums
from .store import BASIS


@dataclass(frozen=True)
class QuerySettings:
    """The arguments of one ``python train.py query``, as :func:`iprox_lightning.commands.query.query` received them
    (its signature declares their defaults, its docstring what each means)."""

    store: str
    validation: str
    output_dir: str
    model: Optional[str]
    pool: Optional[str]
    subtasks: bool
    neighbours: int
    val_per_task: Optional[int]
    batch_size: Optional[int]
    progress: bool
    validation_model: Optional[str]
    overwrite: bool


def run_query(q: QuerySettings) -> str:
    """Score the store ``q.store``'s pool against ``q.validation`` into ``<output_dir>/scores.parquet`` (+
    ``settings.json``, ``neighbours.jsonl``); returns the table's path."""
    t0 = time.perf_counter()
    info, out = _read_store(q.store, q.output_dir)
    _check_output_dir(out, q.overwrite)
    if q.pool is not None:
        check_output_is_not_input(out, q.pool, "output_dir")
    make_owned_dir(out, "scores")
    fp, st, tok = info["fingerprint"], info["fingerprint"]["settings"], info.get("tokenization", {})
    model = q.model or info.get("model_source")
    net = _check_model(q.store, fp["model"], model, st)
    batch_size = q.batch_size or tok.get("batch_size", 8)
    val = _validation_loader(q.store, info, model, q.validation, q.pool, q.subtasks, q.val_per_task, batch_size)
    val_digest = loader_digest(val)
    metric = ScoringConfig.from_settings(st).build_metric()  # the store's settings, the rest at their defaults
    vnet, extra = None, {}
    if q.validation_model is not None:  # only then in the cache key: earlier caches keep matching
        vnet = _load_net(q.validation_model, st)
        extra["validation_model"] = model_identity(q.validation_model, vnet)
    cache_fp = gs.validation_cache_fingerprint(q.store, info, val_digest, batch_size=batch_size,
                                               subtasks=q.subtasks, **extra)
    names, S, counts, near, cache_event = _validation_gradients(
        q.store, info, metric, val, cache_fp, neighbours=q.neighbours, progress=q.progress, t0=t0,
        net=lambda: net if net is not None else _load_net(model, st), pairs_from=vnet)
    del vnet
    t_val = time.perf_counter() - t0
    table, wall = _write_scores(out, q.store, info, metric, names, S, counts, near, q.neighbours, t0, t_val, {
        "store": fp, "validation": val_digest, "subtasks": q.subtasks, **extra}, q.validation_model, cache_event)
    reused = "; validation gradients reused from the store's cache" if cache_event["action"] == "reused" else ""
    print(f"query: {len(table)} stored pool examples scored against {len(names)} validation task(s) "
          f"({int(counts.sum())} examples{reused}) in {wall:.1f} s -> {out / 'scores.parquet'}")
    if q.neighbours:
        print(f"query: the {q.neighbours} nearest stored pool examples of each of the {int(counts.sum())} validation "
              f"examples (cosine) -> {out / 'neighbours.jsonl'}")
    return str(out / "scores.parquet")


def _check_output_dir(out, overwrite: bool) -> None:
    """Refuse an output directory holding another kind of run (exact scoring's shards and settings, RDS+, ...): a
    query would replace its table and settings and leave its shards beside them. ``overwrite`` clears it first."""

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

    info = gs.read_info(store)
    if not info.get("complete"):
        raise gs.StoreFormatError(f"{store}: the store's build has not finished ({Path(store) / gs.STORE_FILE}: "
                                  "'complete' is false); run the same build_store command again to finish it")
    gs.verify_contents(store, info)  # the shards, projections and factors the build recorded, unchanged
    out = Path(output_dir)
    if out.resolve() == Path(store).resolve():
        raise UserInputError(f"output_dir {output_dir} is the store itself; write the scores elsewhere")
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
    net, _ = load_model(model, dtype=st.get("dtype", "float32"), attn_implementation="sdpa", tokenizer=False,
                        merge_adapters=st.get("gradients") != "adapters")  # as the store was built
    return net.eval()


def _check_model(store: str, stored: dict, model: str, st: dict):
    """Refuse ``model`` unless it is the one the store was built with (``stored``: the store fingerprint's model);
    the loaded model when telling needed loading it (a hub id), else ``None`` (a file or directory: identified by
    its files, loaded only if gradients are computed)."""

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

    cached = gs.load_validation_gradients(store, cache_fp, vectors=bool(neighbours))
    if cached is not None:
        near = (cached["vectors"], cached["ids"], cached["tasks"]) if neighbours else None
        return cached["task_names"], cached["sums"], cached["counts"], near, {
            "action": "reused", "fingerprint": cache_fp, "path": cached["path"], "seconds_saved": cached["seconds"]}
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

    Q, vids, vtasks = near
    nn_ids, nn_sims = nearest(gs.iter_shards(store), Q, neighbours)
    rows = [{"id": i, "task": t, "neighbours": [{"id": n, "cosine": float(c)} for n, c in zip(ids, sims)]}
            for i, t, ids, sims in zip(vids, vtasks, nn_ids, nn_sims)]
    write_text_atomic(out / "neighbours.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def _projector(store: str, info: dict, st: dict, metric, net, pairs_from=None):
    """The store's projections and factors, exactly as built, on ``net``."""

    loaded = gs.load_projections(store)
    projections = {row["key"]: LayerProjection(row["key"], row["out"], row["in"], *loaded[row["key"]])
                   for row in info["layout"]}
    p = next(net.parameters())
    dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    if metric.needs_factor_data:
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
