"""EK-FAC against a dense brute-force reference (eigen-corrected diagonal from materialised per-example gradients), its
use through the store's projections, and saved factors reused by fingerprint (K-FAC and EK-FAC)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from iprox_lightning.io.fingerprint import FingerprintMismatch
from iprox_lightning.models.tiny import tiny_causal_lm
from iprox_lightning.scoring import influence_scores
from iprox_lightning.scoring.features import tracked_modules, virtual_linears
from iprox_lightning.scoring.influence import influence_metric
from iprox_lightning.scoring.metrics import EKFAC, KFAC, fit_or_load
from iprox_lightning.scoring.projection import GradientProjector
from iprox_lightning.scoring.query import query_table, task_sums

from test_scoring_influence import (  # noqa: E402
    TINY, TRAIN, VAL, batches, make_examples, make_proxy, ref_example, tracked_params)

pytestmark = pytest.mark.usefixtures("one_thread")
FACTOR = make_examples(12, seed=3)
DAMPING = 1e-2



# cosine scores (|value| <= 1) computed by two float64 routes (EK-FAC's eigenbasis among them) differ by up to 9.5e-9
# under ATen's AVX2 kernels (1e-16 natively; cf. tests/data/isa_spread.json, self_consistency): 5e-7 holds on any
# x86 kernel set
KERNEL_ATOL = 5e-7

def dense_ekfac_inverse(model, factor_examples, damping):
    """Per weight ``H⁻¹ = Q diag(1/(Λ+λ)) Qᵀ`` (dense, ``[out·in]²``), ``Q = Q_δ ⊗ Q_h`` the eigenbases of the token
    second moments, ``Λ = mean_z (Q_δᵀ G_z Q_h)²`` from the autograd per-example gradients, ``λ = damping·mean(Λ)``."""
    refs = [ref_example(model, e) for e in factor_examples]
    out = {}
    for key, _, _ in tracked_params(model):
        hs = torch.cat([r[1][key][0] for r in refs])
        ds = torch.cat([r[1][key][1] for r in refs])
        _, Qh = torch.linalg.eigh(hs.t() @ hs / len(hs))
        _, Qd = torch.linalg.eigh(ds.t() @ ds / len(ds))
        lam = torch.stack([(Qd.t() @ r[0][key] @ Qh) ** 2 for r in refs]).mean(0).reshape(-1)
        Q = torch.kron(Qd, Qh)
        out[key] = Q @ torch.diag(1.0 / (lam + damping * lam.mean())) @ Q.t()
    return out


def dense_scores(model, Hinv, train, val):
    keys = [k for k, _, _ in tracked_params(model)]
    flat = lambda e: {k: g.reshape(-1) for k, g in ref_example(model, e)[0].items()}  # noqa: E731
    ip = lambda a, b: sum(float(a[k] @ Hinv[k] @ b[k]) for k in keys)  # noqa: E731
    G, Gv = [flat(e) for e in train], [flat(e) for e in val]
    tasks = sorted({e["task"] for e in val})
    vt = {t: {k: sum(g[k] for g, e in zip(Gv, val) if e["task"] == t) for k in keys} for t in tasks}
    vall = {k: sum(vt[t][k] for t in tasks) for k in keys}

    def cos(a, b):
        na, nb = math.sqrt(ip(a, a)), math.sqrt(ip(b, b))
        return 0.0 if na == 0 or nb == 0 else ip(a, b) / (na * nb)
    return ([cos(g, vall) for g in G], [[cos(g, vt[t]) for t in tasks] for g in G])


@pytest.mark.parametrize("proxy", [False, True])
def test_ekfac_scores_equal_the_dense_eigen_corrected_reference(proxy):
    model = make_proxy() if proxy else tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    want, want_t = dense_scores(model, dense_ekfac_inverse(model, FACTOR, DAMPING), TRAIN, VAL)
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric="ekfac", damping=DAMPING,
                             kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, 5), progress=False)
    np.testing.assert_allclose(table.scores, want, rtol=0, atol=KERNEL_ATOL)
    np.testing.assert_allclose(table.task_scores, want_t, rtol=0, atol=KERNEL_ATOL)
    # EK-FAC is not K-FAC: the corrected eigenvalues change the scores
    kfac = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric="kfac", damping=DAMPING,
                            kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, 5), progress=False)
    assert np.abs(kfac.scores - table.scores).max() > 1e-3


@pytest.mark.parametrize("proxy", [False, True])
@pytest.mark.parametrize("mode", ["ghost", "materialize"])
def test_plain_ekfac_scores_through_the_dual_directions_equal_the_dense_reference(proxy, mode):
    """``normalize=False`` takes ``⟨G, Q_δ (s²⊙V̂) Q_hᵀ⟩`` on the raw tokens (no training token rotated): the dense
    ``gᵀ H⁻¹ v`` over the validation counts, and the same zero-gradient flags as the cosine pass."""
    model = make_proxy() if proxy else tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    Hinv = dense_ekfac_inverse(model, FACTOR, DAMPING)
    keys = [k for k, _, _ in tracked_params(model)]
    flat = lambda e: {k: g.reshape(-1) for k, g in ref_example(model, e)[0].items()}  # noqa: E731
    ip = lambda a, b: sum(float(a[k] @ Hinv[k] @ b[k]) for k in keys)  # noqa: E731
    G, Gv = [flat(e) for e in TRAIN], [flat(e) for e in VAL]
    tasks = sorted({e["task"] for e in VAL})
    n_t = {t: sum(e["task"] == t for e in VAL) for t in tasks}
    vt = {t: {k: sum(g[k] for g, e in zip(Gv, VAL) if e["task"] == t) for k in keys} for t in tasks}
    vall = {k: sum(vt[t][k] for t in tasks) for k in keys}
    kw = dict(metric="ekfac", damping=DAMPING, kfac_examples=len(FACTOR), factor_dataloader=batches(FACTOR, 5),
              feature_mode=mode, progress=False)
    table = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), normalize=False, **kw)
    want = np.array([ip(g, vall) / len(VAL) for g in G])
    want_t = np.array([[ip(g, vt[t]) / n_t[t] for t in tasks] for g in G])
    # float64 both ways; under ATen's AVX2 kernels the two eigen-routes differ by up to 7e-8 of the largest |score|
    # (1e-15 natively): KERNEL_ATOL of it, as the cosines' bound
    np.testing.assert_allclose(table.scores, want, rtol=0, atol=KERNEL_ATOL * float(np.abs(want).max()))
    np.testing.assert_allclose(table.task_scores, want_t, rtol=0, atol=KERNEL_ATOL * float(np.abs(want_t).max()))
    cos = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), **kw)
    assert table.zero_grad.any() and (table.zero_grad == cos.zero_grad).all()


def test_ekfac_through_identity_projections_equals_ekfac_scoring():
    """A metric of the whole per-example gradient goes through the store's projection path unchanged."""
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    metric = influence_metric("ekfac", damping=DAMPING, kfac_examples=len(FACTOR))
    mods = tracked_modules(model)
    metric.fit(model, mods, [v.key for v in virtual_linears(mods)], batches(FACTOR, 5), dtype=torch.float64)
    proj = GradientProjector(model, k=10_000, metric=metric)
    names, S, _ = task_sums(proj.project_batch(b) for b in batches(VAL, 3))
    shards = []
    for b in batches(TRAIN, 4):
        p = proj.project_batch(b)
        shards.append({"ids": p["id"], "tasks": p["task"], "vectors": p["vectors"], **{
            k: torch.as_tensor(p[k]) for k in ("n_tokens", "zero_grad", "nonfinite")}})
    got = query_table(shards, names, S)
    exact = influence_scores(model, batches(TRAIN, 4), batches(VAL, 3), metric=metric,
                             factor_dataloader=batches(FACTOR, 5), progress=False)  # refits the same factors
    np.testing.assert_allclose(got.scores, exact.scores, rtol=0, atol=KERNEL_ATOL)
    np.testing.assert_allclose(got.task_scores, exact.task_scores, rtol=0, atol=KERNEL_ATOL)


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_factors_are_saved_once_and_reused_by_fingerprint(tmp_path, method):
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    mods = tracked_modules(model)
    keys = [v.key for v in virtual_linears(mods)]
    fp = {"model": "tiny", "data": "factor-digest"}
    calls = []

    def loader():
        calls.append(1)
        return batches(FACTOR, 5)

    def fit(metric, fingerprint=fp):
        return fit_or_load(metric, model, mods, keys, loader(), factors_dir=str(tmp_path), fingerprint=fingerprint,
                           dtype=torch.float64)

    first = influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR))
    st = fit(first)
    assert st["factors_reused"] is False and len(list(tmp_path.glob(f"{method}-*.safetensors"))) == 1
    again = influence_metric(method, damping=0.1, kfac_examples=len(FACTOR))  # damping is applied after loading
    st2 = fit(again)
    assert st2["factors_reused"] is True and st2["factors"] == st["factors"]
    G = torch.randn(3, *next(iter(first.eigens.values()))["e_d"].shape, len(first.eigens[keys[0]]["e_h"]),
                    dtype=torch.float64)
    same = influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR))
    fit(same)
    assert all(torch.equal(t, first.state_dict()[k]) for k, t in same.state_dict().items())  # bit for bit
    torch.testing.assert_close(same.matrix(keys[0], G), first.matrix(keys[0], G), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(again.matrix(keys[0], G), first.matrix(keys[0], G))
    # a changed input never reuses the old file
    fit(influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR) - 2))
    fit(influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR)), {**fp, "data": "other"})
    assert len(list(tmp_path.glob(f"{method}-*.safetensors"))) == 3
    # a file whose recorded fingerprint is not its name's is refused; safetensors only
    files = sorted(tmp_path.glob(f"{method}-*.safetensors"))
    files[0].write_bytes(files[1].read_bytes())
    with pytest.raises(FingerprintMismatch, match="fitted on other inputs"):
        for f in (fp, {**fp, "data": "other"}):
            fit(influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR)), f)
            fit(influence_metric(method, damping=DAMPING, kfac_examples=len(FACTOR) - 2))
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.pkl"))


