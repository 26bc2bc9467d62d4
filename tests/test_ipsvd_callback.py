"""IPSVDCallback inside Trainer.fit: compresses before optimisers exist, so the optimiser trains the factors."""
import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from iprox_lightning.engine.batch import sft_loss
from iprox_lightning.callbacks import IPSVDCallback
from iprox_lightning.compression.apply import compress_model, lowrank_layers
from iprox_lightning.engine.target_layers import find_target_linears
from iprox_lightning.models.tiny import tiny_causal_lm

from test_probes import make_batches


class ProbeData(pl.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.batches = make_batches(n_examples=6, batch_size=3, seed=0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.batches, batch_size=None)

    def probe_dataloader(self):
        return self.batches


class TinyProxyModule(pl.LightningModule):
    """Module contract: configure_model is idempotent and builds self.proxy; only factors are trained."""

    def __init__(self, arch: str = "llama"):
        super().__init__()
        self.arch = arch
        self.proxy = None
        self.configure_calls = 0
        self.optimizer_param_ids: set[int] = set()

    def configure_model(self):
        self.configure_calls += 1
        if self.proxy is None:
            self.proxy = tiny_causal_lm(self.arch, seed=0)

    def training_step(self, batch, batch_idx):
        out = self.proxy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return sft_loss(out.logits, batch["labels"])

    def configure_optimizers(self):
        params = [p for m in lowrank_layers(self.proxy).values() for p in (m.A, m.B)]
        opt = torch.optim.SGD(params, lr=0.5)
        self.optimizer_param_ids = {id(p) for g in opt.param_groups for p in g["params"]}
        return opt


def _trainer(tmp_path, cb, **kw):
    return pl.Trainer(max_steps=2, accelerator="cpu", devices=1, callbacks=[cb], logger=CSVLogger(tmp_path),
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


def test_callback_compresses_before_optimizers(tmp_path):
    module, data = TinyProxyModule(), ProbeData()
    cb = IPSVDCallback(sparsity=0.5, num_probe_tokens=24, allocation="uniform", save_dir=str(tmp_path / "proxy"))
    trainer = _trainer(tmp_path, cb)
    snapshot = {}

    class Snap(pl.Callback):  # factors right after compression, before any step
        def on_fit_start(self, trainer, pl_module):
            snapshot.update({n: m.A.detach().clone() for n, m in lowrank_layers(pl_module.proxy).items()})

    trainer.callbacks.append(Snap())
    trainer.fit(module, datamodule=data)
    low = lowrank_layers(module.proxy)
    assert len(low) == len(find_target_linears(tiny_causal_lm("llama")))
    factor_ids = {id(p) for m in low.values() for p in (m.A, m.B)}
    assert module.optimizer_param_ids == factor_ids  # the optimiser holds exactly the live factors
    assert all(not torch.equal(m.A, snapshot[n]) for n, m in low.items())  # and it trained them
    assert module.configure_calls >= 2  # called by the callback, then by Lightning (idempotent)
    assert cb.report is not None and module.ipsvd_report is cb.report and cb.report.probe_tokens == 24
    assert cb.report.params_after < cb.report.params_before
    # logged to the logger
    rows = list(csv.DictReader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")))
    keys = set().union(*[{k for k, v in r.items() if v} for r in rows])
    assert "ipsvd/params_after" in keys and "ipsvd/rank/model.layers.0.self_attn.q_proj" in keys
    assert any(k.startswith("ipsvd/relative_objective/") for k in keys)
    vals = [float(r["ipsvd/rank/model.layers.0.self_attn.q_proj"]) for r in rows if r.get("ipsvd/rank/model.layers.0.self_attn.q_proj")]
    assert vals == [8.0]
    assert (tmp_path / "proxy" / "iprox_proxy.json").is_file()


def test_callback_skips_compressed_and_needs_probes(tmp_path):
    module = TinyProxyModule()
    module.configure_model()
    compress_model(module.proxy, None, 0.5, method="svd", progress=False)
    A0 = {n: m.A.detach().clone() for n, m in lowrank_layers(module.proxy).items()}
    cb = IPSVDCallback(sparsity=0.7)
    trainer = _trainer(tmp_path, cb)
    cb.setup(trainer, module, "fit")  # resumed / already compressed: no-op
    assert cb.report is None
    assert all(torch.equal(m.A, A0[n]) for n, m in lowrank_layers(module.proxy).items())  # rho=0.5 factors kept

    class NoProbes(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(make_batches(3, 3), batch_size=None)

    with pytest.raises(AttributeError, match="probe_dataloader"):
        _trainer(tmp_path, IPSVDCallback()).fit(TinyProxyModule(), datamodule=NoProbes())


def test_health_line_warns_only_without_alignment_and_names_unused_settings(monkeypatch, caplog):
    """Stage 1 leaves ~2 nat/token at ρ = 0.5 with the shipped settings: with Stage 2 next that is information, not a
    warning on the happy path; without alignment it warns, and its advice names only settings not already in use."""
    import logging
    from types import SimpleNamespace

    import iprox_lightning.compression.health as health
    from iprox_lightning.compression.callback import HEALTH_KL, health_message

    h = {"examples": 16, "proxy_loss": 4.5, "target_loss": 1.85, "kl": 2.15, "top1_agreement": 0.41}
    warn, text = health_message(h, allocation="global", mode="exact", aligning=True)
    assert not warn and text.endswith("(Stage 2 aligns the proxy next)") and "KL 2.150 nat/token" in text
    warn, text = health_message(h, allocation="global", mode="exact", aligning=False)
    assert warn and "allocation=" not in text and "mode=" not in text and "align: true" in text
    warn, text = health_message(h, allocation="uniform", mode="core", aligning=False)
    assert warn and "allocation='global'" in text and "mode='exact'" in text
    assert health_message({**h, "kl": HEALTH_KL}, allocation="uniform", mode="core", aligning=False)[0] is False

    # through the callback: the module (a TeacherHolder) says whether Stage 2 follows
    monkeypatch.setattr(health, "proxy_health", lambda teacher, model, batches: dict(h))
    cb = IPSVDCallback(sparsity=0.5, allocation="global")
    report = SimpleNamespace(allocation="global", mode="exact", health=None)
    trainer = SimpleNamespace(datamodule=SimpleNamespace(dataloader=lambda split: iter([{"x": 1}])))
    for align, warned in ((True, False), (False, True)):
        caplog.clear()
        module = SimpleNamespace(teacher=object(), aligns=align)  # a TeacherHolder
        with caplog.at_level(logging.INFO, logger="iprox_lightning.compression.callback"):
            cb._health(trainer, module, None, report)
        assert any(r.levelno == logging.WARNING for r in caplog.records) is warned
        assert report.health["kl"] == 2.15


@pytest.mark.parametrize("arch, settings", [
    ("llama", dict(drop_blocks=1, allocation="global", keep_dense=[r"layers\.0\.mlp"])),
    ("gpt2", dict(allocation="uniform")),  # Conv1D layers with biases
])
def test_report_structure_holds_the_compressed_state_and_keeps_the_generator_in_step(arch, settings):
    """A model given a report's structure without computing it: ``apply_report_structure`` gives the uncompressed model the
    compressed one's structure (blocks cut, the same ranks, biases), so the compressed state dict loads strictly and
    the two models compute the same logits; its parameter draws leave the global generator where ``compress`` does."""
    from iprox_lightning.compression.apply import CompressionConfig, apply_report_structure, compress

    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    compressed, shell = tiny_causal_lm(arch, seed=0, num_layers=4), tiny_causal_lm(arch, seed=0, num_layers=4)
    torch.manual_seed(7)
    report = compress(compressed, batches, CompressionConfig(sparsity=0.5, num_probe_tokens=24, **settings),
                      progress=False)
    after_compress = torch.random.get_rng_state()
    torch.manual_seed(7)
    apply_report_structure(shell, report)
    assert torch.equal(torch.random.get_rng_state(), after_compress)
    ranks = {n: m.rank for n, m in lowrank_layers(compressed).items()}
    assert ranks and {n: m.rank for n, m in lowrank_layers(shell).items()} == ranks
    assert shell.config.num_hidden_layers == 4 - settings.get("drop_blocks", 0)
    assert len(ranks) == sum(lr.rank is not None for lr in report.layers)
    assert not any(n.startswith("model.layers.0.mlp") for n in ranks) or not settings.get("keep_dense")
    before = {k: v.clone() for k, v in shell.state_dict().items()}
    shell.load_state_dict(compressed.state_dict(), strict=True)
    for k, v in compressed.state_dict().items():  # every tensor but the factors was already the compressed one's
        if not k.endswith((".A", ".B")):
            assert torch.equal(before[k], v), k
    ids = batches[0]["input_ids"]
    torch.testing.assert_close(shell(input_ids=ids).logits, compressed(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="already compressed"):
        apply_report_structure(shell, report)
