"""Stage 2's per-task ranking fidelity (``fidelity_per_task``): the Spearman of the proxy's vs the target's scores
against each validation task, against a brute-force recomputation (the product's ``tracin_scores`` and scipy), and
``keep_best`` on the worst task (``val/fidelity_worst_loss``) keeping the factors with the best minimum."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from iprox_lightning.alignment.keep_best import KeepBestFactors
from iprox_lightning.alignment.fidelity import per_task_spearman, worst_task_rho
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.alignment.module import AlignConfig
from iprox_lightning.scoring.influence import ScoreTable, tracin_scores
from iprox_lightning.models.builtin import builtin_model

from test_align_fidelity import factors, fit

pytestmark = pytest.mark.usefixtures("one_thread")


def test_per_task_spearman_and_worst_against_scipy():
    rng = np.random.default_rng(0)
    target = rng.normal(size=(30, 3))
    proxy = target + rng.normal(scale=[0.1, 1.0, 3.0], size=(30, 3))
    rhos = per_task_spearman(proxy, target, ["a", "b", "c"])
    for k, t in enumerate("abc"):
        assert rhos[t] == pytest.approx(spearmanr(proxy[:, k], target[:, k]).statistic, abs=1e-12)
    assert rhos["a"] > rhos["b"] > rhos["c"] and worst_task_rho(rhos) == rhos["c"]
    proxy[4, 1] = np.nan
    rhos = per_task_spearman(proxy, target, ["a", "b", "c"])
    assert np.isnan(rhos["b"]) and np.isnan(worst_task_rho(rhos))  # a task that cannot be judged is never served


def test_align_config_checks_the_per_task_options():
    AlignConfig(fidelity_examples=4, fidelity_per_task=True, monitor="val/fidelity_worst_loss")
    with pytest.raises(ValueError, match="fidelity_per_task needs fidelity_examples > 0"):
        AlignConfig(fidelity_per_task=True)
    with pytest.raises(ValueError, match="needs fidelity_per_task"):
        AlignConfig(fidelity_examples=4, monitor="val/fidelity_worst_loss")
    with pytest.raises(ValueError, match="higher-is-better"):
        AlignConfig(fidelity_examples=4, fidelity_per_task=True, monitor="val/fidelity_worst")
    with pytest.raises(ValueError, match="true or false"):
        ProxyAlignModule(fidelity_examples=4, fidelity_per_task="yes")


def test_per_task_fidelity_matches_brute_force_and_keeps_the_best_worst_task(tmp_path):
    module, dm, snaps, tr = fit(tmp_path, lr=1e-2, steps=2, fidelity_examples=24, fidelity_per_task=True,
                                monitor="val/fidelity_worst_loss")
    hist = module.validation_history
    assert [h["step"] for h in hist] == [0, 1, 2]
    fid, val = dm.fidelity_dataloader(24), dm.val_dataloader()
    target = tracin_scores(builtin_model(0), fid, val, progress=False)
    tasks = target.task_names
    assert tasks == sorted(dm.validation_tasks) and len(tasks) == 2
    for h in hist:
        proxy = snaps.proxies["init" if h["step"] == 0 else h["step"]]
        mine = tracin_scores(proxy, fid, val, progress=False)
        expected = {t: spearmanr(mine.task_scores[:, k], target.task_scores[:, k]).statistic for k, t in enumerate(tasks)}
        for t in tasks:
            assert h[f"val/fidelity_{t}"] == pytest.approx(expected[t], abs=1e-6)
        assert h["val/fidelity_worst"] == pytest.approx(min(expected.values()), abs=1e-6)
        assert h["val/fidelity_worst_loss"] == pytest.approx(1 - min(expected.values()), abs=1e-6)
        assert h["val/fidelity_spearman"] == pytest.approx(spearmanr(mine.scores, target.scores).statistic, abs=1e-6)
    best = min(hist, key=lambda h: h["val/fidelity_worst_loss"])["step"]
    assert module.best_factors.best["step"] == best
    restored, kept = factors(module.proxy), factors(snaps.proxies["init" if best == 0 else best])
    assert all(torch.equal(restored[k], kept[k]) for k in kept)
    rec = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["alignment"]
    assert rec["fidelity_per_task"] is True and rec["fidelity"]["tasks"] == tasks
    assert [h["worst"] for h in rec["fidelity"]["history"]] == [pytest.approx(h["val/fidelity_worst"]) for h in hist]
    assert set(rec["fidelity"]["history"][0]["tasks"]) == set(tasks)
    # the logger got every per-task metric at every step, step 0 included
    rows = (tmp_path / "log" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for name in [f"val/fidelity_{t}" for t in tasks] + ["val/fidelity_worst", "val/fidelity_worst_loss"]:
        col = header.index(name)
        assert sum(1 for r in rows[1:] if r.split(",")[col] != "") == 3


def _scripted_scorer(per_call):
    """A fidelity scorer whose call ``c`` returns the table ``per_call[c](ids)`` (the target is call 0)."""
    calls = []

    def scorer(model, loader, val_batches, progress=False):
        ids = [i for b in loader for i in b["id"]]
        calls.append(model)
        pooled, tasks = per_call[len(calls) - 1](len(ids))
        n = len(ids)
        return ScoreTable(ids, pooled, ["t0", "t1"], tasks, np.ones(n), np.zeros(n, bool), settings={"val_examples": 4})

    return scorer, calls


def test_worst_task_monitor_keeps_the_best_minimum_not_the_best_pooled(tmp_path):
    """Constructed: step 0 ranks the pool perfectly pooled but reverses task t1; step 1 reverses the pooled ranking but
    keeps both tasks; step 2 is in between. keep_best on val/fidelity_worst_loss keeps step 1 (best minimum), on
    val/fidelity_loss it would keep step 0."""
    base = np.linspace(0.0, 1.0, 12)
    rev = base[::-1].copy()
    tgt = lambda n: (base[:n], np.stack([base[:n], base[:n]], 1))  # noqa: E731
    calls = [
        tgt,  # the target
        lambda n: (base[:n], np.stack([base[:n], rev[-n:]], 1)),  # step 0: pooled 1, t1 −1
        lambda n: (rev[-n:], np.stack([base[:n], base[:n]], 1)),  # step 1: pooled −1, both tasks 1
        lambda n: (base[:n], np.stack([base[:n], np.r_[base[: n // 2], rev[-(n - n // 2):]]], 1)),  # step 2
    ]
    scorer, used = _scripted_scorer(calls)
    module, dm, snaps, tr = fit(tmp_path, lr=1e-2, steps=2, fidelity_examples=12, fidelity_per_task=True,
                                fidelity_scorer=scorer, monitor="val/fidelity_worst_loss")
    hist = module.validation_history
    assert len(used) == 4 and [h["step"] for h in hist] == [0, 1, 2]
    assert [round(h["val/fidelity_spearman"], 6) for h in hist][:2] == [1.0, -1.0]
    assert [round(h["val/fidelity_worst"], 6) for h in hist][:2] == [-1.0, 1.0]
    assert module.best_factors.best["step"] == 1
    restored, kept = factors(module.proxy), factors(snaps.proxies[1])
    assert all(torch.equal(restored[k], kept[k]) for k in kept)
    # the same history under the pooled monitor keeps step 0
    pooled = KeepBestFactors(monitor="val/fidelity_loss")

    class Factors:
        def factor_parameters(self):
            return [torch.zeros(1)]

    for h in hist:
        pooled.record(h["step"], {k: v for k, v in h.items() if k != "step"}, Factors())
    assert pooled.best["step"] == 0


def test_per_task_needs_task_scores_and_refuses_colliding_names(tmp_path):
    def no_tasks(model, loader, val_batches, progress=False):
        ids = [i for b in loader for i in b["id"]]
        return ScoreTable(ids, np.arange(len(ids), dtype=float), [], np.zeros((len(ids), 0)), np.ones(len(ids)),
                          np.zeros(len(ids), bool))

    with pytest.raises(ValueError, match="needs per-task scores"):
        fit(tmp_path / "a", lr=1e-2, steps=1, fidelity_examples=8, fidelity_per_task=True, fidelity_scorer=no_tasks)

    def reserved(model, loader, val_batches, progress=False):
        ids = [i for b in loader for i in b["id"]]
        n = len(ids)
        return ScoreTable(ids, np.arange(n, dtype=float), ["worst", "b"], np.zeros((n, 2)), np.ones(n), np.zeros(n, bool))

    with pytest.raises(ValueError, match="would collide"):
        fit(tmp_path / "b", lr=1e-2, steps=1, fidelity_examples=8, fidelity_per_task=True, fidelity_scorer=reserved)
