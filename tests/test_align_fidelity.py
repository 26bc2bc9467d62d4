"""Stage 2's ranking-fidelity check and the step-0 keep_best candidate: the ``fidelity`` split (disjoint,
seeded, other splits unchanged), ``val/fidelity_spearman`` against a brute-force recomputation with the product's
``tracin_scores`` and scipy, and ``keep_best`` on ``val/fidelity_loss`` restoring the un-aligned factors."""
from __future__ import annotations

import copy
import json

import lightning as L
import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from iprox_lightning.compression.callback import IPSVDCallback
from iprox_lightning.compression.apply import load_proxy
from iprox_lightning.data import SFTDataModule
from iprox_lightning.data.splits import make_splits
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.builtin import builtin_model
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.alignment.module import AlignConfig
from iprox_lightning.scoring.influence import tracin_scores


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


# ------------------------------------------------------------------------------------------------ the split
def test_fidelity_split_disjoint_deterministic_and_other_splits_unchanged():
    ids = [f"ex-{i:03d}" for i in range(40)]
    kw = dict(seed=7, warmup_fraction=0.1, construction_fraction=0.2, probe_fraction=0.25)
    base = make_splits(ids, **kw)
    # the ids these splits had before the fidelity split existed (pinned)
    assert base.warmup == ["ex-004", "ex-000", "ex-028", "ex-020"]
    assert base.probe == ["ex-030", "ex-010"]
    assert base.align == ["ex-012", "ex-032", "ex-019", "ex-009", "ex-014", "ex-022"]
    assert base.fidelity == []
    for n in (1, 5, 28):
        s = make_splits(list(reversed(ids)), **kw, fidelity_examples=n)
        assert (s.warmup, s.probe, s.align, s.pool) == (base.warmup, base.probe, base.align, base.pool)
        assert len(s.fidelity) == len(set(s.fidelity)) == n
        assert not set(s.fidelity) & set(s.warmup + s.probe + s.align) and set(s.fidelity) <= set(ids)
        assert s.get("fidelity") == make_splits(ids, **kw, fidelity_examples=n).fidelity  # deterministic
    assert make_splits(ids, **kw, fidelity_examples=5).fidelity == make_splits(ids, **kw, fidelity_examples=28).fidelity[:5]
    assert make_splits(ids, **{**kw, "seed": 8}, fidelity_examples=5).fidelity != make_splits(ids, **kw, fidelity_examples=5).fidelity
    with pytest.raises(ValueError, match="at most 28"):
        make_splits(ids, **kw, fidelity_examples=29)
    with pytest.raises(ValueError, match="fidelity_examples must be >= 0"):
        make_splits(ids, **kw, fidelity_examples=-1)

    dm = SFTDataModule(builtin_size=120, validation=None, seed=3, construction_fraction=0.1, max_length=48)
    before = {k: dm.splits.get(k) for k in ("warmup", "probe", "align")}
    with pytest.raises(ValueError, match="split 'fidelity' is empty"):
        dm.dataloader("fidelity")
    loader = dm.fidelity_dataloader(10)
    assert {k: dm.splits.get(k) for k in ("warmup", "probe", "align")} == before
    served = [i for b in loader for i in b["id"]]
    assert served == dm.ids("fidelity") and set(served) <= set(dm.splits.fidelity) and len(dm.splits.fidelity) == 10
    assert not set(served) & set(sum(before.values(), []))
    again = SFTDataModule(builtin_size=120, validation=None, seed=3, construction_fraction=0.1, max_length=48)
    assert [i for b in again.fidelity_dataloader(10) for i in b["id"]] == served


def test_align_config_checks_fidelity_options():
    assert AlignConfig().fidelity_examples == 0 and AlignConfig().monitor == "val/loss"
    with pytest.raises(ValueError, match="fidelity_examples must be an int >= 0"):
        AlignConfig(fidelity_examples=-1)
    with pytest.raises(ValueError, match="needs fidelity_examples > 0"):
        AlignConfig(monitor="val/fidelity_loss")
    AlignConfig(monitor="val/fidelity_loss", fidelity_examples=4)


# ------------------------------------------------------------------------------------------------ the check
def datamodule() -> SFTDataModule:
    return SFTDataModule(builtin_size=200, val_per_task=2, seed=1, construction_fraction=0.1, probe_fraction=0.2,
                         max_length=40, batch_size=4, eval_batch_size=8, train_split="align")


