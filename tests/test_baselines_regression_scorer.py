"""The regression scorer (the paper's Influence Scorer baseline, MATES-style) learns a synthetic score on a tiny model; Lightning front-end; random baseline."""
import numpy as np
import pytest
import torch

from iprox_lightning.io.scores import read_scores
from iprox_lightning.analysis.retention import spearman
from iprox_lightning.baselines.regression_scorer import (
    RegressionLM,
    fit_regression_scorer,
    predict_scores,
)
from iprox_lightning.baselines.random_selection import random_score, random_scores, random_subset, write_random_scores
from iprox_lightning.models.tiny import tiny_causal_lm


def _data(n, prefix, seed):
    """Examples whose share of 'low' token ids varies; the synthetic score is that share."""
    g = torch.Generator().manual_seed(seed)
    batches, targets = [], {}
    for s in range(0, n, 16):
        ids = torch.randint(40, 128, (16, 20), generator=g)
        share = torch.rand(16, 1, generator=g)
        low = torch.randint(3, 40, (16, 20), generator=g)
        ids = torch.where(torch.rand(16, 20, generator=g) < share, low, ids)
        mask = torch.ones_like(ids)
        mask[::3, 15:] = 0
        names = [f"{prefix}{s + i}" for i in range(16)]
        for name, row, m in zip(names, ids, mask):
            targets[name] = float((row[m.bool()] < 40).float().mean())
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "id": names})
    return batches, targets


def test_regression_head_only_trains_head():
    sc = RegressionLM(tiny_causal_lm("llama"))
    trainable = [n for n, p in sc.named_parameters() if p.requires_grad]
    assert trainable == ["head.weight", "head.bias"]
    sc2 = RegressionLM(tiny_causal_lm("llama"), trainable_blocks=1, pooling="last")
    names = {n for n, p in sc2.named_parameters() if p.requires_grad}
    assert any(n.startswith("backbone.layers.1.") for n in names) and not any(n.startswith("backbone.layers.0.") for n in names)


def test_pooling_matches_manual():
    lm = tiny_causal_lm("qwen2")
    batches, _ = _data(16, "p", 0)
    b = batches[0]
    h = lm.base_model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).last_hidden_state
    m = b["attention_mask"]
    mean = RegressionLM(lm, pooling="mean").features(b["input_ids"], m)
    last = RegressionLM(lm, pooling="last").features(b["input_ids"], m)
    for i in range(4):
        n = int(m[i].sum())
        torch.testing.assert_close(mean[i], h[i, :n].mean(0))
        torch.testing.assert_close(last[i], h[i, n - 1])


def test_regression_scorer_learns_synthetic_score():
    train, t_train = _data(160, "t", 1)
    held, t_held = _data(96, "h", 2)
    targets = {**t_train, **t_held}
    sc = RegressionLM(tiny_causal_lm("llama"))
    before = predict_scores(sc, held, progress=False)
    ids = sorted(before)
    rho_before = spearman([before[i] for i in ids], [targets[i] for i in ids])
    hist = fit_regression_scorer(sc, train, targets, epochs=6, lr=1e-2, eval_batches=held, progress=False)
    after = predict_scores(sc, held, progress=False)
    rho_after = spearman([after[i] for i in ids], [targets[i] for i in ids])
    assert rho_after > 0.5 and rho_after > abs(rho_before) + 0.2
    assert hist[-1]["train_mse"] < hist[0]["train_mse"]
    assert hist[-1]["eval_spearman"] == pytest.approx(rho_after)
    # predictions are on the target scale (de-standardised)
    pred = np.array([after[i] for i in ids])
    assert abs(pred.mean() - np.mean([targets[i] for i in ids])) < 0.1
    with pytest.raises(KeyError, match="no entry"):
        fit_regression_scorer(sc, train, {"unrelated": 1.0}, epochs=1, progress=False)


def test_random_selection_is_seeded_and_order_free(tmp_path):
    ids = [f"id{i}" for i in range(2000)]
    a = random_scores(ids, seed=3)
    b = random_scores(list(reversed(ids)), seed=3)
    assert a == b and random_scores(ids, seed=4) != a
    v = np.array(list(a.values()))
    assert 0 <= v.min() and v.max() < 1 and abs(v.mean() - 0.5) < 0.03  # ~uniform
    assert a["id7"] == random_score("id7", 3)
    sub = random_subset(ids, 0.05, seed=3)
    assert len(sub) == 100 and set(sub) == set(sorted(ids, key=a.get)[-100:])
    path = write_random_scores(ids[:10], tmp_path / "random.jsonl", seed=3)
    assert read_scores(path) == {i: a[i] for i in ids[:10]}
    with pytest.raises(ValueError, match="duplicate"):
        random_scores(["x", "x"])
