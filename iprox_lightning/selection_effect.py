"""The point of the pipeline: does the proxy's selection fine-tune the target as well as the target's own
selection, and better than a random one of the same size?

:func:`selection_effect` evaluates the warmed-up model (``base``, before any fine-tuning) and the three
models fine-tuned on the proxy's, the target's and the random selection (``<workdir>/finetune/<who>/model``)
on the same held-out examples (:func:`iprox_lightning.evaluation.heldout.heldout_records`) and returns
``{"heldout": description, "metrics": {who: heldout_metrics}}``; :func:`format_effect` prints it. With per-task
selections (``tasks``) the proxy's and the target's row hold, for each task, the model fine-tuned on that task's
selection (``finetune/<who>.<task>/model``) evaluated on that task's examples (overall: the example-weighted mean).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

WHO = ("base", "proxy", "target", "random")


def selection_effect(wd: str | Path, warm: str | Path, *, pool: Any, validation: Any, seed: int = 0,
                     data_args: dict | None = None, n_per_task: int = 50, tasks: Sequence[str] | None = None,
                     eval_per_task: int | None = None) -> dict[str, Any]:
    """See the module doc. ``eval_per_task``: on data other than the built-in, at most this many validation examples
    per task, those the scoring's validation sample left out first (:func:`heldout_records`); on the built-in data it
    replaces ``n_per_task``."""
    from .evaluation.heldout import evaluate_heldout, heldout_records

    wd = Path(wd)
    data_args = data_args or {}
    val_records, steered = None, None
    if not (pool == "builtin" and validation == "builtin"):
        from .data import SFTDataModule

        val_records = SFTDataModule(pool=pool, validation=validation, tokenizer=str(warm)).validation_records
        if eval_per_task is not None:  # the validation examples the scoring used (val_per_task of them per task)
            same = {k: data_args[k] for k in ("val_per_task", "seed", "field_map", "builtin_size") if k in data_args}
            steered = {r["id"] for r in SFTDataModule(pool=pool, validation=validation, tokenizer=str(warm),
                                                      **same).validation_records}
    records, desc = heldout_records(pool, validation, n_per_task=eval_per_task or n_per_task, seed=seed,
                                    validation_records=val_records,
                                    per_task=eval_per_task if val_records is not None else None, steered=steered)
    max_length = int(data_args.get("max_length") or (128 if pool == "builtin" else 512))
    evaluate = lambda m, recs: evaluate_heldout(str(m), recs, str(warm), max_length=max_length)  # noqa: E731
    if not tasks:
        models = {"base": Path(warm), **{w: wd / "finetune" / w / "model" for w in WHO[1:]}}
        return {"heldout": desc, "metrics": {w: evaluate(m, records) for w, m in models.items()
                                             if (m / "config.json").exists()}}
    metrics = {w: evaluate(m, records) for w, m in (("base", Path(warm)), ("random", wd / "finetune" / "random" / "model"))
               if (m / "config.json").exists()}
    for who in ("proxy", "target"):
        per = {}
        for task in tasks:
            model = wd / "finetune" / f"{who}.{task}" / "model"
            recs = [r for r in records if r["category"] == task]
            if recs and (model / "config.json").exists():
                per[task] = evaluate(model, recs)
        if per:
            n = sum(m["n"] for m in per.values())
            metrics[who] = {"n": n, **{k: sum(m[k] * m["n"] for m in per.values()) / n for k in ("loss", "exact_match")},
                            "per_task": {t: m["per_task"][t] for t, m in per.items()},
                            "models": {t: str(wd / "finetune" / f"{who}.{t}" / "model") for t in per}}
    metrics = {w: metrics[w] for w in WHO if w in metrics}
    return {"heldout": desc, "metrics": metrics, "per_task_models": True}


def format_effect(e: dict[str, Any]) -> list[str]:
    m = e["metrics"]
    each = ("each selection (proxy and target: per task, the model fine-tuned on that task's selection)"
            if e.get("per_task_models") else "each selection")
    lines = [f"fine-tuned effect : warmed-up target fine-tuned on {each}, evaluated on {e['heldout']}",
             "   loss (lower is better): " + " | ".join(f"{w} {m[w]['loss']:.3f}" for w in WHO if w in m),
             "   exact match (greedy)  : " + " | ".join(f"{w} {m[w]['exact_match']:.3f}" for w in WHO if w in m)]
    tasks = sorted({t for v in m.values() for t in v["per_task"]})
    if len(tasks) > 1:
        for t in tasks:
            lines.append(f"   loss on {t:<14}: " + " | ".join(
                f"{w} {m[w]['per_task'][t]['loss']:.3f}" for w in WHO if w in m and t in m[w]["per_task"]))
    return lines
