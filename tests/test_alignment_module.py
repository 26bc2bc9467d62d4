"""ProxyAlignModule under a Lightning Trainer: trainable set, teacher isolation, logging, checkpoint, saving."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from iprox_lightning.compression.apply import compress_model, load_proxy
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.modules import ProxyAlignModule


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def make_batch(seed: int, B: int = 4, T: int = 12, V: int = 128) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, : T // 2] = -100
    return dict(input_ids=ids, attention_mask=torch.ones(B, T, dtype=torch.long), labels=labels,
                id=[f"{seed}-{i}" for i in range(B)])


def loader(n: int, offset: int = 0) -> DataLoader:
    return DataLoader([make_batch(offset + i) for i in range(n)], batch_size=None)


class SVDCompress(L.Callback):
    """Stand-in for IPSVDCallback with the same contract: configure_model() then compress pl_module.proxy."""

    def setup(self, trainer, pl_module, stage):
        pl_module.configure_model()
        if not any(isinstance(m, LowRankLinear) for m in pl_module.proxy.modules()):
            pl_module.ipsvd_report = compress_model(pl_module.proxy, None, 0.5, method="svd", progress=False)


def trainer(tmp_path, **kw) -> L.Trainer:
    kw.setdefault("max_steps", 4)
    return L.Trainer(accelerator="cpu", devices=1, callbacks=[SVDCompress()], default_root_dir=tmp_path,
                     logger=L.pytorch.loggers.CSVLogger(tmp_path), log_every_n_steps=1, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kw)


def test_fit_trains_only_factors_and_saves_loadable_proxy(tmp_path):
    target = tiny_causal_lm("llama", seed=3)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    module = ProxyAlignModule(target=target, lr=1e-3, save_dir=str(tmp_path / "proxy"))
    tr = trainer(tmp_path, max_steps=4, enable_checkpointing=True)
    # snapshot the proxy right after compression (before the optimiser moves anything)
    snap = {}

    class Snap(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            snap.update({k: v.detach().clone() for k, v in pl_module.proxy.state_dict().items()})

    tr.callbacks.append(Snap())
    tr.fit(module, loader(4), val_dataloaders=loader(1, offset=100))

    # teacher: the very target module, untouched, frozen, eval, no grad, not in the module tree
    assert module.teacher is target and not module.teacher.training
    assert all(not p.requires_grad and p.grad is None for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, target_before[k]), k
    assert not any(k.startswith(("teacher", "_teacher", "target")) for k in module.state_dict())
    assert all(k.startswith("proxy.") for k in module.state_dict())

    # optimiser: exactly the factors
    opt_params = {id(p) for g in tr.optimizers[0].param_groups for p in g["params"]}
    factors = {id(p) for m in module.proxy.modules() if isinstance(m, LowRankLinear) for p in (m.A, m.B)}
    assert opt_params == factors and len(factors) == 28

    # only factors changed; every other tensor bit-identical
    after = module.proxy.state_dict()
    changed = [k for k in after if not torch.equal(after[k], snap[k])]
    assert changed and all(k.endswith((".A", ".B")) for k in changed)
    assert len(changed) == 28  # every factor moved

    # logged metrics (L_GA, L_KL, per-layer cosines, validation cosines)
    metrics = tr.logged_metrics
    for key in ("align/l_ga", "align/l_kl", "align/cos_A_mean", "val/l_ga",
                "align/cos_A/model.layers.0.self_attn.q_proj", "val/cos_B/model.layers.1.mlp.down_proj"):
        assert key in metrics, key
    assert 0.0 <= float(metrics["align/l_ga"]) <= 4.0

    # checkpoint holds no teacher weight and restores the proxy
    ckpts = list(Path(tmp_path).rglob("*.ckpt"))
    assert ckpts
    ck = torch.load(ckpts[0], map_location="cpu", weights_only=True)
    assert all(k.startswith("proxy.") for k in ck["state_dict"])
    assert len(ck["optimizer_states"][0]["state"]) == 28

    # the saved proxy reloads bit-identically with its manifest
    loaded, _ = load_proxy(tmp_path / "proxy")
    for k, v in module.proxy.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    man = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert man["alignment"]["aligned"] is True and man["alignment"]["steps"] == 4
    assert man["method"] == "svd" and man["sparsity"] == 0.5


def test_loss_is_ga_plus_weighted_kl_and_kl_ablation(tmp_path):
    target = tiny_causal_lm("llama", seed=1)
    batch = make_batch(7)
    outs = {}
    for lam in (0.0, 0.5):
        m = ProxyAlignModule(target=target, kl_weight=lam, temperature=1.5)
        m.configure_model()
        compress_model(m.proxy, None, 0.5, method="svd", progress=False)
        m.configure_model()
        outs[lam] = m.alignment_step(batch)
    assert outs[0.0].loss.item() == pytest.approx(outs[0.0].l_ga.item(), abs=1e-7)
    o = outs[0.5]
    assert o.loss.item() == pytest.approx(o.l_ga.item() + 0.5 * o.l_kl.item(), rel=1e-6)
    assert o.l_kl.item() > 0 and outs[0.0].l_kl.item() == pytest.approx(o.l_kl.item(), rel=1e-6)


def test_align_false_only_saves(tmp_path):
    target = tiny_causal_lm("qwen2", seed=2)
    module = ProxyAlignModule(target=target, align=False, save_dir=str(tmp_path / "proxy"))
    snap = {}

    class Snap(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            snap.update({k: v.detach().clone() for k, v in pl_module.proxy.state_dict().items()})

    tr = trainer(tmp_path, max_epochs=1, max_steps=-1, enable_checkpointing=False)
    tr.callbacks.append(Snap())
    tr.fit(module, loader(3))
    assert tr.global_step == 0
    for k, v in module.proxy.state_dict().items():
        assert torch.equal(v, snap[k]), k
    loaded, _ = load_proxy(tmp_path / "proxy")
    assert json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())["alignment"]["aligned"] is False
    assert sum(isinstance(m, LowRankLinear) for m in loaded.modules()) == 14


def test_resume_from_saved_proxy_dir(tmp_path):
    target = tiny_causal_lm("llama", seed=4)
    proxy = copy.deepcopy(target)
    compress_model(proxy, None, 0.6, method="svd", progress=False)
    from iprox_lightning.compression.apply import save_proxy

    save_proxy(proxy, None, tmp_path / "p0", {"method": "svd", "sparsity": 0.6})
    m = ProxyAlignModule(target=target, proxy=str(tmp_path / "p0"), lr=1e-3, save_dir=str(tmp_path / "p1"))
    L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(m, loader(2))
    man = json.loads((tmp_path / "p1" / "iprox_proxy.json").read_text())
    assert man["sparsity"] == 0.6 and man["alignment"]["steps"] == 2
    p1, _ = load_proxy(tmp_path / "p1")
    changed = [k for k, v in p1.state_dict().items() if not torch.equal(v, proxy.state_dict()[k])]
    assert changed and all(k.endswith((".A", ".B")) for k in changed)


def test_teacher_follows_device_and_dtype_moves():
    m = ProxyAlignModule(target=tiny_causal_lm("llama"))
    m.configure_model()
    m.to(torch.float64)
    assert next(m.teacher.parameters()).dtype == torch.float64
    assert next(m.proxy.parameters()).dtype == torch.float64


def test_refuses_trainable_non_factors():
    m = ProxyAlignModule(target=tiny_causal_lm("llama"))
    m.configure_model()
    compress_model(m.proxy, None, 0.5, method="svd", progress=False)
    m.configure_model()
    m.proxy.model.norm.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        m.configure_optimizers()


def test_with_real_ipsvd_callback_and_datamodule(tmp_path):
    """The IPSVDCallback contract: configure_model() → compress pl_module.proxy from the teacher's probes → align."""
    from iprox_lightning.compression.callback import IPSVDCallback

    class DM(L.LightningDataModule):
        def train_dataloader(self):
            return loader(3)

        def probe_dataloader(self):
            return loader(2, offset=50)

    target = tiny_causal_lm("llama", seed=6)
    module = ProxyAlignModule(target=target, lr=1e-3, save_dir=str(tmp_path / "proxy"))
    cb = IPSVDCallback(sparsity=0.5, method="ipsvd", num_probe_tokens=32, allocation="uniform")
    tr = L.Trainer(accelerator="cpu", max_steps=3, callbacks=[cb], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    tr.fit(module, datamodule=DM())
    assert module.ipsvd_report is cb.report and cb.report.method == "ipsvd"
    assert sum(isinstance(m, LowRankLinear) for m in module.proxy.modules()) == 14
    assert all(not p.requires_grad for p in module.teacher.parameters())
    assert all(isinstance(m, torch.nn.Linear) for n, m in module.teacher.named_modules() if n.endswith("q_proj"))
    man = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert man["method"] == "ipsvd" and man["alignment"]["steps"] == 3 and man["num_probe_tokens"] == 32
    # both stages' configs, verbatim (frozen dataclasses; tuples become JSON lists)
    assert man["compression"] == {**dataclasses.asdict(cb.config), "targets": None, "keep_dense": None}
    assert man["compression"]["num_probe_tokens"] == 32 and man["compression"]["allocation"] == "uniform"
    assert {k: man["alignment"][k] for k in dataclasses.asdict(module.config)} == dataclasses.asdict(module.config)
    assert man["alignment"]["lr"] == 1e-3 and man["alignment"]["aligned"] is True


def test_layers_subset_trains_only_those_factors():
    m = ProxyAlignModule(target=tiny_causal_lm("llama"), layers=["model.layers.1.mlp.down_proj"], lr=1e-2)
    m.configure_model()
    compress_model(m.proxy, None, 0.5, method="svd", progress=False)
    m.configure_model()
    opt = m.configure_optimizers()
    before = {k: v.clone() for k, v in m.proxy.state_dict().items()}
    out = m.alignment_step(make_batch(0))
    assert list(out.cos_a) == ["model.layers.1.mlp.down_proj"]
    out.loss.backward()
    opt.step()
    changed = sorted(k for k, v in m.proxy.state_dict().items() if not torch.equal(v, before[k]))
    assert changed == ["model.layers.1.mlp.down_proj.A", "model.layers.1.mlp.down_proj.B"]


def test_keep_best_restores_the_factors_with_the_lowest_held_out_loss(tmp_path):
    """Validate after every step; the saved proxy holds the factors of the best held-out ``val/loss``
    (recomputed here on the restored proxy), not the last ones. The un-aligned factors are the step-0 candidate."""
    target = tiny_causal_lm("llama", seed=3)
    val = loader(1, offset=100)
    module = ProxyAlignModule(target=target, lr=0.3, save_dir=str(tmp_path / "proxy"), log_layer_cosines=False)
    seen, init = [], []

    class Record(L.Callback):  # the factors as they were at each validation
        def on_train_start(self, trainer, pl_module):  # runs before the module's own step-0 evaluation
            init.extend(p.detach().clone() for p in pl_module.factor_parameters())

        def on_validation_epoch_end(self, trainer, pl_module):
            seen.append((int(trainer.global_step), float(trainer.callback_metrics["val/loss"]),
                         [p.detach().clone() for p in pl_module.factor_parameters()]))

    tr = trainer(tmp_path, max_steps=5, val_check_interval=1, enable_checkpointing=False)
    tr.callbacks.append(Record())
    tr.fit(module, loader(5), val_dataloaders=val)
    assert len(seen) == 5 and len(module.validation_history) == 6
    step0 = module.validation_history[0]
    assert step0["step"] == 0
    with torch.enable_grad():  # step 0 = the un-aligned factors on the full held-out set
        m0 = ProxyAlignModule(target=target, proxy=copy.deepcopy(module.proxy), log_layer_cosines=False)
        m0.configure_model()
        with torch.no_grad():
            for p, q in zip(m0.factor_parameters(), init):
                p.copy_(q)
        assert float(m0.alignment_step(next(iter(val)), create_graph=False).loss) == pytest.approx(step0["val/loss"],
                                                                                                   rel=1e-5)
    seen.insert(0, (0, step0["val/loss"], init))
    best_step, best_val, best_factors = min(seen, key=lambda x: x[1])
    last_factors = seen[-1][2]
    assert best_val < seen[-1][1]  # lr 0.3 overshoots: the last factors are not the best
    for p, q in zip(module.factor_parameters(), best_factors):
        assert torch.equal(p.detach(), q)
    assert not all(torch.equal(p, q) for p, q in zip(best_factors, last_factors))
    with torch.enable_grad():
        recomputed = float(module.alignment_step(next(iter(val)), create_graph=False).loss)
    assert recomputed == pytest.approx(best_val, rel=1e-4)
    manifest = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert manifest["alignment"]["best"] == {"value": pytest.approx(best_val), "step": best_step}
    assert [h["step"] for h in manifest["alignment"]["validation_history"]] == [s for s, _, _ in seen]
    sd = load_proxy(str(tmp_path / "proxy"))[0].state_dict()
    for (name, m) in ((n, m) for n, m in module.proxy.named_modules() if isinstance(m, LowRankLinear)):
        assert torch.equal(sd[f"{name}.A"], m.A.detach())


def test_keep_best_off_saves_the_last_factors(tmp_path):
    target = tiny_causal_lm("llama", seed=3)
    module = ProxyAlignModule(target=target, lr=0.3, keep_best=False, log_layer_cosines=False)
    last = []

    class Record(L.Callback):
        def on_train_end(self, trainer, pl_module):
            last.extend(p.detach().clone() for p in pl_module.factor_parameters())

    tr = trainer(tmp_path, max_steps=3, val_check_interval=1, enable_checkpointing=False)
    tr.callbacks.append(Record())
    tr.fit(module, loader(3), val_dataloaders=loader(1, offset=100))
    assert all(torch.equal(p.detach(), q) for p, q in zip(module.factor_parameters(), last))
    assert module.best_factors.best is None and len(module.validation_history) == 3


def test_ipsvd_callback_health_check_matches_brute_force(tmp_path):
    """Right after compression the callback compares proxy and teacher on the alignment split; the numbers
    equal a direct computation (per-example loss means, token-mean KL, top-1 agreement) and reach the manifest."""
    import torch.nn.functional as F

    from iprox_lightning.compression.callback import IPSVDCallback

    align = [make_batch(200 + i) for i in range(3)]

    class DM(L.LightningDataModule):
        def train_dataloader(self):
            return loader(2)

        def probe_dataloader(self):
            return loader(2, offset=50)

        def dataloader(self, split):
            assert split == "align"
            return DataLoader(align, batch_size=None)

    target = tiny_causal_lm("llama", seed=6)
    module = ProxyAlignModule(target=target, align=False, save_dir=str(tmp_path / "proxy"))
    cb = IPSVDCallback(sparsity=0.7, method="svd", health_batches=2)
    snap = {}

    class Snap(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            snap["proxy"] = copy.deepcopy(pl_module.proxy)

    tr = L.Trainer(accelerator="cpu", max_epochs=1, callbacks=[cb, Snap()], logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    tr.fit(module, datamodule=DM())
    h = cb.report.health
    proxy = snap["proxy"].eval()
    losses = {"t": [], "p": []}
    kl, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for b in align[:2]:
            lt = target(input_ids=b["input_ids"]).logits
            lp = proxy(input_ids=b["input_ids"]).logits
            for key, lg in (("t", lt), ("p", lp)):
                for i in range(lg.shape[0]):  # per example: mean CE over its response tokens
                    lab = b["labels"][i, 1:]
                    m = lab != -100
                    losses[key].append(float(F.cross_entropy(lg[i, :-1][m], lab[m])))
            m = b["labels"][:, 1:] != -100
            pt, pp = F.log_softmax(lt[:, :-1][m], -1), F.log_softmax(lp[:, :-1][m], -1)
            kl += float((pt.exp() * (pt - pp)).sum())
            agree += int((pt.argmax(-1) == pp.argmax(-1)).sum())
            n += int(m.sum())
    assert h["target_loss"] == pytest.approx(np.mean(losses["t"]), rel=1e-5)
    assert h["proxy_loss"] == pytest.approx(np.mean(losses["p"]), rel=1e-5)
    assert h["kl"] == pytest.approx(kl / n, rel=1e-4)
    assert h["top1_agreement"] == pytest.approx(agree / n)
    assert h["examples"] == 8 and h["batches"] == 2
    man = json.loads((tmp_path / "proxy" / "iprox_proxy.json").read_text())
    assert man["health"]["kl"] == pytest.approx(h["kl"])
