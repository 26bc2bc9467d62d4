"""The point of the pipeline: does the proxy's selection fine-tune the target as well as the target's own
selection, and better than a random one of the same size?

:func:`selection_effect` evaluates the warmed-up model (``base``, before any fine-tuning) and the three
models fine-tuned on the proxy's, the target's and the random selection (``<workdir>/finetune/<who>/model``)
on the same held-out examples (:func:`iprox_lightning.evaluation.heldout.heldout_records`) and returns
``{"heldout": description, "metrics": {who: heldout_metrics}}``; :func:`format_effect` prints it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

WHO = ("base", "proxy", "target", "random")


def selection_effect(wd: str | Path, warm: str | Path, *, pool: Any, validation: Any, seed: int = 0,
                     data_args: dict | None = None, n_per_task: int = 50) -> dict[str, Any]:
    from .evaluation.heldout import evaluate_heldout, heldout_records

    wd = Path(wd)
    val_records = None
    if not (pool == "builtin" and validation == "builtin"):
        from .data import SFTDataModule

        val_records = SFTDataModule(pool=pool, validation=validation, tokenizer=str(warm)).validation_records
    records, desc = heldout_records(pool, validation, n_per_task=n_per_task, seed=seed, validation_records=val_records)
    max_length = int((data_args or {}).get("max_length") or (128 if pool == "builtin" else 512))
    models = {"base": Path(warm), **{w: wd / "finetune" / w / "model" for w in WHO[1:]}}
    metrics = {w: evaluate_heldout(str(m), records, str(warm), max_length=max_length)
               for w, m in models.items() if (m / "config.json").exists()}
    return {"heldout": desc, "metrics": metrics}


def format_effect(e: dict[str, Any]) -> list[str]:
    m = e["metrics"]
    lines = [f"fine-tuned effect : warmed-up target fine-tuned on each selection, evaluated on {e['heldout']}",
             "   loss (lower is better): " + " | ".join(f"{w} {m[w]['loss']:.3f}" for w in WHO if w in m),
             "   exact match (greedy)  : " + " | ".join(f"{w} {m[w]['exact_match']:.3f}" for w in WHO if w in m)]
    tasks = sorted({t for v in m.values() for t in v["per_task"]})
    if len(tasks) > 1:
        for t in tasks:
            lines.append(f"   loss on {t:<14}: " + " | ".join(
                f"{w} {m[w]['per_task'][t]['loss']:.3f}" for w in WHO if w in m and t in m[w]["per_task"]))
    return lines
