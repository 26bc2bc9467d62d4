"""Plots: the data each figure shows (points per category, thresholds, histogram counts per bin, curve values,
labels), read back from the matplotlib objects; TensorBoard images; the report table."""
import numpy as np
import pytest
import torch
from scipy import stats

from iprox_lightning.analysis.plots import (
    CATEGORY_COLORS,
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


def _labelled(ax):
    """{legend label: collection} of the scatter series (matplotlib's private artists start with '_')."""
    return {c.get_label(): c for c in ax.collections if c.get_label() and not c.get_label().startswith("_")}


def test_scatter_shows_every_shared_point_in_its_category(tmp_path):
    proxy, target = _scores()
    proxy["only_in_proxy"] = 5.0  # not shared -> not plotted
    fig = plot_score_scatter(proxy, target, frac=0.05, path=tmp_path / "scatter.png")
    assert (tmp_path / "scatter.png").read_bytes()[:8] == PNG_MAGIC
    ax = fig.axes[0]
    ids = sorted(target)
    p = np.array([proxy[i] for i in ids])
    t = np.array([target[i] for i in ids])
    cat = scatter_categories(p, t, 0.05)
    # 10 selected by each side (5 % of 200)
    assert (cat == "both top-k").sum() + (cat == "proxy top-k only").sum() == 10
    assert (cat == "both top-k").sum() + (cat == "target top-k only").sum() == 10
    series = _labelled(ax)
    want = {f"{name} ({int((cat == name).sum())})": name for name in CATEGORY_COLORS if (cat == name).any()}
    assert set(series) == set(want)
    for label, name in want.items():
        xy = np.asarray(series[label].get_offsets())
        sel = cat == name
        # exactly this category's (proxy, target) pairs, in id order
        np.testing.assert_array_equal(xy, np.stack([p[sel], t[sel]], 1))
    assert sum(len(c.get_offsets()) for c in series.values()) == 200  # 'only_in_proxy' not drawn
    # the dashed threshold lines sit at the 10th largest proxy / target score
    (vline,), (hline,) = [l for l in ax.get_lines() if l.get_xdata()[0] == l.get_xdata()[-1]], \
        [l for l in ax.get_lines() if l.get_ydata()[0] == l.get_ydata()[-1]]
    assert vline.get_xdata()[0] == np.sort(p)[-10] and hline.get_ydata()[0] == np.sort(t)[-10]
    assert ax.get_xlabel() == "proxy score" and ax.get_ylabel() == "target score"
    rho = stats.spearmanr(p, t)[0]
    assert ax.get_title().startswith(f"n=200  Spearman={rho:.3f}  Pearson={np.corrcoef(p, t)[0, 1]:.3f}  top5% overlap=")
    assert ax.get_title().endswith(f"overlap={(cat == 'both top-k').sum() / 10:.2f}")


def _step_heights(patch, edges):
    """Bar heights of a ``histtype='stepfilled'`` polygon, read at the middle of each bin."""
    xy = patch.get_xy()
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        top = [y for (x0, y0), (x1, y) in zip(xy[:-1], xy[1:]) if np.isclose(x0, lo) and np.isclose(x1, hi) and np.isclose(y0, y)]
        assert len(top) == 1, (lo, hi)
        out.append(top[0])
    return np.array(out)


def test_histograms_count_each_table_on_shared_bins(tmp_path):
    proxy, target = _scores()
    fig = plot_score_histograms({"proxy": proxy, "target": target}, bins=20, path=tmp_path / "hist.png")
    assert (tmp_path / "hist.png").read_bytes()[:8] == PNG_MAGIC
    assert len(fig.axes) == 2 and all(len(ax.patches) == 1 for ax in fig.axes)  # one panel per table
    assert fig.axes[0].get_shared_x_axes().joined(fig.axes[0], fig.axes[1])
    allv = np.array(list(proxy.values()) + list(target.values()))
    edges = np.histogram_bin_edges(allv, bins=20)
    for ax, (name, table) in zip(fig.axes, (("proxy", proxy), ("target", target))):
        v = np.array(list(table.values()))
        counts, _ = np.histogram(v, bins=edges)
        np.testing.assert_array_equal(_step_heights(ax.patches[0], edges), counts)
        assert counts.sum() == 200
        (text,) = ax.texts
        assert text.get_text() == f"{name} (n=200, median {np.median(v):.2f})"
        assert ax.get_ylabel() == "examples"
    assert fig.axes[-1].get_xlabel() == "score" and fig.axes[0].get_title() == "score distributions"
    z = plot_score_histograms({"proxy": proxy}, bins=10, standardize=True)
    zp = np.array(list(proxy.values()))
    zp = (zp - zp.mean()) / zp.std()
    np.testing.assert_array_equal(_step_heights(z.axes[0].patches[0], np.histogram_bin_edges(zp, bins=10)),
                                  np.histogram(zp, bins=10)[0])
    assert z.axes[0].get_xlabel() == "score (z-scored per table)"


def test_retention_curve_one_line_per_method_and_metric(tmp_path):
    results = {
        "IPSVD": {0.3: {"spearman": 0.9, "top5%": 0.7}, 0.5: {"spearman": 0.8, "top5%": 0.6}, 0.7: {"spearman": 0.6, "top5%": 0.4}},
        "SVD": {0.5: {"spearman": 0.5, "top5%": 0.3}, 0.3: {"spearman": 0.7, "top5%": 0.5}, 0.7: {"spearman": 0.2, "top5%": 0.1}},
    }
    fig = plot_retention_vs_sparsity(results, metrics=("spearman", "top5%"), path=tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == PNG_MAGIC
    ax = fig.axes[0]
    got = {l.get_label(): (list(l.get_xdata()), list(l.get_ydata())) for l in ax.get_lines()}
    assert got == {  # x sorted by ρ whatever the input order
        "IPSVD: spearman": ([0.3, 0.5, 0.7], [0.9, 0.8, 0.6]), "IPSVD: top5%": ([0.3, 0.5, 0.7], [0.7, 0.6, 0.4]),
        "SVD: spearman": ([0.3, 0.5, 0.7], [0.7, 0.5, 0.2]), "SVD: top5%": ([0.3, 0.5, 0.7], [0.5, 0.3, 0.1]),
    }
    # a method keeps one marker and line style, a metric one colour
    style = {l.get_label(): (l.get_marker(), l.get_linestyle(), l.get_color()) for l in ax.get_lines()}
    assert style["IPSVD: spearman"][:2] == style["IPSVD: top5%"][:2] != style["SVD: spearman"][:2]
    assert style["IPSVD: spearman"][2] == style["SVD: spearman"][2] != style["SVD: top5%"][2]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(got)
    assert ax.get_xlabel() == "sparsity ρ (share of parameters removed)" and ax.get_ylabel() == "retention"
    single = plot_retention_vs_sparsity(results["SVD"], metrics=("spearman",))
    (line,) = single.axes[0].get_lines()
    assert line.get_label() == "spearman" and list(line.get_ydata()) == [0.7, 0.5, 0.2]
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
