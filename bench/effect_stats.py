"""The downstream-effect benchmark's statistics over evaluations (``bench/effect.py``): each selector against its
controls (length-matched, shortlist, fresh, its own suffix), the length-vs-effect trend and the fine-tune noise floor."""
from __future__ import annotations

from typing import Any, Mapping
import numpy as np

from effect_selectors import lenmatch_reference, split_fresh, split_shortlist  # bench/

from iprox_lightning.evaluation import paired_gain


def against_controls(per_model: Mapping[str, Mapping[str, np.ndarray]], by_ref: Mapping[str, list[str]], m: str,
                     hib: bool, bootstrap: int, seed: int) -> dict[str, dict]:
    """Each selector ``ref`` of ``by_ref`` against its control subsets (``by_ref[ref]``) under metric ``m``: the
    paired gain over their mean, and whether it beats every one of them."""
    out = {}
    for ref, controls in by_ref.items():
        if ref not in per_model or not controls:
            continue
        v = per_model[ref][m]
        diff, ci, gains = paired_gain(v, [per_model[c][m] for c in controls], hib, bootstrap, seed)
        out[ref] = {"seeds": len(controls), "seed_means": [float(per_model[c][m].mean()) for c in controls],
                    "selector": float(v.mean()), "diff": diff, "diff_ci": ci, "beats_every_seed": bool(min(gains) > 0)}
    return out


def length_matched_controls(per_model: Mapping[str, Mapping[str, np.ndarray]], m: str, hib: bool, bootstrap: int,
                            seed: int) -> dict[str, dict]:
    """Each selector with length-matched controls (``lenmatch[-<selector>]:<seed>``) against them under metric ``m``:
    its choice vs random subsets with its response lengths."""
    by_ref: dict[str, list[str]] = {}
    for k in sorted(per_model):
        if (ref := lenmatch_reference(k)) is not None:
            by_ref.setdefault(ref[0], []).append(k)
    return against_controls(per_model, by_ref, m, hib, bootstrap, seed)


def suffix_controls(per_model: Mapping[str, Mapping[str, np.ndarray]], split, m: str, hib: bool, bootstrap: int,
                    seed: int) -> dict[str, dict]:
    """Each selector whose name carries a candidate restriction (``split(name)`` -> ``(base, restriction or None)``)
    against the random subsets drawn under the same restriction (``random:<seed>`` + the same suffix), metric ``m``."""
    controls: dict[Any, list[str]] = {}
    for k in sorted(per_model):
        base, tag = split(k)
        if tag is not None and base.startswith("random:"):
            controls.setdefault(tag, []).append(k)
    by_ref = {k: controls.get(tag, []) for k in sorted(per_model)
              for base, tag in [split(k)] if tag is not None and not base.startswith("random:")}
    return against_controls(per_model, by_ref, m, hib, bootstrap, seed)


def shortlist_controls(per_model: Mapping[str, Mapping[str, np.ndarray]], m: str, hib: bool, bootstrap: int,
                       seed: int) -> dict[str, dict]:
    """Each ``<selector>~short<m>`` against the random subsets of the same shortlist (``random:<seed>~short<m>``)
    under metric ``m``: what its scores choose beyond taking short responses."""
    return suffix_controls(per_model, split_shortlist, m, hib, bootstrap, seed)


def fresh_controls(per_model: Mapping[str, Mapping[str, np.ndarray]], m: str, hib: bool, bootstrap: int,
                   seed: int) -> dict[str, dict]:
    """Each ``<selector>~fresh`` against the random subsets of the same candidates (``random:<seed>~fresh``) under
    metric ``m``: what its scores choose when the held-out examples' own source is not a candidate."""
    return suffix_controls(per_model, lambda k: (split_fresh(k)[0], True if split_fresh(k)[1] else None), m, hib,
                           bootstrap, seed)


def length_vs_effect(rows: list[dict], field: str = "selected_response_tokens") -> dict:
    """Per task and metric, across the fine-tuned rows: Pearson and Spearman of a row's ``field`` (its mean selected
    response length; ``selected_heldout_origin_share``: the share of its subset from the held-out examples' own pool
    categories) with its held-out value — how much of the table the lengths (the sources) the selectors picked
    explain."""
    from scipy.stats import pearsonr, spearmanr

    out: dict[str, dict] = {}
    groups: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get(field) is not None:
            groups.setdefault(f"{r['task']}/{r['metric']}", []).append((r[field], r["value"]))
    for k, xy in groups.items():
        x, y = np.asarray(xy).T
        if len(xy) > 2 and x.std() > 0 and y.std() > 0:
            out[k] = {"rows": len(xy), "pearson": float(pearsonr(x, y)[0]), "spearman": float(spearmanr(x, y)[0])}
    return out


def finetune_noise(rows: list[dict]) -> dict:
    """Per task and metric, over the rows fine-tuned with two or more training seeds: how far apart the seeds' values
    are (max - min within a row; mean and max over rows) -- the part of the noise floor that is the training run,
    not which subset was drawn."""
    out: dict[str, dict] = {}
    for r in rows:
        vals = r.get("finetune_seed_values") or []
        if len(vals) > 1:
            out.setdefault(f"{r['task']}/{r['metric']}", []).append(max(vals) - min(vals))
    return {k: {"rows": len(v), "mean_spread": float(np.mean(v)), "max_spread": float(np.max(v))} for k, v in out.items()}
