"""Check a proxy before trusting it: score a random pool sample with the target and the proxy, print retention.

The sample is scored with TracIn or K-FAC (:func:`~iprox_lightning.scoring.influence_scores`); the table holds
Spearman / Pearson / Kendall and top-1/5/10% overlap, with response length partialled out, next to the free
baselines (length sort, Layer Extraction at the proxy's sparsity), then the same per validation task (Spearman,
length-partialled Spearman, top-5/10% overlap of each task's top-k, and the worst task). A bad proxy is caught in
minutes.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _sample_loader(dm, split: str, ids: list[str], batch_size: int):
    from torch.utils.data import DataLoader, Subset

    from ..data.sft import SFTCollator

    ds = dm.dataset(split)
    index = {i: k for k, i in enumerate(ds.ids)}
    return DataLoader(Subset(ds, [index[i] for i in ids]), batch_size=batch_size,
                      collate_fn=SFTCollator(dm.pad_token_id), shuffle=False)


def _proxy_sparsity(proxy: str) -> float | None:
    """Achieved sparsity of the targeted layers of a saved IProX proxy (``None`` for any other model)."""
    from ..io.proxy import PROXY_MANIFEST

    path = Path(proxy) / PROXY_MANIFEST
    if not path.is_file():
        return None
    m = json.loads(path.read_text())
    before, after = m.get("target_params_before"), m.get("target_params_after")
    return 1.0 - after / before if before and after is not None else m.get("sparsity")


def check(
    target: str,
    proxy: str,
    pool: str = "builtin",
    validation: str = "builtin",
    tokenizer: str | None = None,
    sample: int = 200,
    method: str = "tracin",
    max_length: int = 256,
    batch_size: int = 8,
    seed: int = 0,
    output: str | None = None,
    layer_extraction: bool = True,
) -> dict[str, Any]:
    """Score ``sample`` random pool examples with ``target`` and ``proxy``; print the retention table.

    Besides Spearman / Kendall / top-k overlap the row holds ``length_floor`` (how well ranking by
    response length alone, shortest first, matches the target) and ``spearman_length_partialled``
    (the proxy's retention that length does not explain) — TracIn rankings often follow length, and
    then raw retention flatters any proxy (see docs/BENCHMARKS.md). The pooled score is one cosine to the mean
    gradient of every validation example, so the largest task dominates it: each row also holds ``per_task``
    (:func:`~iprox_lightning.analysis.retention.per_task_retention` of the per-task scores: Spearman,
    length-partialled Spearman, top-5% / top-10% overlap per validation task) and ``worst_task`` (the minimum over
    tasks); the length sort ranks every task by length.

    Args:
        target: the target model (hub id, dir, ``.gguf``, ``builtin``).
        proxy: the proxy (saved IProX proxy dir, or any causal LM).
        pool: the candidate pool the sample is drawn from (any source ``SFTDataModule`` reads).
        validation: the validation sets (any source ``SFTDataModule`` reads).
        tokenizer: defaults to the target's.
        sample: number of random pool examples to score.
        method: ``tracin`` or ``kfac``.
        max_length: token cap per example.
        batch_size: examples per batch.
        seed: seed of the random sample.
        output: optional JSON path for the table.
        layer_extraction: also score the free baselines on the same sample — ``length sort`` (shortest
            response first, model-free) and, for an IProX proxy directory, Layer Extraction of the target at
            the proxy's achieved sparsity (same parameter budget) — as extra rows. A proxy worth using beats
            both, also with length partialled out.
    """
    from ..analysis.retention import format_per_task, length_confound, per_task_retention, per_task_scores, worst_task
    from ..analysis.tables import format_table, retention_rows
    from ..baselines.random_selection import random_subset
    from ..batch import token_counts
    from ..data import SFTDataModule
    from ..models.loading import load_model
    from ..scoring import influence_scores

    dm = SFTDataModule(pool=pool, validation=validation, tokenizer=tokenizer or target, max_length=max_length,
                       batch_size=batch_size, seed=seed)
    dm.setup("predict")
    ids = dm.ids("pool")
    chosen = random_subset(ids, min(1.0, sample / max(len(ids), 1)), seed=seed)[:sample]
    tables, seconds = {}, {}
    for name, path in (("target", target), ("proxy", proxy)):
        model, _ = load_model(path, tokenizer=False)
        t0 = time.perf_counter()
        tables[name] = influence_scores(model, _sample_loader(dm, "pool", chosen, batch_size), dm.validation_dataloader(),
                                        metric=method)
        seconds[name] = time.perf_counter() - t0
        del model
    lengths = token_counts(_sample_loader(dm, "pool", chosen, batch_size))["response_tokens"]
    others: dict[str, dict[str, float]] = {}
    task_maps = {"proxy": per_task_scores(tables["proxy"])}  # id -> {task: score} of every row
    t_tasks = per_task_scores(tables["target"])
    names = tables["target"].task_names
    if layer_extraction:
        others["length sort (shortest first)"] = {i: -float(v) for i, v in lengths.items()}
        task_maps["length sort (shortest first)"] = {i: dict.fromkeys(names, -float(v)) for i, v in lengths.items()}
        le_rho = _proxy_sparsity(proxy)
        if le_rho is not None:
            from ..baselines.layer_extraction import layer_extraction_proxy

            model, _ = load_model(target, tokenizer=False)
            le, _ = layer_extraction_proxy(model, dm.dataloader("probe"), sparsity=le_rho, progress=False)
            t0 = time.perf_counter()
            le_table = influence_scores(le, _sample_loader(dm, "pool", chosen, batch_size), dm.validation_dataloader(),
                                        metric=method)
            others[f"layer extraction (ρ={le_rho:.2f})"] = dict(le_table)
            task_maps[f"layer extraction (ρ={le_rho:.2f})"] = per_task_scores(le_table)
            seconds["layer_extraction"] = time.perf_counter() - t0
            del model, le
    rows = retention_rows(dict(tables["target"]), {f"proxy ({method})": dict(tables["proxy"]), **others})
    rows[0]["target_s"] = seconds["target"]
    rows[0]["proxy_s"] = seconds["proxy"]
    for r, table, tm in zip(rows, [dict(tables["proxy"]), *others.values()], task_maps.values()):
        r.update(length_confound(dict(tables["target"]), table, lengths))
        if names:
            r["per_task"] = per_task_retention(tm, t_tasks, lengths, tasks=names)
            r["worst_task"] = worst_task(r["per_task"])
    print(f"\nproxy check on {len(chosen)} random pool examples ({method}): {proxy} vs {target}\n")
    columns = list(dict.fromkeys(c for r in rows for c in r if c not in ("per_task", "worst_task")))
    print(format_table(rows, columns))
    if names:
        print(f"\nper validation task (the pooled score above is one cosine to all of them together): {', '.join(names)}")
        for r in rows:
            print(f"{r['proxy']}:")
            print("\n".join(format_per_task(r["per_task"])))
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(json.dumps(rows, indent=2))
    return rows[0]
