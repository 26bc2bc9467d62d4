"""Retention metrics vs scipy / brute force, top-k overlap on hand-made cases, score-table IO."""
import itertools
import json
import math

import numpy as np
import pytest
import scipy.stats

from iprox_lightning.analysis import retention_metrics
from iprox_lightning.io.scores import read_scores, write_scores
from iprox_lightning.analysis.retention import (
    kendall,
    pearson,
    rankdata,
    spearman,
    spearman_columns,
    topk_count,
    topk_overlap,
)


def _tables(n, seed, ties=False):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=n)
    p = 0.7 * t + 0.5 * rng.normal(size=n)
    if ties:
        t, p = np.round(t, 0), np.round(p, 0)
    ids = [f"ex{i:04d}" for i in range(n)]
    return dict(zip(ids, p.tolist())), dict(zip(ids, t.tolist())), p, t


@pytest.mark.parametrize("ties", [False, True])
def test_correlations_match_scipy(ties):
    proxy, target, p, t = _tables(300, 0, ties)
    m = retention_metrics(proxy, target)
    assert m["n"] == 300
    assert m["pearson"] == pytest.approx(scipy.stats.pearsonr(p, t).statistic, abs=1e-12)
    assert m["spearman"] == pytest.approx(scipy.stats.spearmanr(p, t).statistic, abs=1e-12)
    assert m["kendall"] == pytest.approx(scipy.stats.kendalltau(p, t).statistic, abs=1e-12)
    np.testing.assert_allclose(rankdata(t), scipy.stats.rankdata(t))


def test_rankdata_average_ranks_by_hand_and_nan():
    x = np.array([3.0, 1.0, 3.0, 2.0, 3.0, -np.inf])
    r = rankdata(x)
    assert r.dtype == np.float64
    assert r.tolist() == [5.0, 2.0, 5.0, 3.0, 5.0, 1.0]  # the three 3.0 share ranks 4, 5, 6
    brute = [sum(v < xi for v in x) + (sum(v == xi for v in x) + 1) / 2 for xi in x]
    assert r.tolist() == brute
    assert np.isnan(rankdata([1.0, np.nan, 2.0])).all()  # scipy's rule: a NaN makes every rank NaN


def test_spearman_columns_is_scipy_and_nan_when_undefined():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=40), rng.normal(size=40)
    b = np.round(b + a, 1)  # ties
    assert spearman_columns(a, b) == scipy.stats.spearmanr(a, b).statistic
    assert spearman_columns(a, b) == pytest.approx(spearman(a, b), abs=1e-14)  # the pooled tables' Spearman
    assert math.isnan(spearman_columns(np.ones(5), a[:5]))  # constant: NaN, no warning
    assert math.isnan(spearman_columns(a[:1], b[:1]))


def test_kendall_tau_b_brute_force():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 5, size=25).astype(float)  # many ties
    y = rng.integers(0, 4, size=25).astype(float)
    c = d = tx = ty = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
        if sx == 0 and sy == 0:
            continue
        if sx == 0:
            tx += 1
        elif sy == 0:
            ty += 1
        elif sx == sy:
            c += 1
        else:
            d += 1
    ref = (c - d) / math.sqrt((c + d + tx) * (c + d + ty))
    assert kendall(x, y) == pytest.approx(ref, abs=1e-12)


def test_perfect_and_reversed_proxy():
    target = {str(i): float(i) for i in range(50)}
    m = retention_metrics({k: 3 * v + 1 for k, v in target.items()}, target)
    assert m["spearman"] == pytest.approx(1) and m["pearson"] == pytest.approx(1) and m["kendall"] == pytest.approx(1)
    assert m["top1%"] == m["top5%"] == m["top10%"] == 1.0
    r = retention_metrics({k: -v for k, v in target.items()}, target)
    assert r["spearman"] == pytest.approx(-1) and r["kendall"] == pytest.approx(-1)
    assert r["top10%"] == 0.0


