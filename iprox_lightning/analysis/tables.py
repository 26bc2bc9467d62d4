"""One table for a set of proxies: retention vs the target, SA / 1-NND of their selections, FLOPs.

Rows are plain dicts (``{"proxy": name, "spearman": ..., "top5%": ..., "SA": ..., ...}``) so
they can be printed (:func:`format_table`), written as JSON, or logged.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..io.jsonfile import write_json
from ..selection.topk import topk_count, topk_indices
from .flops import ModelShape, pipeline_flops
from .retention import DEFAULT_TOPK, retention_metrics
from .subspace import mean_nn_distance, subspace_affinity


def select_top(scores: Mapping[str, float], frac: float) -> list[str]:
    """Ids of the top ``round(frac · n)`` scores (ties broken by id) — the paper's selection rule (5 %)."""
    ids = sorted(map(str, scores))

    vals = np.array([float(scores[i]) for i in ids])
    return [ids[i] for i in topk_indices(vals, topk_count(float(frac), len(ids)))]


def retention_rows(
    target: Mapping[str, float], proxies: Mapping[str, Mapping[str, float]], *, topk: Sequence[float] = DEFAULT_TOPK
) -> list[dict[str, Any]]:
    """One row of :func:`retention_metrics` per proxy (``{"proxy": name, ...}``)."""
    return [{"proxy": name, **retention_metrics(scores, target, topk=topk)} for name, scores in proxies.items()]


def selection_rows(
    selections: Mapping[str, Sequence[str]],
    pool_ids: Sequence[str],
    pool_grads: torch.Tensor,
    val_grads: torch.Tensor,
    *,
    rank: int | None = None,
    energy: float = 0.9,
    normalize: bool = False,
) -> list[dict[str, Any]]:
    """SA (× 100, as the paper reports it) and 1-NND of each selection's rows of ``pool_grads``.

    ``pool_grads [n_pool, d]`` holds one gradient row per id of ``pool_ids`` (target-model
    gradients, so all proxies are judged in the same space); ``val_grads [n_val, d]``.
    """
    index = {str(i): r for r, i in enumerate(pool_ids)}
    rows = []
    for name, ids in selections.items():
        missing = [i for i in ids if str(i) not in index]
        if missing:
            raise KeyError(f"selection {name!r}: {len(missing)} id(s) without a gradient row, e.g. {missing[0]!r}")
        G = pool_grads[[index[str(i)] for i in ids]]
        rows.append(
            {
                "proxy": name,
                "SA": 100.0 * subspace_affinity(G, val_grads, rank=rank, energy=energy),
                "1-NND": mean_nn_distance(G, normalize=normalize) if len(ids) > 1 else math.nan,
                "n_selected": len(ids),
            }
        )
    return rows


def flops_rows(
    target: "ModelShape", proxies: Mapping[str, "ModelShape | None"], **pipeline_kwargs: Any
) -> list[dict[str, Any]]:
    """TFLOPs per stage for each proxy (``None`` = score with the target itself).

    ``pipeline_kwargs`` go to :func:`~iprox_lightning.analysis.flops.pipeline_flops` (``seq_len``,
    ``n_train``, ``n_val``, probe / alignment sizes); off-the-shelf proxies should pass no probe /
    alignment examples — give them their own call or ``ModelShape`` with ``n_probe_examples=0``.
    """
    rows = []
    for name, shape in proxies.items():
        f = pipeline_flops(target, shape, **pipeline_kwargs)
        rows.append({"proxy": name, **{f"TFLOPs_{k}": v / 1e12 for k, v in f.items()},
                     "params_tracked": (shape or target).tracked_params})
    return rows


def merge_rows(*tables: Sequence[Mapping[str, Any]], key: str = "proxy") -> list[dict[str, Any]]:
    """Join row lists on ``key`` (first table's order, later tables' names appended)."""
    out: dict[str, dict[str, Any]] = {}
    for table in tables:
        for row in table:
            out.setdefault(row[key], {key: row[key]}).update(row)
    return list(out.values())


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None, *, digits: int = 3) -> str:
    """A Markdown table of ``rows`` (missing cells shown as ``-``)."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = []
        for r in rows:
            columns += [c for c in r if c not in columns]

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if math.isnan(v):
                return "nan"
            if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
                return f"{v:.{digits}e}"
            return f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows as a JSON list (NaN written as ``null``)."""
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    return write_json(path, clean)
