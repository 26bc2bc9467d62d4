"""Stage 2's task terms (iprox_lightning.alignment.task) against brute-force autograd references on tiny models.

The references materialise every per-example gradient with ``torch.autograd.grad`` of the example's own loss (float64,
``create_graph=True``), form the TracIn scores / task gradients from those flat vectors, recompute the correlation,
listwise and cosine losses by hand, and take their gradient w.r.t. the factors by autograd again (double autograd);
central finite differences check a few factor entries of the library's own loss. The library's cross-entropy runs in
float32 (``batch.per_example_token_ce``); the ``float64_ce`` fixture keeps the models' float64 so the comparisons can
be tight, and GPT-2 (no float32 cast in its norms) is the model of the tight checks.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import iprox_lightning.engine.batch as batch_module
from iprox_lightning.alignment.losses import alignment_losses, proxy_factor_layers
from iprox_lightning.engine.batch import per_example_loss
from iprox_lightning.compression.apply import compress_model
from iprox_lightning.models.tiny import tiny_causal_lm
from transformers.pytorch_utils import Conv1D
from iprox_lightning.alignment.task import (
    ExampleScoreTracker,
    FactorPairTracker,
    cosines_from_dots,
    example_features,
    listwise_loss,
    pearson_loss,
    projected_directions,
    proxy_directions,
    score_agreement_loss,
    score_alignment_loss,
    task_alignment_losses,
    task_directions,
    task_gradient_alignment,
    task_rows,
)
from iprox_lightning.engine.tracking import backward_pairs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def float64_ce(monkeypatch):
    """The library's per-example cross-entropy in the logits' own dtype (float64 here) instead of float32."""
    def ce(logits, labels):
        lab = labels[:, 1:]
        sl = logits[:, :-1, :]
        ce = F.cross_entropy(sl.reshape(-1, sl.size(-1)), lab.reshape(-1), ignore_index=-100,
                             reduction="none").view(lab.shape)
        return ce.sum(dim=1), (lab != -100).sum(dim=1)

    monkeypatch.setattr(batch_module, "per_example_token_ce", ce)


def make_batch(seed: int, tasks, T: int = 10, V: int = 128, empty_row: bool = False) -> dict:
    """Random tokens, the first 4 prompt; row 0 right-padded by 2; with ``empty_row`` the last row has no response."""
    B = len(tasks)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    labels = ids.clone()
    labels[:, :4] = -100
    ids[0, -2:], mask[0, -2:], labels[0, -2:] = 0, 0, -100
    if empty_row:
        labels[-1] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels, id=[f"{seed}-{i}" for i in range(B)],
                task=list(tasks))


def make_pair(arch: str = "gpt2", seed: int = 0, dtype=torch.float64):
    teacher = tiny_causal_lm(arch, seed=seed)
    teacher.requires_grad_(False)
    proxy = copy.deepcopy(teacher)
    compress_model(proxy, None, 0.5, method="svd", progress=False)
    teacher.to(dtype)
    proxy.to(dtype).requires_grad_(False)
    for m in proxy_factor_layers(proxy).values():
        m.A.requires_grad_(True)
        m.B.requires_grad_(True)
    return teacher, proxy


def factor_params(proxy):
    return [p for m in proxy_factor_layers(proxy).values() for p in (m.A, m.B)]


def example_grads(model, batch, params, create_graph: bool):
    """Brute force: ``[B, D]`` flat per-example gradients of each row's own loss (mean over its response tokens)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    losses, _ = per_example_loss(logits, batch["labels"])
    rows = []
    for i in range(losses.shape[0]):
        g = torch.autograd.grad(losses[i], params, retain_graph=True, create_graph=create_graph, allow_unused=True)
        rows.append(torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1) for x, p in zip(g, params)]))
    return torch.stack(rows)


def target_params(teacher, proxy):
    """The target's weights at the aligned paths, made to require grad on a copy (the brute-force target)."""
    t = copy.deepcopy(teacher)
    ws = [t.get_submodule(n).weight for n in proxy_factor_layers(proxy)]
    for w in ws:
        w.requires_grad_(True)
    return t, ws


def out_in(module, G):
    """A weight-shaped gradient as ``[out, in]`` (GPT-2's ``Conv1D`` stores its weight ``[in, out]``)."""
    return G.transpose(-1, -2) if Conv1D is not None and isinstance(module, Conv1D) else G