@pytest.mark.parametrize("first", ["kfac", "ekfac"])
def test_ekfac_and_kfac_share_the_kfac_factors_on_disk(tmp_path, monkeypatch, first):
    """EK-FAC corrects the eigenvalues of K-FAC's eigenbases: with a K-FAC fit of the same inputs saved, it loads it
    instead of a second K-FAC pass, and an EK-FAC fit saves its K-FAC part for a later K-FAC run; the fitted state
    is the one fitted from scratch."""
    import iprox_lightning.scoring.metrics as metrics

    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    mods = tracked_modules(model)
    keys = [v.key for v in virtual_linears(mods)]
    fresh = {m: _fitted(m, model, FACTOR).state_dict() for m in ("kfac", "ekfac")}
    passes = []
    real = metrics._factor_batches
    monkeypatch.setattr(metrics, "_factor_batches", lambda *a, **k: passes.append(a[5]) or real(*a, **k))
    fit = lambda m: fit_or_load(influence_metric(m, damping=DAMPING, kfac_examples=len(FACTOR)), model, mods, keys,  # noqa: E731
                                batches(FACTOR, 5), factors_dir=str(tmp_path), fingerprint={"model": "tiny"},
                                dtype=torch.float64)
    second = {"kfac": "ekfac", "ekfac": "kfac"}[first]
    fit(first)
    assert sorted(f.name.split("-")[0] for f in tmp_path.glob("*.safetensors")) == sorted({"kfac", first})
    passes.clear()
    st = fit(second)
    assert passes == (["EK-FAC eigenvalues"] if second == "ekfac" else [])  # no second K-FAC pass
    assert st.get("kfac_factors_reused", st.get("factors_reused")) is True
    for m in ("kfac", "ekfac"):
        again = influence_metric(m, damping=DAMPING, kfac_examples=len(FACTOR))
        assert fit_or_load(again, model, mods, keys, None, factors_dir=str(tmp_path), fingerprint={"model": "tiny"},
                           dtype=torch.float64)["factors_reused"] is True
        assert again.state_dict().keys() == fresh[m].keys()
        for k, t in again.state_dict().items():  # equal up to rounding (loaded eigenvectors are laid out otherwise)
            torch.testing.assert_close(t, fresh[m][k], rtol=1e-10, atol=1e-12 * float(fresh[m][k].abs().max()))


