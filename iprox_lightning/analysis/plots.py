"""Figures people would rather look at than read: PNG files and TensorBoard images.

* :func:`plot_score_scatter` — proxy vs target score of every shared example, the top-k region
  (both above their top-k thresholds) shaded, points coloured by where they fall;
* :func:`plot_score_histograms` — score distributions of several score tables;
* :func:`plot_retention_vs_sparsity` — retention metrics against the proxy's sparsity ρ.

Every function returns a matplotlib ``Figure`` (Agg backend, no display needed) and writes a
PNG when given ``path``; :func:`log_figure` sends a figure to TensorBoard. Close figures you no
longer need (``matplotlib.pyplot.close(fig)``) when making many of them in one process.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

from .retention import pearson, spearman, topk_overlap

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..selection.topk import topk_count, topk_indices
from .retention import align_scores, topk_key

CATEGORY_COLORS = {
    "both top-k": "tab:green",
    "proxy top-k only": "tab:orange",
    "target top-k only": "tab:red",
    "neither": "tab:gray",
}


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 120) -> Path:
    """Write ``fig`` as PNG (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", format="png")
    return path


def log_figure(logger: Any, tag: str, fig, step: int = 0) -> None:
    """Add ``fig`` to TensorBoard: ``logger`` is a Lightning ``TensorBoardLogger`` or a ``SummaryWriter``."""
    writer = getattr(logger, "experiment", logger)
    if not hasattr(writer, "add_figure"):
        raise TypeError(f"cannot log a figure to {type(logger).__name__}: it has no TensorBoard writer (add_figure)")
    writer.add_figure(tag, fig, global_step=step, close=False)


def scatter_categories(proxy: np.ndarray, target: np.ndarray, frac: float) -> np.ndarray:
    """Category of each point (keys of ``CATEGORY_COLORS``) given the top-``frac`` sets."""
    k = topk_count(float(frac), len(proxy))
    in_p = np.zeros(len(proxy), bool)
    in_t = np.zeros(len(proxy), bool)
    in_p[topk_indices(proxy, k)] = True
    in_t[topk_indices(target, k)] = True
    cat = np.full(len(proxy), "neither", dtype=object)
    cat[in_p & in_t] = "both top-k"
    cat[in_p & ~in_t] = "proxy top-k only"
    cat[~in_p & in_t] = "target top-k only"
    return cat


def plot_score_scatter(
    proxy: Mapping[str, float],
    target: Mapping[str, float],
    *,
    frac: float = 0.05,
    path: str | os.PathLike | None = None,
    title: str | None = None,
    proxy_name: str = "proxy",
    target_name: str = "target",
):
    """Scatter of proxy (x) vs target (y) scores on the shared ids, top-``frac`` region marked.

    One point per shared id; the dashed lines are the k-th largest proxy / target scores
    (``k = round(frac · n)``) and the shaded upper-right box holds the examples both select.
    """
    _, p, t = align_scores(proxy, target, names=(proxy_name, target_name))
    k = topk_count(float(frac), len(p))
    p_thr = p[topk_indices(p, k)].min()
    t_thr = t[topk_indices(t, k)].min()
    cat = scatter_categories(p, t, frac)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, color in CATEGORY_COLORS.items():
        sel = cat == name
        if sel.any():
            ax.scatter(p[sel], t[sel], s=8, c=color, alpha=0.7, label=f"{name} ({int(sel.sum())})", linewidths=0)
    ax.axvline(p_thr, ls="--", lw=1, c="k")
    ax.axhline(t_thr, ls="--", lw=1, c="k")
    xlim, ylim = ax.get_xlim(), ax.get_ylim()
    ax.fill_between([p_thr, xlim[1]], t_thr, ylim[1], color="tab:green", alpha=0.08, zorder=0)
    ax.set_xlim(xlim)
    ax.set_ylim(ylim)
    ax.set_xlabel(f"{proxy_name} score")
    ax.set_ylabel(f"{target_name} score")
    ax.set_title(
        title
        or f"n={len(p)}  Spearman={spearman(p, t):.3f}  Pearson={pearson(p, t):.3f}  "
        f"{topk_key(frac)} overlap={topk_overlap(p, t, frac):.2f}",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_score_histograms(
    tables: Mapping[str, Mapping[str, float]],
    *,
    bins: int = 50,
    standardize: bool = False,
    path: str | os.PathLike | None = None,
    title: str = "score distributions",
):
    """Histograms of several score tables, one panel each on shared bins (``name -> {id: score}``); ``standardize`` z-scores each."""
    if not tables:
        raise ValueError("plot_score_histograms needs at least one score table")
    values = {}
    for name, table in tables.items():
        v = np.asarray(list(table.values()), dtype=np.float64)
        if v.size == 0:
            raise ValueError(f"score table {name!r} is empty")
        if standardize and v.std() > 0:
            v = (v - v.mean()) / v.std()
        values[name] = v
    edges = np.histogram_bin_edges(np.concatenate(list(values.values())), bins=bins)  # shared bins
    # one panel per table on a shared x axis (overlaid translucent histograms of 4+ series are unreadable)
    fig, axes = plt.subplots(len(values), 1, figsize=(6, 1.2 + 1.3 * len(values)), sharex=True, squeeze=False)
    for k, (ax, (name, v)) in enumerate(zip(axes[:, 0], values.items())):
        ax.hist(v, bins=edges, color=f"C{k}", histtype="stepfilled")
        ax.set_ylabel("examples", fontsize=8)
        ax.text(0.99, 0.92, f"{name} (n={v.size}, median {np.median(v):.2f})", transform=ax.transAxes,
                ha="right", va="top", fontsize=9)
    axes[-1, 0].set_xlabel("score (z-scored per table)" if standardize else "score")
    axes[0, 0].set_title(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_retention_vs_sparsity(
    results: Mapping[str, Mapping[float, Mapping[str, float]]] | Mapping[float, Mapping[str, float]],
    *,
    metrics: Sequence[str] = ("spearman", "pearson", "kendall", "top5%"),
    path: str | os.PathLike | None = None,
    title: str = "influence retention vs sparsity",
):
    """Retention metrics against sparsity ρ.

    ``results`` is ``{ρ: retention_metrics(...)}`` for one method, or ``{method: {ρ: metrics}}``
    (e.g. IPSVD vs SVD) — one line per (method, metric), one point per ρ.
    """
    if not results:
        raise ValueError("plot_retention_vs_sparsity needs at least one result")
    first = next(iter(results.values()))
    series = results if isinstance(first, Mapping) and first and isinstance(next(iter(first.values())), Mapping) else {"": results}
    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osd^v<>p*h"
    for mi, (method, by_rho) in enumerate(series.items()):
        rhos = sorted(float(r) for r in by_rho)
        for ci, metric in enumerate(metrics):
            ys = []
            for r in rhos:
                row = by_rho[r] if r in by_rho else by_rho[str(r)]
                if metric not in row:
                    raise KeyError(f"metric {metric!r} missing for sparsity {r} of {method or 'results'}; have {sorted(row)}")
                ys.append(row[metric])
            label = f"{method}: {metric}" if method else metric
            ax.plot(rhos, ys, marker=markers[mi % len(markers)], ls=("-", "--", ":", "-.")[mi % 4], color=f"C{ci % 10}",
                    label=label)
    ax.set_xlabel("sparsity ρ (share of parameters removed)")
    ax.set_ylabel("retention")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
