"""IPSVD factor math against brute-force references (explicit damped second moments, matrix
square roots by eigendecomposition, full SVD)."""
import pytest
import torch

from iprox_lightning.compression.ipsvd import (
    damping_values,
    ipsvd_factors,
    random_factors,
    svd_factors,
    weighted_objective,
)

F64 = torch.float64


def _problem(out_f, in_f, N, seed=0, delta_scale=1e-3):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out_f, in_f, generator=g, dtype=F64)
    # correlated, anisotropic probes, like real activations / gradients
    H = torch.randn(in_f, in_f, generator=g, dtype=F64) @ torch.randn(in_f, N, generator=g, dtype=F64)
    H = H + 3.0 * torch.randn(in_f, 1, generator=g, dtype=F64)
    Delta = delta_scale * (torch.randn(out_f, out_f, generator=g, dtype=F64) @ torch.randn(out_f, N, generator=g, dtype=F64))
    return W, H, Delta


def _lambdas_ref(H, Delta, damping, damping_mode):
    N = H.shape[1]
    Ch, Cd = H @ H.T / N, Delta @ Delta.T / N
    if damping_mode == "absolute":
        return Ch, Cd, damping, damping
    return Ch, Cd, damping * torch.trace(Ch).item() / H.shape[0], damping * torch.trace(Cd).item() / Delta.shape[0]


def _sqrtm(C, power):
    evals, evecs = torch.linalg.eigh(C)
    return evecs @ torch.diag(evals.clamp(min=0) ** power) @ evecs.T


def exact_reference(W, H, Delta, rank, damping, damping_mode):
    """Dense brute force: explicit damped C's, eigh square roots, full SVD of S."""
    Ch, Cd, lh, ld = _lambdas_ref(H, Delta, damping, damping_mode)
    Chl = Ch + lh * torch.eye(Ch.shape[0], dtype=F64)
    Cdl = Cd + ld * torch.eye(Cd.shape[0], dtype=F64)
    S = _sqrtm(Cdl, 0.5) @ W @ _sqrtm(Chl, 0.5)
    U, s, Vh = torch.linalg.svd(S, full_matrices=True)
    A = _sqrtm(Cdl, -0.5) @ U[:, :rank] @ torch.diag(s[:rank].sqrt())
    B = torch.diag(s[:rank].sqrt()) @ Vh[:rank] @ _sqrtm(Chl, -0.5)
    return A, B, Cdl, Chl


def core_reference(W, H, Delta, rank, damping, damping_mode):
    """The appendix formula, literally."""
    N = H.shape[1]
    _, _, lh, ld = _lambdas_ref(H, Delta, damping, damping_mode)
    UH, SH, _ = torch.linalg.svd(H, full_matrices=False)
    UD, SD, _ = torch.linalg.svd(Delta, full_matrices=False)
    DH = torch.diag(torch.sqrt(SH**2 / N + lh))
    DD = torch.diag(torch.sqrt(SD**2 / N + ld))
    M = DD @ UD.T @ W @ UH @ DH
    P, s, Qh = torch.linalg.svd(M)
    A = UD @ torch.linalg.inv(DD) @ P[:, :rank] @ torch.diag(s[:rank].sqrt())
    B = torch.diag(s[:rank].sqrt()) @ Qh[:rank] @ torch.linalg.inv(DH) @ UH.T
    return A, B


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _components(A, B):
    """Sign-invariant rank-one components a_i b_iᵀ, stacked."""
    return torch.einsum("or,ri->roi", A.to(F64), B.to(F64))


SHAPES = [  # (out, in, N, rank)
    (20, 12, 8, 4),
    (12, 20, 30, 10),  # N > in, out
    (16, 16, 5, 9),  # rank > N
    (40, 24, 16, 20),  # rank > N, out != in
    (24, 40, 64, 12),
]


@pytest.mark.parametrize("damping_mode,damping", [("relative", 1e-2), ("absolute", 1e-3), ("relative", 1.0)])
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_matches_bruteforce(shape, damping_mode, damping):
    out_f, in_f, N, r = shape
    W, H, Delta = _problem(out_f, in_f, N, seed=out_f + N)
    A_ref, B_ref, _, _ = exact_reference(W, H, Delta, r, damping, damping_mode)
    for compute_dtype, tol in ((None, 1e-6), (F64, 1e-6)):
        A, B = ipsvd_factors(W, H, Delta, r, damping=damping, damping_mode=damping_mode, mode="exact",
                             split="paper", compute_dtype=compute_dtype)
        assert A.dtype == torch.float32 and A.shape == (out_f, r) and B.shape == (r, in_f)
        # float32 outputs: compare at float32 resolution
        tol = max(tol, 1e-6)
        assert _rel(A.double() @ B.double(), A_ref @ B_ref) < tol
        # every component (and so the paper's split of A and B) matches, up to the SVD sign
        assert _rel(_components(A, B), _components(A_ref, B_ref)) < 10 * tol
        assert torch.allclose(A.double().norm(dim=0), A_ref.norm(dim=0), rtol=10 * tol)


