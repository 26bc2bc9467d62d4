"""Clean console output: one tqdm progress-bar style without ``v_num``, no ``Total FLOPs: 0``, no Lightning
"skipping default" lines or pytree deprecation warnings, scoring metrics in TensorBoard."""
from __future__ import annotations

import logging

import numpy as np

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, RichProgressBar, TQDMProgressBar

from iprox_lightning.console import ProgressBar, ProgressLinesCallback, Summary, add_console_callbacks


def test_add_console_callbacks_defaults_and_user_choices(monkeypatch):
    import iprox_lightning.console as console

    # on a terminal: one bar (the user's if given), the summary; no progress lines (the bar speaks)
    monkeypatch.setattr(console, "interactive", lambda: True)
    cfg = add_console_callbacks({"callbacks": None})
    assert [type(c) for c in cfg["callbacks"]] == [ProgressBar, Summary]
    assert cfg["enable_model_summary"] is False  # Lightning adds no second summary and prints no "skipping" line
    user_bar = RichProgressBar()
    cfg = add_console_callbacks({"callbacks": [user_bar]})
    assert cfg["callbacks"][0] is user_bar and sum(isinstance(c, (TQDMProgressBar, RichProgressBar)) for c in cfg["callbacks"]) == 1
    cfg = add_console_callbacks({"callbacks": [ModelSummary(max_depth=2)]})
    assert [type(c) for c in cfg["callbacks"]] == [ModelSummary, ProgressBar]
    assert "enable_model_summary" not in cfg
    # off a terminal (a log file, a pipe, pytest's capture): no bar at all, whatever the config says (issue 65: tqdm's
    # carriage returns in logs), and the progress lines instead (tests/test_progress.py)
    monkeypatch.setattr(console, "interactive", lambda: False)
    cfg = add_console_callbacks({"callbacks": None})
    assert [type(c) for c in cfg["callbacks"]] == [Summary, ProgressLinesCallback]
    assert cfg["enable_progress_bar"] is False
    cfg = add_console_callbacks({"callbacks": [RichProgressBar()]})
    assert [type(c) for c in cfg["callbacks"]] == [Summary, ProgressLinesCallback]
    cfg = add_console_callbacks({"enable_progress_bar": False, "enable_model_summary": False})
    assert [type(c) for c in cfg["callbacks"]] == [ProgressLinesCallback]


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = __import__("torch").nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        import torch

        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_progress_bar_has_no_v_num_and_summary_no_flops(tmp_path, caplog):
    import torch
    from lightning.pytorch.loggers import CSVLogger

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 3)), batch_size=4)
    bar = ProgressBar()
    seen = {}

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            seen.update(bar.get_metrics(trainer, pl_module))

    caplog.set_level(logging.INFO)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
                        enable_checkpointing=False, **add_console_callbacks({"callbacks": [bar, Spy()]}))
    trainer.fit(_Tiny(), data)
    assert "train/loss" in seen and "v_num" not in seen
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Total params" in text and "Linear" in text  # the plain-text summary ran
    assert "FLOPs" not in text and "Flops" not in text
    assert "Skipping setting a default" not in text


# ------------------------------------------------------------------------------------------- scoring metrics
class _Recorder(L.pytorch.loggers.Logger):
    """A logger that keeps every ``log_metrics`` call (what TensorBoard would receive)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, dict]] = []

    name = "rec"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_scoring_logs_examples_tokens_per_second_and_flags():
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from test_artifacts import nan_model, poison
    from test_scoring_influence import batches, collate, make_examples

    from iprox_lightning.scoring.module import InfluenceScoringModule

    pool = poison(make_examples(10, seed=3, zero_every=4), rows={1, 5})  # NaN rows 1, 5; zero-gradient rows 3, 7
    val = make_examples(4, seed=4, tasks=["mmlu", "bbh"])
    rec = _Recorder()

    class PoolAndValidation(L.LightningDataModule):
        def predict_dataloader(self):
            return torch.utils.data.DataLoader(pool, batch_size=3, collate_fn=collate)

        def validation_dataloader(self):
            return batches(val, 3)

    module = InfluenceScoringModule(nan_model())
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=rec, log_every_n_steps=2, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    out = trainer.predict(module, datamodule=PoolAndValidation())
    rows = {k: np.concatenate([o[k] for o in out]) for k in ("n_tokens", "nonfinite", "zero_grad")}
    assert int(rows["nonfinite"].sum()) == 2 and int(rows["zero_grad"].sum()) == 2  # what the rows say ...

    steps = [s for s, m in rec.calls if "scoring/examples" in m]
    assert steps == [2, 4, 4]  # every log_every_n_steps=2 of the 4 batches, then the totals at the end
    first = next(m for s, m in rec.calls if s == 2 and "scoring/examples" in m)
    assert first["scoring/examples"] == 6.0  # two batches of 3
    final = [m for s, m in rec.calls if "scoring/examples" in m][-1]
    assert final["scoring/examples"] == 10.0  # ... and what the log says
    assert final["scoring/nonfinite"] == 2.0 and final["scoring/zero_grad"] == 2.0
    assert final["scoring/skipped_resumed"] == 0.0
    assert final["scoring/tokens_per_s"] > 0 and final["scoring/examples_per_s"] > 0
    # tokens/s and examples/s share the same elapsed time: their ratio is the mean tokens per example
    np.testing.assert_allclose(final["scoring/tokens_per_s"] / final["scoring/examples_per_s"],
                               rows["n_tokens"].sum() / 10, rtol=1e-6)
    start = rec.calls[0][1]
    assert rec.calls[0][0] == 0 and start["scoring/val_examples/mmlu"] + start["scoring/val_examples/bbh"] == 4
    assert start["scoring/prepare_seconds"] >= 0
