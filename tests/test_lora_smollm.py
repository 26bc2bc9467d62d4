"""``pipeline --lora`` on the real SmolLM2-135M (slow; small sizes): LoRA warm-up of the GGUF target -> the merged
target -> proxy -> scoring -> selection -> LoRA fine-tunes -> evaluation (issue 66).

Guards the real-model path (a ``.gguf`` base recorded by its absolute path, peft on the Llama layers, the adapters
loaded back onto the dequantised base), not quality: 40 pool examples of at most 64 tokens, as
``tests/test_pipeline_smollm.py``. Asserted: the stages that ran, the adapters of every epoch, each adapter's base,
the selections' sizes, and that the merged target the proxy is built from equals base + adapters.
"""
import json
from pathlib import Path

import pytest
import torch

from iprox_lightning.commands.pipeline import pipeline

pytestmark = pytest.mark.slow

DATA = {"max_length": 64, "batch_size": 4, "val_per_task": 2, "construction_fraction": 0.25, "probe_fraction": 0.5,
        "warmup_fraction": 0.1}
LORA = {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def test_lora_pipeline_on_smollm(smollm_gguf, shared_dir, tmp_path, monkeypatch):
    from iprox_lightning.models.loading import load_adapter, load_model

    monkeypatch.chdir(tmp_path)
    pool = tmp_path / "pool.jsonl"
    with open(shared_dir / "data" / "pool" / "instructions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rows = rows[:: len(rows) // 40][:40]  # 40 examples spread over the file
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wd = tmp_path / "run"
    s = pipeline(workdir=str(wd), target=str(smollm_gguf), pool=str(pool),
                 validation=f"eval:{shared_dir / 'data' / 'eval'}", data_args=DATA, select_rule="pooled",
                 align_epochs=1, eval_per_task=4, lora=LORA)
    assert {"warmup", "build_proxy", "score:target", "score:proxy", "select", "finetune:proxy", "finetune:target",
            "finetune:random", "evaluate"} <= set(s["seconds_per_stage"])
    warm = wd / "warmup" / "model"
    # configs/warmup.yaml: 1 epoch; configs/finetune.yaml: 4
    assert sorted(p.name for p in (warm / "adapters").iterdir()) == ["epoch_1", "final"]
    cfg = json.loads((warm / "adapters" / "final" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(Path(smollm_gguf).resolve()) and cfg["r"] == 8
    for who in ("proxy", "target", "random"):
        ft = wd / "finetune" / who / "model"
        assert sorted(p.name for p in (ft / "adapters").iterdir()) == [f"epoch_{i}" for i in (1, 2, 3, 4)] + ["final"]
        assert (wd / "selected" / f"{who}.jsonl").read_text().count("\n") == 2  # 5% of 40
    assert s["target_params"] == 134_515_008  # the merged target: SmolLM2's own parameters, no adapter left
    merged, tok = load_model(str(warm))
    adapted, _ = load_adapter(warm / "adapters" / "final", merged=False, tokenizer=False)
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    # x (W + s B A) vs x W + s (x A) B in float32 over 30 layers, logits of size ~20: relative 1e-5 of the largest
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)
    assert not torch.equal(merged.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           load_model(str(smollm_gguf), tokenizer=False)[0].state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])
