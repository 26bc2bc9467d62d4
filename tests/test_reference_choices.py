"""The reference implementation's choices as options: probes of the loss over every non-pad token
(``probe_labels="all"``), ranks rounded UP to a multiple of ``rank_multiple`` (``rank_rounding="up"``, a layer whose
rounded factors are no cheaper than dense kept dense), and alignment without the KL anchor (``kl_weight: 0``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from iprox_lightning.alignment.losses import distillation_kl
from iprox_lightning.engine.batch import shifted_token_mask
from iprox_lightning.compression.apply import CompressionConfig, compress, compress_model, count_parameters, lowrank_layers
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.modules import ProxyAlignModule
from iprox_lightning.compression.probes import all_token_labels, collect_probes
from iprox_lightning.compression.ranks import (
    cheaper_than_dense,
    rank_for_sparsity,
    round_plan_up,
    uniform_plan_for_budget,
)
from iprox_lightning.engine.target_layers import find_target_linears

from test_alignment_module import loader, make_batch, trainer
from test_probes import brute_force_columns, make_batches

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------ (i) probe labels
def test_all_token_probes_equal_brute_force_moments_over_every_non_pad_token():
    model = tiny_causal_lm("llama", seed=1).double()
    modules = find_target_linears(model)
    batches = make_batches(n_examples=6, batch_size=3, seed=4)
    for b in batches:  # pad tokens with ids that would be scored if padding were not excluded
        b["input_ids"] = torch.where(b["attention_mask"].bool(), b["input_ids"], torch.full_like(b["input_ids"], 5))
    n_valid = sum(int(b["attention_mask"].sum()) for b in batches)
    probes = collect_probes(model, batches, modules, num_tokens=10_000, progress=False, labels="all")
    response = collect_probes(model, batches, modules, num_tokens=10_000, progress=False)
    assert probes.num_tokens == n_valid
    # brute force: labels = every non-pad token, δ of Σ_z L(z) (per-example mean over those tokens), all valid columns
    relabelled = []
    for b in batches:
        lab = torch.full_like(b["input_ids"], -100)
        mask = b["attention_mask"].bool()
        lab[mask] = b["input_ids"][mask]
        relabelled.append({**b, "labels": lab})
        assert torch.equal(all_token_labels(b)["labels"], lab)
    H_ref, D_ref = brute_force_columns(model, relabelled, modules)
    N = n_valid
    for n in modules:
        H, D = probes.H[n].double(), probes.Delta[n].double()
        # second moments C_h = H Hᵀ / N and C_δ = Δ Δᵀ / N (probes are stored as float32)
        torch.testing.assert_close(H @ H.T / N, H_ref[n] @ H_ref[n].T / N, rtol=1e-6, atol=1e-9)
        scale = (D_ref[n] @ D_ref[n].T / N).abs().max()
        torch.testing.assert_close(D @ D.T / N, D_ref[n] @ D_ref[n].T / N, rtol=1e-5, atol=1e-6 * scale)
        # the option changes δ (every token is now a loss term), not h
        assert torch.equal(probes.H[n], response.H[n])
        assert not torch.allclose(probes.Delta[n], response.Delta[n], rtol=1e-3, atol=0)


def test_compress_uses_all_token_probes_when_asked():
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    cfg = CompressionConfig(sparsity=0.5, num_probe_tokens=24, allocation="uniform", probe_labels="all")
    m1, m2, m3 = (tiny_causal_lm("llama", seed=0) for _ in range(3))
    compress(m1, batches, cfg, progress=False)
    pre = collect_probes(m2, batches, find_target_linears(m2), num_tokens=24, progress=False, labels="all")
    compress(m2, None, cfg, probes=pre, progress=False)
    compress(m3, batches, CompressionConfig(sparsity=0.5, num_probe_tokens=24, allocation="uniform"), progress=False)
    l1, l2, l3 = lowrank_layers(m1), lowrank_layers(m2), lowrank_layers(m3)
    assert all(torch.equal(l1[n].A, l2[n].A) and torch.equal(l1[n].B, l2[n].B) for n in l1)
    assert any(not torch.allclose(l1[n].A @ l1[n].B, l3[n].A @ l3[n].B) for n in l1)
    with pytest.raises(ValueError, match="probe_labels must be one of"):
        CompressionConfig(probe_labels="prompt")


# ------------------------------------------------------------------------------------------------ (ii) rounding up
def test_rank_for_sparsity_rounding_up_values():
    # SmolLM2 shapes, rank_multiple 128 (the reference's)
    assert rank_for_sparsity(576, 576, 0.5, 128, "up") == 256  # 144 -> 256 (nearest: 128)
    assert rank_for_sparsity(576, 576, 0.5, 128) == 128
    assert rank_for_sparsity(576, 1536, 0.5, 128, "up") == 256  # 209.5 -> 256
    assert rank_for_sparsity(576, 192, 0.5, 128, "up") == 128  # k/v: 72 -> 128, 128·768 < 576·192
    assert rank_for_sparsity(576, 192, 0.1, 128, "up") is None  # 129.6 -> 256 >= 192: dense
    assert rank_for_sparsity(576, 576, 0.1, 128, "up") is None  # 259.2 -> 384: 384·1152 > 576²: dense
    assert rank_for_sparsity(576, 576, 0.5, 144, "up") == 144  # an exact multiple stays
    # tiny shapes: k/v 16x32 at ρ 0.5 (5.33): multiple 12 -> 12 < min(16, 32) but 12·48 = 576 >= 512: dense
    assert rank_for_sparsity(32, 16, 0.5, 12, "up") is None
    assert rank_for_sparsity(32, 16, 0.5, 12) == 12  # (nearest keeps the old rule: dense only at min(in, out))
    assert rank_for_sparsity(32, 16, 0.5, 4, "up") == 8
    assert rank_for_sparsity(10, 10, 0.99, 1, "up") == 1
    with pytest.raises(ValueError, match="rank_rounding must be one of"):
        rank_for_sparsity(10, 10, 0.5, 1, "down")
    assert not cheaper_than_dense(12, 32, 16) and cheaper_than_dense(8, 32, 16)


def _accounting(model_before_params, rep, m):
    """Every rank a multiple of m or dense; dense exactly where the rounded rank is not cheaper; the counts add up."""
    dense_w = fact_w = 0
    for lr in rep.layers:
        if lr.rank is None:
            dense_w += lr.in_features * lr.out_features
            assert lr.params_after == lr.in_features * lr.out_features
        else:
            assert lr.rank % m == 0 and cheaper_than_dense(lr.rank, lr.in_features, lr.out_features)
            fact_w += lr.rank * (lr.in_features + lr.out_features)
            assert lr.params_after == lr.rank * (lr.in_features + lr.out_features)
    assert rep.target_params_after == dense_w + fact_w
    assert rep.params_after == model_before_params - rep.target_params_before + rep.target_params_after


def test_uniform_rounding_up_keeps_not_cheaper_layers_dense_and_counts_right():
    model = tiny_causal_lm("llama", seed=0)
    before = count_parameters(model)
    rep = compress_model(model, None, 0.5, method="svd", rank_multiple=12, rank_rounding="up", progress=False)
    ranks = rep.ranks
    # q/o 32x32: 8 -> 12; k/v 16x32: 5.33 -> 12, 12·48 >= 512 -> dense; gate/up/down: 10.67 -> 12
    assert ranks["model.layers.0.self_attn.q_proj"] == 12 and ranks["model.layers.1.mlp.down_proj"] == 12
    assert ranks["model.layers.0.self_attn.k_proj"] is None and ranks["model.layers.1.self_attn.v_proj"] is None
    assert isinstance(model.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    _accounting(before, rep, 12)
    assert rep.params_after == count_parameters(model)
    nearest = compress_model(tiny_causal_lm("llama", seed=0), None, 0.5, method="svd", rank_multiple=4, progress=False)
    up = compress_model(tiny_causal_lm("llama", seed=0), None, 0.5, method="svd", rank_multiple=4, rank_rounding="up",
                        progress=False)
    assert up.target_params_after >= nearest.target_params_after  # up never holds fewer weights
    assert all(u is None or (n is not None and u >= n) for u, n in zip(up.ranks.values(), nearest.ranks.values()))


def test_global_rounding_up_rounds_the_exact_budget_allocation_up():
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    m = 4
    exact = compress_model(tiny_causal_lm("llama", seed=0), batches, 0.5, num_probe_tokens=24, allocation="global",
                           progress=False)  # granularity 1: the budget spent exactly
    model = tiny_causal_lm("llama", seed=0)
    before = count_parameters(model)
    up = compress_model(model, batches, 0.5, num_probe_tokens=24, allocation="global", rank_multiple=m,
                        rank_rounding="up", progress=False)
    shapes = {lr.name: (lr.out_features, lr.in_features) for lr in up.layers}
    assert up.ranks == round_plan_up(exact.ranks, shapes, m)
    _accounting(before, up, m)
    budget = up.params_requested - (up.params_before - up.target_params_before)
    slack = sum((m - 1) * (i + o) for o, i in shapes.values())
    assert exact.target_params_after <= budget + 1e-6
    assert exact.target_params_after <= up.target_params_after <= budget + slack
    assert any(r is not None and r % m == 0 for r in up.ranks.values())


def test_uniform_plan_for_budget_rounding_up_is_the_closest_plan():
    """drop_blocks' uniform solve with rounding up: ONE ρ' whose plan comes closest to the budget (brute force over a
    fine grid of ρ')."""
    shapes = {"q": (32, 32), "k": (16, 32), "gate": (64, 32), "down": (32, 64), "q2": (32, 32)}
    m = 4

    def total(rho):
        return sum(o * i if (r := rank_for_sparsity(i, o, rho, m, "up")) is None else r * (i + o)
                   for o, i in shapes.values())

    grid = np.linspace(0.0, 0.999, 20001)
    for budget in (2500.0, 4000.0, 5200.0):
        plan, rho = uniform_plan_for_budget(shapes, budget, rank_multiple=m, rounding="up")
        best = min(abs(total(r) - budget) for r in grid)
        got = sum(o * i if plan[n] is None else plan[n] * (i + o) for n, (o, i) in shapes.items())
        assert abs(got - budget) == best and got == total(rho)
        assert all(r is None or r % m == 0 for r in plan.values())


def test_drop_blocks_with_rounding_up():
    batches = make_batches(n_examples=6, batch_size=3, seed=1)
    model = tiny_causal_lm("llama", seed=0, num_layers=4)
    before = count_parameters(model)
    rep = compress(model, batches, CompressionConfig(sparsity=0.5, num_probe_tokens=24, allocation="uniform",
                                                     drop_blocks=1, rank_multiple=4, rank_rounding="up"), progress=False)
    assert rep.block_drop.num_blocks_after == 3
    assert all(lr.rank is None or lr.rank % 4 == 0 for lr in rep.layers)
    assert rep.params_after == count_parameters(model) < before


# ------------------------------------------------------------------------------------------------ (iii) kl_weight 0
def test_kl_weight_zero_leaves_the_kl_out_of_the_gradient_but_reports_it():
    target = tiny_causal_lm("llama", seed=1)
    batch = make_batch(3)
    module = ProxyAlignModule(target=target, kl_weight=0.0)
    module.configure_model()
    compress_model(module.proxy, None, 0.5, method="svd", progress=False)
    module.configure_model()
    module.double()  # float64 (the loss keeps a few float32 casts: ~1e-6 relative)
    params = module.factor_parameters()

    def grads(kl_weight):
        object.__setattr__(module, "config", module.config.__class__(kl_weight=kl_weight))
        out = module.alignment_step(batch)
        return out, torch.autograd.grad(out.loss, params)

    out0, g0 = grads(0.0)
    out1, g1 = grads(100.0)  # λ large enough that λ ∇L_KL stands far above rounding
    # an independent ∇L_KL: teacher logits, a fresh proxy forward, the same KL
    with torch.no_grad():
        t_logits = module.teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = module.proxy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    scored = shifted_token_mask(batch["labels"])
    g_kl = torch.autograd.grad(distillation_kl(t_logits[scored], logits[scored], 2.0), params)
    assert out0.loss.item() == pytest.approx(out0.l_ga.item(), abs=1e-7) and out0.l_kl.item() > 0  # logged, not added
    assert out0.l_kl.item() == pytest.approx(out1.l_kl.item(), rel=1e-6)
    assert max(float(k.abs().max()) for k in g_kl) > 0
    scale = 100.0 * max(float(k.abs().max()) for k in g_kl)
    for a, b, k in zip(g0, g1, g_kl):  # L(λ) = L_GA + λ L_KL: the λ = 0 gradient holds no KL part
        torch.testing.assert_close(b - a, 100.0 * k, rtol=1e-3, atol=1e-4 * scale)  # measured: 1.3e-6 of scale


def test_kl_weight_zero_trains_under_lightning(tmp_path):
    target = tiny_causal_lm("llama", seed=1)
    module = ProxyAlignModule(target=target, kl_weight=0.0, lr=1e-2, log_layer_cosines=False)
    tr = trainer(tmp_path, max_steps=3, val_check_interval=3)
    tr.fit(module, train_dataloaders=loader(3), val_dataloaders=loader(2, offset=50))
    hist = module.validation_history
    start = hist[0]
    assert start["step"] == 0 and hist[-1]["step"] == 3
    assert all(h["val/loss"] == pytest.approx(h["val/l_ga"], rel=1e-6) for h in hist)  # the KL is not in the loss
    assert all(np.isfinite(h["val/l_kl"]) and h["val/l_kl"] > 0 for h in hist)  # but it is measured and logged
    assert any(k.startswith("align/l_kl") for k in tr.logged_metrics)  # the training steps log it too
    moved = [h["val/l_ga"] for h in hist]
    assert moved[-1] != moved[0]  # the factors trained
