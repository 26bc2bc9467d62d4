"""``train.py check``'s work (:func:`run_check`): draw a pool sample and a stratified validation sample, score the
sample with the target, the proxy and the free baselines (each model's validation gradients and score table cached
by fingerprint under ``<output_dir>/cache/``, :mod:`iprox_lightning.scoring.check_cache`), then the retention
tables and the verdict (:func:`~iprox_lightning.analysis.verdict.check_verdict`). ``commands/check.py`` holds the
command's arguments."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch.utils.data import DataLoader, Subset

from .. import console
from ..analysis.retention import format_per_task, length_confound, per_task_retention, per_task_scores, worst_task
from ..analysis.tables import format_table, retention_rows
from ..analysis.verdict import check_verdict
from ..baselines.layer_extraction import layer_extraction_proxy
from ..baselines.random_selection import random_subset
from ..data import SFTDataModule
from ..data.pool import check_output_is_not_input
from ..data.sft import SFTCollator
from ..engine.batch import token_counts
from ..errors import PROXY_VALIDATIONS, OutputIsDirectoryError, UserInputError, check_choice, check_output_dir
from ..io.fingerprint import loader_digest, source_identity
from ..io.jsonfile import write_json
from ..io.output_guard import check_output_not_input
from ..io.ownership import make_owned_dir, owned_kind
from ..io.proxy import PROXY_MANIFEST, read_manifest
from ..models.hub import check_model_source
from ..models.loading import load_model
from ..scoring.check_cache import CheckCache, batch_tokens, padded_tokens
from ..scoring.config import ScoringConfig
from ..scoring.features import progress_bar
from ..scoring.influence import InfluenceScorer, _table_from_parts
from ..scoring.metrics import InfluenceMetric


@dataclass(frozen=True)
class CheckSettings:
    """The arguments of one ``python train.py check``, as :func:`iprox_lightning.commands.check.check` received them
    (its signature declares their defaults, its docstring what each means); ``scoring``: the scoring settings."""

    target: str
    proxy: str
    pool: Any
    validation: Any
    tokenizer: str | None
    sample: int
    val_per_task: int | None
    max_length: int
    batch_size: int
    seed: int
    output_dir: str | None
    output: str | None
    layer_extraction: bool
    min_spearman: float
    proxy_validation: str | None
    keep_validation_cache: bool
    scoring: ScoringConfig


def run_check(c: CheckSettings) -> dict[str, Any]:
    """Check the proxy ``c.proxy`` against ``c.target``: the retention table, the per-task tables and the verdict
    printed and written (``check.json``); returns the proxy's row with the verdict and whether to use it."""
    _check_arguments(c.sample, c.val_per_task)
    _check_models(target=c.target, proxy=c.proxy)
    proxy_validation = _proxy_validation(c.proxy, c.proxy_validation)
    config, method = c.scoring, c.scoring.method  # checked when built, before anything is loaded
    if getattr(config.metric_class(), "needs_optimizer_state", False):  # (LESS) a LoRA checkpoint's, not a proxy's
        raise UserInputError(f"method: {method} scores a LoRA checkpoint's adapter gradients with its Adam moments, "
                             "which a proxy and its dense target do not have: check with tracin, kfac or ekfac")
    result_path, cache = _output_paths(c.output_dir, c.output)
    check_output_is_not_input(result_path, c.pool, "output")
    check_output_is_not_input(cache.root, c.pool, "output_dir")
    for path, option in ((result_path, "output"), (cache.root, "output_dir")):
        check_output_not_input(path, {"target": c.target, "proxy": c.proxy}, option)
    make_owned_dir(cache.root.parent, "check output")
    s = _sample_pool(c.sample, cache, pool=c.pool, validation=c.validation, tokenizer=c.tokenizer or c.target,
                     max_length=c.max_length, batch_size=c.batch_size, seed=c.seed, val_per_task=c.val_per_task)
    models, le_rho = _models_to_score(c.target, c.proxy, s.dm, c.layer_extraction)
    validation_from = {"proxy": models["target"]} if proxy_validation == "target" else {}
    fps, estimate = _plan_cache(cache, models, s, config, c.max_length, validation_from)
    tables, seconds = _score_models(models, fps, cache, config, s, estimate, validation_from)
    rows = _retention_rows(tables, seconds, s, method, c.layer_extraction, le_rho)
    verdict = check_verdict(rows, manifest=_proxy_manifest(c.proxy), target=c.target, floor=c.min_spearman)
    _print_tables(rows, verdict, tables["target"].task_names, len(s.chosen), method, c.proxy, c.target,
                  proxy_validation)
    result = {"rows": rows, "verdict": verdict, "target": c.target, "proxy": c.proxy, "method": method,
              "proxy_validation": proxy_validation,
              "sample": len(s.chosen), "seed": c.seed, "max_length": c.max_length,
              "validation": {"source": c.validation, "val_per_task": c.val_per_task, "seed": c.seed,
                             "counts": {t: len(v) for t, v in s.val_sample.items()}, "ids": s.val_sample},
              "cache": cache.events, "seconds": seconds, "estimate_s": estimate.estimate_s}
    _write_result(result_path, result)
    if not c.keep_validation_cache:
        _drop_validation_cache(cache)
    return {**rows[0], "verdict": verdict["verdict"], "use": verdict["use"]}


