"""The loss and curvature conventions of the peers (``loss_reduction``, ``fisher``, ``damping_target``): scores against
a brute-force autograd reference on a tiny float64 model, the sampled labels, the store's path, and the settings and
fingerprints that record them (only when not the default). The cross-check against kronfluence's own code:
``tests/test_peers_kronfluence.py``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from iprox_lightning.engine.batch import IGNORE_INDEX, sample_targets, shifted_token_mask
from iprox_lightning.errors import UserInputError
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import influence_scores
from iprox_lightning.scoring.features import tracked_modules, virtual_linears
from iprox_lightning.scoring.influence import ScoringConfig
from iprox_lightning.scoring.influence import influence_metric
from iprox_lightning.scoring.metrics import FISHER_SEED, fit_or_load
from iprox_lightning.scoring.projection import GradientProjector
from iprox_lightning.scoring.query import query_table, task_sums

from test_scoring_influence import TINY, batches, collate, make_examples, tracked_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = make_examples(7, seed=11)
VAL = make_examples(5, seed=12, tasks=["a", "b"])
FACTOR = make_examples(10, seed=13)
FACTOR_BS = 4
DAMPING = 1e-2
# inner products and cosines of two float64 routes: ~1e-12 natively; 5e-7 (relative to the largest value) holds on any
# x86 kernel set (tests/test_ekfac.py, KERNEL_ATOL)
RTOL = 5e-7


def model64():
    return tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)


def ref_grads(model, ex, reduction, targets=None):
    """Per tracked weight ``(G [out, in], h [T, in], δ [T, out])`` of one example's loss ``L(z)`` (autograd, batch of
    one): the ``reduction`` (mean / sum) of its response tokens' cross-entropies against their labels, or against
    ``targets`` (one per scored position)."""
    tp = tracked_params(model)
    ins, outs = {}, {}
    def keep(key):
        def hook(mod, args, out):
            ins[key], outs[key] = args[0], out
        return hook

    hooks = [m.register_forward_hook(keep(k)) for k, m, _ in tp]
    try:
        ids = ex["input_ids"][None]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0]
        mask = shifted_token_mask(ex["labels"][None])[0]
        t = ex["labels"][1:][mask[:-1]] if targets is None else targets
        ce = F.cross_entropy(logits[mask], t, reduction="sum")
        loss = ce / max(int(mask.sum()), 1) if reduction == "mean" else ce
        weights = [m.weight for _, m, _ in tp]
        g = torch.autograd.grad(loss, weights + [outs[k] for k, _, _ in tp])
    finally:
        for h in hooks:
            h.remove()
    n = len(tp)
    return {k: (g[i], ins[k][0].detach(), g[n + i][0]) for i, (k, _, _) in enumerate(tp)}


def sampled(model, examples, bs):
    """Per example: the labels a sampled Fisher draws for it (batch ``j`` of ``bs`` with ``FISHER_SEED + j``)."""
    out = []
    for j, b in enumerate(batches(examples, bs)):
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
        mask = shifted_token_mask(b["labels"])
        t = sample_targets(logits[mask], FISHER_SEED + j)
        counts = mask.sum(1).tolist()
        out += list(torch.split(t, counts))
    return out


def ref_inverse(model, method, reduction, fisher, target, damping=DAMPING):
    """Per weight the dense ``H⁻¹`` (``[out·in]²``) of ``method`` from autograd per-example gradients of the factor
    examples: K-FAC's ``Q diag(1/(e_δ,λ ⊗ e_h,λ)) Qᵀ`` (damped per factor) or ``Q diag(1/(e_δ ⊗ e_h + λ)) Qᵀ``
    (damped product), EK-FAC's ``Q diag(1/(Λ + λ)) Qᵀ``; relative damping."""
    targets = sampled(model, FACTOR, FACTOR_BS) if fisher == "sampled" else [None] * len(FACTOR)
    refs = [ref_grads(model, e, reduction, t) for e, t in zip(FACTOR, targets)]
    out = {}
    for key, _, _ in tracked_params(model):
        hs = torch.cat([r[key][1] for r in refs])
        ds = torch.cat([r[key][2] for r in refs])
        e_h, Qh = torch.linalg.eigh(hs.t() @ hs / len(hs))
        e_d, Qd = torch.linalg.eigh(ds.t() @ ds / len(ds))
        e_h, e_d = e_h.clamp(min=0), e_d.clamp(min=0)
        if method == "ekfac":
            lam = torch.stack([(Qd.t() @ r[key][0] @ Qh) ** 2 for r in refs]).mean(0).reshape(-1)
            lam = lam + damping * lam.mean()
        elif target == "product":
            lam = torch.outer(e_d, e_h).reshape(-1)
            lam = lam + damping * lam.mean()
        else:
            lam = torch.outer(e_d + damping * e_d.mean(), e_h + damping * e_h.mean()).reshape(-1)
        Q = torch.kron(Qd, Qh)
        out[key] = Q @ torch.diag(1.0 / lam) @ Q.t()
    return out