class Snapshots(L.Callback):
    """Deep copies of the proxy: before the first step (``"init"``) and at every validation run (by step)."""

    def __init__(self):
        self.proxies = {}

    def on_train_start(self, trainer, pl_module):  # callbacks run before the module's hook: un-aligned factors
        self.proxies["init"] = copy.deepcopy(pl_module.proxy)

    def on_validation_epoch_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.proxies[int(trainer.global_step)] = copy.deepcopy(pl_module.proxy)


def fit(tmp_path, *, lr, steps, **module_kw):
    dm = datamodule()
    module = ProxyAlignModule(target=builtin_model(0), lr=lr, save_dir=str(tmp_path / "proxy"),
                              log_layer_cosines=False, **module_kw)
    snaps = Snapshots()
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=1, num_sanity_val_steps=2,
                   callbacks=[IPSVDCallback(sparsity=0.5, method="ipsvd", num_probe_tokens=32, allocation="uniform",
                                            health_batches=0), snaps],
                   default_root_dir=tmp_path, logger=L.pytorch.loggers.CSVLogger(tmp_path, name="log"),
                   log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False)
    tr.fit(module, datamodule=dm)
    return module, dm, snaps, tr


def factors(model):
    return {f"{n}.{k}": getattr(m, k).detach().clone() for n, m in model.named_modules()
            if isinstance(m, LowRankLinear) for k in ("A", "B")}


def test_fidelity_spearman_matches_brute_force_tracin_and_scipy(tmp_path):
    module, dm, snaps, tr = fit(tmp_path, lr=1e-2, steps=2, fidelity_examples=24, monitor="val/fidelity_loss")
    hist = module.validation_history
    assert [h["step"] for h in hist] == [0, 1, 2]  # step 0 (un-aligned) + one per step; the sanity check is not one
    fid = dm.fidelity_dataloader(24)
    ids = [i for b in fid for i in b["id"]]
    assert len(ids) == 24 and not set(ids) & set(dm.splits.align + dm.splits.probe + dm.splits.warmup)
    target = tracin_scores(builtin_model(0), fid, dm.val_dataloader(), progress=False)
    assert target.ids == ids
    for h in hist:
        proxy = snaps.proxies["init" if h["step"] == 0 else h["step"]]
        mine = tracin_scores(proxy, fid, dm.val_dataloader(), progress=False)
        expected = spearmanr(mine.scores, target.scores).statistic
        assert h["val/fidelity_spearman"] == pytest.approx(expected, abs=1e-6)
        assert h["val/fidelity_loss"] == pytest.approx(1 - expected, abs=1e-6)
    assert len({round(h["val/fidelity_spearman"], 6) for h in hist}) > 1  # training moved the ranking
    # keep_best on val/fidelity_loss keeps the best-ranking step (here a trained one, where val/loss would keep step 0)
    best = min(hist, key=lambda h: h["val/fidelity_loss"])["step"]
    assert best != 0 and min(hist, key=lambda h: h["val/loss"])["step"] == 0
    assert module.best_factors.best["step"] == best
    kept, restored = factors(snaps.proxies[best]), factors(module.proxy)
    assert all(torch.equal(restored[k], kept[k]) for k in kept)
    # step 0's held-out alignment metrics are the full validation set's, as a Lightning validation run reports them
    check = ProxyAlignModule(target=builtin_model(0), proxy=snaps.proxies["init"], log_layer_cosines=False)
    out = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                    enable_model_summary=False).validate(check, datamodule=dm, verbose=False)[0]
    assert hist[0]["val/loss"] == pytest.approx(out["val/loss"], rel=1e-5)
    assert hist[0]["val/l_kl"] == pytest.approx(out["val/l_kl"], rel=1e-5)
    # the manifest records the check (strict JSON)
    text = (tmp_path / "proxy" / "iprox_proxy.json").read_text()
    fidelity = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["alignment"]["fidelity"]
    assert fidelity["examples"] == 24 and fidelity["ids"] == ids and fidelity["validation_examples"] == len(dm.ids("validation"))
    assert fidelity["history"] == [{"step": h["step"], "spearman": pytest.approx(h["val/fidelity_spearman"])} for h in hist]
    # the logger got step 0 too
    rows = (tmp_path / "log" / "version_0" / "metrics.csv").read_text().splitlines()
    col = rows[0].split(",").index("val/fidelity_spearman")
    assert sum(1 for r in rows[1:] if r.split(",")[col] != "") == 3