def test_ekfac_is_a_method_name():
    assert isinstance(influence_metric("ekfac"), EKFAC) and isinstance(influence_metric("kfac"), KFAC)
    assert EKFAC.token_factored is False and KFAC.token_factored is True
    with pytest.raises(NotImplementedError, match="does not factor over tokens"):
        influence_metric("ekfac").tokens("w", torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))


# ------------------------------------------------------------------------------------------------ store projections
def _fitted(method, model, examples):
    mods = tracked_modules(model)
    metric = influence_metric(method, damping=DAMPING, kfac_examples=len(examples))
    metric.fit(model, mods, [v.key for v in virtual_linears(mods)], batches(examples, 5), dtype=torch.float64)
    return metric


def _vectors(model, metric, k, seed=4):
    proj = GradientProjector(model, k=k, seed=seed, metric=metric)
    return proj, torch.cat([proj.project_batch(b)["vectors"] for b in batches(TRAIN, 4)])


def _sym_pow(C, p):
    """``C^p`` of a symmetric positive definite ``C`` (a function of ``C`` alone, whatever basis ``eigh`` picks)."""
    e, Q = torch.linalg.eigh(C)
    return Q @ torch.diag(e ** p) @ Q.t()


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_store_vectors_are_the_projected_whitened_gradient_in_weight_coordinates(method):
    """Brute force, from autograd per-example gradients ``G`` and the dense token second moments ``C_h``, ``C_δ`` of
    the factor examples: K-FAC's vector is ``P_δ C_δ,λ^{-1/2} G C_h,λ^{-1/2} P_hᵀ`` (``λ = damping·tr C/dim``; the
    matrix powers do not depend on an eigenbasis); EK-FAC's is ``P_δ Q_δ ((Q_δᵀ G Q_h) / sqrt(Λ + λ)) Q_hᵀ P_hᵀ``
    (``Q`` from ``eigh`` here; the factor examples' second moments have distinct eigenvalues, so ``Q`` is unique up
    to signs, which cancel)."""
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    metric = _fitted(method, model, FACTOR)
    proj, got = _vectors(model, metric, k=5)
    assert any(p.P_in is not None and p.P_out is not None for p in proj.projections.values())
    refs = [ref_example(model, e) for e in FACTOR]
    white = {}
    for key, _, _ in tracked_params(model):
        hs = torch.cat([r[1][key][0] for r in refs])
        ds = torch.cat([r[1][key][1] for r in refs])
        Ch, Cd = hs.t() @ hs / len(hs), ds.t() @ ds / len(ds)
        if method == "kfac":
            Wh = _sym_pow(Ch + DAMPING * torch.trace(Ch) / len(Ch) * torch.eye(len(Ch), dtype=Ch.dtype), -0.5)
            Wd = _sym_pow(Cd + DAMPING * torch.trace(Cd) / len(Cd) * torch.eye(len(Cd), dtype=Cd.dtype), -0.5)
            white[key] = lambda G, Wh=Wh, Wd=Wd: Wd @ G @ Wh
        else:
            eh, Qh = torch.linalg.eigh(Ch)
            ed, Qd = torch.linalg.eigh(Cd)
            assert (eh.diff() > 1e-9 * eh.abs().max()).all() and (ed.diff() > 1e-9 * ed.abs().max()).all()
            lam = torch.stack([(Qd.t() @ r[0][key] @ Qh) ** 2 for r in refs]).mean(0)
            s = (lam + DAMPING * lam.mean()).rsqrt()
            white[key] = lambda G, Qh=Qh, Qd=Qd, s=s: Qd @ ((Qd.t() @ G @ Qh) * s) @ Qh.t()
    want = []
    for e in TRAIN:
        layer_g, _ = ref_example(model, e)
        parts = []
        for key, _, _ in tracked_params(model):
            p = proj.projections[key]
            G = white[key](layer_g[key])
            G = G if p.P_out is None else p.P_out.double() @ G
            G = G if p.P_in is None else G @ p.P_in.double().t()
            parts.append(G.reshape(-1))
        want.append(torch.cat(parts))
    want = torch.stack(want)
    # float64 both ways: 1e-14 of the largest |value| natively and under ATen's generic kernels; under its AVX2 kernels
    # the model's float64 forward rounds otherwise (cf. KERNEL_ATOL) and the whitening amplifies it: 3.7e-8 measured
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_store_vectors_do_not_depend_on_the_eigensolvers_choice_of_eigenvectors(method):
    """Two builds of one store (one process or two, another machine) round the factors differently, and ``eigh`` may
    then return other eigenvector signs or, for a repeated eigenvalue (K-FAC factors fitted on fewer tokens than a
    layer's width: the null space), any basis of its space. The stored vectors must not follow: eigenvectors with
    flipped signs (and, for K-FAC, rotated within the null space) give the same vectors and query scores."""
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    few = FACTOR[:2]  # fewer tokens than the MLP's width: rank-deficient second moments
    metric = _fitted(method, model, few)
    _, before = _vectors(model, metric, k=5)
    g = torch.Generator().manual_seed(0)
    state = metric.state_dict()
    rotated = 0
    for key in metric.eigens:
        for side in ("h", "d"):
            Q, e = state[f"{key}|Q_{side}"].clone(), state[f"{key}|e_{side}"]
            Q = Q * torch.where(torch.rand(Q.shape[1], generator=g) < 0.5, -1.0, 1.0).to(Q)  # column signs
            null = torch.nonzero(e.abs() <= 1e-12 * e.abs().max()).flatten()
            if method == "kfac" and len(null) > 1:  # another orthonormal basis of the null space
                R, _ = torch.linalg.qr(torch.randn(len(null), len(null), generator=g, dtype=Q.dtype))
                Q[:, null] = Q[:, null] @ R
                rotated += 1
            state[f"{key}|Q_{side}"] = Q
    assert method == "ekfac" or rotated > 0
    other = influence_metric(method, damping=DAMPING, kfac_examples=len(few))
    other.load_state_dict(state, list(metric.eigens), dtype=torch.float64)
    _, after = _vectors(model, other, k=5)
    assert not torch.equal(state[f"{key}|Q_h"], metric.state_dict()[f"{key}|Q_h"])
    torch.testing.assert_close(after, before, rtol=0, atol=1e-9 * float(before.abs().max()))


