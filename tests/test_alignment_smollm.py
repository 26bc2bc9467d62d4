"""Stage 2 on the real SmolLM2-135M (slow): teacher projections vs autograd, one alignment step helps."""
from __future__ import annotations

import copy

import pytest
import torch

from iprox_lightning.alignment.losses import alignment_losses, proxy_factor_layers, teacher_pass
from iprox_lightning.engine.batch import sft_loss
from iprox_lightning.engine.target_layers import set_submodule
from iprox_lightning.compression.ipsvd import svd_factors
from iprox_lightning.engine.lowrank import LowRankLinear

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj")


@pytest.mark.slow
def test_smollm_projections_and_one_step(smollm_gguf):
    from iprox_lightning.models.loading import load_model

    teacher, tok = load_model(str(smollm_gguf))
    teacher.requires_grad_(False)
    proxy = copy.deepcopy(teacher)
    for name in LAYERS:  # compress two layers with plain SVD (rank = half of min(out, in))
        W = proxy.get_submodule(name).weight
        A, B = svd_factors(W, min(W.shape) // 2)
        set_submodule(proxy, name, LowRankLinear.from_factors(A, B))
    for m in proxy_factor_layers(proxy).values():
        m.A.requires_grad_(True)
        m.B.requires_grad_(True)
    enc = tok(["Question: What is the capital of France? Answer: Paris is the capital of France.",
               "Instruction: add 2 and 3. Response: 2 + 3 = 5, so the answer is 5."], return_tensors="pt",
              padding=True)
    labels = enc["input_ids"].clone()
    labels[:, :6] = -100
    labels[enc["attention_mask"] == 0] = -100
    batch = dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], labels=labels, id=["a", "b"])

    factors = {n: (m.A, m.B) for n, m in proxy_factor_layers(proxy).items()}
    tp = teacher_pass(teacher, batch, factors)
    t2 = copy.deepcopy(teacher)
    ws = [t2.get_submodule(n).weight for n in LAYERS]
    for w in ws:
        w.requires_grad_(True)
    logits = t2(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    G = torch.autograd.grad(sft_loss(logits, labels), ws)
    del t2
    for n, g in zip(LAYERS, G):
        A, B = factors[n]
        ref_a, ref_b = g @ B.detach().t(), A.detach().t() @ g
        torch.testing.assert_close(tp.projections[n][0], ref_a, rtol=1e-4, atol=1e-5 * ref_a.abs().max().item())
        torch.testing.assert_close(tp.projections[n][1], ref_b, rtol=1e-4, atol=1e-5 * ref_b.abs().max().item())

    before = {k: v.clone() for k, v in proxy.state_dict().items()}
    params = [p for f in factors.values() for p in f]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    out0 = alignment_losses(teacher, proxy, batch, kl_weight=0.1)
    opt.zero_grad()
    out0.loss.backward()
    opt.step()
    out1 = alignment_losses(teacher, proxy, batch, kl_weight=0.1, create_graph=False)
    assert torch.isfinite(out0.loss) and out1.loss.item() < out0.loss.item()
    changed = [k for k, v in proxy.state_dict().items() if not torch.equal(v, before[k])]
    assert sorted(changed) == sorted(f"{n}.{x}" for n in LAYERS for x in "AB")
    assert all(p.grad is None for p in teacher.parameters())
