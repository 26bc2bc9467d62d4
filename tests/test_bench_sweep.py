"""The IPSVD damping sweep script (bench/ipsvd_sweep.py) on the built-in model and data, so it cannot rot;
and its undamped-objective meter against the brute-force formula."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import compress_real  # noqa: E402
import ipsvd_sweep  # noqa: E402

from iprox_lightning.ipsvd import ipsvd_factors, weighted_objective  # noqa: E402
from iprox_lightning.probes import Probes  # noqa: E402

TINY = ["--model", "builtin", "--pool", "builtin", "--validation", "builtin", "--tokenizer", "builtin",
        "--builtin-size", "120", "--probe-examples", "8", "--sample", "24", "--heldout", "8", "--tokens", "96",
        "--max-length", "64", "--probe-length", "64", "--val-per-task", "2", "--batch-size", "8",
        "--ci-resamples", "50"]  # the Markdown's Spearman CIs (2000 resamples: 95% of the sweep's time here)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    ipsvd_sweep.main(TINY + ["--dampings", "1e-2", "1", "--kfac", "--out", str(out)])
    return out, json.loads(out.with_suffix(".json").read_text())


def test_sweep_rows_and_numbers(sweep):
    out, res = sweep
    keys = [r["key"] for r in res["rows"]]
    expected = ["svd"] + [f"ipsvd/{m}/{dm}/{d}" for dm in ("relative", "absolute") for m in ("core", "exact")
                          for d in ("0.01", "1")]
    assert keys == expected
    assert res["target"]["sample"] == 24 and len(res["target_scores"]) == 24
    for r in res["rows"]:
        for k in ("spearman", "kendall", "pearson", "top5%", "top10%", "rel_objective_probe", "rel_objective_heldout",
                  "heldout_loss", "factor_time_s"):
            assert math.isfinite(r[k]), (r["key"], k)
        assert -1 <= r["spearman"] <= 1 and 0 <= r["top10%"] <= 1
        assert 0 <= r["rel_objective_probe"] <= 1.5 and r["params_after"] < r["params_before"]
        assert set(r["proxy_scores"]) == set(res["target_scores"])
    # IPSVD minimises the damped weighted objective on the probes; with small damping it must beat plain SVD there
    by = {r["key"]: r for r in res["rows"]}
    assert by["ipsvd/exact/relative/0.01"]["rel_objective_probe"] < by["svd"]["rel_objective_probe"]
    # the best row is the IPSVD row with the highest Spearman (tie-break top-10%)
    best = max((r for r in res["rows"] if r["method"] == "ipsvd"), key=lambda r: (round(r["spearman"], 6), r["top10%"]))
    assert res["best"]["key"] == best["key"]
    assert set(res["kfac"]) == {"svd", best["key"]}
    assert all(math.isfinite(v) for m in res["kfac"].values() for v in m.values())
    md = out.with_suffix(".md").read_text()
    tracin_md, kfac_md = md.split("K-FAC retention")
    assert tracin_md.count("\n| ipsvd") == 8 and tracin_md.count("(best)") == 1
    assert kfac_md.count("\n| ") == 3  # header, svd, best


def test_sweep_resume_keeps_rows(sweep, tmp_path):
    out, res = sweep
    # resuming a finished sweep recomputes nothing and keeps every number
    again = ipsvd_sweep.main(TINY + ["--dampings", "1e-2", "1", "--kfac", "--out", str(out), "--resume"])
    assert [r["spearman"] for r in again["rows"]] == [r["spearman"] for r in res["rows"]]
    assert again["target_scores"] == res["target_scores"]


def test_objective_meter_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    out_f, in_f, N, r = 12, 9, 7, 4
    W = torch.randn(out_f, in_f, generator=g)
    H, D = torch.randn(in_f, N, generator=g), torch.randn(out_f, N, generator=g) * 1e-3
    A, B = ipsvd_factors(W, H, D, r, damping=1e-2, mode="exact")
    meter = ipsvd_sweep.ObjectiveMeter({"l": W}, Probes(H={"l": H}, Delta={"l": D}, num_tokens=N, num_valid_tokens=N,
                                                        num_examples=1, mean_loss=0.0), dtype=torch.float64)
    # brute force: explicit second moments, tr(C_δ E C_h Eᵀ)
    Hd, Dd = H.double(), D.double()
    Ch, Cd = Hd @ Hd.T / N, Dd @ Dd.T / N
    E = W.double() - A.double() @ B.double()
    J = float(torch.trace(Cd @ E @ Ch @ E.T))
    J0 = float(torch.trace(Cd @ W.double() @ Ch @ W.double().T))
    assert meter.relative("l", A, B) == pytest.approx(J / J0, rel=1e-9)
    assert ipsvd_sweep.undamped_objective(E, H, D) == pytest.approx(J, rel=1e-9)
    # the damped objective of the library tends to it as the damping vanishes
    assert weighted_objective(W, A, B, H, D, damping=1e-12, damping_mode="relative") == pytest.approx(J, rel=1e-6)


def test_sweep_configs_and_best_row():
    cfg = ipsvd_sweep.sweep_configs(["core", "exact"], [1e-3, 1.0], ["relative", "absolute"])
    assert len(cfg) == 1 + 2 * 2 * 2 and cfg[0]["method"] == "svd"
    assert ipsvd_sweep.config_key(cfg[1]) == "ipsvd/core/relative/0.001"
    rows = [dict(method="ipsvd", spearman=0.5, **{"top10%": 0.2}, key="a"),
            dict(method="ipsvd", spearman=0.5, **{"top10%": 0.4}, key="b"),
            dict(method="svd", spearman=0.9, **{"top10%": 1.0}, key="svd"),
            dict(method="ipsvd", spearman=float("nan"), **{"top10%": 1.0}, key="c")]
    assert ipsvd_sweep.best_row(rows)["key"] == "b"


def test_objective_meter_float32_close_to_float64():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(20, 16, generator=g)
    H, D = torch.randn(16, 10, generator=g), torch.randn(20, 10, generator=g) * 1e-4
    A, B = ipsvd_factors(W, H, D, 5, damping=1e-2, mode="core")
    pr = Probes(H={"l": H}, Delta={"l": D}, num_tokens=10, num_valid_tokens=10, num_examples=1, mean_loss=0.0)
    r64 = ipsvd_sweep.ObjectiveMeter({"l": W}, pr, dtype=torch.float64).relative("l", A, B)
    assert ipsvd_sweep.ObjectiveMeter({"l": W}, pr).relative("l", A, B) == pytest.approx(r64, rel=1e-4)


def test_compress_real_script(tmp_path):
    res = compress_real.main(["--model", "builtin", "--pool", "builtin", "--tokenizer", "builtin",
                              "--builtin-size", "60", "--probe-examples", "8", "--heldout", "8", "--tokens", "96",
                              "--probe-length", "64",
                              "--sparsity", "0.3", "0.7", "--out", str(tmp_path / "c")])
    rows = res["rows"]
    assert [(r["sparsity"], r["method"], r["mode"]) for r in rows] == [
        (rho, m, mode) for rho in (0.3, 0.7) for m, mode in (("ipsvd", "exact"), ("ipsvd", "core"), ("svd", None))]
    for r in rows:
        assert r["params_after"] < r["params_before"] and math.isfinite(r["heldout_loss"])
        assert 0 <= r["rel_objective_probe"] <= 1.5 and r["factor_time_s"] >= 0
    # more sparsity -> fewer parameters and larger SVD error; exact is the damped optimum so it beats SVD in-sample
    by = {(r["sparsity"], r["mode"] or "svd"): r for r in rows}
    assert by[(0.7, "svd")]["params_after"] < by[(0.3, "svd")]["params_after"]
    assert by[(0.7, "svd")]["rel_objective_probe"] > by[(0.3, "svd")]["rel_objective_probe"]
    assert by[(0.3, "exact")]["rel_objective_own"] <= by[(0.3, "svd")]["rel_objective_own"] + 1e-9
    saved = json.loads((tmp_path / "c.json").read_text())
    assert len(saved["rows"]) == 6 and (tmp_path / "c.md").read_text().count("\n| 0.") == 6