def task_sum(G, tasks, order):
    return torch.stack([G[[i for i, t in enumerate(tasks) if t == k]].sum(0) for k in order])


# ------------------------------------------------------------------------------------------------ elementary
@pytest.mark.parametrize("mode", ["ghost", "materialize", "auto"])
def test_example_features_equal_materialised_gradients_and_differentiate(mode):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    d = torch.randn(3, 5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    V = torch.randn(2, 4, 7, dtype=torch.float64, generator=g)
    sq, dots = example_features(h, d, V, mode)
    G = torch.einsum("bto,bti->boi", d, h)  # per-example gradients
    torch.testing.assert_close(sq, G.pow(2).sum((1, 2)), rtol=1e-12, atol=0)
    torch.testing.assert_close(dots, torch.einsum("boi,koi->bk", G, V), rtol=1e-12, atol=1e-13)
    w = torch.randn(3, 2, dtype=torch.float64, generator=g)
    got = torch.autograd.grad((dots * w).sum() + sq.sum(), (h, d))
    want = torch.autograd.grad((torch.einsum("boi,koi->bk", G, V) * w).sum() + G.pow(2).sum(), (h, d))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)
    with pytest.raises(ValueError, match="do not match"):
        example_features(h, d, V.transpose(1, 2), mode)


def test_pearson_and_listwise_losses_by_hand():
    rng = np.random.default_rng(0)
    p, t = rng.normal(size=(6, 3)), rng.normal(size=(6, 3))
    P, Tt = torch.tensor(p), torch.tensor(t)
    want = [1 - np.corrcoef(p[:, k], t[:, k])[0, 1] for k in range(3)]
    np.testing.assert_allclose(pearson_loss(P, Tt).numpy(), want, rtol=1e-12)
    z = lambda x: (x - x.mean(0)) / x.std(0)  # noqa: E731  population std
    sm = lambda x: np.exp(x) / np.exp(x).sum(0)  # noqa: E731
    q, r = sm(z(p)), sm(z(t))
    np.testing.assert_allclose(listwise_loss(P, Tt).numpy(), (r * np.log(r / q)).sum(0), rtol=1e-6)
    # invariant to each side's scale and offset; identical orderings of equal spacing give 0
    torch.testing.assert_close(pearson_loss(3 * P + 1, Tt), pearson_loss(P, Tt))
    torch.testing.assert_close(listwise_loss(P, 2 * Tt - 5), listwise_loss(P, Tt), rtol=1e-6, atol=1e-9)
    assert float(pearson_loss(Tt, Tt).abs().max()) < 1e-12 and float(listwise_loss(Tt, Tt).abs().max()) < 1e-9
    # a constant column: correlation 0, finite gradient
    c = torch.zeros(6, 1, dtype=torch.float64, requires_grad=True)
    loss = pearson_loss(c, Tt[:, :1])
    assert float(loss) == 1.0 and bool(torch.isfinite(torch.autograd.grad(loss.sum(), c)[0]).all())


def test_score_agreement_loss_reduces_and_skips_invalid_rows():
    rng = np.random.default_rng(1)
    p, t = torch.tensor(rng.normal(size=(5, 3))), torch.tensor(rng.normal(size=(5, 3)))
    valid = torch.tensor([True, True, False, True, True])
    per = pearson_loss(p[valid], t[valid])
    loss, got = score_agreement_loss(p, t, valid, "pearson", "mean")
    torch.testing.assert_close(got, per)
    assert float(loss) == pytest.approx(float(per.mean()), rel=1e-12)
    assert float(score_agreement_loss(p, t, valid, "pearson", "max")[0]) == pytest.approx(float(per.max()), rel=1e-12)
    one = torch.tensor([False, False, True, False, False])
    loss, got = score_agreement_loss(p, t, one, "listwise", "mean")
    assert float(loss) == 0.0 and bool(torch.isnan(got).all())
    with pytest.raises(ValueError, match="score_loss"):
        score_agreement_loss(p, t, valid, "spearman")
    with pytest.raises(ValueError, match="task_reduction"):
        score_agreement_loss(p, t, valid, "pearson", "median")


