"""Which layers carry a task's TracIn ranking, and which of them a proxy keeps (issue 22's per-layer diagnosis).

With ``x_i`` the stored (projected) gradient of pool example ``i`` and ``s_T`` the summed validation gradient of
task ``T`` (:mod:`iprox_lightning.scoring.query`), the score is a sum over layers ``ℓ`` (blocks of the vector):

    score_T(i) = cos(x_i, s_T) = Σ_ℓ c_iℓ,   c_iℓ = ⟨x_iℓ, s_Tℓ⟩ / (‖x_i‖ ‖s_T‖).

Per layer and task this module reports

* ``share``: ``Cov_i(c_iℓ, score_i) / Var_i(score_i)`` -- the layer's share of the ranking's variance (the shares
  of all layers sum to 1; a layer with a large share is where the ranking lives, a negative one works against it);
* ``alone``: Spearman between ``c_iℓ`` and the score -- how well the layer by itself ranks like the full score;
* for a proxy against its target (the same examples, layers matched by module path; a proxy's two factors of one
  module are summed into that module): ``kept``, Spearman between the proxy's ``c_iℓ`` and the target's -- whether
  the proxy keeps that layer's part of the ranking. Vectors of different models live in different spaces (a proxy's
  factor gradients are not the target's), so layers are compared through the rankings they induce, never by cosine.

Everything is float64 NumPy over arrays already in memory (``bench/layer_diagnosis.py`` reads them from stores).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from .retention import spearman_columns

FACTOR_SUFFIXES = (".weight", ".A", ".B", ".factor_a", ".factor_b", ".down", ".up")


def module_of(key: str) -> str:
    """The module path a store layout key belongs to: ``model.layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj``; a proxy's factor keys (``...up_proj.A.weight``, ``...up_proj.B.weight``)
    map to the same module."""
    k = key
    changed = True
    while changed:
        changed = False
        for s in FACTOR_SUFFIXES:
            if k.endswith(s):
                k, changed = k[: -len(s)], True
    return k


def layer_blocks(layout: Sequence[Mapping], dim: int) -> dict[str, list[tuple[int, int]]]:
    """``{module: [(start, stop), ...]}`` of the vector's blocks (a store's ``layout`` rows, in offset order; the
    last block ends at ``dim``), a proxy's factors grouped under their module."""
    rows = sorted(layout, key=lambda r: int(r["offset"]))
    out: dict[str, list[tuple[int, int]]] = {}
    for j, r in enumerate(rows):
        stop = int(rows[j + 1]["offset"]) if j + 1 < len(rows) else int(dim)
        out.setdefault(module_of(r["key"]), []).append((int(r["offset"]), stop))
    return out


def layer_contributions(X: np.ndarray, s: np.ndarray, blocks: Mapping[str, Sequence[tuple[int, int]]]
                        ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(score [n], {module: c [n]})`` for rows ``X [n, D]`` against one task's sum ``s [D]``; a row of norm 0
    scores 0 (as in scoring)."""
    X = np.asarray(X, np.float64)
    s = np.asarray(s, np.float64)
    den = np.linalg.norm(X, axis=1) * np.linalg.norm(s)
    inv = np.divide(1.0, den, out=np.zeros_like(den), where=den > 0)
    contrib = {m: sum(X[:, a:b] @ s[a:b] for a, b in bl) * inv for m, bl in blocks.items()}
    return X @ s * inv, contrib


def task_layer_table(score: np.ndarray, contrib: Mapping[str, np.ndarray],
                     proxy_contrib: Mapping[str, np.ndarray] | None = None) -> dict[str, dict[str, float]]:
    """Per module: ``share`` and ``alone`` (see the module doc); with ``proxy_contrib`` (the proxy's per-module
    contributions over the same examples) also ``kept``."""
    score = np.asarray(score, np.float64)
    var = float(np.var(score))
    out = {}
    for m, c in contrib.items():
        row = {"share": float(np.mean((c - c.mean()) * (score - score.mean())) / var) if var > 0 else float("nan"),
               "alone": spearman_columns(c, score)}
        if proxy_contrib is not None:
            row["kept"] = spearman_columns(proxy_contrib[m], c) if m in proxy_contrib else float("nan")
        out[m] = row
    return out


def group_of(module: str, by: str) -> str:
    """``by="type"``: ``q_proj`` / ``mlp.down_proj`` ...; ``by="block"``: ``layers.7``."""
    parts = module.split(".")
    if by == "type":
        return parts[-1]
    if by == "block":
        for j, p in enumerate(parts[:-1]):
            if p.isdigit():
                return f"{parts[j - 1]}.{p}" if j else p
        return module
    raise ValueError(f"group by 'type' or 'block', got {by!r}")


def group_table(contrib: Mapping[str, np.ndarray], score: np.ndarray, by: str,
                proxy_contrib: Mapping[str, np.ndarray] | None = None) -> dict[str, dict[str, float]]:
    """:func:`task_layer_table` of modules summed per group (a group's contribution is the sum of its modules'),
    so ``share`` still sums to 1 over groups."""
    groups: dict[str, list[str]] = {}
    for m in contrib:
        groups.setdefault(group_of(m, by), []).append(m)
    gc = {g: sum(contrib[m] for m in ms) for g, ms in groups.items()}
    gp = None
    if proxy_contrib is not None:
        gp = {g: sum(proxy_contrib[m] for m in ms if m in proxy_contrib) for g, ms in groups.items()
              if any(m in proxy_contrib for m in ms)}
    return task_layer_table(score, gc, gp)