def ref_dots(model, Hinv, reduction):
    """``⟨g(z), H⁻¹ ḡ_T⟩`` per training example and validation task (``[N, K]``), ``ḡ_T`` the mean over the task's
    validation examples (``H⁻¹ = I`` for ``Hinv=None``)."""
    keys = [k for k, _, _ in tracked_params(model)]
    flat = lambda e: {k: v[0].reshape(-1) for k, v in ref_grads(model, e, reduction).items()}  # noqa: E731
    tasks = sorted({e["task"] for e in VAL})
    gv = {t: [flat(e) for e in VAL if e["task"] == t] for t in tasks}
    vbar = {t: {k: sum(g[k] for g in gv[t]) / len(gv[t]) for k in keys} for t in tasks}
    G = [flat(e) for e in TRAIN]
    ip = lambda a, b, k: float(a[k] @ (b[k] if Hinv is None else Hinv[k] @ b[k]))  # noqa: E731
    return np.array([[sum(ip(g, vbar[t], k) for k in keys) for t in tasks] for g in G])


def ours(model, method, **conventions):
    return influence_scores(model, batches(TRAIN, 3), batches(VAL, 2), metric=method, damping=DAMPING,
                            kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, FACTOR_BS), normalize=False,
                            progress=False, **conventions)


@pytest.mark.parametrize("method,reduction,fisher,target", [
    ("tracin", "sum", "empirical", "factors"),
    ("kfac", "sum", "empirical", "factors"),
    ("kfac", "mean", "empirical", "product"),
    ("kfac", "sum", "sampled", "product"),
    ("ekfac", "sum", "empirical", "factors"),
    ("ekfac", "mean", "sampled", "factors"),
])
def test_each_convention_equals_the_brute_force_reference(method, reduction, fisher, target):
    """Inner products ``⟨g(z), H⁻¹ ḡ_T⟩`` (``normalize=False``: every scale shows) of each convention against autograd
    per-example gradients of the same loss, factors and damping."""
    model = model64()
    table = ours(model, method, loss_reduction=reduction, fisher=fisher, damping_target=target)
    Hinv = None if method == "tracin" else ref_inverse(model, method, reduction, fisher, target)
    want = ref_dots(model, Hinv, reduction)
    scale = np.abs(want).max()
    np.testing.assert_allclose(table.task_scores, want, rtol=0, atol=RTOL * scale)
    st = table.settings
    assert st.get("loss_reduction", "mean") == reduction
    if method != "tracin":
        assert st.get("fisher", "empirical") == fisher
    # a convention that is not the default changes the numbers (else the test would not see it)
    default = ours(model, method)
    assert np.abs(default.task_scores - table.task_scores).max() > 1e-3 * scale


