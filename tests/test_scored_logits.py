"""The LM head on the scored positions only (``iprox_lightning.engine.batch.scored_logits``) against full logits."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from iprox_lightning.engine.batch import (IGNORE_INDEX, ScoredTokens, head_on_scored_positions, per_example_token_ce,
                                   scored_logits, shifted_token_mask)
from iprox_lightning.models.tiny import ARCHITECTURES, tiny_causal_lm


def _batch(seed=0, B=3, T=9, vocab=None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab or 50, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX  # prompt
    labels[1, :2] = IGNORE_INDEX
    labels[1, 6:] = IGNORE_INDEX  # padding
    labels[2, :] = IGNORE_INDEX  # no response token at all
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_scored_tokens_follow_the_shifted_mask_in_row_major_order():
    labels = _batch()["labels"]
    s = ScoredTokens.of(labels)
    want_rows, want_targets = [], []
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            if labels[b, t + 1] != IGNORE_INDEX:
                want_rows.append(b)
                want_targets.append(int(labels[b, t + 1]))
    assert s.rows.tolist() == want_rows and s.targets.tolist() == want_targets
    assert torch.equal(s.mask, shifted_token_mask(labels))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scored_logits_equal_full_logits_and_the_head_sees_only_scored_rows(arch):
    model = tiny_causal_lm(arch, seed=1).double().eval()
    batch = _batch(vocab=model.config.vocab_size)
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    seen = []
    h = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].shape))
    try:
        logits, scored = scored_logits(model, batch)
    finally:
        h.remove()
    n = int(shifted_token_mask(batch["labels"]).sum())
    assert seen == [torch.Size([1, n, model.config.hidden_size])]  # the head ran on the N scored rows only
    torch.testing.assert_close(logits, full[scored.mask], rtol=1e-12, atol=1e-12)
    # per-example sums and counts against a loop over examples and tokens
    ce_sum, cnt = scored.ce_sums(logits)
    for b in range(3):
        toks = [t for t in range(8) if batch["labels"][b, t + 1] != IGNORE_INDEX]
        ref = sum(float(F.cross_entropy(full[b, t:t + 1], batch["labels"][b, t + 1:t + 2])) for t in toks)
        assert int(cnt[b]) == len(toks) and float(ce_sum[b]) == pytest.approx(ref, rel=1e-12, abs=1e-12)
    ref_sum, ref_n = per_example_token_ce(full, batch["labels"])
    torch.testing.assert_close(ce_sum, ref_sum.double(), rtol=1e-12, atol=1e-12)
    assert torch.equal(cnt, ref_n)
    # outside the block the model is unchanged
    assert model(input_ids=batch["input_ids"]).logits.shape[:2] == batch["input_ids"].shape


def test_gradients_through_scored_logits_equal_full_logits():
    model = tiny_causal_lm("llama", seed=2).double()
    batch = _batch(seed=3, vocab=model.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    logits, scored = scored_logits(model, batch)
    got = torch.autograd.grad(scored.ce_sums(logits)[0].sum(), params)
    full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = torch.autograd.grad(per_example_token_ce(full, batch["labels"])[0].sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


class _NoHead(nn.Module):
    """A causal LM without ``get_output_embeddings``: full logits are kept and picked after."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, **kw):
        return self.inner(**kw)


