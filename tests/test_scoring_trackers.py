"""The scoring trackers of the backward-pairs engine and the influence-metric interface, against brute-force
autograd per-example gradients (float64, a padded batch, a proxy with LowRankLinear layers)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from iprox_lightning.engine.batch import IGNORE_INDEX, per_example_loss
from iprox_lightning.engine.lowrank import LowRankLinear
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import (
    KFAC,
    InfluenceScoringModule,
    TracIn,
    influence_metric,
    influence_scores,
    tracin_scores,
    tracked_modules,
    virtual_linears,
)
from iprox_lightning.scoring.features import ScoreFeatureTracker, ValidationGradientTracker, WeightPairTracker
from iprox_lightning.scoring.metrics import KFACFactors
from iprox_lightning.engine.tracking import backward_pairs

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2)


def proxy(seed=0):
    model = tiny_causal_lm("llama", seed=seed, dtype=torch.float64, **TINY)
    g = torch.Generator().manual_seed(seed + 1)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for parent, leaf in ((attn, "q_proj"), (mlp, "up_proj")):
        old = getattr(parent, leaf)
        A = torch.randn(old.out_features, 3, generator=g, dtype=torch.float64) * 0.3
        B = torch.randn(3, old.in_features, generator=g, dtype=torch.float64) * 0.3
        setattr(parent, leaf, LowRankLinear.from_factors(A, B))
    return model


def batch(seed=0):
    """4 right-padded examples (one without response token), prompts masked, tasks a/b."""
    g = torch.Generator().manual_seed(seed)
    lengths, prompts = [7, 5, 6, 3], [2, 1, 3, 3]
    ids = torch.zeros(4, 8, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for b, (L, p) in enumerate(zip(lengths, prompts)):
        ids[b, :L] = torch.randint(3, 64, (L,), generator=g)
        mask[b, :L] = 1
        labels[b, p:L] = ids[b, p:L]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "id": list("wxyz"), "task": ["a", "b", "a", "b"]}


def per_example_grads(model, b):
    """{key: [B, out, in]} per-example gradients of L(z) by autograd, one example at a time."""
    keys, params = [], []
    for v in virtual_linears(tracked_modules(model)):
        m = model.get_submodule(v.module_name)
        keys.append(v.key)
        params.append(m.A if v.key.endswith(".A") else m.B if v.key.endswith(".B") else m.weight)
    losses, _ = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    out = {k: [] for k in keys}
    for loss in losses:
        gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        for k, p, g in zip(keys, params, gs):
            out[k].append(torch.zeros_like(p) if g is None else g)
    model.zero_grad(set_to_none=True)
    return {k: torch.stack(v) for k, v in out.items()}


class GradientSums(WeightPairTracker):
    """Per weight: Σ over the batch of the per-example gradients, and the padding rows of δ."""

    def __init__(self, modules):
        super().__init__(modules)
        self.sums, self.pad_delta = {}, {}

    def on_weight(self, key, h, delta):
        self.sums[key] = torch.einsum("bto,bti->oi", delta, h)
        self.pad_delta[key] = delta[~self.keep.squeeze(-1)]


def test_weight_pairs_give_every_weight_gradient_including_both_factors():
    model, b = proxy(), batch()
    modules = tracked_modules(model)
    t = GradientSums(modules)
    backward_pairs(model, b, [t])
    ref = per_example_grads(model, b)
    assert sorted(t.sums) == sorted(ref) and any(k.endswith(".A") for k in ref) and any(k.endswith(".B") for k in ref)
    for key, g in ref.items():
        torch.testing.assert_close(t.sums[key], g.sum(0), rtol=1e-10, atol=1e-13)
        assert t.pad_delta[key].abs().max() == 0  # δ zeroed on padding


def test_validation_gradient_tracker_sums_per_task():
    model, b = proxy(1), batch(1)
    modules = tracked_modules(model)
    keys = [v.key for v in virtual_linears(modules)]
    t = ValidationGradientTracker(modules, keys, lambda bb: list(bb["task"]), torch.float64)
    backward_pairs(model, b, [t])
    ref = per_example_grads(model, b)
    for key in keys:
        torch.testing.assert_close(t.sums[key]["a"], ref[key][[0, 2]].sum(0), rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(t.sums[key]["b"], ref[key][[1, 3]].sum(0), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("feature_mode", ["ghost", "materialize"])
def test_score_feature_tracker_norms_and_dots(feature_mode):
    model, b = proxy(2), batch(2)
    modules = tracked_modules(model)
    keys = [v.key for v in virtual_linears(modules)]
    ref = per_example_grads(model, b)
    g = torch.Generator().manual_seed(5)
    V = {k: torch.randn(2, *ref[k].shape[1:], generator=g, dtype=torch.float64) for k in keys}
    t = ScoreFeatureTracker(modules, influence_metric("tracin"), V, 2, torch.float64, feature_mode)
    backward_pairs(model, b, [t])
    sq = sum(ref[k].flatten(1).pow(2).sum(1) for k in keys)
    dots = sum(ref[k].flatten(1) @ V[k].flatten(1).t() for k in keys)
    torch.testing.assert_close(t.sq, sq, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(t.dots, dots, rtol=1e-10, atol=1e-13)
    assert t.sq[3] == 0  # the example without response token


def test_kfac_factors_and_metric_against_brute_force():
    model, b = proxy(3), batch(3)
    modules = tracked_modules(model)
    keys = [v.key for v in virtual_linears(modules)]
    fac = KFACFactors(modules)
    backward_pairs(model, b, [fac])
    # brute force: h and δ of every weight at the non-padding tokens, from hooks + autograd w.r.t. the outputs
    ins, outs = {}, {}
    hooked = {**modules, **{f"{n}.bottleneck": m.bottleneck for n, m in modules.items() if isinstance(m, LowRankLinear)}}

    def keep(name):
        def hook(mod, args, out):
            ins[name], outs[name] = args[0], out
        return hook

    hs = [m.register_forward_hook(keep(n)) for n, m in hooked.items()]
    losses, _ = per_example_loss(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    for h in hs:
        h.remove()
    grads = dict(zip(hooked, torch.autograd.grad(losses.sum(), [outs[n] for n in hooked])))
    valid = b["attention_mask"].bool()
    for name, m in modules.items():
        if isinstance(m, LowRankLinear):
            seam = f"{name}.bottleneck"
            pairs = {f"{name}.A": (ins[seam], grads[name]), f"{name}.B": (ins[name], grads[seam])}
        else:
            pairs = {f"{name}.weight": (ins[name], grads[name])}
        for key, (h, d) in pairs.items():
            h, d = h.detach()[valid], d[valid]
            torch.testing.assert_close(fac.sum_hh[key], h.t() @ h, rtol=1e-10, atol=1e-13)
            torch.testing.assert_close(fac.sum_dd[key], d.t() @ d, rtol=1e-10, atol=1e-13)
            assert fac.tokens[key] == int(valid.sum())
    # the whitening M = H^{-1/2}: ‖M G‖² = vec(G)ᵀ H⁻¹ vec(G) with H = C_δ,λ ⊗ C_h,λ, same on tokens and matrices
    errors, pairs = kfac_whitening(3)
    assert max(errors) <= WHITENING_RTOL, errors
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ‖M G‖² vs the direct solve (float64): relative error up to 2.2e-14 with ATen's AVX-512 and generic kernels but 4.2e-9
# with its AVX2 ones (tests/data/isa_spread.json, self_consistency; the former rel=1e-9 failed under
# ATEN_CPU_CAPABILITY=avx2): 9.5x that
WHITENING_RTOL = 4e-8


def test_whitening_tolerance_covers_the_measured_spread():
    spread = json.loads((Path(__file__).parent / "data" / "isa_spread.json").read_text())["self_consistency"]["spread"]
    assert WHITENING_RTOL >= 5 * spread["test_kfac_factors_and_metric_against_brute_force"]


def kfac_whitening(seed: int):
    """For the K-FAC metric fitted on ``batch(seed)`` of ``proxy(seed)``, per layer key: the relative error of
    ‖M G‖² against vec(G)ᵀ H⁻¹ vec(G) (H from the brute-force factors), and the pair (M applied to tokens, M applied
    to their matrix) that must agree (tests/isa_spread.py measures the errors under each CPU kernel set)."""
    model, b = proxy(seed), batch(seed)
    modules = tracked_modules(model)
    keys = [v.key for v in virtual_linears(modules)]
    fac = KFACFactors(modules)
    backward_pairs(model, b, [fac])
    metric = influence_metric("kfac", damping=1e-2, damping_mode="absolute", kfac_examples=4)
    metric.fit(model, modules, keys, [b], dtype=torch.float64)
    n = int(b["attention_mask"].sum())
    g = torch.Generator().manual_seed(seed)
    errors, pairs = [], []
    for key in keys:
        Ch, Cd = fac.sum_hh[key] / n, fac.sum_dd[key] / n
        H = torch.kron(Cd + 1e-2 * torch.eye(len(Cd), dtype=Cd.dtype), Ch + 1e-2 * torch.eye(len(Ch), dtype=Ch.dtype))
        G = torch.randn(len(Cd), len(Ch), generator=g, dtype=torch.float64)
        want = float(G.reshape(-1) @ torch.linalg.solve(H, G.reshape(-1)))
        errors.append(abs(float(metric.matrix(key, G).pow(2).sum()) - want) / abs(want))
        h = torch.randn(5, len(Ch), generator=g, dtype=torch.float64)
        d = torch.randn(5, len(Cd), generator=g, dtype=torch.float64)
        ht, dt = metric.tokens(key, h, d)
        pairs.append((dt.t() @ ht, metric.matrix(key, d.t() @ h)))
    return errors, pairs


def test_metric_interface_names_and_config_compatibility():
    model = proxy(4)
    train = [batch(4), batch(5)]
    for bb, tag in zip(train, "pq"):
        bb["id"] = [f"{tag}{i}" for i in bb["id"]]
    val = [batch(6)]
    # tracin_scores is influence_scores with the identity metric, by name or by instance
    t = tracin_scores(model, train, val, progress=False)
    for metric in ("tracin", influence_metric("tracin")):
        np.testing.assert_array_equal(influence_scores(model, train, val, metric=metric, progress=False).scores, t.scores)
    with pytest.raises(TypeError):
        tracin_scores(model, train, val, method="kfac", progress=False)
    # K-FAC by name with options == by instance; its settings carry the options, TracIn's none
    k1 = influence_scores(model, train, val, metric="kfac", damping=1e-2, kfac_examples=4, progress=False)
    k2 = influence_scores(model, train, val, metric=influence_metric("kfac", damping=1e-2, kfac_examples=4), progress=False)
    np.testing.assert_array_equal(k1.scores, k2.scores)
    assert np.abs(k1.scores - t.scores).max() > 1e-3
    assert k1.settings["method"] == "kfac" and k1.settings["damping"] == 1e-2 and k1.settings["kfac_examples"] == 4
    assert t.settings["method"] == "tracin" and "damping" not in t.settings
    with pytest.raises(TypeError, match="given by name"):
        influence_scores(model, train, val, metric=influence_metric("tracin"), damping=1e-2, progress=False)
    # the configs' `method: tracin|kfac` (+ damping options) select the metric of the Lightning module
    m = InfluenceScoringModule(model, method="kfac", damping=1e-2, damping_mode="absolute", kfac_examples=8)
    assert isinstance(m.metric, KFAC) and (m.metric.damping, m.metric.damping_mode, m.metric.examples) == (1e-2, "absolute", 8)
    assert m.metric.needs_factor_data and not InfluenceScoringModule(model).metric.needs_factor_data
    with pytest.raises(ValueError, match="InfluenceScoringModule: method must be one of"):
        InfluenceScoringModule(model, method="lissa")
    with pytest.raises(ValueError, match="damping_mode must be one of"):
        influence_metric("tracin", damping_mode="rel")
    with pytest.raises(ValueError, match="damping must be > 0"):
        influence_metric("kfac", damping=0.0)
