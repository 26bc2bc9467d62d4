import pytest
import torch

from iprox_lightning.batch import per_example_loss, sft_loss, shifted_token_mask
from iprox_lightning.models.targets import find_target_linears
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.tracking import LayerTracker, requires_grad_inputs


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
    torch.testing.assert_close(loss[0], expected0.float())
    assert loss[1].item() == 0.0 and n.tolist() == [2, 0]
    assert shifted_token_mask(labels).tolist() == [[True, True, False, False], [False] * 4]
