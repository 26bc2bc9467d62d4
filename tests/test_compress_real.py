"""Slow: compress SmolLM2-135M at ρ=0.5 in both IPSVD modes on a few real pool examples.

What is asserted follows from the settings, not from this machine's floating-point kernels: the allocation each
mode resolves to, which layers are factorised (exactly the layers the report gives a rank), the ranks of the
uniform plan (:func:`iprox_lightning.compression.ranks.rank_for_sparsity`), the global plan spending no more than its budget,
the parameter counts adding up, and a save/load round trip that reproduces the logits bit for bit.
"""
import copy
import json

import pytest
import torch

from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.compression.apply import compress_model, load_proxy, lowrank_layers, resolve_allocation, save_proxy
from iprox_lightning.compression.ranks import rank_for_sparsity
from iprox_lightning.engine.target_layers import linear_shape

SPARSITY = 0.5
N_LAYERS = 30 * 7  # SmolLM2-135M: 30 blocks × (q, k, v, o, gate, up, down)


def _batches(tok, rows, max_length=128):
    out = []
    for r in rows:
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
    shapes = {n: linear_shape(m) for n, m in target.named_modules()
              if isinstance(m, torch.nn.Linear) and n.split(".")[-1].endswith("_proj")}
    assert len(shapes) == N_LAYERS
    lines = (shared_dir / "data" / "pool" / "instructions.jsonl").read_text(encoding="utf-8").split("\n")[:6]
    batches = _batches(tok, [json.loads(x) for x in lines if x.strip()])
    total = sum(o * i for o, i in shapes.values())
    budget = (1 - SPARSITY) * total
    for mode, allocation in (("exact", "global"), ("core", "uniform")):
        proxy = copy.deepcopy(target)
        rep = compress_model(proxy, batches, SPARSITY, mode=mode, num_probe_tokens=256, progress=False)
        # the defaults: exact IPSVD allocates one global budget, the core mode every layer at ρ
        assert rep.allocation == resolve_allocation(None, "ipsvd", mode) == allocation
        assert rep.probe_tokens == 256 and rep.target_params_before == total
        factorised = {name for name, r in rep.ranks.items() if r is not None}
        assert set(rep.ranks) == set(shapes) and set(lowrank_layers(proxy)) == factorised
        for name, layer in lowrank_layers(proxy).items():
            assert layer.rank == rep.ranks[name]
        # the counts add up: a factorised layer holds r·(in + out), a dense one in·out
        held = sum(o * i if rep.ranks[n] is None else rep.ranks[n] * (o + i) for n, (o, i) in shapes.items())
        assert rep.target_params_after == held and rep.params_before - rep.params_after == total - held
        if allocation == "uniform":
            assert rep.ranks == {n: rank_for_sparsity(i, o, SPARSITY) for n, (o, i) in shapes.items()}
            assert len(factorised) == N_LAYERS
        else:
            # one budget over all layers: never more than (1 − ρ) of the weights; some layers end up dense
            # (their factors would hold as much as the layer), most are factorised
            assert held <= budget and 0 < N_LAYERS - len(factorised) < N_LAYERS // 2
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