def _sample_loader(dm, split: str, ids: list[str], batch_size: int):
    ds = dm.dataset(split)
    index = {i: k for k, i in enumerate(ds.ids)}
    return DataLoader(Subset(ds, [index[i] for i in ids]), batch_size=batch_size,
                      collate_fn=SFTCollator(dm.pad_token_id), shuffle=False)


def _proxy_manifest(proxy: str) -> dict | None:
    return read_manifest(proxy) if (Path(proxy) / PROXY_MANIFEST).is_file() else None


def _proxy_sparsity(proxy: str) -> float | None:
    """Achieved sparsity of the targeted layers of a saved IProX proxy (``None`` for any other model)."""
    m = _proxy_manifest(proxy)
    if m is None:
        return None
    before, after = m.get("target_params_before"), m.get("target_params_after")
    return 1.0 - after / before if before and after is not None else m.get("sparsity")


class _Estimate:
    """Prints, once: the seconds per padded token of one measured batch x the padded tokens still to process. The
    measured batch is the second of a loop (the first one also pays one-time costs: allocation, hooks), or the first
    when its loop has only one."""

    def __init__(self, total_tokens: int, describe: str) -> None:
        self.left = total_tokens
        self.describe = describe
        self.printed = False
        self.estimate_s: float | None = None

    def timed(self, batches, who: str, what: str):
        n_batches = len(batches) if hasattr(batches, "__len__") else None
        it = iter(batches)
        j = 0
        while True:
            t0 = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            yield b  # the consumer processes the batch before asking for the next one
            n = batch_tokens(b)
            j += 1
            if not self.printed and n and (j == 2 or n_batches == 1):
                s = time.perf_counter() - t0
                self.estimate_s = s / n * max(self.left - n, 0)
                self.printed = True
                print(f"check: one {who} batch ({what}, {len(b['id'])} examples, {n} padded tokens) took {s:.1f} s; "
                      f"the rest: at most ~{_duration(self.estimate_s)}, a rough upper bound ({self.describe}, all "
                      "at this batch's rate; the proxies are smaller than the target and run faster)", flush=True)
            self.left -= n


class _Reiterable:
    """Batches that can be walked more than once (EK-FAC fits in two passes), each walk made afresh by ``make()``."""

    def __init__(self, make: Callable):
        self.make = make

    def __iter__(self):
        return iter(self.make())


