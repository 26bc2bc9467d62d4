"""Per-layer attribution of a task's TracIn ranking (analysis/layer_attribution.py) against brute force."""
import numpy as np
import pytest
from scipy.stats import spearmanr

from iprox_lightning.analysis.layer_attribution import (
    group_of, group_table, layer_blocks, layer_contributions, module_of, task_layer_table,
)

LAYOUT = [  # two blocks, three modules each; one store row per weight (a proxy's module has two)
    {"key": "model.layers.0.self_attn.q_proj.weight", "offset": 0},
    {"key": "model.layers.0.mlp.up_proj.weight", "offset": 6},
    {"key": "model.layers.0.mlp.down_proj.weight", "offset": 10},
    {"key": "model.layers.1.self_attn.q_proj.weight", "offset": 13},
    {"key": "model.layers.1.mlp.up_proj.weight", "offset": 17},
    {"key": "model.layers.1.mlp.down_proj.weight", "offset": 24},
]
DIM = 30


def test_module_of_groups_a_proxys_factors_under_their_module():
    assert module_of("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj"
    assert module_of("model.layers.3.mlp.up_proj.A.weight") == "model.layers.3.mlp.up_proj"
    assert module_of("model.layers.3.mlp.up_proj.B.weight") == "model.layers.3.mlp.up_proj"
    blocks = layer_blocks([{"key": "m.l.0.q.A.weight", "offset": 0}, {"key": "m.l.0.q.B.weight", "offset": 4},
                           {"key": "m.l.0.k.weight", "offset": 9}], dim=12)
    assert blocks == {"m.l.0.q": [(0, 4), (4, 9)], "m.l.0.k": [(9, 12)]}
    assert group_of("model.layers.12.mlp.up_proj", "type") == "up_proj"
    assert group_of("model.layers.12.mlp.up_proj", "block") == "layers.12"


def test_contributions_shares_and_rankings_against_brute_force():
    rng = np.random.default_rng(0)
    n = 40
    X = rng.normal(size=(n, DIM))
    X[5] = 0.0  # a zero-gradient example scores 0
    s = rng.normal(size=DIM)
    blocks = layer_blocks(LAYOUT, DIM)
    assert [b for bl in blocks.values() for b in bl][-1] == (24, 30) and len(blocks) == 6
    score, contrib = layer_contributions(X, s, blocks)
    # brute force: the cosine, and each layer's slice of the dot product over the same norms
    norms = np.linalg.norm(X, axis=1)
    cos = np.array([x @ s / (nx * np.linalg.norm(s)) if nx > 0 else 0.0 for x, nx in zip(X, norms)])
    np.testing.assert_allclose(score, cos, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(sum(contrib.values()), cos, rtol=1e-12, atol=1e-14)
    up0 = np.array([x[6:10] @ s[6:10] / (nx * np.linalg.norm(s)) if nx > 0 else 0.0 for x, nx in zip(X, norms)])
    np.testing.assert_allclose(contrib["model.layers.0.mlp.up_proj"], up0, rtol=1e-12, atol=1e-15)

    table = task_layer_table(score, contrib)
    shares = {m: np.cov(c, score, bias=True)[0, 1] / np.var(score) for m, c in contrib.items()}
    for m, row in table.items():
        assert row["share"] == pytest.approx(shares[m], rel=1e-10, abs=1e-12)
        assert row["alone"] == pytest.approx(spearmanr(contrib[m], score)[0], abs=1e-12)
        assert "kept" not in row
    assert sum(r["share"] for r in table.values()) == pytest.approx(1.0, abs=1e-12)

    # a proxy identical on one module, scrambled on another: kept 1 there, the recomputed Spearman elsewhere
    proxy = dict(contrib)
    m_scr = "model.layers.1.mlp.down_proj"
    proxy[m_scr] = contrib[m_scr][rng.permutation(n)]
    kept = task_layer_table(score, contrib, proxy)
    assert kept["model.layers.0.mlp.up_proj"]["kept"] == pytest.approx(1.0, abs=1e-12)
    assert kept[m_scr]["kept"] == pytest.approx(spearmanr(proxy[m_scr], contrib[m_scr])[0], abs=1e-12)
    del proxy["model.layers.0.self_attn.q_proj"]  # a module the proxy lacks (e.g. dropped): NaN, not a number
    assert np.isnan(task_layer_table(score, contrib, proxy)["model.layers.0.self_attn.q_proj"]["kept"])

    # grouped per type and per block: group contributions are sums, shares still sum to 1
    by_type = group_table(contrib, score, "type")
    assert set(by_type) == {"q_proj", "up_proj", "down_proj"}
    up = contrib["model.layers.0.mlp.up_proj"] + contrib["model.layers.1.mlp.up_proj"]
    assert by_type["up_proj"]["share"] == pytest.approx(np.cov(up, score, bias=True)[0, 1] / np.var(score), rel=1e-10)
    by_block = group_table(contrib, score, "block", proxy_contrib=contrib)
    assert set(by_block) == {"layers.0", "layers.1"}
    assert sum(r["share"] for r in by_block.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(r["kept"] == pytest.approx(1.0, abs=1e-12) for r in by_block.values())