@pytest.mark.parametrize("T", [3, 200])  # 3 tokens: rotate the tokens first; 200: rotate the formed gradient
def test_eigenbasis_gradients_equal_the_rotated_materialised_gradients(T):
    from iprox_lightning.scoring.metrics import eigenbasis_gradients

    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(2, T, 7, generator=g, dtype=torch.float64), torch.randn(2, T, 5, generator=g, dtype=torch.float64)
    Q_h = torch.linalg.qr(torch.randn(7, 7, generator=g, dtype=torch.float64))[0]
    Q_d = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))[0]
    want = torch.stack([Q_d.t() @ sum(torch.outer(d[b, t], h[b, t]) for t in range(T)) @ Q_h for b in range(2)])
    torch.testing.assert_close(eigenbasis_gradients(h, d, Q_h, Q_d), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sums", [torch.float32, torch.float64])
def test_factor_passes_on_float32_tokens_match_float64_sums_to_float32_precision(sums):
    """A float32 model's factor pass multiplies each batch's tokens in float32 (kronfluence's default) and sums the
    batches in float32 (the default ``kfac_dtype``, kronfluence's) or float64: the K-FAC second moments and EK-FAC's
    eigenvalue sums equal float64 brute force to float32 rounding (1e-5 of the largest entry), in the sums' dtype."""
    from iprox_lightning.scoring.metrics import EigenCorrection, KFACFactors

    g = torch.Generator().manual_seed(1)
    steps = [(torch.randn(3, 9, 24, generator=g, dtype=torch.float64),
              torch.randn(3, 9, 40, generator=g, dtype=torch.float64),
              (torch.rand(3, 9, generator=g) < 0.8).long()) for _ in range(4)]
    Q_h = torch.linalg.qr(torch.randn(24, 24, generator=g, dtype=torch.float64))[0]
    Q_d = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))[0]
    kf, ec = KFACFactors({}, sums), EigenCorrection({}, {"w": (Q_h.float(), Q_d.float())}, sums)
    for h, d, mask in steps:
        for tr in (kf, ec):
            tr.start_step({"attention_mask": mask})
            tr.on_weight("w", h.float(), (d * mask[..., None]).float())
    hs = torch.cat([h[mask.bool()] for h, _, mask in steps])
    ds = torch.cat([d[mask.bool()] for _, d, mask in steps])
    lam = sum(((Q_d.t() @ (d * m[..., None]).transpose(1, 2) @ h @ Q_h) ** 2).sum(0) for h, d, m in steps)
    for got, want in ((kf.sum_hh["w"], hs.t() @ hs), (kf.sum_dd["w"], ds.t() @ ds), (ec.sums["w"], lam)):
        assert got.dtype == sums
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_a_metric_registers_once_by_its_class_keyword():
    from iprox_lightning.errors import UserInputError
    from iprox_lightning.scoring.influence import influence_metric
    from iprox_lightning.scoring.metrics import EKFAC, KFAC, InfluenceMetric, TracIn, metric_names

    class Doubled(InfluenceMetric, name="doubled_for_test"):
        def fit(self, *a, **k):
            return {}

        def matrix(self, key, G):
            return 2 * G

    try:
        metric = influence_metric("doubled_for_test")
        assert isinstance(metric, Doubled) and metric.name == "doubled_for_test" and not metric.needs_factor_data
        assert "doubled_for_test" in metric_names()
        G = torch.arange(6.0).reshape(2, 3)
        assert torch.equal(metric.matrix("w", G), 2 * G)
        with pytest.raises(TypeError, match="taken"):
            class Again(InfluenceMetric, name="doubled_for_test"):
                pass
    finally:
        InfluenceMetric.registry.pop("doubled_for_test")
    with pytest.raises(UserInputError, match="doubled_for_test"):
        influence_metric("doubled_for_test")
    assert metric_names()[:3] == ("tracin", "kfac", "ekfac")
    assert (TracIn.factor_passes, KFAC.factor_passes, EKFAC.factor_passes) == (0, 1, 2)
    assert isinstance(influence_metric("ekfac", kfac_examples=7), EKFAC) and influence_metric("ekfac").needs_factor_data
    assert influence_metric("kfac", kfac_examples=7).examples == 7


def test_a_factor_file_whose_tensors_were_changed_is_refused(tmp_path):
    """Issue 57: an altered K-FAC factor file in a shared factors dir was loaded (vectors off by up to 1.8e3). The file
    records a digest of its tensors; a changed tensor (metadata kept) or a file without the digest is refused."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    from iprox_lightning.io.gradient_store import StoreFormatError

    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64, **TINY)
    mods = tracked_modules(model)
    keys = [v.key for v in virtual_linears(mods)]
    fp = {"model": "tiny", "data": "factor-digest"}

    def fit():
        return fit_or_load(influence_metric("kfac", damping=DAMPING, kfac_examples=len(FACTOR)), model, mods, keys,
                           batches(FACTOR, 5), factors_dir=str(tmp_path), fingerprint=fp, dtype=torch.float64)

    path = fit()["factors"]
    assert fit()["factors_reused"] is True
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 2  # altered, metadata (fingerprint) kept
    save_file(tensors, path, metadata=meta)
    with pytest.raises(StoreFormatError, match="'content_sha256' differs"):
        fit()
    del meta["content_sha256"]
    save_file(load_file(path), path, metadata=meta)
    with pytest.raises(StoreFormatError, match="'content_sha256' missing"):
        fit()