def _duration(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min"


def _drop_validation_cache(cache) -> None:
    """Delete the check's cached validation gradient sums (``keep_validation_cache=False``), saying how much."""

    d = cache.root / "validation"
    if not d.is_dir():
        return
    if owned_kind(cache.root) != "check cache":  # an older version's cache, or a folder of the user's: kept
        print(f"check: kept {d}: {cache.root} holds no check cache marker (written by an older version, or not by "
              "iprox_lightning); delete it by hand if it is yours to drop")
        return
    size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    shutil.rmtree(d)
    print(f"check: deleted the validation gradient cache {d} ({size / 1e6:.1f} MB; keep_validation_cache false)")


def _proxy_validation(proxy: str, choice: str | None) -> str:
    """``target`` or ``proxy`` (:func:`check`'s ``proxy_validation``; ``None``: ``target`` for a saved IProX proxy that
    kept every block, else ``proxy``)."""
    if choice is None:
        m = _proxy_manifest(proxy)
        return "target" if m is not None and not m.get("block_drop") else "proxy"
    check_choice("proxy_validation", choice, PROXY_VALIDATIONS)
    return choice


def _check_arguments(sample: int, val_per_task: int | None) -> None:
    """Refuse a sample size or a validation sample size below 1."""
    if sample < 1:
        raise UserInputError(f"sample must be >= 1, got {sample}")
    if val_per_task is not None and val_per_task < 1:
        raise UserInputError(f"val_per_task must be >= 1 or null (every validation example), got {val_per_task}")


def _check_models(**models: str) -> None:
    """Each model option checked by its own name (not as the tokenizer the data module would load first)."""

    for option, value in models.items():
        check_model_source(value, what=f"check: --{option}")


def _output_paths(output_dir: str | None, output: str | None):
    """Where a check writes: ``(the result file, the CheckCache under <output_dir>/cache)``."""

    out_dir = Path(output_dir) if output_dir else (Path(output).parent if output else Path("outputs/check"))
    check_output_dir(out_dir, "--output_dir" if output_dir else "the folder of --output")
    result_path = Path(output) if output else out_dir / "check.json"
    if result_path.is_dir():
        raise OutputIsDirectoryError(f"{'--output ' if output else ''}{result_path} is a directory: name a file")
    return result_path, CheckCache(out_dir / "cache")


@dataclass(frozen=True)
class _Sample:
    """What a check scores: the data module, the chosen pool ids, the validation ids per task, and the digests of
    the two loaders (what the cache's fingerprints take)."""

    dm: Any
    chosen: list[str]
    batch_size: int
    val_sample: dict[str, list[str]]
    val_digest: Any
    pool_digest: Any

    def pool_loader(self):
        return _sample_loader(self.dm, "pool", self.chosen, self.batch_size)


def _sample_pool(sample: int, cache, *, pool, validation, tokenizer, max_length: int, batch_size: int, seed: int,
                 val_per_task: int | None) -> _Sample:
    """Draw ``sample`` random pool examples and the stratified validation sample; print what was drawn."""

    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer, max_length=max_length,
                       batch_size=batch_size, seed=seed, val_per_task=val_per_task)
    dm.setup("predict")
    ids = dm.ids("pool")
    chosen = random_subset(ids, min(1.0, sample / max(len(ids), 1)), seed=seed)[:sample]
    val_ds = dm.dataset("validation")
    val_sample: dict[str, list[str]] = {}
    for it in (val_ds[i] for i in range(len(val_ds))):
        val_sample.setdefault(str(it["task"]), []).append(str(it["id"]))
    val_digest = loader_digest(dm.validation_dataloader())
    pool_digest = loader_digest(_sample_loader(dm, "pool", chosen, batch_size))
    print(f"check: {len(chosen)} random pool examples, validation sample of {len(val_ds)} examples "
          f"({', '.join(f'{t} {len(v)}' for t, v in val_sample.items())}; val_per_task {val_per_task}, seed {seed}); "
          f"cache {cache.root}", flush=True)
    return _Sample(dm, chosen, batch_size, val_sample, val_digest, pool_digest)


