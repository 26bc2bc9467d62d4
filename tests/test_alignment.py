"""Stage 2 math (iprox_lightning.alignment.losses) against brute-force autograd references on tiny models."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from iprox_lightning.alignment.losses import (
    alignment_losses,
    cosine_distance,
    distillation_kl,
    factor_projections,
    gradient_alignment_loss,
    proxy_factor_layers,
    teacher_pass,
)
from iprox_lightning.engine.batch import sft_loss, shifted_token_mask
from iprox_lightning.compression.apply import compress_model
from iprox_lightning.engine.target_layers import linear_weight
from iprox_lightning.models.tiny import tiny_causal_lm


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def make_batch(seed: int, B: int = 3, T: int = 12, V: int = 128, pad: bool = True) -> dict:
    """Random token batch: prompt = first half, response = second half; row 0 right-padded by 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    labels = ids.clone()
    labels[:, : T // 2] = -100
    if pad:
        ids[0, -3:] = 0
        mask[0, -3:] = 0
        labels[0, -3:] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels, id=[f"{seed}-{i}" for i in range(B)])


def make_pair(arch: str = "llama", sparsity: float = 0.5, seed: int = 0):
    teacher = tiny_causal_lm(arch, seed=seed)
    teacher.requires_grad_(False)
    proxy = copy.deepcopy(teacher)
    compress_model(proxy, None, sparsity, method="svd", progress=False)
    proxy.requires_grad_(False)
    for m in proxy_factor_layers(proxy).values():
        m.A.requires_grad_(True)
        m.B.requires_grad_(True)
    return teacher, proxy


def teacher_weight_grads(teacher, batch, names):
    """Brute force: ∇_W L of the teacher's layers by autograd on a copy whose weights require grad."""
    t = copy.deepcopy(teacher)
    mods = {n: t.get_submodule(n) for n in names}
    ws = [m.weight for m in mods.values()]
    for w in ws:
        w.requires_grad_(True)
    logits = t(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    grads = torch.autograd.grad(sft_loss(logits, batch["labels"]), ws)
    out = {}
    for (n, m), g in zip(mods.items(), grads):
        out[n] = g if linear_weight(m) is m.weight else g.t()  # Conv1D stores [in, out]
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2", "phi3"])
def test_teacher_projections_equal_autograd(arch):
    teacher, proxy = make_pair(arch)
    batch = make_batch(1)
    layers = proxy_factor_layers(proxy)
    factors = {n: (m.A, m.B) for n, m in layers.items()}
    G = teacher_weight_grads(teacher, batch, list(layers))
    tp = teacher_pass(teacher, batch, factors)
    tk = teacher_pass(teacher, batch, factors, keep_tokens=True).projections_for(factors)
    assert set(tp.projections) == set(layers) and len(layers) >= 6
    for n, (A, B) in factors.items():
        ref_a, ref_b = G[n] @ B.detach().t(), A.detach().t() @ G[n]
        scale_a, scale_b = ref_a.abs().max().item(), ref_b.abs().max().item()
        assert scale_a > 0 and scale_b > 0
        for p_a, p_b in (tp.projections[n], tk[n]):
            torch.testing.assert_close(p_a, ref_a, rtol=1e-5, atol=1e-5 * scale_a)
            torch.testing.assert_close(p_b, ref_b, rtol=1e-5, atol=1e-5 * scale_b)
    # the teacher pass never touches teacher parameters
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


def test_factor_projections_explicit_matrices():
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 4, generator=g)
    A, B = torch.randn(4, 3, generator=g), torch.randn(3, 7, generator=g)
    G = sum(torch.outer(d[i, t], h[i, t]) for i in range(2) for t in range(5))  # Σ_t δ_t h_tᵀ
    p_a, p_b = factor_projections(h, d, A, B)
    torch.testing.assert_close(p_a, G @ B.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p_b, A.t() @ G, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        factor_projections(h, d, B.t(), A.t())


def test_distillation_kl_equals_hand_computation():
    g = torch.Generator().manual_seed(0)
    t_logits = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    s_logits = torch.randn(2, 6, 9, generator=g, dtype=torch.float64)
    labels = torch.full((2, 6), -100)
    labels[0, 2:5] = 1
    labels[1, 4:] = 3
    tau = 2.0
    kls = []
    for b in range(2):
        for t in range(5):
            if labels[b, t + 1] == -100:
                continue
            p = torch.exp(t_logits[b, t] / tau) / torch.exp(t_logits[b, t] / tau).sum()
            q = torch.exp(s_logits[b, t] / tau) / torch.exp(s_logits[b, t] / tau).sum()
            kls.append((p * (p / q).log()).sum())
    assert len(kls) == 5
    ref = tau**2 * torch.stack(kls).mean()
    m = shifted_token_mask(labels)
    got = distillation_kl(t_logits[m], s_logits[m], tau)
    assert abs(got.item() - ref.item()) < 1e-6
    # no response token → 0, and identical logits → 0
    none = shifted_token_mask(torch.full((2, 6), -100))
    assert distillation_kl(t_logits[none], s_logits[none], tau).item() == 0.0
    assert abs(distillation_kl(t_logits[m], t_logits[m], tau).item()) < 1e-7
    with pytest.raises(ValueError, match=r"\[N, V\] logits of one shape"):
        distillation_kl(t_logits, s_logits, tau)


def test_cosine_distance_and_ga_loss_definition():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    assert cosine_distance(x, x).item() == pytest.approx(0.0, abs=1e-6)
    assert cosine_distance(x, -x).item() == pytest.approx(2.0, abs=1e-6)
    assert cosine_distance(x, torch.zeros_like(x)).item() == pytest.approx(1.0)
    y = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    grads = {"l0": (x, y), "l1": (y, y)}
    proj = {"l0": (y, y), "l1": (x, -y)}
    c = 1 / (2**0.5 * 2**0.5)  # cos(x, y) = <x,y>/(|x||y|) = 1/(√2·√2)
    loss, cos_a, cos_b = gradient_alignment_loss(grads, proj)
    expected = ((1 - c) + 0 + (1 - c) + 2) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert cos_a["l0"].item() == pytest.approx(c) and cos_b["l1"].item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="differ on layers"):
        gradient_alignment_loss(grads, {"l0": proj["l0"]})


