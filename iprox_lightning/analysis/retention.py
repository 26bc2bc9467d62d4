"""Influence retention: how well a proxy's scores reproduce the target model's scores.

Given two score tables ``proxy: id -> s_p`` and ``target: id -> s_t`` on (partly) the same
examples, retention is measured on the ``n`` ids they share:

* **Pearson** ``r = cov(s_p, s_t) / (σ_p σ_t)``;
* **Spearman** ``ρ`` = Pearson correlation of the ranks (ties get their average rank);
* **Kendall** ``τ_b = (C − D) / sqrt((C + D + T_p)(C + D + T_t))`` over all pairs, with ``C``/``D``
  the concordant/discordant pairs and ``T_p``/``T_t`` the pairs tied only in the proxy/target
  scores (computed with ``scipy.stats.kendalltau``, O(n log n));
* **top-k overlap** for a fraction ``f``: ``k = max(1, round(f · n))`` and
  ``precision@k = |top_k(s_p) ∩ top_k(s_t)| / k`` — the share of the proxy's top-k selection that
  the target would also have selected (top-k = the k largest scores; ties broken by id so the
  result is deterministic).

All of them are 1 for a perfect proxy; the paper selects the top 5 % by score, so ``top5%`` is
the number that matters most for data selection.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_TOPK = (0.01, 0.05, 0.10)


def align_scores(
    proxy: Mapping[str, float], target: Mapping[str, float], *, names: tuple[str, str] = ("proxy", "target")
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Intersect the ids of two score tables: ``(ids, proxy_scores[n], target_scores[n])`` (ids sorted).

    Raises ``ValueError`` when the tables share no id (typically two different pools or id
    schemes); logs a warning when only part of either table is shared.
    """
    common = sorted(set(map(str, proxy)) & set(map(str, target)))
    if not common:
        ex_p = next(iter(proxy), None)
        ex_t = next(iter(target), None)
        raise ValueError(
            f"the {names[0]} ({len(proxy)} ids, e.g. {ex_p!r}) and {names[1]} ({len(target)} ids, e.g. {ex_t!r}) "
            "score tables share no id: were they scored on the same pool?"
        )
    if len(common) < max(len(proxy), len(target)):
        log.warning(
            "retention computed on the %d shared ids (%s has %d, %s has %d)",
            len(common), names[0], len(proxy), names[1], len(target),
        )
    p = np.array([float(proxy[k]) for k in common], dtype=np.float64)
    t = np.array([float(target[k]) for k in common], dtype=np.float64)
    for name, arr in zip(names, (p, t)):
        if not np.all(np.isfinite(arr)):
            bad = common[int(np.flatnonzero(~np.isfinite(arr))[0])]
            raise ValueError(f"{name} score of id {bad!r} is not finite")
    return common, p, t


def rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties replaced by their average rank (``scipy.stats.rankdata(method='average')``)."""
    x = np.asarray(x)
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    # boundaries of runs of equal values
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(xs)]
    avg = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks_sorted = np.repeat(avg, ends - starts)
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = ranks_sorted
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; ``nan`` when either input is constant."""
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    y = np.asarray(y, dtype=np.float64) - np.mean(y)
    denom = np.sqrt(np.dot(x, x) * np.dot(y, y))
    return float(np.dot(x, y) / denom) if denom > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (Pearson of average ranks)."""
    return pearson(rankdata(x), rankdata(y))


def partial_spearman(x: np.ndarray, y: np.ndarray, control: np.ndarray) -> float:
    """Spearman of ``x`` and ``y`` with ``control`` partialled out: the Pearson correlation of their
    ranks after regressing each on the rank of ``control``. Use it to report retention that a nuisance
    variable (e.g. response length, which TracIn rankings often follow) does not explain. ``nan`` when
    either ranking is a function of the control."""
    rx, ry, rc = rankdata(x), rankdata(y), rankdata(control)
    r_xy, r_xc, r_yc = pearson(rx, ry), pearson(rx, rc), pearson(ry, rc)
    den = np.sqrt(max((1 - r_xc ** 2) * (1 - r_yc ** 2), 0.0))
    return float((r_xy - r_xc * r_yc) / den) if den > 1e-12 else float("nan")


def kendall(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's τ_b (tie-corrected), via ``scipy.stats.kendalltau``."""
    from scipy.stats import kendalltau

    return float(kendalltau(x, y, variant="b").statistic)


def topk_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest scores; ties broken by position (``align_scores`` sorts by id).
    The ranking rule is the package's one: :func:`iprox_lightning.io.scores.topk_order`."""
    from ..io.scores import topk_order

    return topk_order(scores)[:k]


def topk_count(frac: float, n: int) -> int:
    """``k = max(1, round(frac · n))`` (capped at ``n``): :func:`iprox_lightning.io.scores.topk_count`."""
    from ..io.scores import topk_count as count

    return count(float(frac), n)


def topk_overlap(proxy: np.ndarray, target: np.ndarray, frac: float) -> float:
    """``|top_k(proxy) ∩ top_k(target)| / k`` with ``k = topk_count(frac, n)``."""
    n = len(proxy)
    k = topk_count(frac, n)
    a = set(topk_indices(proxy, k).tolist())
    b = set(topk_indices(target, k).tolist())
    return len(a & b) / k


def topk_key(frac: float) -> str:
    """Column name of a top-k fraction: ``0.05 -> 'top5%'``."""
    return f"top{100 * frac:g}%"


def retention_metrics(
    proxy: Mapping[str, float],
    target: Mapping[str, float],
    *,
    topk: Sequence[float] = DEFAULT_TOPK,
) -> dict[str, float]:
    """Retention of ``proxy`` scores w.r.t. ``target`` scores on their shared ids.

    Returns ``{"n", "pearson", "spearman", "kendall", "top1%", "top5%", "top10%"}`` (keys of the
    top-k entries follow ``topk``). See the module docstring for the definitions.
    """
    ids, p, t = align_scores(proxy, target)
    out: dict[str, float] = {
        "n": float(len(ids)),
        "pearson": pearson(p, t),
        "spearman": spearman(p, t),
        "kendall": kendall(p, t) if len(ids) > 1 else float("nan"),
    }
    for frac in topk:
        out[topk_key(frac)] = topk_overlap(p, t, frac)
    return out


def length_confound(target: dict[str, float], proxy: dict[str, float], lengths: dict[str, float]) -> dict[str, float]:
    """How much of the target's ranking response length alone explains (``length_floor``: Spearman of
    shortest-first with the target) and the proxy's retention with length partialled out."""
    import numpy as np

    ids = sorted(set(target) & set(proxy) & set(lengths))
    t, p, n = (np.array([d[i] for i in ids], dtype=float) for d in (target, proxy, lengths))
    return {"length_floor": spearman(-n, t), "spearman_length_partialled": partial_spearman(p, t, n)}