def _models_to_score(target: str, proxy: str, dm, layer_extraction: bool):
    """``({who: (identity, load)}, le_rho)``: the target, the proxy and, for an IProX proxy with
    ``layer_extraction``, Layer Extraction of the target at the proxy's sparsity ``le_rho`` (else ``None``)."""

    le_rho = _proxy_sparsity(proxy) if layer_extraction else None
    target_id = source_identity(target)
    models: dict[str, tuple[Any, Callable]] = {"target": (target_id, lambda: _load(target)),
                                                "proxy": (source_identity(proxy), lambda: _load(proxy))}
    if le_rho is not None:
        def build_le():
            model = _load(target)
            le, _ = layer_extraction_proxy(model, dm.dataloader("probe"), sparsity=le_rho, progress=False)
            return le
        models["layer_extraction"] = ({"layer_extraction_of": target_id, "sparsity": le_rho,
                                       "probe": loader_digest(dm.dataloader("probe"))}, build_le)
    return models, le_rho


def _plan_cache(cache, models: dict, s: _Sample, config, max_length: int, validation_from: dict):
    """``(fingerprints, estimate)``: each model's ``(validation, scores)`` fingerprints (a model whose validation
    gradients come from another, ``validation_from[who] = (identity, load)``, has that identity in its validation
    fingerprint), and the time estimate of what the cache does not hold yet (padded tokens left to process)."""

    scorer_settings = {"per_task": config.per_task, "target_patterns": config.target_patterns,
                       "max_length": max_length}
    val_ds = s.dm.dataset("validation")
    val_tokens = padded_tokens([len(val_ds[i]["input_ids"]) for i in range(len(val_ds))], s.dm.eval_batch_size)
    pool_ds = s.dm.dataset("pool")
    index = {i: k for k, i in enumerate(pool_ds.ids)}
    pool_tokens = padded_tokens([len(pool_ds[index[i]]["input_ids"]) for i in s.chosen], s.batch_size)
    fps, todo = {}, 0
    for who, (identity, _) in models.items():
        settings = scorer_settings if who not in validation_from else {
            **scorer_settings, "validation_model": validation_from[who][0]}
        vfp = cache.validation_fingerprint(identity, s.val_digest, settings)
        sfp = cache.scores_fingerprint(vfp, s.pool_digest, config.to_dict(), s.batch_size)
        fps[who] = (vfp, sfp)
        if not cache.scores_path(sfp).is_file():
            todo += pool_tokens * (1 + InfluenceMetric.registry[config.method].factor_passes)  # fit passes + scoring
            if not cache.validation_path(vfp).is_file():
                todo += val_tokens
    return fps, _Estimate(todo, f"{len(models)} models, the cached parts skipped")


def _score_models(models: dict, fps: dict, cache, config, s: _Sample, estimate: _Estimate, validation_from: dict):
    """``(tables, seconds)``: each model's score table of the pool sample, from the cache or scored now (its
    validation gradients from ``validation_from[who]``'s model, when named); one line per model on what was computed
    or reused."""
    tables, seconds = {}, {}
    for who, (_, load) in models.items():
        vfp, sfp = fps[who]
        t0 = time.perf_counter()
        table = cache.load_scores(sfp, who)
        if table is None:
            vload = validation_from[who][1] if who in validation_from else None
            table = _score(who, load(), cache, vfp, sfp, config, s.dm, s.chosen, s.batch_size, estimate, vload)
        seconds[who] = time.perf_counter() - t0
        tables[who] = table
        ev = [e for e in cache.events if e["model"] == who]
        print(f"check: {who}: " + ", ".join(f"{e['what']} {e['action']}" for e in ev)
              + f" ({seconds[who]:.1f} s) -> {cache.scores_path(sfp)}", flush=True)
    return tables, seconds