def test_cosines_from_dots_zero_gradient_is_zero_with_finite_gradient():
    dots = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    sq = torch.tensor([0.0, 4.0], dtype=torch.float64, requires_grad=True)
    s = cosines_from_dots(dots, sq, torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    assert s.abs().max() == 0
    assert all(bool(torch.isfinite(g).all()) for g in torch.autograd.grad(s.sum(), (dots, sq)))


# ------------------------------------------------------------------------------------------------ the engine
def test_differentiable_pairs_equal_detached_and_hooks_are_removed():
    """backward_pairs(create_graph=True): the same pairs as the detached engine, carrying a graph to the factors; once
    the step is over, a backward through that graph hands no pair to the tracker again."""
    _, proxy = make_pair()
    batch = make_batch(0, ["a", "b", "a"])
    layers = proxy_factor_layers(proxy)

    class Count(FactorPairTracker):
        calls = 0

        def on_pair(self, name, h, delta):
            Count.calls += 1
            super().on_pair(name, h, delta)

    plain, live = FactorPairTracker(layers), Count(layers)
    backward_pairs(proxy, batch, [plain])
    backward_pairs(proxy, batch, [live], create_graph=True)
    assert Count.calls == 2 * len(layers)
    for n in layers:
        for (x0, g0), (x1, g1) in zip(plain.pairs[n], live.pairs[n]):
            # (the detached engine fuses the LM head with the cross-entropy, the differentiable one cannot: float64
            # rounding apart)
            assert torch.equal(x0, x1.detach())
            torch.testing.assert_close(g0, g1.detach(), rtol=1e-12, atol=1e-15)
            assert not g0.requires_grad and g1.requires_grad
    total = sum((g.pow(2).sum() for n in layers for _, g in live.pairs[n]))
    grads = torch.autograd.grad(total, factor_params(proxy))
    assert all(float(g.abs().max()) > 0 for g in grads)
    assert Count.calls == 2 * len(layers)  # the hooks went with the step


def test_trackers_riding_on_alignment_losses_change_nothing():
    """alignment_losses with the task trackers attached gives bit-identical L_GA, L_KL and factor gradients."""
    teacher, proxy = make_pair("llama", dtype=torch.float32)
    batch = make_batch(3, ["a", "b", "a", "b"])
    params = factor_params(proxy)
    ref = alignment_losses(teacher, proxy, batch)
    g_ref = torch.autograd.grad(ref.loss, params)
    layers = proxy_factor_layers(proxy)
    V = {n: torch.ones(1, *teacher.get_submodule(n).weight.shape) for n in layers}
    pairs, feats = FactorPairTracker(layers), ExampleScoreTracker({n: teacher.get_submodule(n) for n in layers}, V)
    out = alignment_losses(teacher, proxy, batch, teacher_trackers=[feats], proxy_trackers=[pairs])
    g = torch.autograd.grad(out.loss, params)
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.l_kl, ref.l_kl)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert set(pairs.pairs) == set(layers) and feats.dots.shape == (4, 1)