@pytest.mark.parametrize("damping_mode,damping", [("relative", 1e-2), ("absolute", 1e-3)])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[3] <= s[2]])
def test_core_matches_appendix_formula(shape, damping_mode, damping):
    out_f, in_f, N, r = shape
    W, H, Delta = _problem(out_f, in_f, N, seed=3 * out_f + N)
    A_ref, B_ref = core_reference(W, H, Delta, r, damping, damping_mode)
    A, B = ipsvd_factors(W, H, Delta, r, damping=damping, damping_mode=damping_mode, mode="core", split="paper")
    assert _rel(A.double() @ B.double(), A_ref @ B_ref) < 1e-6
    assert _rel(_components(A, B), _components(A_ref, B_ref)) < 1e-5
    assert torch.allclose(B.double().norm(dim=1), B_ref.norm(dim=1), rtol=1e-5)


def test_core_equals_exact_when_probes_span_everything():
    W, H, Delta = _problem(10, 14, 40, seed=5)  # N >= in, out: U_H, U_Δ are square
    for dm in ("relative", "absolute"):
        Ae, Be = ipsvd_factors(W, H, Delta, 6, mode="exact", damping_mode=dm, compute_dtype=F64)
        Ac, Bc = ipsvd_factors(W, H, Delta, 6, mode="core", damping_mode=dm)
        assert _rel(Ac.double() @ Bc.double(), Ae.double() @ Be.double()) < 1e-6
        assert torch.allclose(Ac, Ae, rtol=1e-4, atol=1e-6) and torch.allclose(Bc, Be, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("damping_mode,damping", [("relative", 1e-2), ("absolute", 1e-3), ("relative", 1e-1)])
def test_exact_objective_is_smallest(seed, damping_mode, damping):
    W, H, Delta = _problem(32, 24, 12, seed=seed)
    kw = dict(damping=damping, damping_mode=damping_mode)
    r = 8
    J = {}
    for mode in ("exact", "core"):
        J[mode] = weighted_objective(W, *ipsvd_factors(W, H, Delta, r, mode=mode, compute_dtype=F64, **kw), H, Delta, **kw)
    J["svd"] = weighted_objective(W, *svd_factors(W, r), H, Delta, **kw)
    # the optimum equals the tail of the whitened spectrum (Eckart–Young in the weighted norm)
    _, _, Cdl, Chl = exact_reference(W, H, Delta, r, damping, damping_mode)
    s = torch.linalg.svdvals(_sqrtm(Cdl, 0.5) @ W @ _sqrtm(Chl, 0.5))
    assert J["exact"] == pytest.approx((s[r:] ** 2).sum().item(), rel=1e-6)
    assert J["exact"] <= J["core"] * (1 + 1e-9)
    assert J["exact"] <= J["svd"] * (1 + 1e-9)
    # (core is NOT always below plain SVD: it ignores the damped complement of the probe span)


def test_weighted_objective_matches_explicit_trace():
    W, H, Delta = _problem(18, 11, 7, seed=1)
    A, B = torch.randn(18, 3, dtype=F64), torch.randn(3, 11, dtype=F64)
    for dm, d in (("relative", 0.05), ("absolute", 1e-3)):
        Ch, Cd, lh, ld = _lambdas_ref(H, Delta, d, dm)
        E = W - A @ B
        ref = torch.trace((Cd + ld * torch.eye(18, dtype=F64)) @ E @ (Ch + lh * torch.eye(11, dtype=F64)) @ E.T)
        assert weighted_objective(W, A, B, H, Delta, damping=d, damping_mode=dm) == pytest.approx(ref.item(), rel=1e-10)
        assert damping_values(H, Delta, d, dm) == pytest.approx((lh, ld), rel=1e-12)
    ref0 = weighted_objective(W, torch.zeros(18, 1, dtype=F64), torch.zeros(1, 11, dtype=F64), H, Delta)
    assert weighted_objective(W, None, None, H, Delta) == pytest.approx(ref0, rel=1e-12)


@pytest.mark.parametrize("mode", ["exact", "core"])
def test_relative_damping_is_loss_scale_invariant(mode):
    W, H, Delta = _problem(24, 16, 12, seed=7)
    A1, B1 = ipsvd_factors(W, H, Delta, 6, mode=mode, damping=1e-2, damping_mode="relative")
    for c in (1e-4, 37.0):
        A2, B2 = ipsvd_factors(W, H, c * Delta, 6, mode=mode, damping=1e-2, damping_mode="relative")
        assert torch.allclose(A1, A2, rtol=1e-4, atol=1e-6) and torch.allclose(B1, B2, rtol=1e-4, atol=1e-6)
    # absolute damping is not: a tiny Δ is swamped by λ = 1e-3 and the δ-side weighting vanishes
    A3, B3 = ipsvd_factors(W, H, 1e-4 * Delta, 6, mode=mode, damping=1e-3, damping_mode="absolute")
    A4, B4 = ipsvd_factors(W, H, 1e2 * Delta, 6, mode=mode, damping=1e-3, damping_mode="absolute")
    assert _rel(A3 @ B3, A4 @ B4) > 1e-2


def test_balanced_split_same_product_equal_norms():
    W, H, Delta = _problem(30, 20, 10, seed=2)
    for mode in ("exact", "core"):
        Ap, Bp = ipsvd_factors(W, H, Delta, 7, mode=mode, split="paper", compute_dtype=F64)
        Ab, Bb = ipsvd_factors(W, H, Delta, 7, mode=mode, split="balanced", compute_dtype=F64)
        assert _rel(Ab.double() @ Bb.double(), Ap.double() @ Bp.double()) < 1e-6
        assert torch.allclose(Ab.norm(dim=0), Bb.norm(dim=1), rtol=1e-5)
        # deterministic signs: the largest-|.| entry of each column of A is positive
        assert (Ab.gather(0, Ab.abs().argmax(0)[None]) > 0).all()


def test_core_rank_above_probe_count_errors_or_falls_back():
    W, H, Delta = _problem(20, 16, 5, seed=4)
    with pytest.raises(ValueError, match=r"mode='core' supports rank <= 5 \(N = 5 probe tokens"):
        ipsvd_factors(W, H, Delta, 8, mode="core")
    reasons = []
    Af, Bf = ipsvd_factors(W, H, Delta, 8, mode="core", core_fallback="exact", on_fallback=reasons.append)
    assert reasons == ["mode='core' supports rank <= 5 (N = 5 probe tokens; at most min(N, in, out) = 5), got rank 8"]
    ipsvd_factors(W, H, Delta, 4, mode="core", core_fallback="exact", on_fallback=reasons.append)
    assert len(reasons) == 1  # the core holds rank 4: no fallback
    Ae, Be = ipsvd_factors(W, H, Delta, 8, mode="exact")
    assert torch.equal(Af, Ae) and torch.equal(Bf, Be)
    A_ref, B_ref, _, _ = exact_reference(W, H, Delta, 8, 1e-3, "relative")
    assert _rel(Af.double() @ Bf.double(), A_ref @ B_ref) < 1e-5


def test_input_validation_and_dtypes():
    W, H, Delta = _problem(12, 8, 6, seed=0)
    with pytest.raises(ValueError, match="H must be"):
        ipsvd_factors(W, H.T, Delta, 2)
    with pytest.raises(ValueError, match="same N"):
        ipsvd_factors(W, H, Delta[:, :5], 2)
    with pytest.raises(ValueError, match="rank must be in"):
        ipsvd_factors(W, H, Delta, 9)
    with pytest.raises(ValueError, match="damping must be > 0"):
        ipsvd_factors(W, H, Delta, 2, damping=0.0)
    with pytest.raises(ValueError, match="damping_mode"):
        ipsvd_factors(W, H, Delta, 2, damping_mode="rel")
    A, B = ipsvd_factors(W.bfloat16(), H.bfloat16(), Delta.bfloat16(), 3, mode="exact")
    Ar, Br = ipsvd_factors(W.bfloat16().double(), H.bfloat16().double(), Delta.bfloat16().double(), 3, mode="exact")
    assert A.dtype == B.dtype == torch.float32
    assert _rel(A @ B, Ar @ Br) < 1e-5  # bf16 inputs are computed in float32/64, not bf16
    # a layer with all-zero output-gradients falls back to an unweighted δ side (λ_δ = damping)
    A0, B0 = ipsvd_factors(W, H, torch.zeros_like(Delta), 3, mode="exact")
    assert torch.isfinite(A0).all() and torch.isfinite(B0).all()


def test_svd_factors_eckart_young():
    W = torch.randn(15, 9, dtype=F64, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(W)
    for r in (1, 4, 8):
        A, B = svd_factors(W, r, compute_dtype=F64)
        assert ((W - A.double() @ B.double()).norm() ** 2).item() == pytest.approx((s[r:] ** 2).sum().item(), rel=1e-6)
        assert torch.allclose(A.norm(dim=0).double(), s[:r].sqrt(), rtol=1e-6)
        assert torch.allclose(B.norm(dim=1).double(), s[:r].sqrt(), rtol=1e-6)


def test_random_factors_seeded_kaiming_bounds():
    W = torch.zeros(40, 30)
    A1, B1 = random_factors(W, 5, seed=3)
    A2, B2 = random_factors(W, 5, seed=3)
    A3, _ = random_factors(W, 5, seed=4)
    assert torch.equal(A1, A2) and torch.equal(B1, B2) and not torch.equal(A1, A3)
    assert A1.abs().max() <= 1 / 5**0.5 and B1.abs().max() <= 1 / 30**0.5
    assert A1.abs().max() > 0.8 / 5**0.5 and B1.std() == pytest.approx(1 / (3 * 30) ** 0.5, rel=0.1)