def _retention_rows(tables: dict, seconds: dict, s: _Sample, method: str, layer_extraction: bool,
                    le_rho: float | None) -> list[dict[str, Any]]:
    """The table: the proxy's retention of the target's ranking, then the free baselines' (length sort, Layer
    Extraction), each with length partialled out and, with per-task scores, per validation task."""

    lengths = token_counts(s.pool_loader())["response_tokens"]
    others: dict[str, dict[str, float]] = {}
    task_maps = {"proxy": per_task_scores(tables["proxy"])}  # id -> {task: score} of every row
    t_tasks = per_task_scores(tables["target"])
    names = tables["target"].task_names
    if layer_extraction:
        others["length sort (shortest first)"] = {i: -float(v) for i, v in lengths.items()}
        task_maps["length sort (shortest first)"] = {i: dict.fromkeys(names, -float(v)) for i, v in lengths.items()}
        if "layer_extraction" in tables:
            others[f"layer extraction (ρ={le_rho:.2f})"] = dict(tables["layer_extraction"])
            task_maps[f"layer extraction (ρ={le_rho:.2f})"] = per_task_scores(tables["layer_extraction"])
    rows = retention_rows(dict(tables["target"]), {f"proxy ({method})": dict(tables["proxy"]), **others})
    rows[0]["target_s"] = seconds["target"]
    rows[0]["proxy_s"] = seconds["proxy"]
    for r, table, tm in zip(rows, [dict(tables["proxy"]), *others.values()], task_maps.values()):
        r.update(length_confound(dict(tables["target"]), table, lengths))
        if names:
            r["per_task"] = per_task_retention(tm, t_tasks, lengths, tasks=names)
            r["worst_task"] = worst_task(r["per_task"])
    return rows


def _print_tables(rows: list[dict[str, Any]], verdict: dict[str, Any], names: list[str], n: int, method: str,
                  proxy: str, target: str, proxy_validation: str = "proxy") -> None:
    """Print the retention table, the per-task tables and the verdict with its next step."""

    side = "the target's validation gradients" if proxy_validation == "target" else "its own validation gradients"
    print(f"\nproxy check on {n} random pool examples ({method}): {proxy} vs {target}; the proxy scored against {side}\n")
    columns = list(dict.fromkeys(c for r in rows for c in r if c not in ("per_task", "worst_task")))
    print(format_table(rows, columns))
    if names:
        print(f"\nper validation task (the pooled score above is one cosine to all of them together): {', '.join(names)}")
        for r in rows:
            print(f"{r['proxy']}:")
            print("\n".join(format_per_task(r["per_task"])))
    print(f"\nverdict: {verdict['verdict']}")
    if verdict["next_step"]:
        print(f"next step: {verdict['next_step']}")


def _write_result(result_path: Path, result: dict[str, Any]) -> None:
    """Write the result JSON (``check.json``) and say where."""

    write_json(result_path, result, default=_json_default)
    print(f"check: wrote {result_path}")


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def _load(path: str):
    model, _ = load_model(path, tokenizer=False)
    return model


def _score(who, model, cache, vfp, sfp, config, dm, chosen, batch_size, estimate, validation_model=None):
    """Validation gradients (cached or computed and cached; ``validation_model``: a loader of the dense model they
    are taken from, else ``model``'s own), then the pool sample's scores (cached when done)."""

    show = console.interactive()  # progress bars on a terminal only

    def timed(loader, what):
        return progress_bar(estimate.timed(loader, who, what), show, f"{who}: {what}", total=len(loader))

    t0 = time.perf_counter()
    scorer = InfluenceScorer(model, config)
    pool = lambda: _sample_loader(dm, "pool", chosen, batch_size)  # noqa: E731
    factor_batches = _Reiterable(lambda: timed(pool(), "factors")) if scorer.metric.needs_factor_data else pool()
    scorer.stats.update(scorer.metric.fit(model, scorer.modules, [v.key for v in scorer.linears], factor_batches,
                                          dtype=scorer.dtype, progress=False))
    if not cache.load_validation(scorer, vfp, who):
        vmodel = None if validation_model is None else validation_model()
        scorer.collect_validation(timed(dm.validation_dataloader(), "validation gradients"), model=vmodel)
        del vmodel
        cache.save_validation(scorer, vfp, who)
    scorer.finalize()
    parts = [scorer.score_batch(b) for b in timed(pool(), "scoring")]
    table = _table_from_parts(parts, scorer.task_names, scorer.settings())
    cache.save_scores(table, sfp, who, time.perf_counter() - t0)
    return table