# ------------------------------------------------------------------------------------------------ directions
def test_task_directions_equal_summed_per_example_gradients(float64_ce):
    teacher, proxy = make_pair()
    val = [make_batch(10, ["x", "y", "x"]), make_batch(11, ["z", "y"])]
    layers = list(proxy_factor_layers(proxy))
    d = task_directions(teacher, val, layers)
    assert d.tasks == ["x", "y", "z"] and d.examples == 5
    t, ws = target_params(teacher, proxy)
    G = torch.cat([example_grads(t, b, ws, False) for b in val])
    tasks = [k for b in val for k in b["task"]]
    want = task_sum(G, tasks, d.tasks)
    got = torch.cat([out_in(teacher.get_submodule(n), d.target[n]).reshape(3, -1) for n in layers], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))
    torch.testing.assert_close(d.target_sq, want.pow(2).sum(1), rtol=1e-9, atol=0)
    V, sq = proxy_directions(proxy, val, d.tasks, layers)
    P = torch.cat([example_grads(proxy, b, factor_params(proxy), False) for b in val])
    want_p = task_sum(P, tasks, d.tasks)
    got_p = torch.cat([x.reshape(3, -1) for n in layers for x in V[n]], dim=1)
    torch.testing.assert_close(got_p, want_p, rtol=1e-9, atol=1e-12 * float(want_p.abs().max()))
    torch.testing.assert_close(sq, want_p.pow(2).sum(1), rtol=1e-9, atol=0)
    with pytest.raises(ValueError, match="not among"):
        proxy_directions(proxy, [make_batch(12, ["w", "x"])], d.tasks, layers)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_projected_directions_are_the_targets_summed_gradients_through_the_factors(float64_ce, arch):
    """``proxy_validation="target"``: the score term's proxy directions are the target's per-task summed validation
    gradients (brute force: autograd per example) mapped into factor space by hand, ``(G Bᵀ, Aᵀ G)`` per layer, and
    what the scoring engine takes as the proxy's validation gradients from the target (``validation_model``)."""
    from iprox_lightning.scoring.features import FactorSpaceView, ValidationGradientTracker, tracked_modules

    teacher, proxy = make_pair(arch)
    val = [make_batch(10, ["x", "y", "x"]), make_batch(11, ["z", "y"])]
    lowrank = proxy_factor_layers(proxy)
    layers = list(lowrank)
    d = task_directions(teacher, val, layers)
    V, sq = projected_directions(proxy, d, layers)
    t, ws = target_params(teacher, proxy)
    G = task_sum(torch.cat([example_grads(t, b, ws, False) for b in val]), [k for b in val for k in b["task"]], d.tasks)
    off, want = 0, []
    for n, w in zip(layers, ws):
        Gn = out_in(teacher.get_submodule(n), G[:, off:off + w.numel()].reshape(3, *w.shape))  # [K, out, in]
        off += w.numel()
        A, B = lowrank[n].A.detach(), lowrank[n].B.detach()
        want.append((Gn @ B.t(), A.t() @ Gn))
    scale = max(float(x.abs().max()) for pair in want for x in pair)
    for n, (wa, wb) in zip(layers, want):
        torch.testing.assert_close(V[n][0], wa, rtol=1e-9, atol=1e-12 * scale)
        torch.testing.assert_close(V[n][1], wb, rtol=1e-9, atol=1e-12 * scale)
    flat = torch.cat([x.reshape(3, -1) for pair in want for x in pair], dim=1)
    torch.testing.assert_close(sq, flat.pow(2).sum(1), rtol=1e-9, atol=0)
    # the scoring engine's sums of the same validation examples through the target, in the proxy's coordinates
    mods = {n: m for n, m in tracked_modules(proxy).items()}
    tracker = ValidationGradientTracker(mods, [f"{n}.{k}" for n in layers for k in ("A", "B")],
                                        lambda b: [str(k) for k in b["task"]], torch.float64)
    for b in val:
        backward_pairs(teacher, b, [FactorSpaceView(tracked_modules(teacher), tracker, mods)])
    for n in layers:
        for j, k in enumerate(("A", "B")):
            eng = torch.stack([tracker.sums[f"{n}.{k}"][task] for task in d.tasks])
            torch.testing.assert_close(eng, V[n][j], rtol=1e-9, atol=1e-12 * scale)
    with pytest.raises(ValueError, match="no target direction"):
        projected_directions(proxy, type(d)(tasks=d.tasks, target={}, target_sq=d.target_sq), layers)


# ------------------------------------------------------------------------------------------------ score term
def library_score_loss(teacher, proxy, batch, d, kind, reduction):
    layers = proxy_factor_layers(proxy)
    pairs = FactorPairTracker(layers)
    feats = ExampleScoreTracker({n: teacher.get_submodule(n) for n in layers}, d.target)
    alignment_losses(teacher, proxy, batch, kl_weight=0.0, teacher_trackers=[feats], proxy_trackers=[pairs])
    return score_alignment_loss(pairs, feats, d, batch, kind=kind, reduction=reduction)


