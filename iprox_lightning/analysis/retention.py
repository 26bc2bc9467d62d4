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

**Per validation task** (:func:`per_task_retention`, :func:`worst_task`): the pooled score is one cosine to the
mean gradient of *all* validation examples, so the largest task dominates it; a user selects one subset per
target task. ``per_task_retention`` takes ``id -> {task: score}`` tables (:func:`per_task_scores` reads them from
a score table's ``score/<task>`` columns) and gives each task's Spearman, length-partialled Spearman, Spearman among
the shortest responses (the 10% shortest, ties kept: where a short-answer task's top-k comes from, so a proxy cannot
agree there by preferring short responses) and top-k overlap of the per-task top-k sets (Spearman from
``scipy.stats.spearmanr``); ``worst_task`` is the minimum over tasks — the number a proxy should be judged by.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from scipy.stats import kendalltau, rankdata as average_ranks, spearmanr

from ..io.scores import read_table, task_names_of
from ..selection.topk import shortest_cut, topk_count, topk_indices

log = logging.getLogger(__name__)

DEFAULT_TOPK = (0.01, 0.05, 0.10)
SHORTEST_FRACTION = 0.10  # the shortlist of "spearman_within_shortest": 2 × the paper's 5%


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
    """1-based ranks with ties replaced by their average rank: ``scipy.stats.rankdata(x)`` (float64; a NaN in ``x``
    makes every rank NaN)."""
    return np.asarray(average_ranks(x), dtype=np.float64)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; ``nan`` when either input is constant. (Written out rather than
    ``scipy.stats.pearsonr``, which rounds differently in the last bit: the pooled retention figures of the demo
    summary and of the recorded benchmarks are this function's; :func:`spearman_columns` is scipy's.)"""
    x = np.asarray(x, dtype=np.float64) - np.mean(x)
    y = np.asarray(y, dtype=np.float64) - np.mean(y)
    denom = np.sqrt(np.dot(x, x) * np.dot(y, y))
    return float(np.dot(x, y) / denom) if denom > 0 else float("nan")


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (:func:`pearson` of :func:`rankdata`; equal to ``scipy.stats.spearmanr`` up to the
    last bit, see :func:`pearson`)."""
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
    return float(kendalltau(x, y, variant="b").statistic)


def topk_overlap(proxy: np.ndarray, target: np.ndarray, frac: float) -> float:
    """``|top_k(proxy) ∩ top_k(target)| / k`` with ``k = topk_count(frac, n)``."""
    n = len(proxy)
    k = topk_count(float(frac), n)
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
        "n": len(ids),
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
    ids = sorted(set(target) & set(proxy) & set(lengths))
    t, p, n = (np.array([d[i] for i in ids], dtype=float) for d in (target, proxy, lengths))
    return {"length_floor": spearman(-n, t), "spearman_length_partialled": partial_spearman(p, t, n)}


# ------------------------------------------------------------------------------------------------
# per validation task
# ------------------------------------------------------------------------------------------------
PER_TASK_TOPK = (0.05, 0.10)

#: ``interval(stat, n) -> [lo, hi]``: a confidence interval of ``stat(index array)`` over ``n`` items
#: (e.g. a percentile bootstrap that calls ``stat`` on resampled index arrays)
Interval = Callable[[Callable[[np.ndarray], float], int], Sequence[float]]


def per_task_scores(source: Any) -> dict[str, dict[str, float]]:
    """``id -> {task: score}`` of a score table: a :class:`~iprox_lightning.scoring.ScoreTable` (``ids``,
    ``task_names``, ``task_scores``) or a Parquet score table / scoring directory (its ``score/<task>``
    columns). Empty dicts per id when the table has no per-task columns."""
    if hasattr(source, "task_names") and hasattr(source, "task_scores"):
        ids, names, ts = list(source.ids), list(source.task_names), np.asarray(source.task_scores, dtype=np.float64)
    else:
        _, table = read_table(source)
        names = task_names_of(table)
        ids = [str(i) for i in table.column("id").to_pylist()]
        ts = np.stack([np.asarray(table.column(f"score/{t}").to_pylist(), dtype=np.float64) for t in names], axis=1) \
            if names else np.zeros((len(ids), 0))
    return {str(i): {t: float(ts[j, k]) for k, t in enumerate(names)} for j, i in enumerate(ids)}


def _rank_corr(*cols: np.ndarray) -> np.ndarray:
    """Spearman correlation matrix of the columns (``scipy.stats.spearmanr``; NaN where a column is constant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # constant input: NaN, as documented
        r = np.asarray(spearmanr(np.stack(cols, axis=1)).statistic, dtype=np.float64)
    return r if r.ndim == 2 else np.array([[1.0, float(r)], [float(r), 1.0]])  # two columns: a scalar


def spearman_columns(p: np.ndarray, t: np.ndarray) -> float:
    """``scipy.stats.spearmanr(p, t)``; NaN for fewer than two values or a constant column, without a warning (the
    per-task retention and the layer attribution)."""
    return float(_rank_corr(p, t)[0, 1]) if len(p) > 1 else float("nan")


def _partialled(p: np.ndarray, t: np.ndarray, c: np.ndarray) -> float:
    """Spearman of ``p`` and ``t`` with ``c`` partialled out: ``(r_pt − r_pc r_tc) / sqrt((1 − r_pc²)(1 − r_tc²))``
    on Spearman correlations (= the Pearson correlation of the rank residuals after regressing on ``c``'s ranks);
    NaN when either ranking is a function of ``c``."""
    if len(p) < 3:
        return float("nan")
    r = _rank_corr(p, t, c)
    r_pt, r_pc, r_tc = r[0, 1], r[0, 2], r[1, 2]
    u, v = 1 - r_pc ** 2, 1 - r_tc ** 2
    if not (np.isfinite([u, v]).all() and u > 1e-9 and v > 1e-9):  # a ranking is (up to rounding) the control's
        return float("nan")
    return float((r_pt - r_pc * r_tc) / math.sqrt(u * v))


def per_task_retention(
    proxy: Mapping[str, Mapping[str, float]],
    target: Mapping[str, Mapping[str, float]],
    lengths: Mapping[str, float] | None = None,
    *,
    tasks: Sequence[str] | None = None,
    topk: Sequence[float] = PER_TASK_TOPK,
    interval: Interval | None = None,
    shortest_fraction: float | None = SHORTEST_FRACTION,
) -> dict[str, dict[str, Any]]:
    """Retention of ``proxy`` w.r.t. ``target`` for each validation task, on the ids both tables (and
    ``lengths``, when given) share.

    ``proxy`` / ``target``: ``id -> {task: score}`` (:func:`per_task_scores`). ``tasks``: which tasks, in this
    order (default: those both tables hold for every id, sorted). ``lengths``: ``id -> response length``, for the
    length-partialled Spearman. ``interval``: ``interval(stat, n) -> [lo, hi]``, called once per task and metric
    with ``stat(index array)`` (e.g. a percentile bootstrap); its result is stored under ``<metric>_ci``.

    Returns ``{task: {"n", "spearman", "spearman_length_partialled", "spearman_within_shortest", "shortest_n",
    "target_top5_in_shortest" (the last four with ``lengths``), "top5%", "top10%"}}``:
    Spearman of the task's scores (``scipy.stats.spearmanr``), the same with the length ranks partialled out, the same
    among the ``shortest_n`` ids as short as the ``topk_count(shortest_fraction, n)``-th shortest (ties at the cut
    kept; ``select(within_shortest=2)``'s shortlist at ``k = 5%``; a bootstrap resample keeps its ids in it) and the
    share of the target's top 5% on the task that lies among them (near 1: a short-answer task, whose selection is
    made there), and
    ``|top_k(proxy task scores) ∩ top_k(target task scores)| / k`` with :func:`topk_count` / :func:`topk_indices`
    (ties broken by id). Raises ``ValueError`` when the tables share no id or a task score is not finite.
    """
    common = set(map(str, proxy)) & set(map(str, target))
    if lengths is not None:
        common &= set(map(str, lengths))
    ids = sorted(common)
    if not ids:
        raise ValueError(f"the proxy ({len(proxy)} ids) and target ({len(target)} ids) score tables"
                         f"{'' if lengths is None else ' and the lengths'} share no id")
    if tasks is None:
        tasks = sorted(set.intersection(*(set(d[i]) for d in (proxy, target) for i in ids)))
    c = None if lengths is None else np.array([float(lengths[i]) for i in ids], dtype=np.float64)
    short = None
    if c is not None and shortest_fraction is not None:
        short = c <= shortest_cut(c, topk_count(float(shortest_fraction), len(ids)))
    out: dict[str, dict[str, Any]] = {}
    for task in tasks:
        cols = []
        for name, d in (("proxy", proxy), ("target", target)):
            try:
                v = np.array([float(d[i][task]) for i in ids], dtype=np.float64)
            except KeyError:
                raise ValueError(f"{name} score table has no score for task {task!r} on every shared id") from None
            if not np.isfinite(v).all():
                bad = ids[int(np.flatnonzero(~np.isfinite(v))[0])]
                raise ValueError(f"{name} score of id {bad!r} on task {task!r} is not finite")
            cols.append(v)
        p, t = cols
        stats: dict[str, Callable[[np.ndarray], float]] = {
            "spearman": lambda ix, p=p, t=t: spearman_columns(p[ix], t[ix])}
        if c is not None:
            stats["spearman_length_partialled"] = lambda ix, p=p, t=t: _partialled(p[ix], t[ix], c[ix])
        if short is not None:
            stats["spearman_within_shortest"] = lambda ix, p=p, t=t: spearman_columns(p[ix][short[ix]], t[ix][short[ix]])
        for frac in topk:
            stats[topk_key(frac)] = lambda ix, p=p, t=t, frac=frac: topk_overlap(p[ix], t[ix], frac)
        full = np.arange(len(ids))
        m: dict[str, Any] = {"n": len(ids)}
        if short is not None:  # how many of the target's top 5% are short: is this a short-answer task here?
            top = topk_indices(t, topk_count(0.05, len(ids)))
            m.update(shortest_n=int(short.sum()), target_top5_in_shortest=float(short[top].mean()))
        for key, f in stats.items():
            m[key] = float(f(full))
            if interval is not None:
                m[f"{key}_ci"] = [float(x) for x in interval(f, len(ids))]
        out[task] = m
    return out


def worst_task(per_task: Mapping[str, Mapping[str, Any]],
               metrics: Sequence[str] = ("spearman", "spearman_length_partialled", "spearman_within_shortest")
               ) -> dict[str, Any]:
    """The minimum over tasks of each metric of :func:`per_task_retention`: ``{metric: value, metric_task: task}``
    (tasks where the metric is undefined (NaN) are skipped; NaN and ``None`` when it is undefined on every task)."""
    out: dict[str, Any] = {}
    for key in metrics:
        vals = [(float(m[key]), task) for task, m in per_task.items()
                if m.get(key) is not None and math.isfinite(float(m[key]))]
        v, task = min(vals) if vals else (float("nan"), None)
        out[key], out[f"{key}_task"] = v, task
    return out


def format_per_task(per_task: Mapping[str, Mapping[str, Any]], indent: str = "   ", width: int = 15) -> list[str]:
    """Console lines of :func:`per_task_retention` (one per task) and :func:`worst_task`."""
    lines = []
    for task, m in per_task.items():
        part, short = m.get("spearman_length_partialled"), m.get("spearman_within_shortest")
        lines.append(f"{indent}{'on ' + task:<{width}}: Spearman {m['spearman']:.3f}"
                     + (f", length-partialled {part:.3f}" if part is not None and not math.isnan(part) else "")
                     + (f", among the {m['shortest_n']} shortest {short:.3f}" if short is not None
                        and not math.isnan(short) else "")
                     + "".join(f", {k.replace('top', 'top-')} overlap {m[k]:.2f}" for k in m
                               if k.startswith("top") and not k.endswith("_ci")))
    w = worst_task(per_task)

    def worst(key: str) -> str:
        return f"{w[key]:.3f} ({w[key + '_task']})" if w[key + "_task"] is not None else "undefined"
    if per_task:
        lines.append(f"{indent}{'worst task':<{width}}: Spearman {worst('spearman')}"
                     + (f", length-partialled {worst('spearman_length_partialled')}"
                        if any("spearman_length_partialled" in m for m in per_task.values()) else "")
                     + (f", among the shortest {worst('spearman_within_shortest')}"
                        if any("spearman_within_shortest" in m for m in per_task.values()) else ""))
    return lines
