"""bench/speed.py on a tiny random-init Llama, so the script cannot rot: the engine agrees with the
per-example (LESS) loop, every timing / ratio is recorded, and the proxies have the sizes compress_model gives."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import speed  # noqa: E402

TINY = ["--random-init", "--shape", "tiny", "--batches", "3", "--batch-size", "4", "--seq-len", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("speed") / "speed.json"
    res = speed.main(TINY + ["--proxy-rhos", "0.3", "0.7", "--store-k", "4", "--out", str(out)])
    return res, out


def test_engine_matches_per_example_loop_and_everything_is_timed(result):
    res, out = result
    assert res["max_abs_diff_engine_vs_loop"] < 1e-5
    assert set(res["totals_s"]) == {"a", "b", "c1", "c2", "p0.3", "p0.7", "s", "s0.3", "s0.7"}
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in res["times_s"].values())
    assert res["tokens"] == 3 * 4 * 32  # random batches have no padding
    for k, v in res["totals_s"].items():
        assert res["tokens_per_s"][k] == pytest.approx(res["tokens"] / v)
    r = res["ratios"]
    assert r["loop/engine"] == pytest.approx(res["totals_s"]["b"] / res["totals_s"]["a"])
    assert r["proxy0.7/target"] == pytest.approx(res["totals_s"]["p0.7"] / res["totals_s"]["a"])
    assert r["store_proxy0.3/store_target"] == pytest.approx(res["totals_s"]["s0.3"] / res["totals_s"]["s"])
    assert r["store/engine"] == pytest.approx(res["totals_s"]["s"] / res["totals_s"]["a"])
    assert all(math.isfinite(x) and x > 0 for x in r.values())
    assert json.loads(out.read_text())["ratios"] == pytest.approx(r)


def test_proxy_sizes_follow_the_sparsity(result):
    res, _ = result
    p3, p7 = res["proxies"]["p0.3"], res["proxies"]["p0.7"]
    assert p7["params"] < p3["params"] < res["params"]
    assert p3["tracked_params"] > p7["tracked_params"]
    assert p3["achieved_sparsity"] == pytest.approx(0.3, abs=0.05)
    assert p7["achieved_sparsity"] == pytest.approx(0.7, abs=0.05)


def test_bfloat16_model_scores_close_to_the_loop():
    res = speed.main(TINY[:-2] + ["--batches", "2", "--dtype", "bfloat16", "--threads", "1"])
    assert res["max_abs_diff_engine_vs_loop"] < 1e-3


def test_shapes_are_llama_3_2():
    assert speed.SHAPES["llama-1b"]["hidden_size"] == 2048 and speed.SHAPES["llama-1b"]["num_hidden_layers"] == 16
    assert speed.SHAPES["llama-3b"]["hidden_size"] == 3072 and speed.SHAPES["llama-3b"]["num_hidden_layers"] == 28


def test_proxy_flop_ratio_is_the_analytic_scoring_cost(result):
    """Each timed proxy records the analytic scoring-FLOP ratio of its real shape, which equals the meta-device
    prediction ``--flops-only`` makes for the same shape and sparsity (both take ranks from ``rank_for_sparsity``)."""
    res, _ = result
    got = {rho: res["proxies"][f"p{rho}"]["flop_ratio"] for rho in ("0.3", "0.7")}
    assert 0 < got["0.7"] < got["0.3"] < 1
    for rho, r in got.items():
        assert r == pytest.approx(speed.shape_flop_ratio("tiny", float(rho), 32, res["head_share"]), rel=1e-12)
    # the random batches score the last 3/4 of each row (prompt = the first quarter): the LM head runs there only
    assert res["head_share"] == pytest.approx(24 / 32)


def test_flops_only_predicts_every_shape(tmp_path):
    out = tmp_path / "flops.json"
    res = speed.main(["--flops-only", "--proxy-rhos", "0.5", "0.7", "--seq-len", "256", "--out", str(out)])
    r = res["flop_ratios"]
    assert set(r) == set(speed.SHAPES) and json.loads(out.read_text()) == res
    assert all(0 < r[s]["0.7"] < r[s]["0.5"] < 1 for s in r)
    # at 7B the untouched parts (LM head, attention) weigh less than at 135M: the same sparsity saves more
    assert r["llama2-7b"]["0.5"] < r["smollm-135m"]["0.5"]


def test_saved_proxies_are_timed_like_the_built_ones(tmp_path):
    """``--proxy-dirs``: a proxy saved by the product is loaded as any model and timed in the same rotation (engine and
    store ways); its analytic FLOP ratio is that of its shape."""
    from iprox_lightning import compress_model, save_proxy

    args = speed.parse_args(TINY)
    model, _ = speed.build_model(args)
    compress_model(model, None, 0.5, method="svd", progress=False)
    path = save_proxy(model, None, tmp_path / "proxy", target_model="tiny")
    res = speed.main(TINY + ["--batches", "2", "--skip-less", "--store-k", "4", "--proxy-dirs", str(path)])
    assert {"p:proxy", "s:proxy"} <= set(res["totals_s"])
    r = res["ratios"]
    assert r["proxy:proxy/target"] == pytest.approx(res["totals_s"]["p:proxy"] / res["totals_s"]["a"])
    assert r["store_proxy:proxy/store_target"] == pytest.approx(res["totals_s"]["s:proxy"] / res["totals_s"]["s"])
    assert r["proxy:proxy/target_flops"] == pytest.approx(speed.shape_flop_ratio("tiny", 0.5, 32, res["head_share"]),
                                                          rel=1e-12)
    assert res["proxies"]["p:proxy"]["path"] == str(path)


def test_compare_unfused_times_every_engine_way_both_ways_and_restores_the_head():
    res = speed.main(TINY[:-2] + ["--batches", "2", "--threads", "1", "--skip-less", "--proxy-rhos", "0.5",
                                  "--store-k", "4", "--compare-unfused", "--profile"])
    ways = {"a", "p0.5", "s", "s0.5"}
    assert {k[:-1] for k in res["totals_s"] if k.endswith("~")} == ways
    for k in ways:
        assert res["ratios"][f"{k}:fused/unfused"] == pytest.approx(res["totals_s"][k] / res["totals_s"][k + "~"])
    from iprox_lightning.engine import batch as batch_module

    assert not any(v is False for v in batch_module._HEAD_IS_PLAIN.values())  # no model left unfused
    # --profile: one engine step of the target and of the proxy split by where its time goes
    assert set(res["profile"]) == {"a", "p0.5"}
    for split in res["profile"].values():
        assert set(split) == {"block_linears", "lm_head_and_ce", "attention", "other"}
        assert all(v >= 0 for v in split.values()) and split["block_linears"] > 0 and split["lm_head_and_ce"] > 0