def test_topk_overlap_hand_made():
    # n = 20 -> k(10%) = 2, k(5%) = 1, k(25%) = 5
    target = np.arange(20, dtype=float)  # top-2 = {19, 18}; top-5 = {15..19}
    proxy = target.copy()
    proxy[19] = -1.0  # proxy top-2 = {18, 17}; top-5 = {14..18}
    assert topk_count(0.10, 20) == 2 and topk_count(0.05, 20) == 1 and topk_count(0.01, 20) == 1
    assert topk_overlap(proxy, target, 0.10) == pytest.approx(0.5)
    assert topk_overlap(proxy, target, 0.05) == 0.0
    assert topk_overlap(proxy, target, 0.25) == pytest.approx(4 / 5)
    ids = [f"{i:02d}" for i in range(20)]
    m = retention_metrics(dict(zip(ids, proxy)), dict(zip(ids, target)), topk=(0.1, 0.25))
    assert m["top10%"] == pytest.approx(0.5) and m["top25%"] == pytest.approx(0.8)


def test_intersects_ids_and_rejects_disjoint():
    target = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    proxy = {"b": 20.0, "c": 30.0, "d": 10.0, "zzz": 99.0}
    m = retention_metrics(proxy, target, topk=(0.34,))
    assert m["n"] == 3  # b, c, d
    assert m["spearman"] == pytest.approx(scipy.stats.spearmanr([20, 30, 10], [2, 3, 4]).statistic)
    assert m["top34%"] == 0.0  # proxy top-1 = c, target top-1 = d
    with pytest.raises(ValueError, match="share no id"):
        retention_metrics({"x": 1.0}, target)
    with pytest.raises(ValueError, match="not finite"):
        retention_metrics({"a": float("nan"), "b": 1.0}, target)


def test_pearson_spearman_helpers_constant():
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1)


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_score_table_roundtrip(tmp_path, suffix):
    scores = {"a": 0.5, "b": -1.25, "7": 3.0}
    p = write_scores(scores, tmp_path / f"s{suffix}", task={"a": "qa", "b": "qa", "7": "math"})
    assert read_scores(p) == scores


def test_read_scores_sniffs_and_validates(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Parquet written by someone else, with extra columns, non-string ids and an odd suffix
    pq.write_table(pa.table({"id": [1, 2], "score": [0.1, 0.2], "n_tokens": [5, 6]}), tmp_path / "table.bin")
    assert read_scores(tmp_path / "table.bin") == {"1": 0.1, "2": 0.2}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "score": 1}) + "\n" + json.dumps({"id": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: record lacks 'id' or 'score'"):
        read_scores(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"id": "a", "score": 1}) + "\n\n{oops\n")
    with pytest.raises(ValueError, match=r"broken.jsonl, line 3: malformed JSON"):
        read_scores(broken)
    pq.write_table(pa.table({"id": ["a"], "value": [1.0]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match="missing column"):
        read_scores(tmp_path / "nocol.parquet")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "score": 1}\n{"id": "a", "score": 2}\n')
    with pytest.raises(ValueError, match="two different scores"):
        read_scores(dup)
    # a directory of per-rank shards is read as their union
    d = tmp_path / "shards"
    write_scores({"a": 1.0}, d / "rank0.parquet")
    write_scores({"b": 2.0}, d / "rank1.jsonl")
    assert read_scores(d) == {"a": 1.0, "b": 2.0}


def test_partial_spearman_against_scipy_residuals():
    """Partial Spearman = Pearson of the rank residuals after least squares on the control's rank."""
    from scipy import stats

    from iprox_lightning.analysis.retention import partial_spearman

    rng = np.random.default_rng(5)
    c = rng.integers(1, 30, size=120).astype(float)
    y = -c + rng.normal(scale=6, size=120)
    x = y + rng.normal(scale=8, size=120) - 0.3 * c
    r = [stats.rankdata(v) for v in (x, y, c)]
    X = np.stack([np.ones(120), r[2]], 1)
    res = [v - X @ np.linalg.lstsq(X, v, rcond=None)[0] for v in r[:2]]
    assert partial_spearman(x, y, c) == pytest.approx(float(np.corrcoef(*res)[0, 1]), abs=1e-10)
    assert np.isnan(partial_spearman(-c, y, c))
    # an unrelated control changes little
    assert partial_spearman(x, y, rng.normal(size=120)) == pytest.approx(stats.spearmanr(x, y)[0], abs=0.05)
