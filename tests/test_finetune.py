"""FinetuneModule: paper defaults, every parameter trains, runs on the selected subset from SFTDataModule."""
from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from iprox_lightning.engine.batch import sft_loss
from iprox_lightning.modules import FinetuneModule, WarmupModule


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def test_defaults_are_the_papers():
    f, w = FinetuneModule(), WarmupModule()
    assert f.hparams.lr == 1e-5 and f.hparams.weight_decay == 0.01 and f.hparams.freeze_embeddings is False
    assert w.hparams.lr == 1e-5 and w.hparams.weight_decay == 0.01 and w.hparams.freeze_embeddings is True


def test_finetune_on_selected_file_trains_everything_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    from iprox_lightning.data.sft import SFTDataModule
    from iprox_lightning.data.synthetic import generate_builtin_dataset

    records = [r for r in generate_builtin_dataset(60) if r["category"] in ("addition", "reverse")][:16]
    sel = tmp_path / "selected.jsonl"
    sel.write_text("".join(json.dumps(r) + "\n" for r in records))
    dm = SFTDataModule(train_split="selected", selected=str(sel), batch_size=4, validation=None, builtin_size=200)
    m = FinetuneModule(model="builtin", lr=3e-3, warmup_ratio=0.0, lr_schedule="constant",
                       save_dir=str(tmp_path / "ft"))
    m.configure_model()
    before = {k: v.clone() for k, v in m.model.state_dict().items()}
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sorted(i for b in batches for i in b["id"]) == sorted(r["id"] for r in records)

    def loss():
        with torch.no_grad():
            return sum(sft_loss(m.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                b["labels"]).item() for b in batches) / len(batches)

    l0 = loss()
    tr = L.Trainer(accelerator="cpu", max_epochs=4, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    tr.fit(m, datamodule=dm)
    assert tr.global_step == 4 * len(batches)
    assert loss() < l0 - 0.2
    after = m.model.state_dict()
    assert all(not torch.equal(after[k], before[k]) for k in after if k.endswith("weight")), "every weight trains"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ft")
    for k, v in after.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert (tmp_path / "ft" / "tokenizer_config.json").is_file()