@pytest.mark.parametrize("kind, reduction", [("pearson", "mean"), ("listwise", "max")])
def test_score_loss_and_its_gradient_match_brute_force(float64_ce, kind, reduction):
    teacher, proxy = make_pair()
    val = [make_batch(20, ["x", "y", "x", "y"]), make_batch(21, ["z", "x", "z"])]
    layers = list(proxy_factor_layers(proxy))
    d = task_directions(teacher, val, layers)
    d.proxy, d.proxy_sq = proxy_directions(proxy, val, d.tasks, layers)
    batch = make_batch(5, ["p"] * 6, empty_row=True)  # pool rows; the last has no response token
    params = factor_params(proxy)
    out = library_score_loss(teacher, proxy, batch, d, kind, reduction)
    got = torch.autograd.grad(out.loss, params)

    # brute force: flat per-example gradients, directions = summed validation gradients (proxy's held fixed)
    tasks = [k for b in val for k in b["task"]]
    t, ws = target_params(teacher, proxy)
    v_t = task_sum(torch.cat([example_grads(t, b, ws, False) for b in val]), tasks, d.tasks)
    v_p = task_sum(torch.cat([example_grads(proxy, b, params, False) for b in val]), tasks, d.tasks).detach()
    g_t = example_grads(t, batch, ws, False)
    g_p = example_grads(proxy, batch, params, True)
    assert float(g_t[5].abs().max()) == 0 and float(g_p[5].abs().max()) == 0
    g_t, g_p = g_t[:5], g_p[:5]  # rows with a response token (a zero row's norm has no gradient)
    s_t = (g_t @ v_t.t()) / (g_t.norm(dim=1, keepdim=True) * v_t.norm(dim=1)[None, :])
    s_p = (g_p @ v_p.t()) / (g_p.norm(dim=1, keepdim=True) * v_p.norm(dim=1)[None, :])
    ref_per = []
    for k in range(len(d.tasks)):
        p, q = s_p[:, k], s_t[:, k]
        if kind == "pearson":
            ref_per.append(1 - torch.corrcoef(torch.stack([p, q]))[0, 1])
        else:
            zq, zp = (q - q.mean()) / q.std(unbiased=False), (p - p.mean()) / p.std(unbiased=False)
            ref_per.append(F.kl_div(F.log_softmax(zp, 0), F.log_softmax(zq, 0), log_target=True, reduction="sum"))
    ref_per = torch.stack(ref_per)
    ref = ref_per.mean() if reduction == "mean" else ref_per.max()
    torch.testing.assert_close(out.target_scores[:5], s_t.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(out.proxy_scores[:5], s_p.detach(), rtol=1e-9, atol=1e-12)
    assert out.proxy_scores[5].abs().max() == 0  # the example without a response token scores 0
    assert float(out.loss) == pytest.approx(float(ref), rel=1e-8)
    np.testing.assert_allclose([float(out.per_task[k]) for k in d.tasks], ref_per.detach().numpy(), rtol=1e-8)
    want = torch.autograd.grad(ref, params)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8 * scale)

    # central finite differences of the library's loss (directions fixed) at a few entries of three factors
    rng = np.random.default_rng(0)
    for j in (0, 5, len(params) - 1):
        p = params[j]
        for _ in range(2):
            idx = tuple(int(rng.integers(s)) for s in p.shape)
            eps = 1e-6
            vals = []
            for sgn in (1, -1):
                with torch.no_grad():
                    p[idx] += sgn * eps
                vals.append(float(library_score_loss(teacher, proxy, batch, d, kind, reduction).loss))
                with torch.no_grad():
                    p[idx] -= sgn * eps
            fd = (vals[0] - vals[1]) / (2 * eps)
            assert fd == pytest.approx(float(got[j][idx]), rel=1e-4, abs=1e-7 * scale)


# ------------------------------------------------------------------------------------------------ L_val
@pytest.mark.parametrize("through, reduction", [(True, "mean"), (False, "max")])
def test_task_gradient_term_and_its_gradient_match_brute_force(float64_ce, through, reduction):
    teacher, proxy = make_pair()
    batch = make_batch(30, ["x", "y", "x", "z", "y"])
    params = factor_params(proxy)
    layers = proxy_factor_layers(proxy)
    out = task_gradient_alignment(teacher, proxy, batch, reduction=reduction, grad_through_projection=through)
    got = torch.autograd.grad(out.loss, params)

    order = list(task_rows(batch["task"]))
    assert list(out.cos) == order == ["x", "y", "z"]
    g_p = task_sum(example_grads(proxy, batch, params, True), batch["task"], order)  # [K, D], differentiable
    t, ws = target_params(teacher, proxy)
    g_t = example_grads(t, batch, ws, False)
    cos = []
    for k, task in enumerate(order):
        rows = [i for i, x in enumerate(batch["task"]) if x == task]
        proj, off = [], 0
        for n, m in layers.items():
            w = t.get_submodule(n).weight
            G = g_t[rows, off: off + w.numel()].sum(0).reshape(w.shape)
            G = out_in(t.get_submodule(n), G)
            off += w.numel()
            A, B = (m.A, m.B) if through else (m.A.detach(), m.B.detach())
            proj += [(G @ B.t()).reshape(-1), (A.t() @ G).reshape(-1)]
        cos.append(F.cosine_similarity(g_p[k], torch.cat(proj), dim=0))
    cos = torch.stack(cos)
    ref = (1 - cos).mean() if reduction == "mean" else (1 - cos).max()
    assert float(out.loss) == pytest.approx(float(ref), rel=1e-9)
    np.testing.assert_allclose([float(out.cos[k]) for k in order], cos.detach().numpy(), rtol=1e-9)
    want = torch.autograd.grad(ref, params)
    scale = max(float(w.abs().max()) for w in want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8 * scale)
    # finite differences at one entry of the first and the last factor (the full derivative: only when the projection
    # is differentiated too; with the stop-gradient of through=False a perturbed factor also moves the constant)
    for j in ((0, len(params) - 1) if through else ()):
        p, idx, eps = params[j], (1, 2), 1e-6
        vals = []
        for sgn in (1, -1):
            with torch.no_grad():
                p[idx] += sgn * eps
            vals.append(float(task_gradient_alignment(teacher, proxy, batch, reduction=reduction,
                                                      grad_through_projection=through).loss))
            with torch.no_grad():
                p[idx] -= sgn * eps
        assert (vals[0] - vals[1]) / (2 * eps) == pytest.approx(float(got[j][idx]), rel=1e-4, abs=1e-7 * scale)