def test_keep_best_on_fidelity_restores_the_unaligned_factors_bit_for_bit(tmp_path):
    """lr so large that every step wrecks the ranking: the best fidelity is the un-aligned proxy's (step 0),
    and those IPSVD factors are restored and saved exactly."""
    module, dm, snaps, tr = fit(tmp_path, lr=3.0, steps=2, fidelity_examples=16, monitor="val/fidelity_loss")
    hist = module.validation_history
    losses = [h["val/fidelity_loss"] for h in hist]
    assert [h["step"] for h in hist] == [0, 1, 2]
    best = min(range(len(hist)), key=lambda i: losses[i] if np.isfinite(losses[i]) else np.inf)
    assert hist[best]["step"] == 0 and all(not (l <= losses[0]) for l in losses[1:])
    init = factors(snaps.proxies["init"])
    last = factors(snaps.proxies[2])
    assert any(not torch.equal(init[k], last[k]) for k in init)
    restored = factors(module.proxy)
    assert all(torch.equal(restored[k], init[k]) for k in init)
    saved = load_proxy(str(tmp_path / "proxy"))[0].state_dict()
    assert all(torch.equal(saved[k], init[k]) for k in init)
    manifest = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert manifest["alignment"]["best"] == {"value": pytest.approx(losses[0]), "step": 0}
    assert manifest["alignment"]["fidelity_examples"] == 16 and manifest["alignment"]["monitor"] == "val/fidelity_loss"


def test_fidelity_scorer_is_passed_in(tmp_path):
    """The check scores with the scorer it is given (here the product's TracIn, wrapped to count its calls): the target
    once, the proxy at step 0 and after each validation run; the manifest names it."""
    calls = []

    def scorer(model, loader, val_batches, progress=False):
        calls.append(model)
        return tracin_scores(model, loader, val_batches, progress=progress)

    module, dm, snaps, tr = fit(tmp_path, lr=1e-2, steps=1, fidelity_examples=8, fidelity_scorer=scorer)
    assert calls[0] is module.teacher and len(calls) == 3 and all(c is module.proxy for c in calls[1:])
    fidelity = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())["alignment"]["fidelity"]
    assert "scorer" in fidelity["scores"] and [h["step"] for h in fidelity["history"]] == [0, 1]


def test_fidelity_against_the_targets_validation_gradients(tmp_path):
    """``proxy_validation="target"``: the check scores each proxy against the target's validation gradients (the
    product's TracIn with ``validation_model=<the target>``, as ``pipeline`` scores a proxy by default), per task
    too; the manifest says so. Brute force: the snapshots scored that way, Spearman with the target's scores."""
    module, dm, snaps, tr = fit(tmp_path, lr=1e-2, steps=2, fidelity_examples=24, fidelity_per_task=True,
                                monitor="val/fidelity_worst_loss", proxy_validation="target")
    fid = dm.fidelity_dataloader(24)
    target = tracin_scores(builtin_model(0), fid, dm.val_dataloader(), progress=False)
    hist = module.validation_history
    assert [h["step"] for h in hist] == [0, 1, 2]
    for h in hist:
        proxy = snaps.proxies["init" if h["step"] == 0 else h["step"]]
        mine = tracin_scores(proxy, fid, dm.val_dataloader(), progress=False, validation_model=module.teacher)
        own = tracin_scores(proxy, fid, dm.val_dataloader(), progress=False)
        assert h["val/fidelity_spearman"] == pytest.approx(spearmanr(mine.scores, target.scores).statistic, abs=1e-6)
        assert h["val/fidelity_spearman"] != pytest.approx(spearmanr(own.scores, target.scores).statistic, abs=1e-3)
        for k, t in enumerate(target.task_names):
            assert h[f"val/fidelity_{t}"] == pytest.approx(
                spearmanr(mine.task_scores[:, k], target.task_scores[:, k]).statistic, abs=1e-6)
    fidelity = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())["alignment"]["fidelity"]
    assert fidelity["proxy_validation"] == "target"
