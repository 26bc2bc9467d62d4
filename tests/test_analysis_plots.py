"""Plots: non-empty PNGs with the expected number of points; TensorBoard images; the report table."""
import numpy as np
import pytest
import torch

from iprox_lightning.analysis.plots import (
    log_figure,
    plot_retention_vs_sparsity,
    plot_score_histograms,
    plot_score_scatter,
    scatter_categories,
)
from iprox_lightning.baselines.random_selection import random_scores
from iprox_lightning.analysis.tables import format_table, merge_rows, retention_rows, select_top, selection_rows

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _scores(n=200, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=n)
    p = 0.8 * t + 0.4 * rng.normal(size=n)
    ids = [f"x{i}" for i in range(n)]
    return dict(zip(ids, p.tolist())), dict(zip(ids, t.tolist()))


def _png_ok(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 200 and img[..., :3].std() > 0.01  # not blank


def test_scatter_png_points_and_categories(tmp_path):
    proxy, target = _scores()
    proxy["only_in_proxy"] = 5.0  # not shared -> not plotted
    fig = plot_score_scatter(proxy, target, frac=0.05, path=tmp_path / "scatter.png")
    _png_ok(tmp_path / "scatter.png")
    ax = fig.axes[0]
    n_points = sum(len(c.get_offsets()) for c in ax.collections if hasattr(c, "get_offsets") and c.get_offsets().ndim == 2 and len(c.get_offsets()) and c.get_label() and not c.get_label().startswith("_"))
    assert n_points == 200
    # 10 selected by each side (5 % of 200); categories partition the points consistently
    ids = sorted(target)
    p = np.array([proxy[i] for i in ids])
    t = np.array([target[i] for i in ids])
    cat = scatter_categories(p, t, 0.05)
    assert (cat == "both top-k").sum() + (cat == "proxy top-k only").sum() == 10
    assert (cat == "both top-k").sum() + (cat == "target top-k only").sum() == 10
    labels = [c.get_label() for c in ax.collections if c.get_label() and not c.get_label().startswith("_")]
    assert any(l.startswith(f"both top-k ({(cat == 'both top-k').sum()})") for l in labels)


def test_histograms_and_retention_curve_png(tmp_path):
    proxy, target = _scores()
    fig = plot_score_histograms({"proxy": proxy, "target": target}, bins=20, path=tmp_path / "hist.png")
    _png_ok(tmp_path / "hist.png")
    assert len(fig.axes) == 2 and all(len(ax.patches) == 1 for ax in fig.axes)  # one panel per table, shared bins
    assert fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])
    results = {
        "IPSVD": {0.3: {"spearman": 0.9, "top5%": 0.7}, 0.5: {"spearman": 0.8, "top5%": 0.6}, 0.7: {"spearman": 0.6, "top5%": 0.4}},
        "SVD": {0.3: {"spearman": 0.7, "top5%": 0.5}, 0.5: {"spearman": 0.5, "top5%": 0.3}, 0.7: {"spearman": 0.2, "top5%": 0.1}},
    }
    fig = plot_retention_vs_sparsity(results, metrics=("spearman", "top5%"), path=tmp_path / "curve.png")
    _png_ok(tmp_path / "curve.png")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 4 and all(len(l.get_xdata()) == 3 for l in lines)
    np.testing.assert_allclose(lines[0].get_ydata(), [0.9, 0.8, 0.6])
    single = plot_retention_vs_sparsity(results["SVD"], metrics=("spearman",))
    np.testing.assert_allclose(single.axes[0].get_lines()[0].get_ydata(), [0.7, 0.5, 0.2])
    with pytest.raises(KeyError, match="kendall"):
        plot_retention_vs_sparsity(results, metrics=("kendall",))


def test_tensorboard_image(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proxy, target = _scores(50)
    w = SummaryWriter(tmp_path / "tb")
    log_figure(w, "retention/scatter", plot_score_scatter(proxy, target), step=3)
    w.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    imgs = acc.Images("retention/scatter")
    assert len(imgs) == 1 and imgs[0].step == 3 and imgs[0].width > 200
    with pytest.raises(TypeError):
        log_figure(object(), "x", plot_score_scatter(proxy, target))


def test_report_rows_and_table():
    proxy, target = _scores(100)
    rows = retention_rows(target, {"good": proxy, "random": random_scores(target, seed=1)})
    assert rows[0]["spearman"] > 0.8 and abs(rows[1]["spearman"]) < 0.3
    top = select_top(target, 0.05)
    assert len(top) == 5 and set(top) == set(sorted(target, key=target.get)[-5:])
    ids = sorted(target)
    G = torch.randn(100, 12, dtype=torch.float64)
    V = G[:20] @ torch.randn(12, 12, dtype=torch.float64)  # spans what ids[:20] span
    sel = selection_rows({"good": ids[:20], "random": ids[50:70]}, ids, G, V, energy=1.0)
    assert sel[0]["SA"] == pytest.approx(100.0) and sel[0]["n_selected"] == 20
    table = format_table(merge_rows(rows, sel), ["proxy", "spearman", "top5%", "SA", "1-NND"])
    assert table.count("\n") == 3 and "| good |" in table
    with pytest.raises(KeyError, match="without a gradient row"):
        selection_rows({"bad": ["nope"]}, ids, G, V)
