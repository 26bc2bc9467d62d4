"""Slow: compress SmolLM2-135M at ρ=0.5 in both IPSVD modes on a few real pool examples."""
import copy
import json

import pytest
import torch

from iprox_lightning.batch import per_example_loss
from iprox_lightning.compress import compress_model, load_proxy, lowrank_layers, save_proxy


def _batches(tok, rows, max_length=128):
    out = []
    for i, r in enumerate(rows):
        user = r["instruction"] + (f"\n\n{r['context']}" if r.get("context") else "")
        prompt = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False)
        p = tok(prompt, add_special_tokens=False)["input_ids"][: max_length // 2]
        y = tok(r["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (p + y)[:max_length]
        labels = ([-100] * len(p) + y)[:max_length]
        out.append(dict(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        labels=torch.tensor([labels]), id=[r["id"]]))
    return out


@pytest.mark.slow
def test_compress_smollm2_both_modes(smollm_gguf, shared_dir, tmp_path):
    from iprox_lightning.models.loading import load_model

    target, tok = load_model(str(smollm_gguf))
    lines = (shared_dir / "data" / "pool" / "instructions.jsonl").read_text(encoding="utf-8").split("\n")[:6]
    batches = _batches(tok, [json.loads(x) for x in lines if x.strip()])
    for mode in ("exact", "core"):
        proxy = copy.deepcopy(target)
        rep = compress_model(proxy, batches, 0.5, mode=mode, num_probe_tokens=256, progress=False)
        assert len(lowrank_layers(proxy)) == 30 * 7 and rep.probe_tokens == 256
        assert 0.45 < rep.achieved_sparsity < 0.55 and rep.params_after < rep.params_before
        with torch.no_grad():
            b = batches[0]
            loss, _ = per_example_loss(proxy(input_ids=b["input_ids"]).logits, b["labels"])
        assert torch.isfinite(loss).all()
    save_proxy(proxy, tok, tmp_path / "p", rep)
    loaded, tok2 = load_proxy(tmp_path / "p")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=b["input_ids"]).logits, proxy(input_ids=b["input_ids"]).logits)
    assert tok2(lines[0][:50])["input_ids"] == tok(lines[0][:50])["input_ids"]