def test_sampled_labels_follow_the_model_and_the_seed():
    """``sample_targets``: frequencies of the softmax (5 sigma of 40,000 draws), the same draw for the same seed,
    another for another seed."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0, -30.0]]).repeat(40_000, 1)
    t = sample_targets(logits, 3)
    p = torch.softmax(logits[0].double(), 0)
    freq = torch.bincount(t, minlength=5).double() / len(t)
    assert torch.all((freq - p).abs() <= 5 * (p * (1 - p) / len(t)).sqrt() + 1e-12)
    assert torch.equal(t, sample_targets(logits, 3)) and not torch.equal(t, sample_targets(logits, 4))
    assert torch.equal(sample_targets(logits.float(), 3), t)  # the same labels whatever the logits' precision


def test_sum_reduction_through_the_store_equals_exact_scoring():
    """A store of exact (k large) ``sum``-loss EK-FAC gradients, queried, gives the exact scores."""
    model = model64()
    metric = influence_metric("ekfac", damping=DAMPING, kfac_examples=len(FACTOR), loss_reduction="sum")
    mods = tracked_modules(model)
    metric.fit(model, mods, [v.key for v in virtual_linears(mods)], batches(FACTOR, FACTOR_BS), dtype=torch.float64)
    proj = GradientProjector(model, k=10_000, metric=metric)
    names, S, _ = task_sums(proj.project_batch(b) for b in batches(VAL, 2))
    shards = []
    for b in batches(TRAIN, 3):
        p = proj.project_batch(b)
        shards.append({"ids": p["id"], "tasks": p["task"], "vectors": p["vectors"], **{
            k: torch.as_tensor(p[k]) for k in ("n_tokens", "zero_grad", "nonfinite")}})
    got = query_table(shards, names, S)
    exact = influence_scores(model, batches(TRAIN, 3), batches(VAL, 2), metric=metric,
                             factor_dataloader=batches(FACTOR, FACTOR_BS), progress=False)
    np.testing.assert_allclose(got.task_scores, exact.task_scores, rtol=0, atol=RTOL)
    tracin = GradientProjector(model, k=10_000, loss_reduction="sum")  # TracIn: the reduction without a metric
    assert tracin.loss_fn is not GradientProjector(model, k=10_000).loss_fn


def test_defaults_leave_settings_and_fingerprints_as_before(tmp_path):
    """The defaults are not written (fingerprints of earlier runs still match); a changed convention is, in the score
    settings, the store's settings and the factor file's fingerprint (no fit is reused across conventions)."""
    d = ScoringConfig(method="ekfac").to_dict()
    assert not {"loss_reduction", "fisher", "damping_target"} & set(d)
    assert ScoringConfig(method="ekfac", fisher="sampled").to_dict()["fisher"] == "sampled"
    assert ScoringConfig(**ScoringConfig(loss_reduction="sum").to_dict()).loss_reduction == "sum"
    # kfac_dtype is always recorded by K-FAC / EK-FAC: its default moved from float64 to float32 sums (issue 64), so
    # a score table or factor file of the float64 default before it is not taken for a float32 one
    assert influence_metric("kfac").settings() == {"damping": 1e-3, "damping_mode": "relative", "kfac_examples": 1024,
                                                   "kfac_dtype": "float32"}
    assert influence_metric("tracin").settings() == {}
    assert influence_metric("tracin", loss_reduction="sum").settings() == {"loss_reduction": "sum"}
    assert influence_metric("kfac", damping_target="product").settings()["damping_target"] == "product"
    assert "damping_target" not in influence_metric("ekfac", damping_target="product").settings()
    model = model64()
    mods = tracked_modules(model)
    keys = [v.key for v in virtual_linears(mods)]
    files = set()
    for conv in ({}, {"fisher": "sampled"}, {"loss_reduction": "sum"}, {"damping_target": "product"}):
        st = fit_or_load(influence_metric("kfac", damping=DAMPING, kfac_examples=4, **conv), model, mods, keys,
                         batches(FACTOR[:4], 4), factors_dir=str(tmp_path), fingerprint={"m": 1}, dtype=torch.float64)
        files.add((st["factors"], st["factors_reused"]))
    # damping_target is applied after loading: the default's factors are reused; the other two are fitted anew
    assert len({f for f, _ in files}) == 3 and sum(r for _, r in files) == 1


def test_store_settings_record_a_changed_convention():
    from iprox_lightning.scoring.store import GradientStoreModule

    base = GradientStoreModule(model64(), method="kfac").settings()
    assert not {"loss_reduction", "fisher", "damping_target"} & set(base)
    st = GradientStoreModule(model64(), method="kfac", loss_reduction="sum", fisher="sampled",
                             damping_target="product").settings()
    assert (st["loss_reduction"], st["fisher"], st["damping_target"]) == ("sum", "sampled", "product")


@pytest.mark.parametrize("field,value", [("loss_reduction", "token"), ("fisher", "true"), ("damping_target", "both")])
def test_a_bad_convention_is_a_user_error_naming_it(field, value):
    with pytest.raises(UserInputError, match=field):
        ScoringConfig(**{field: value})


def test_a_token_of_no_response_is_never_sampled_into_the_loss():
    """Prompt and padding positions stay out of a sampled Fisher's loss: only scored positions get labels."""
    b = collate(FACTOR[:3], 2)
    mask = shifted_token_mask(b["labels"])
    assert int(mask.sum()) == sum(int((e["labels"][1:] != IGNORE_INDEX).sum()) for e in FACTOR[:3])
