"""The point of the pipeline: does the proxy's selection fine-tune the target as well as the target's own
selection, and better than a random one of the same size?

:func:`selection_effect` evaluates the warmed-up model (``base``, before any fine-tuning) and the three
models fine-tuned on the proxy's, the target's and the random selection (``<workdir>/finetune/<who>/model``)
on the same held-out examples (:func:`iprox_lightning.evaluation.heldout.heldout_records`) and returns
``{"heldout": description, "metrics": {who: heldout_metrics}, "gain_vs_random": ...}``; :func:`format_effect` prints
it. With per-task selections (``tasks``) the proxy's and the target's row hold, for each task, the model fine-tuned on
that task's selection (``finetune/<who>.<task>/model``) evaluated on that task's examples (overall: the
example-weighted mean). ``gain_vs_random`` (:func:`gains_vs_random`) says it in the benchmark's terms
(``bench/effect.py``): per task, the held-out loss improvement of the proxy's and the target's selection over the
random one, with a paired bootstrap CI over the held-out examples.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..data import SFTDataModule
from .bootstrap import paired_gain
from .heldout import evaluate_heldout, heldout_records

WHO = ("base", "proxy", "target", "random")


def selection_effect(wd: str | Path, warm: str | Path, *, pool: Any, validation: Any, seed: int = 0,
                     data_args: dict | None = None, n_per_task: int = 50, tasks: Sequence[str] | None = None,
                     eval_per_task: int | None = None, device: str = "auto", precision: str | None = None
                     ) -> dict[str, Any]:
    """See the module doc. ``eval_per_task``: on data other than the built-in, at most this many validation examples
    per task, those the scoring's validation sample left out first (:func:`heldout_records`); on the built-in data it
    replaces ``n_per_task``. ``device`` and ``precision`` (a Trainer precision: ``bf16-mixed``, ``bf16-true``, ...):
    where and how each model is evaluated (:func:`~iprox_lightning.evaluation.heldout.evaluate_heldout`)."""
    wd = Path(wd)
    data_args = data_args or {}
    val_records, steered = None, None
    if not (pool == "builtin" and validation == "builtin"):
        val_records = SFTDataModule(pool=pool, validation=validation, tokenizer=str(warm)).validation_records
        if eval_per_task is not None:  # the validation examples the scoring used (val_per_task of them per task)
            same = {k: data_args[k] for k in ("val_per_task", "seed", "field_map", "builtin_size") if k in data_args}
            steered = {r["id"] for r in SFTDataModule(pool=pool, validation=validation, tokenizer=str(warm),
                                                      **same).validation_records}
    records, desc = heldout_records(pool, validation, n_per_task=eval_per_task or n_per_task, seed=seed,
                                    validation_records=val_records,
                                    per_task=eval_per_task if val_records is not None else None, steered=steered)
    max_length = int(data_args.get("max_length") or (128 if pool == "builtin" else 512))
    evaluate = lambda m, recs: evaluate_heldout(str(m), recs, str(warm), max_length=max_length,  # noqa: E731
                                                per_example=True, device=device, precision=precision)
    if not tasks:
        models = {"base": Path(warm), **{w: wd / "finetune" / w / "model" for w in WHO[1:]}}
        effect = {"heldout": desc, "metrics": {w: evaluate(m, records) for w, m in models.items()
                                               if (m / "config.json").exists()}}
    else:
        effect = {"heldout": desc, "metrics": _per_task_metrics(wd, warm, records, tasks, evaluate),
                  "per_task_models": True}
    effect["gain_vs_random"] = gains_vs_random(effect["metrics"], seed=seed)
    for m in effect["metrics"].values():
        m.pop("examples")  # the summary keeps the means; the gains above are their paired statistics
    return effect


def _per_task_metrics(wd: Path, warm: str | Path, records: list[dict], tasks: Sequence[str], evaluate) -> dict:
    """base and random on every example; the proxy's and the target's row from the models fine-tuned on each task's
    selection, each on its task's examples (overall: the example-weighted mean)."""
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
                            "models": {t: str(wd / "finetune" / f"{who}.{t}" / "model") for t in per},
                            "examples": [e for m in per.values() for e in m["examples"]]}
    return {w: metrics[w] for w in WHO if w in metrics}


def gains_vs_random(metrics: Mapping[str, Mapping[str, Any]], seed: int = 0, n_boot: int = 1000
                    ) -> dict[str, dict[str, dict[str, Any]]]:
    """``{task: {who: {"n", "loss_gain", "loss_gain_ci"}}}`` for ``who`` in proxy, target: the random selection's
    held-out loss minus ``who``'s, example by example (positive = ``who``'s selection is better), its mean and paired
    percentile-bootstrap 95% CI (:func:`iprox_lightning.evaluation.bootstrap.paired_gain`). ``metrics``: per model
    :func:`~iprox_lightning.evaluation.heldout.heldout_metrics` with ``examples``; ``{}`` without a random row."""
    if "random" not in metrics:
        return {}
    rand = {(e["task"], e["id"]): e["loss"] for e in metrics["random"]["examples"]}
    if len(rand) != len(metrics["random"]["examples"]):  # e.g. records without ids: nothing could be paired safely
        raise ValueError("gains_vs_random: the held-out examples need distinct (task, id) pairs to be paired")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for who in ("proxy", "target"):
        by_task: dict[str, list[tuple[float, float]]] = {}
        for e in metrics.get(who, {}).get("examples", []):
            if (e["task"], e["id"]) in rand:
                by_task.setdefault(e["task"], []).append((e["loss"], rand[e["task"], e["id"]]))
        for task, pairs in sorted(by_task.items()):
            v, r = np.asarray(pairs, dtype=np.float64).T
            gain, ci, _ = paired_gain(v, [r], higher_is_better=False, n=n_boot, seed=seed)
            out.setdefault(task, {})[who] = {"n": len(v), "loss_gain": gain, "loss_gain_ci": ci}
    return out


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
    gains = e.get("gain_vs_random") or {}
    if gains:
        lines.append("   loss gain over random (positive = better than random; paired 95% CI over the examples):")
        for t, by in gains.items():
            lines.append(f"     {t:<20}: " + " | ".join(
                f"{w} {g['loss_gain']:+.3f} [{g['loss_gain_ci'][0]:+.3f}, {g['loss_gain_ci'][1]:+.3f}]"
                for w, g in by.items()))
    return lines