@pytest.mark.parametrize("through", [True, False])
def test_alignment_loss_and_its_gradient_match_brute_force(through):
    """L = L_GA + λ L_KL and ∂L/∂(A, B) against a reference that forms ∇_W L explicitly."""
    teacher, proxy = make_pair("llama")
    batch = make_batch(2)
    lam, tau = 0.3, 2.0
    out = alignment_losses(teacher, proxy, batch, kl_weight=lam, temperature=tau, grad_through_projection=through)
    layers = proxy_factor_layers(proxy)
    params = [p for m in layers.values() for p in (m.A, m.B)]
    got = torch.autograd.grad(out.loss, params)

    G = teacher_weight_grads(teacher, batch, list(layers))
    t_logits = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = proxy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    g = torch.autograd.grad(sft_loss(logits, batch["labels"]), params, create_graph=True)
    terms = []
    for i, (n, m) in enumerate(layers.items()):
        A, B = (m.A, m.B) if through else (m.A.detach(), m.B.detach())
        terms.append(1 - F.cosine_similarity(g[2 * i].flatten(), (G[n] @ B.t()).flatten(), dim=0, eps=1e-12))
        terms.append(1 - F.cosine_similarity(g[2 * i + 1].flatten(), (A.t() @ G[n]).flatten(), dim=0, eps=1e-12))
    l_ga = torch.stack(terms).sum() / len(layers)
    mask = batch["labels"][:, 1:] != -100
    p_t = F.log_softmax(t_logits[:, :-1][mask] / tau, -1)
    p_s = F.log_softmax(logits[:, :-1][mask] / tau, -1)
    l_kl = tau**2 * (p_t.exp() * (p_t - p_s)).sum(-1).mean()
    ref = l_ga + lam * l_kl
    assert out.l_ga.item() == pytest.approx(l_ga.item(), rel=1e-5, abs=1e-6)
    assert out.l_kl.item() == pytest.approx(l_kl.item(), rel=1e-5, abs=1e-7)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    want = torch.autograd.grad(ref, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item() + 1e-9)
    assert all(p.grad is None for p in teacher.parameters())


def test_projection_gradient_path_matters():
    """The two settings of grad_through_projection give different factor gradients (B/A enter the target)."""
    teacher, proxy = make_pair("llama")
    batch = make_batch(3)
    params = [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]
    g1 = torch.autograd.grad(alignment_losses(teacher, proxy, batch, kl_weight=0.0).loss, params)
    g0 = torch.autograd.grad(alignment_losses(teacher, proxy, batch, kl_weight=0.0, grad_through_projection=False).loss, params)
    diff = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(g1, g0))
    assert diff > 1e-3


def test_alignment_training_raises_heldout_cosines():
    """A few AdamW steps on fresh batches: training loss falls and held-out cosines rise from the SVD init."""
    torch.manual_seed(0)
    teacher, proxy = make_pair("llama")
    params = [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]
    frozen_before = {n: p.detach().clone() for n, p in proxy.named_parameters() if not p.requires_grad}
    teacher_before = {n: p.detach().clone() for n, p in teacher.state_dict().items()}
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    held = make_batch(1000, B=8, T=16, pad=False)
    h0 = alignment_losses(teacher, proxy, held, create_graph=False)
    fixed = make_batch(500, B=4, T=16)
    f0 = alignment_losses(teacher, proxy, fixed, create_graph=False).loss.item()
    for step in range(16):
        out = alignment_losses(teacher, proxy, make_batch(step, B=4, T=16), kl_weight=0.1)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    f1 = alignment_losses(teacher, proxy, fixed, create_graph=False).loss.item()
    h1 = alignment_losses(teacher, proxy, held, create_graph=False)
    assert f1 < f0 - 0.02, (f0, f1)
    assert h1.l_ga.item() < h0.l_ga.item() - 0.02, (h0.l_ga.item(), h1.l_ga.item())
    a0, b0 = h0.mean_cosines()
    a1, b1 = h1.mean_cosines()
    assert a1 > a0 + 0.01 and b1 > b0 + 0.01
    rose = [float(h1.cos_a[n] > h0.cos_a[n]) for n in h0.cos_a] + [float(h1.cos_b[n] > h0.cos_b[n]) for n in h0.cos_b]
    assert sum(rose) / len(rose) >= 0.75, rose
    # only factors moved; teacher untouched
    for n, p in proxy.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
    for n, p in teacher.state_dict().items():
        assert torch.equal(p, teacher_before[n]), n
    assert all(p.grad is None for p in teacher.parameters())


def test_errors_name_the_layer():
    teacher, proxy = make_pair("llama")
    other = tiny_causal_lm("llama", hidden_size=48)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj"):
        alignment_losses(other, proxy, make_batch(0))
    with pytest.raises(ValueError, match="no LowRankLinear"):
        proxy_factor_layers(teacher)
    with pytest.raises(ValueError, match="not LowRankLinear layers"):
        proxy_factor_layers(proxy, ["model.layers.0.nope"])