@pytest.mark.parametrize("through, reduction, chunk", [(True, "mean", 1), (True, "max", 2), (False, "mean", 2)])
def test_chunked_task_gradient_term_equals_one_graph(float64_ce, through, reduction, chunk):
    """``chunk_size``: the same loss and factor gradient as one graph (which matches brute force above), chunks that
    miss a task included (rows x, y, x, z, y in chunks of 1 or 2), and ``param.grad`` untouched until the caller's
    backward."""
    teacher, proxy = make_pair()
    batch = make_batch(30, ["x", "y", "x", "z", "y"])
    params = factor_params(proxy)
    one = task_gradient_alignment(teacher, proxy, batch, reduction=reduction, grad_through_projection=through)
    want = torch.autograd.grad(one.loss, params)
    out = task_gradient_alignment(teacher, proxy, batch, reduction=reduction, grad_through_projection=through,
                                  chunk_size=chunk)
    assert all(p.grad is None for p in params)
    assert float(out.loss) == pytest.approx(float(one.loss), rel=1e-12)
    assert list(out.cos) == list(one.cos) == ["x", "y", "z"]
    np.testing.assert_allclose([float(c) for c in out.cos.values()], [float(c) for c in one.cos.values()], rtol=1e-12)
    got = torch.autograd.grad(out.loss, params)
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12 * scale)
    # a chunk as large as the batch is the one-graph path; a bad size is refused by name
    assert float(task_gradient_alignment(teacher, proxy, batch, chunk_size=5).loss) == pytest.approx(
        float(task_gradient_alignment(teacher, proxy, batch).loss), rel=1e-12)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        task_gradient_alignment(teacher, proxy, batch, chunk_size=0)


def test_task_alignment_losses_adds_the_weighted_terms(float64_ce):
    teacher, proxy = make_pair()
    val = make_batch(40, ["x", "y", "x", "y"])
    batch = make_batch(41, ["p"] * 4)
    layers = list(proxy_factor_layers(proxy))
    d = task_directions(teacher, [val], layers)
    d.proxy, d.proxy_sq = proxy_directions(proxy, [val], d.tasks, layers)
    base = alignment_losses(teacher, proxy, batch, kl_weight=0.2)
    s = library_score_loss(teacher, proxy, batch, d, "pearson", "mean")
    v = task_gradient_alignment(teacher, proxy, val)
    out = task_alignment_losses(teacher, proxy, batch, kl_weight=0.2, val_batch=val, val_grad_weight=0.7,
                                directions=d, score_weight=0.3)
    assert float(out.loss) == pytest.approx(float(base.loss + 0.7 * v.loss + 0.3 * s.loss), rel=1e-12)
    assert float(out.l_ga) == float(base.l_ga) and float(out.l_val_grad) == float(v.loss)
    assert float(out.l_score) == float(s.loss) and set(out.val_grad_cos) == {"x", "y"}
    off = task_alignment_losses(teacher, proxy, batch, kl_weight=0.2)
    assert torch.equal(off.loss, base.loss) and off.l_val_grad is None and off.l_score is None
    with pytest.raises(ValueError, match="validation examples"):
        task_alignment_losses(teacher, proxy, batch, val_grad_weight=1.0)
    with pytest.raises(ValueError, match="task directions"):
        task_alignment_losses(teacher, proxy, batch, score_weight=1.0)
