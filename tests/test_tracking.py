import pytest
import torch

from iprox_lightning.engine.batch import example_mean_sum, per_example_loss, sft_loss, shifted_token_mask, token_mean
from iprox_lightning.engine.target_layers import find_target_linears
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.engine.tracking import LayerTracker, requires_grad_inputs


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (3, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding
    labels = ids.clone()
    labels[:, :3] = -100  # prompt
    labels[mask == 0] = -100
    return ids, mask, labels


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tracker_pairs_reconstruct_weight_gradients(arch):
    model = tiny_causal_lm(arch, seed=1).double()
    ids, mask, labels = _batch()
    targets = find_target_linears(model)
    pairs = {}
    with LayerTracker(targets, lambda n, m, h, d: pairs.__setitem__(n, (h, d))):
        out = model(input_ids=ids, attention_mask=mask)
        loss = sft_loss(out.logits, labels)
        loss.backward()
    for name, module in targets.items():
        h, d = pairs[name]
        grad_w = torch.einsum("bto,bti->oi", d, h)
        ref = module.weight.grad.t() if arch == "gpt2" else module.weight.grad
        torch.testing.assert_close(grad_w, ref, rtol=1e-9, atol=1e-12)


def test_requires_grad_inputs_frozen_model_no_param_grads():
    model = tiny_causal_lm("llama", seed=2).double()
    model.requires_grad_(False)
    ids, mask, labels = _batch()
    targets = find_target_linears(model)
    got = {}
    with requires_grad_inputs(model), LayerTracker(targets, lambda n, m, h, d: got.__setitem__(n, torch.einsum("bto,bti->oi", d, h))):
        out = model(input_ids=ids, attention_mask=mask)
        loss = sft_loss(out.logits, labels)
        loss.backward()
    assert all(p.grad is None for p in model.parameters())
    # reference: same model with grads enabled
    ref_model = tiny_causal_lm("llama", seed=2).double()
    out = ref_model(input_ids=ids, attention_mask=mask)
    sft_loss(out.logits, labels).backward()
    ref_targets = find_target_linears(ref_model)
    for name in targets:
        torch.testing.assert_close(got[name], ref_targets[name].weight.grad, rtol=1e-9, atol=1e-12)


def test_tracker_refuses_reuse_and_missing_graph():
    model = tiny_causal_lm("llama")
    model.model.layers[1].self_attn.q_proj = model.model.layers[0].self_attn.q_proj
    q = {"q": model.model.layers[0].self_attn.q_proj}
    ids = torch.randint(3, 128, (1, 5))
    with LayerTracker(q, lambda *a: None), pytest.raises(RuntimeError, match="ran twice in one step"):
        model(input_ids=ids)
    model = tiny_causal_lm("llama").requires_grad_(False)
    t = {"q": model.model.layers[0].self_attn.q_proj}
    with LayerTracker(t, lambda *a: None), pytest.raises(RuntimeError, match="does not require grad"):
        model(input_ids=ids)


def test_per_example_loss_masks_and_zero_examples():
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    labels = torch.tensor([[-100, 1, 2, -100], [-100, -100, -100, -100]])
    loss, n = per_example_loss(logits, labels)
    lp = torch.log_softmax(logits, -1)
    expected0 = -(lp[0, 0, 1] + lp[0, 1, 2]) / 2
    torch.testing.assert_close(loss[0], expected0)
    assert loss[1].item() == 0.0 and n.tolist() == [2, 0]
    assert shifted_token_mask(labels).tolist() == [[True, True, False, False], [False] * 4]


# ------------------------------------------------------------------------------------------
# the backward-pairs engine
# ------------------------------------------------------------------------------------------
from iprox_lightning.engine.lowrank import LowRankLinear  # noqa: E402
from iprox_lightning.engine.tracking import PairTracker, backward_pairs  # noqa: E402


def _proxy(seed=3):
    """Tiny float64 Llama whose q_proj layers are LowRankLinear (rank 3)."""
    model = tiny_causal_lm("llama", seed=seed).double()
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        q = layer.self_attn.q_proj
        A = torch.randn(q.out_features, 3, generator=g, dtype=torch.float64) * 0.3
        B = torch.randn(3, q.in_features, generator=g, dtype=torch.float64) * 0.3
        layer.self_attn.q_proj = LowRankLinear.from_factors(A, B)
    return model


class Recorder(PairTracker):
    def __init__(self, modules):
        self.modules = dict(modules)
        self.events, self.pairs = [], {}

    def start_step(self, batch):
        self.events.append("start")

    def on_pair(self, name, h, delta):
        self.events.append(name)
        self.pairs[name] = (h, delta)

    def end_step(self):
        self.events.append("end")


def _brute_force_pairs(model, modules, ids, mask, labels, loss_fn):
    """(h, ∂loss/∂y) of each module by plain forward hooks and autograd.grad w.r.t. the outputs."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: seen.__setitem__(n, (a[0], out)))
             for n, m in modules.items()]
    try:
        loss = loss_fn(model(input_ids=ids, attention_mask=mask).logits, labels)
    finally:
        for h in hooks:
            h.remove()
    grads = torch.autograd.grad(loss, [seen[n][1] for n in modules])
    return loss.detach(), {n: (seen[n][0].detach(), g) for n, g in zip(modules, grads)}


def _sum_of_example_losses(logits, labels):
    return per_example_loss(logits, labels)[0].sum()


@pytest.mark.parametrize("loss_fn,full_logits_loss", [(example_mean_sum, _sum_of_example_losses),
                                                      (token_mean, sft_loss)])
def test_backward_pairs_match_brute_force_and_run_the_life_cycle(loss_fn, full_logits_loss):
    model = _proxy()
    ids, mask, labels = _batch()
    targets = find_target_linears(model)  # dense linears + the LowRankLinear q_proj layers
    seams = {f"{n}.bottleneck": m.bottleneck for n, m in targets.items() if isinstance(m, LowRankLinear)}
    assert len(seams) == 2
    dense = {n: m for n, m in targets.items() if not isinstance(m, LowRankLinear)}
    first, second = Recorder(targets), Recorder({**seams, **dict(list(dense.items())[:2])})  # overlapping layers
    step = backward_pairs(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, [first, second],
                          loss_fn=loss_fn)
    assert all(p.grad is None for p in model.parameters())
    # the reference: full logits (the LM head on every position), the loss written on them
    ref_loss, ref = _brute_force_pairs(model, {**targets, **seams}, ids, mask, labels, full_logits_loss)
    assert float(step.loss) == pytest.approx(float(ref_loss), rel=1e-12)
    for tracker in (first, second):
        assert tracker.events[0] == "start" and tracker.events[-1] == "end"
        assert sorted(tracker.events[1:-1]) == sorted(tracker.modules)  # each tracked layer exactly once
        for name, (h, d) in tracker.pairs.items():
            torch.testing.assert_close(h, ref[name][0], rtol=0, atol=0)
            torch.testing.assert_close(d, ref[name][1], rtol=1e-10, atol=1e-14)
    # the seam carries z = B h and ∂L/∂z = Aᵀ δ of its LowRankLinear
    for name, m in targets.items():
        if isinstance(m, LowRankLinear):
            h, d = first.pairs[name]
            z, dz = second.pairs[f"{name}.bottleneck"]
            torch.testing.assert_close(z, h @ m.B.detach().t(), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(dz, d @ m.A.detach(), rtol=1e-10, atol=1e-14)


def test_backward_pairs_inside_inference_mode_and_with_a_frozen_model():
    model = tiny_causal_lm("llama", seed=4).double().requires_grad_(False)
    ids, mask, labels = _batch()
    targets = find_target_linears(model)
    rec = Recorder(targets)
    with torch.inference_mode():  # Lightning's predict loop
        backward_pairs(model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, [rec])
    ref_model = tiny_causal_lm("llama", seed=4).double()
    _, ref = _brute_force_pairs(ref_model, find_target_linears(ref_model), ids, mask, labels, _sum_of_example_losses)
    for name in targets:
        torch.testing.assert_close(rec.pairs[name][1], ref[name][1], rtol=1e-10, atol=1e-14)


def test_lowrank_bottleneck_is_a_seam_without_state():
    layer = LowRankLinear(6, 5, 2, bias=True)
    assert set(layer.state_dict()) == {"A", "B", "bias"}  # saved proxies keep loading strictly
    x = torch.randn(4, 6)
    torch.testing.assert_close(layer(x), x @ (layer.A @ layer.B).t() + layer.bias)
    seen = []
    layer.bottleneck.register_forward_hook(lambda m, a, out: seen.append(out))
    layer(x)
    torch.testing.assert_close(seen[0], x @ layer.B.t())
