"""RDS+ baseline: position-weighted mean pooling and per-task mean cosines against a per-example brute force,
through the command as a user runs it."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from iprox_lightning.baselines.rds import embed, rds_table
from iprox_lightning.data import SFTDataModule
from iprox_lightning.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _records(n, prefix, cats):
    return [{"id": f"{prefix}-{j}", "category": cats[j % len(cats)], "instruction": f"Reverse {'ab' * (j + 1)}",
             "context": "", "response": "ba" * (j % 3 + 1)} for j in range(n)]


def _brute_embedding(model, input_ids):
    """One unpadded example: final hidden states, weights t / sum(t) for t = 1..n, then unit norm."""
    with torch.no_grad():
        h = model.base_model(input_ids=input_ids[None]).last_hidden_state[0].double()
    w = torch.arange(1, len(input_ids) + 1, dtype=torch.float64)
    e = (w[:, None] * h).sum(0) / w.sum()
    return (e / e.norm()).numpy()


def test_rds_table_equals_brute_force(tmp_path):
    torch.manual_seed(0)
    model, _ = load_model("builtin", tokenizer=False)
    pool, val = _records(7, "p", ["x"]), _records(5, "v", ["ta", "tb"])
    vfile = tmp_path / "val.jsonl"
    vfile.write_text("".join(json.dumps(r) + "\n" for r in val))
    dm = SFTDataModule(pool=pool, validation=str(vfile), tokenizer="builtin", max_length=64, batch_size=3)
    dm.setup("predict")
    dm.setup("validate")
    table = rds_table(dm.predict_dataloader(), dm.validation_dataloader(), model)  # batches are padded
    emb = {}
    for loader in (dm.predict_dataloader(), dm.validation_dataloader()):
        for b in loader:
            for j, i in enumerate(b["id"]):
                emb[i] = _brute_embedding(model, b["input_ids"][j][b["attention_mask"][j].bool()])
    vt = {r["id"]: r["category"] for r in val}
    assert table.task_names == ["ta", "tb"]
    for j, i in enumerate(table.ids):
        cos = {v: float(emb[i] @ emb[v]) for v in vt}
        assert table.scores[j] == pytest.approx(np.mean(list(cos.values())), abs=1e-9)
        for k, t in enumerate(["ta", "tb"]):
            assert table.task_scores[j, k] == pytest.approx(np.mean([c for v, c in cos.items() if vt[v] == t]),
                                                            abs=1e-9)
    assert table.n_tokens.min() > 0 and not table.zero_grad.any()
    ids, _, E, _ = embed(model, dm.predict_dataloader())
    np.testing.assert_allclose(np.linalg.norm(E, axis=1), 1.0, atol=1e-12)


def test_rds_scores_command_writes_a_table_select_reads(tmp_path):
    from iprox_lightning.cli import main
    from iprox_lightning.io.scores import read_settings

    pool, val = tmp_path / "pool.jsonl", tmp_path / "val.jsonl"
    pool.write_text("".join(json.dumps(r) + "\n" for r in _records(12, "p", ["x", "y"])))
    val.write_text("".join(json.dumps(r) + "\n" for r in _records(4, "v", ["ta", "tb"])))
    out = tmp_path / "rds"
    main(["rds_scores", "--model", "builtin", "--output_dir", str(out), "--pool", str(pool), "--validation", str(val),
          "--max_length", "64"])
    s = read_settings(out)
    assert s["method"] == "rds+" and s["fingerprint"]["pool"]["n"] == 12 and s["fingerprint"]["validation"]["n"] == 4
    sel = tmp_path / "sel.jsonl"
    main(["select", "--scores_path", str(out), "--k", "3", "--rule", "mean", "--task", "tb", "--pool", str(pool),
          "--output", str(sel), "--quiet", "true"])
    import pyarrow.parquet as pq

    t = pq.read_table(out / "scores.parquet").to_pydict()
    best = sorted(zip(t["score/tb"], t["id"]), key=lambda r: (-r[0], r[1]))[:3]
    assert [json.loads(line)["id"] for line in open(sel)] == [i for _, i in best]
