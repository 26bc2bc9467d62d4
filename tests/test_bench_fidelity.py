"""The fidelity benchmark (bench/fidelity.py) on the built-in model and data, so it cannot rot; and its
helpers (variant grammar, validation halves, split-half and bootstrap statistics, FLOPs) against references."""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import fidelity  # noqa: E402

from iprox_lightning.analysis.flops import ModelShape, scoring_flops  # noqa: E402
from iprox_lightning.compress import DEFAULT_MODE  # noqa: E402
from iprox_lightning.scoring import tracin_scores  # noqa: E402

TINY = ["--model", "builtin", "--pool", "builtin", "--validation", "builtin", "--tokenizer", "builtin",
        "--builtin-size", "120", "--sample", "24", "--probe-examples", "8", "--align-examples", "8", "--tokens", "64",
        "--max-length", "64", "--probe-length", "64", "--align-length", "64", "--align-steps", "3",
        "--val-per-task", "2", "--bootstrap", "50", "--threads", "1", "--fail-fast"]
VARIANTS = ["ipsvd@0.5", "svd@0.5", "le@0.5", "ipsvd@0.5+align", "ipsvd@0.3", "ipsvd@0.5+align+nokl",
            "random@0.5+align", "ipsvd/exact/abs0.1@0.5"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    res = fidelity.main(TINY + ["--variants", *VARIANTS, "--kfac", "--kfac-variants", "ipsvd@0.5", "le@0.5",
                                "--out", str(out)])
    return out, res


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_every_row_has_finite_numbers(run):
    out, res = run
    on_disk = json.loads((out / "fidelity.json").read_text())
    keys = [fidelity.parse_variant(v).key for v in VARIANTS]
    assert [r["key"] for r in on_disk["rows"]] == keys and not on_disk.get("errors")
    t = on_disk["target"]
    assert t["sample"] == 24 and len(on_disk["target_scores"]) == 24 and t["validation"] == 4
    assert _finite(t["scoring_s"]) and t["scoring_s"] > 0 and t["flops_scoring"] > 0
    assert -1 <= t["split_half_spearman"] <= 1
    for r in on_disk["rows"]:
        for k in ("spearman", "kendall", "pearson", "top5%", "top10%", "split_half_spearman", "scoring_ratio"):
            assert _finite(r[k]), (r["key"], k)
        assert -1 <= r["spearman"] <= 1 and 0 <= r["top5%"] <= 1
        lo, hi = r["spearman_ci"]
        assert -1 <= lo <= hi <= 1, r["key"]
        assert 0 < r["params"] < t["params"], r["key"]
        assert all(_finite(v) and v >= 0 for v in r["time_s"].values()), r["key"]
        assert r["time_s"]["scoring"] > 0
        assert all(_finite(v) and v >= 0 for v in r["flops"].values()), r["key"]
        assert r["flops"]["total"] == pytest.approx(r["flops"]["probe"] + r["flops"]["alignment"] + r["flops"]["scoring"])
        assert 0 < r["flops"]["scoring"] < t["flops_scoring"], r["key"]
        assert set(r["proxy_scores"]) == set(on_disk["target_scores"])
        assert (r["flops"]["alignment"] > 0) == r["align"] and (r["time_s"]["alignment"] > 0) == r["align"]
        if r["align"]:
            assert r["alignment"]["steps"] == 3
            assert all(_finite(v) for v in r["alignment"]["last"].values())
    by = {r["key"]: r for r in on_disk["rows"]}
    assert by[f"ipsvd/{DEFAULT_MODE}@0.5"]["flops"]["probe"] > by["svd@0.5"]["flops"]["probe"] > 0
    assert by["le@0.5"]["layer_extraction"]["num_layers_after"] == 1  # 2 blocks, half removed
    assert by[f"ipsvd/{DEFAULT_MODE}@0.3"]["params"] > by[f"ipsvd/{DEFAULT_MODE}@0.5"]["params"]
    # K-FAC: target reference + the two requested proxies
    assert set(on_disk["kfac"]) == {f"ipsvd/{DEFAULT_MODE}@0.5", "le@0.5"}
    assert len(on_disk["kfac_target_scores"]) == 24
    for m in on_disk["kfac"].values():
        assert all(_finite(m[k]) for k in ("spearman", "kendall", "top5%", "scoring_s"))
    md = (out / "fidelity.md").read_text()
    for k in keys:
        # retention + cost (+ alignment) (+ K-FAC) tables
        assert sum(line.startswith(f"| {k} |") for line in md.splitlines()) == 2 + ("+align" in k) + (k in on_disk["kfac"]), k
    assert md.count("+align |") >= 1 and "**Alignment**" in md and "**K-FAC**" in md
    # one scatter per row, plus retention-vs-sparsity when a non-aligned method has >= 2 sparsities
    series = {}
    for r in on_disk["rows"]:
        if not r["align"]:
            series.setdefault((r["method"], r["mode"]), set()).add(r["rho"])
    with_curve = any(len(v) >= 2 for v in series.values())
    assert all((out / p).is_file() for p in on_disk["plots"])
    assert ("retention_vs_sparsity.png" in on_disk["plots"]) == with_curve
    assert len(on_disk["plots"]) == len(keys) + with_curve


def test_resume_recomputes_nothing(run, tmp_path):
    out, res = run
    import shutil

    shutil.copy(out / "fidelity.json", tmp_path / "fidelity.json")
    again = fidelity.main(TINY + ["--variants", *VARIANTS, "--out", str(tmp_path), "--resume", "--no-plots"])
    assert [r["key"] for r in again["rows"]] == [r["key"] for r in res["rows"]]
    for a, b in zip(again["rows"], res["rows"]):
        assert a["spearman"] == b["spearman"] and a["time_s"] == b["time_s"]


def test_scores_are_deterministic_and_scoring_is_seeded(run, tmp_path):
    _, res = run
    again = fidelity.main(TINY + ["--variants", "ipsvd@0.5", "le@0.5", "--no-plots", "--bootstrap", "0"])
    assert again["target_scores"] == pytest.approx(res["target_scores"], abs=1e-9)
    for r in again["rows"]:
        ref = next(x for x in res["rows"] if x["key"] == r["key"])
        assert r["spearman"] == pytest.approx(ref["spearman"], abs=1e-9)
        assert math.isnan(r["spearman_ci"][0])


def test_parse_variant():
    v = fidelity.parse_variant("ipsvd/core@0.5+align+nokl")
    assert (v.method, v.mode, v.rho, v.align, v.kl) == ("ipsvd", "core", 0.5, True, False)
    assert v.key == "ipsvd/core@0.5+align+nokl"
    assert fidelity.parse_variant("ipsvd@0.3").key == f"ipsvd/{DEFAULT_MODE}@0.3"
    assert fidelity.parse_variant("le@0.5").key == "le@0.5"
    d = fidelity.parse_variant("ipsvd/exact/rel1e-2@0.5+align")
    assert (d.mode, d.damping, d.damping_mode, d.align) == ("exact", 1e-2, "relative", True)
    assert d.key == "ipsvd/exact/rel0.01@0.5+align" and fidelity.parse_variant(d.key) == d
    assert fidelity.parse_variant("ipsvd/core/abs0.1@0.3").damping_mode == "absolute"
    for bad in ("foo@0.5", "svd/core@0.5", "svd/rel1e-3@0.5", "ipsvd/core/xyz1@0.5", "ipsvd@1.5", "le@0.5+align", "svd@0.5+nokl", "ipsvd@0.5+fast", "ipsvd"):
        with pytest.raises(ValueError, match="variant"):
            fidelity.parse_variant(bad)


def test_damping_variant_reaches_ipsvd(run):
    """A per-variant damping is recorded and changes the factors (hence the scores) against the default row."""
    _, res = run
    rows = {r["key"]: r for r in res["rows"]}
    d, base = rows["ipsvd/exact/abs0.1@0.5"], rows[f"ipsvd/{DEFAULT_MODE}@0.5"]
    assert (d["damping"], d["damping_mode"]) == (0.1, "absolute")
    assert (base["damping"], base["damping_mode"]) == (fidelity.DEFAULT_DAMPING, fidelity.DEFAULT_DAMPING_MODE)
    assert d["params"] == base["params"]
    diff = max(abs(d["proxy_scores"][k] - base["proxy_scores"][k]) for k in base["proxy_scores"])
    assert diff > 1e-6


def test_paired_bootstrap_difference():
    rng = np.random.default_rng(0)
    t = rng.normal(size=60)
    a, b = t + rng.normal(scale=0.5, size=60), t + rng.normal(scale=3.0, size=60)
    ids = [f"x{i}" for i in range(60)]
    da, db, dt = (dict(zip(ids, v.tolist())) for v in (a, b, t))
    d, lo, hi = fidelity.paired_bootstrap_difference(da, db, dt, n=400, seed=1)
    assert d == pytest.approx(stats.spearmanr(a, t)[0] - stats.spearmanr(b, t)[0], abs=1e-12)
    assert lo < d < hi and lo > 0  # a is clearly closer to the target than b
    assert fidelity.paired_bootstrap_difference(da, da, dt, n=100) == (0.0, 0.0, 0.0)


def test_markdown_has_the_paired_differences_of_the_rows_that_ran(run):
    _, res = run
    qs = {q["question"]: q for q in fidelity.paired_differences(res, n=50)}
    assert {"IPSVD vs SVD init (ρ = 0.5)", "alignment gain, IPSVD init (ρ = 0.5)",
            "KL term in the alignment (ρ = 0.5)"} <= set(qs)
    assert "IPSVD core vs exact (ρ = 0.5)" not in qs  # exact did not run
    rows = {r["key"]: r for r in res["rows"]}
    q = qs["IPSVD vs SVD init (ρ = 0.5)"]
    assert q["diff"] == pytest.approx(rows[q["a"]]["spearman"] - rows[q["b"]]["spearman"], abs=1e-9)
    assert "**Paired differences**" in fidelity.markdown(res)


def test_model_free_length_floor(run):
    _, res = run
    tr = res["trivial"]
    for name in ("response_tokens", "total_tokens"):
        a, b = tr[f"{name}, longest first"], tr[f"{name}, shortest first"]
        assert a["spearman"] == pytest.approx(-b["spearman"], abs=1e-12)
        assert -1 <= a["spearman"] <= 1
    assert "**Model-free floor**" in fidelity.markdown(res)


def test_partial_spearman_equals_residual_correlation_of_ranks():
    rng = np.random.default_rng(3)
    c = rng.integers(5, 60, size=80).astype(float)  # ties, like token counts
    t = -c + rng.normal(scale=10, size=80)
    p = -c + rng.normal(scale=10, size=80) + 0.5 * (t + c)
    ids = [str(i) for i in range(80)]
    dp, dt, dc = (dict(zip(ids, v.tolist())) for v in (p, t, c))
    ranks = [stats.rankdata(v) for v in (p, t, c)]
    X = np.stack([np.ones(80), ranks[2]], 1)
    res = [r - X @ np.linalg.lstsq(X, r, rcond=None)[0] for r in ranks[:2]]
    brute = float(np.corrcoef(res[0], res[1])[0, 1])
    assert fidelity.partial_spearman(dp, dt, dc) == pytest.approx(brute, abs=1e-10)
    # a proxy that is a function of the length alone has no residual: undefined, reported as NaN
    assert math.isnan(fidelity.partial_spearman({k: -v for k, v in dc.items()}, dt, dc))


def test_token_counts_count_tokens():
    batch = {"id": ["a", "b"], "labels": torch.tensor([[-100, 5, 6, -100], [-100, -100, 7, -100]]),
             "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])}
    from iprox_lightning.batch import token_counts

    f = token_counts([batch])
    assert f == {"response_tokens": {"a": 2.0, "b": 1.0}, "total_tokens": {"a": 3.0, "b": 4.0}}


def test_halves_match_scoring_each_half_alone():
    """The per-half scores of one pass equal TracIn against each half's examples alone (brute force)."""
    from iprox_lightning.batch import per_example_loss  # noqa: F401 (documents the loss)
    from iprox_lightning.models.tiny import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("llama", seed=0).eval()

    def batch(ids, tasks, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(1, 128, (len(ids), 10), generator=g)
        labels = x.clone()
        labels[:, :4] = -100
        return dict(input_ids=x, attention_mask=torch.ones_like(x), labels=labels, id=ids, task=tasks)

    val = [batch(["v0", "v1", "v2"], ["a", "b", "a"], 1), batch(["v3", "v4"], ["a", "b"], 2)]
    train = [batch([f"t{i}" for i in range(6)], None, 3)]
    halves_loader = fidelity.HalvesLoader(val)
    tags = [t for b in halves_loader for t in b["task"]]
    assert tags == ["half0", "half0", "half1", "half0", "half1"]  # alternating within a (v0,v2,v3) and b (v1,v4)
    table = tracin_scores(model, train, halves_loader, per_task=True, progress=False)
    allv = tracin_scores(model, train, val, per_task=False, progress=False)

    def only(rows):  # validation batches restricted to the given examples
        out = []
        for b in val:
            keep = [i for i, x in enumerate(b["id"]) if x in rows]
            if keep:
                out.append({k: (v[keep] if torch.is_tensor(v) else [v[i] for i in keep]) for k, v in b.items()})
        return out

    h0 = tracin_scores(model, train, only({"v0", "v1", "v3"}), per_task=False, progress=False)
    h1 = tracin_scores(model, train, only({"v2", "v4"}), per_task=False, progress=False)
    names = list(table.task_names)
    ts = np.asarray(table.task_scores)
    for k, i in enumerate(table):
        assert table[i] == pytest.approx(allv[i], abs=1e-5)
        assert ts[k, names.index("half0")] == pytest.approx(h0[i], abs=1e-5)
        assert ts[k, names.index("half1")] == pytest.approx(h1[i], abs=1e-5)


def test_split_half_and_bootstrap_against_scipy():
    rng = np.random.default_rng(0)
    ids = [f"x{i}" for i in range(40)]
    a = rng.normal(size=40)
    b = a + rng.normal(size=40)
    halves = {"half0": dict(zip(ids, a)), "half1": dict(zip(ids, b))}
    assert fidelity.split_half_spearman(halves) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
    assert math.isnan(fidelity.split_half_spearman({"half0": halves["half0"]}))
    lo, hi = fidelity.bootstrap_spearman(halves["half0"], halves["half1"], n=400, seed=1)
    # brute-force reference: the same resamples with scipy
    ida = sorted(ids)
    pa = np.array([halves["half0"][i] for i in ida])
    pb = np.array([halves["half1"][i] for i in ida])
    g = np.random.default_rng(1)
    vals = [stats.spearmanr(pa[ix], pb[ix]).statistic for ix in (g.integers(0, 40, 40) for _ in range(400))]
    assert (lo, hi) == pytest.approx(tuple(np.percentile(vals, [2.5, 97.5])), abs=1e-9)
    assert lo < stats.spearmanr(a, b).statistic < hi


def test_target_scoring_flops_formula():
    from iprox_lightning.models.tiny import tiny_causal_lm

    m = tiny_causal_lm("llama", seed=0)
    shape = ModelShape.from_model(m)
    data = {"sizes": {"sample": (10, 31.6), "validation": (4, 50.2)}}
    # per-example gradient dims: train 10 × 32 tokens + val 4 × 50 tokens, inner products only for train
    fwd = lambda n, t: shape.forward_flops(n, t)["total"]  # noqa: E731
    bwd = lambda n, t: shape.backward_flops(n, t, weight_grads="tracked")["total"]  # noqa: E731
    expected = fwd(10, 32) + bwd(10, 32) + 2 * 10 * shape.tracked_params + fwd(4, 50) + bwd(4, 50)
    assert fidelity.target_scoring_flops(shape, data) == pytest.approx(expected)
    assert scoring_flops(shape, n_train=0, n_val=4, seq_len=50)["inner_products"] == 0


def test_timing_only_merges_into_the_results(run, tmp_path):
    out, res = run
    import shutil

    shutil.copy(out / "fidelity.json", tmp_path / "fidelity.json")
    r = fidelity.main(TINY + ["--timing-only", "--timing-variants", "random@0.5", "le@0.5", "--timing-repeats", "2",
                              "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / "fidelity.json").read_text())
    assert [x["key"] for x in on_disk["rows"]] == [x["key"] for x in res["rows"]]  # rows untouched
    rows = on_disk["timing"]["rows"]
    assert set(rows) == {"random@0.5", "le@0.5"} and r["timing"]["rows"].keys() == rows.keys()
    for m in rows.values():
        assert m["target_wall_s"] > 0 and m["proxy_wall_s"] > 0 and m["repeats"] == 2 and m["batch_examples"] == 4
        assert m["wall_ratio"] == pytest.approx(m["proxy_wall_s"] / m["target_wall_s"])
        assert m["cpu_ratio"] == pytest.approx(m["proxy_cpu_s"] / m["target_cpu_s"])
        assert 0 < m["params"] < on_disk["target"]["params"]
    assert "interleaved" in (tmp_path / "fidelity.md").read_text()
    with pytest.raises(SystemExit, match="timing-variants"):
        fidelity.main(TINY + ["--timing-only", "--timing-variants", "ipsvd@0.5", "--out", str(tmp_path)])