def test_a_model_without_an_output_embedding_gets_full_logits_picked():
    inner = tiny_causal_lm("llama", seed=1).double().eval()
    batch = _batch(vocab=inner.config.vocab_size)
    logits, scored = scored_logits(_NoHead(inner), batch)
    full = inner(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(logits, full[scored.mask])


def test_a_head_called_on_other_positions_is_a_clear_error():
    model = tiny_causal_lm("llama", seed=1).double().eval()
    batch = _batch(vocab=model.config.vocab_size)
    with pytest.raises(RuntimeError, match="LM head got hidden states of shape"):
        with head_on_scored_positions(model, batch["labels"][:, :5]):
            model(input_ids=batch["input_ids"])
    # the hook is gone after the error
    assert model(input_ids=batch["input_ids"]).logits.shape[1] == batch["input_ids"].shape[1]


def test_proxy_health_equals_a_brute_force_over_full_logits():
    from iprox_lightning.compression.health import proxy_health

    target = tiny_causal_lm("llama", seed=1).double()
    proxy = tiny_causal_lm("llama", seed=5).double()
    batches = [_batch(seed=s, vocab=target.config.vocab_size) for s in (0, 1)]
    got = proxy_health(target, proxy, batches)
    losses = {"t": [], "p": []}
    kls, agree = [], []
    for b in batches:
        lt = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lp = proxy(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        for row in range(b["labels"].shape[0]):
            toks = [t for t in range(b["labels"].shape[1] - 1) if b["labels"][row, t + 1] != IGNORE_INDEX]
            if not toks:
                continue
            for key, lg in (("t", lt), ("p", lp)):
                losses[key].append(sum(float(F.cross_entropy(lg[row, t:t + 1], b["labels"][row, t + 1:t + 2]))
                                       for t in toks) / len(toks))
            for t in toks:
                p, q = lt[row, t].log_softmax(-1), lp[row, t].log_softmax(-1)
                kls.append(float((p.exp() * (p - q)).sum()))
                agree.append(int(lt[row, t].argmax() == lp[row, t].argmax()))
    assert got["examples"] == len(losses["t"]) == 4 and got["tokens"] == len(kls)
    assert got["target_loss"] == pytest.approx(sum(losses["t"]) / 4, rel=1e-6)
    assert got["proxy_loss"] == pytest.approx(sum(losses["p"]) / 4, rel=1e-6)
    assert got["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    assert got["top1_agreement"] == pytest.approx(sum(agree) / len(agree))


# --- the LM head fused with the cross-entropy (``linear_cross_entropy``, ``scored_ce_sums``) ---------------------

@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_equals_cross_entropy_of_the_logits_with_its_gradient(chunk, bias):
    from iprox_lightning.engine.batch import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    N, d, V = 7, 5, 11
    h = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, d, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(N, generator=g, dtype=torch.float64)  # a per-row weight on the way back (as 1/n_tokens is)
    got = linear_cross_entropy(h, W, b, t, chunk=chunk)
    want = F.cross_entropy(F.linear(h, W, b), t, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    (g_got,) = torch.autograd.grad((got * w).sum(), h)
    (g_want,) = torch.autograd.grad((want * w).sum(), h)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-13)
    with torch.no_grad():  # values only, no gradient kept
        torch.testing.assert_close(linear_cross_entropy(h, W, b, t, chunk=chunk), want.detach(), rtol=1e-13, atol=1e-13)


def test_linear_cross_entropy_in_float32_and_bfloat16_is_the_unfused_computation():
    from iprox_lightning.engine.batch import linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    h64, W64 = torch.randn(9, 16, generator=g, dtype=torch.float64), torch.randn(50, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 50, (9,), generator=g)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        h = h64.to(dtype).requires_grad_(True)
        W = W64.to(dtype)
        got = linear_cross_entropy(h, W, None, t, chunk=4)
        assert got.dtype == torch.float32  # the cross-entropy in float32, as ScoredTokens.ce_sums
        want = F.cross_entropy(F.linear(h, W).float(), t, reduction="none")
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        (g_got,) = torch.autograd.grad(got.sum(), h)
        (g_want,) = torch.autograd.grad(want.sum(), h)
        assert g_got.dtype == dtype
        torch.testing.assert_close(g_got.float(), g_want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scored_ce_sums_equal_the_logits_way_with_gradients_and_the_head_sees_one_row(arch):
    from iprox_lightning.engine.batch import scored_ce_sums

    model = tiny_causal_lm(arch, seed=1).double().eval()
    batch = _batch(vocab=model.config.vocab_size)
    logits, scored = scored_logits(model, batch)
    want_sum, want_n = scored.ce_sums(logits)
    params = [p for p in model.parameters() if p.requires_grad and p is not model.get_output_embeddings().weight]
    want_g = torch.autograd.grad((want_sum * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum(), params)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].shape[:2]))
    try:
        ce_sum, n, scored2 = scored_ce_sums(model, batch)
        scored_ce_sums(model, batch)
    finally:
        hook.remove()
    # the first call checks the head once (a forward of two tokens); then the model's own head runs on no row
    assert seen == [torch.Size([1, 2]), torch.Size([1, 0]), torch.Size([1, 0])]
    torch.testing.assert_close(ce_sum, want_sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(n, want_n) and torch.equal(scored2.rows, scored.rows)
    got_g = torch.autograd.grad((ce_sum * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum(), params,
                                allow_unused=True)
    for p, g, w in zip(params, got_g, want_g):
        torch.testing.assert_close(torch.zeros_like(w) if g is None else g, w, rtol=1e-10, atol=1e-12)


class _ScaledLogits(nn.Module):
    """A causal LM whose forward changes the head's output (as logit soft-capping or a logit scale do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = 2.0 * torch.tanh(out.logits / 2.0)
        return out


def test_a_forward_that_changes_the_head_output_is_computed_unfused_and_remembered():
    from iprox_lightning.engine.batch import scored_ce_sums

    model = _ScaledLogits(tiny_causal_lm("llama", seed=1).double().eval())
    batch = _batch(vocab=model.inner.config.vocab_size)
    logits, scored = scored_logits(model, batch)
    want_sum, want_n = scored.ce_sums(logits)
    for _ in range(2):  # detected on the first call (without a second forward of the batch), remembered
        ce_sum, n, _ = scored_ce_sums(model, batch)
        torch.testing.assert_close(ce_sum, want_sum, rtol=1e-12, atol=1e-12)
        assert torch.equal(n, want_n)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].shape[:2]))
    try:
        scored_ce_sums(model, batch)
    finally:
        hook.remove()
    assert seen == [torch.Size([1, int(want_n.sum())])]  # checked once: the unfused head on all scored rows


def test_backward_pairs_keeps_logits_only_when_asked_and_its_loss_is_the_same():
    from iprox_lightning.engine.tracking import backward_pairs

    model = tiny_causal_lm("qwen2", seed=3).double().eval()
    batch = _batch(seed=4, vocab=model.config.vocab_size)
    fused = backward_pairs(model, batch, [])
    kept = backward_pairs(model, batch, [], keep_logits=True)
    assert fused.logits is None
    logits, scored = scored_logits(model, batch)
    torch.testing.assert_close(kept.logits, logits.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fused.loss, kept.loss, rtol=1e-12, atol=1e-12)


def test_a_tracked_head_runs_unfused_and_gets_its_pairs_on_every_scored_row():
    from iprox_lightning.engine.tracking import PairTracker, backward_pairs

    model = tiny_causal_lm("llama", seed=3).double().eval()
    batch = _batch(seed=4, vocab=model.config.vocab_size)

    class HeadPairs(PairTracker):
        def __init__(self):
            self.modules = {"lm_head": model.get_output_embeddings()}
            self.shapes = []

        def on_pair(self, name, h, delta):
            self.shapes.append((tuple(h.shape), tuple(delta.shape)))

    tracker = HeadPairs()
    step = backward_pairs(model, batch, [tracker])
    n = int(shifted_token_mask(batch["labels"]).sum())
    assert tracker.shapes == [((1, n, model.config.hidden_size), (1, n, model.config.vocab_size))]
    torch.testing.assert_close(step.loss, backward_pairs(model, batch, []).loss, rtol=1e-12, atol=1e-12)


def test_gemma3_with_final_logit_softcapping_is_computed_unfused():
    """A real architecture whose forward changes the head's output: Gemma-3 with ``final_logit_softcapping``
    (``tanh(logits / c) · c``) — the check refuses to fuse it, and the sums equal the logits way."""
    from transformers import AutoModelForCausalLM

    from iprox_lightning.engine.batch import fusable_head, scored_ce_sums

    import copy

    base = tiny_causal_lm("gemma3", seed=2)
    cfg = copy.deepcopy(base.config)
    cfg.final_logit_softcapping = 1.5  # small: every logit is bent
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    model.load_state_dict(base.double().state_dict())
    batch = _batch(vocab=cfg.vocab_size)
    assert fusable_head(model, batch) is None and fusable_head(base.eval(), batch) is not None
    logits, scored = scored_logits(model, batch)
    want_sum, want_n = scored.ce_sums(logits)
    ce_sum, n, _ = scored_ce_sums(model, batch)
    torch.testing.assert_close(ce_sum, want_sum, rtol=1e-12, atol=1e-12)
    assert torch.equal(n, want_n)
    plain_sum, _, _ = scored_ce_sums(base, batch)  # the same weights without capping: another loss
    assert (plain_sum - want_sum).abs().max() > 1e-3
