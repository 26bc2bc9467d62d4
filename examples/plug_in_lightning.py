"""Add IProX to an existing Lightning project — no copy of the iprox CLI.

The "user code" below is an ordinary causal-LM LightningModule and LightningDataModule. IProX needs
only that the batches carry an ``id`` list next to ``input_ids`` / ``attention_mask`` / ``labels``
(labels -100 outside the response) and that the data module offers a ``probe_dataloader()``
(a few batches for IPSVD) and validation batches (``val_dataloader()``) to score against.

Run:  python examples/plug_in_lightning.py /tmp/plug_in
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from iprox_lightning import IPSVDCallback, ProxyAlignModule, tiny_causal_lm
from iprox_lightning.scoring import InfluenceScoringModule, InfluenceWriter
from iprox_lightning.selection.select import select


# ----------------------------------------------------------------------------- the user's code
class MyCausalLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 3e-3):
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.log("train/loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr)


def make_examples(n: int, seed: int, vocab: int = 128) -> list[dict]:
    """Two kinds of sequences: 'count' (ascending runs) and 'noise' (random tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        kind = "count" if i % 2 == 0 else "noise"
        length = int(torch.randint(8, 16, (1,), generator=g))
        if kind == "count":
            start = int(torch.randint(3, vocab - 20, (1,), generator=g))
            ids = list(range(start, start + length))
        else:
            ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"id": f"{kind}-{seed}-{i}", "task": kind, "ids": ids, "prompt": 4})
    return out


def collate(items: list[dict]) -> dict:
    T = max(len(x["ids"]) for x in items)
    input_ids = torch.zeros(len(items), T, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for r, x in enumerate(items):
        n = len(x["ids"])
        input_ids[r, :n] = torch.tensor(x["ids"])
        mask[r, :n] = 1
        labels[r, x["prompt"]:n] = input_ids[r, x["prompt"]:n]
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
            "id": [x["id"] for x in items], "task": [x["task"] for x in items]}


class MyData(L.LightningDataModule):
    def __init__(self, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size
        self.pool = make_examples(96, seed=0)
        self.val = [x for x in make_examples(16, seed=1) if x["task"] == "count"]  # we care about 'count'

    def train_dataloader(self):
        return DataLoader(self.pool, batch_size=self.batch_size, shuffle=True, collate_fn=collate)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=self.batch_size, collate_fn=collate)

    def predict_dataloader(self):
        return DataLoader(self.pool, batch_size=self.batch_size, collate_fn=collate)

    # ---- the two hooks IProX uses
    def probe_dataloader(self):
        return DataLoader(self.pool[:16], batch_size=self.batch_size, collate_fn=collate)

    def align_dataloader(self):
        return DataLoader(self.pool[16:48], batch_size=4, shuffle=True, collate_fn=collate)


# ----------------------------------------------------------------------------- IProX, added
def main(workdir: str) -> dict:
    wd = Path(workdir)
    L.seed_everything(0)
    data = MyData()
    trainer_kw = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)

    # the user's own training (here: a short warm-up of a tiny Llama)
    target = tiny_causal_lm("llama", seed=0)
    L.Trainer(max_epochs=3, **trainer_kw).fit(MyCausalLM(target), datamodule=data)

    # Stage 1 + 2: IPSVDCallback compresses a copy of the target in setup("fit") with the data
    # module's probe batches; ProxyAlignModule aligns the factors on the training batches.
    class AlignData(MyData):
        def train_dataloader(self):  # align on a separate small subset
            return self.align_dataloader()

    align = ProxyAlignModule(target=target, lr=5e-5, kl_weight=0.1, save_dir=str(wd / "proxy"))
    L.Trainer(max_epochs=1, callbacks=[IPSVDCallback(sparsity=0.5)], **trainer_kw).fit(align, datamodule=AlignData())

    # Stage 3: score the pool with the proxy, writing resumable shards merged into one Parquet table
    scorer = InfluenceScoringModule(model=align.proxy, method="tracin")
    writer = InfluenceWriter(output_dir=str(wd / "scores"), write_every_n_batches=4)
    L.Trainer(callbacks=[writer], inference_mode=False, **trainer_kw).predict(scorer, datamodule=data, return_predictions=False)

    # Stage 4: top 25%
    selected = select(str(wd / "scores" / "scores.parquet"), k=0.25, output=str(wd / "selected.jsonl"))
    return {"proxy": align.proxy, "scores": wd / "scores" / "scores.parquet", "selected": Path(selected)}


if __name__ == "__main__":
    res = main(sys.argv[1] if len(sys.argv) > 1 else "outputs/plug_in")
    print("selected subset written to", res["selected"])
