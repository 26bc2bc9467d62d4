"""Influence-Preserving SVD (IPSVD): the low-rank factors of one layer (paper §4.1, Appendix
"Efficient Implementation via Probe-Based Approximation and Core SVD").

Notation (one linear layer ``y = W x``): ``W: [out, in]``; probe matrices ``H: [in, N]`` (layer
inputs ``h`` as columns) and ``Delta: [out, N]`` (output-gradients ``δ = dL/dy`` as columns), the
same ``N`` token positions for both.

* Second moments ``C_h = H Hᵀ / N`` and ``C_δ = Δ Δᵀ / N``; damped
  ``C_h,λ = C_h + λ_h I`` and ``C_δ,λ = C_δ + λ_δ I`` with

  - ``damping_mode="relative"``: ``λ_h = damping · tr(C_h) / in`` and ``λ_δ = damping · tr(C_δ) / out``
    (the damping is a fraction of the mean eigenvalue, so scaling the loss — hence Δ — by a constant
    changes nothing; a side whose trace is 0 falls back to ``λ = damping``);
  - ``damping_mode="absolute"``: ``λ_h = λ_δ = damping`` (the paper: 1e-3). Output-gradients of a
    mean-reduced loss are tiny, so an absolute 1e-3 usually swamps ``C_δ`` and the δ-side weighting
    disappears — that is why ``"relative"`` exists.

* Weighted objective (the paper's Eq. 3, the expected squared layer-local effect under K-FAC):
  ``J(Ŵ) = ‖C_δ,λ^{1/2} (W − Ŵ) C_h,λ^{1/2}‖_F²`` (:func:`weighted_objective`).

* ``mode="exact"``: ``Ŵ = A B`` is the exact minimiser of ``J`` over rank ≤ r, damped directions
  outside the probe span included. With the thin SVDs ``H = U_H Σ_H V_Hᵀ``, ``Δ = U_Δ Σ_Δ V_Δᵀ``
  and ``D = (Σ²/N + λ I)^{1/2}``, ``C_λ^{±1/2} = U D^{±1} Uᵀ + λ^{±1/2} (I − U Uᵀ)``, so the
  whitened ``S = C_δ,λ^{1/2} W C_h,λ^{1/2}`` (``[out, in]``) costs ``O(out·in·N)`` with no dense
  ``in×in``/``out×out`` matrix; ``S = U Σ Vᵀ`` truncated to r gives
  ``A = C_δ,λ^{-1/2} U_r Σ_r^{1/2}``, ``B = Σ_r^{1/2} V_rᵀ C_h,λ^{-1/2}``. Any ``r ≤ min(in, out)``.

* ``mode="core"``: the paper's appendix formula, restricted to the probe subspaces: core
  ``M = D_Δ U_Δᵀ W U_H D_H`` (at most ``N×N``), ``M = P Σ Qᵀ``,
  ``A = U_Δ D_Δ⁻¹ P_r Σ_r^{1/2}``, ``B = Σ_r^{1/2} Q_rᵀ D_H⁻¹ U_Hᵀ``. Needs ``r ≤ rank of M``
  (``≤ min(N, in, out)``); asking for more raises, or falls back to ``"exact"`` with
  ``core_fallback="exact"``. When the probe span covers the whole space (``N ≥ in, out`` and full
  rank probes) core and exact coincide; otherwise core ignores the damped complement and
  ``J(exact) ≤ J(core)``.

* Splitting ``Ŵ = A B`` (``split``): ``"paper"`` is the formula above (``Σ_r^{1/2}`` on both sides);
  ``"balanced"`` (default) rescales each rank-one component ``a_i b_iᵀ`` so ``‖a_i‖ = ‖b_i‖`` — the
  product is unchanged, it coincides with ``"paper"`` for plain SVD, and it makes the factors
  (not just their product) invariant to the loss scale in relative mode. Signs are fixed so that
  the largest-magnitude entry of each column of ``A`` is positive (deterministic factors).

Baselines in the same interface: :func:`svd_factors` (plain truncated SVD of ``W``, the paper's
"w/o IPSVD" ablation) and :func:`random_factors` (``LowRankLinear``'s random init).

Precision: everything runs in float64 whatever the input dtype (measured: a float32 whitened SVD
is off the brute-force optimum by up to ~1e-4 relative when the damping is small, because
``C^{-1/2}`` amplifies its rounding). It stays cheap because every SVD is taken from the
eigendecomposition of the smaller Gram matrix (``min(in, out)²`` or ``N²``), not a full SVD;
``compute_dtype=torch.float32`` runs the dense ``out×in`` part in float32 (e.g. on a GPU).
The returned factors are float32 on the device of ``weight``: the caller casts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..engine.damping import DAMPING_MODES, damping_value

MODES = ("exact", "core")
# The library's defaults, one place (why these: the comment above them in compress.py; CompressionConfig uses them)
DEFAULT_MODE = "exact"
DEFAULT_DAMPING = 1e-3
DEFAULT_DAMPING_MODE = "relative"
SPLITS = ("balanced", "paper")
_F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _check_inputs(weight: torch.Tensor, H: torch.Tensor, Delta: torch.Tensor, rank: int) -> tuple[int, int, int]:
    if weight.dim() != 2:
        raise ValueError(f"weight must be [out, in], got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if H.dim() != 2 or H.shape[0] != in_f:
        raise ValueError(f"H must be [in={in_f}, N], got shape {tuple(H.shape)}")
    if Delta.dim() != 2 or Delta.shape[0] != out_f:
        raise ValueError(f"Delta must be [out={out_f}, N], got shape {tuple(Delta.shape)}")
    if H.shape[1] != Delta.shape[1]:
        raise ValueError(f"H and Delta must hold the same N probe columns, got {H.shape[1]} and {Delta.shape[1]}")
    if H.shape[1] == 0:
        raise ValueError("no probe columns (N = 0): collect probes on a non-empty probe set")
    if not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be in [1, min(in, out) = {min(in_f, out_f)}], got {rank}")
    return out_f, in_f, H.shape[1]


def damping_values(H: torch.Tensor, Delta: torch.Tensor, damping: float, damping_mode: str) -> tuple[float, float]:
    """``(λ_h, λ_δ)`` of ``C_h = H Hᵀ / N`` and ``C_δ = Δ Δᵀ / N`` (:func:`~iprox_lightning.engine.damping.damping_value`)."""
    N = H.shape[1]
    lam_h, lam_d = (damping_value(float(X.to(_F64).pow(2).sum()) / N, X.shape[0], damping, damping_mode)  # tr(X Xᵀ / N)
                    for X in (H, Delta))
    return lam_h, lam_d


def _gram_svd(X: torch.Tensor, k: int | None = None, rel_tol: float = 0.0,
              all_values: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` singular triplets ``(U [d, k], S [k], V [n, k])`` of ``X: [d, n]`` (descending)
    from the symmetric eigendecomposition of the smaller Gram matrix (``XᵀX`` or ``XXᵀ``), in the
    dtype of ``X`` (float64 here). Much faster than a full SVD on CPU; the side taken from the
    Gram matrix is exactly orthonormal, the other is ``X V / σ``. Components with
    ``σ ≤ rel_tol · σ_max`` are dropped (``k`` shrinks). ``all_values``: ``S`` holds all ``min(d, n)`` singular
    values (``U``, ``V`` still the top ``k``; not with ``rel_tol``)."""
    d, n = X.shape
    k = min(d, n) if k is None else min(k, d, n)
    if n <= d:
        evals, V = torch.linalg.eigh(X.T @ X)
    else:
        evals, V = torch.linalg.eigh(X @ X.T)
    S_all = evals.flip(0).clamp(min=0).sqrt()
    S, V = S_all[:k], V.flip(1)[:, :k]
    keep = S > rel_tol * S[0] if S.numel() and S[0] > 0 else S > 0
    if rel_tol > 0:
        S, V = S[keep], V[:, keep]
    inv = torch.where(S > 0, 1.0 / torch.where(S > 0, S, torch.ones_like(S)), torch.zeros_like(S))
    if all_values:
        S = S_all
    if n <= d:
        return (X @ V) * inv[None, :], S, V
    return V, S, (X.T @ V) * inv[None, :]


# probe directions with σ below this fraction of σ_max are treated as outside the probe span
# (their damped weight differs from √λ by < σ²/(2N√λ), i.e. nothing at any sensible damping)
_PROBE_REL_TOL = 1e-6


def _thin_svd(X: torch.Tensor, lam: float, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` (``[d, k]``, k ≤ min(d, N)) and ``D = (Σ²/N + λ)^{1/2}`` (``[k]``), float64."""
    U, S, _ = _gram_svd(X.to(_F64), rel_tol=_PROBE_REL_TOL)
    return U, torch.sqrt(S.pow(2) / N + lam)


def _apply_sqrt(X: torch.Tensor, U: torch.Tensor, D: torch.Tensor, lam: float, power: float, side: str) -> torch.Tensor:
    """``C_λ^{power} X`` (side="left") or ``X C_λ^{power}`` (side="right") for power ±1/2 with
    ``C_λ^{p} = U D^{2p} Uᵀ + λ^{p} (I − U Uᵀ) = λ^{p} I + U (D^{2p} − λ^{p}) Uᵀ``."""
    Ud = U.to(X.dtype)
    diag = (D.pow(2 * power) - lam**power).to(X.dtype)
    if side == "left":
        return lam**power * X + Ud @ (diag[:, None] * (Ud.T @ X))
    return lam**power * X + ((X @ Ud) * diag[None, :]) @ Ud.T


def _split(Ul: torch.Tensor, S: torch.Tensor, Vr: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors ``A = Ul Σ^{1/2}``, ``B = Σ^{1/2} Vrᵀ`` (``Ul: [out, r]``, ``Vr: [in, r]``), optionally
    rebalanced per component, with deterministic signs."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    s = S.clamp(min=0).sqrt()
    A = Ul * s[None, :]
    B = (Vr * s[None, :]).T
    if split == "balanced":
        na, nb = A.norm(dim=0), B.norm(dim=1)
        ok = (na > 0) & (nb > 0)
        scale = torch.where(ok, torch.sqrt(nb / torch.where(ok, na, torch.ones_like(na))), torch.ones_like(na))
        A = A * scale[None, :]
        B = B / scale[:, None]
    # sign convention: the largest-|.| entry of each column of A is positive
    idx = A.abs().argmax(dim=0)
    sign = torch.sign(A.gather(0, idx[None, :]).squeeze(0))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return A * sign[None, :], B * sign[:, None]


# ------------------------------------------------------------------------------------------------
# factor functions
# ------------------------------------------------------------------------------------------------
def ipsvd_factors(
    weight: torch.Tensor,
    H: torch.Tensor,
    Delta: torch.Tensor,
    rank: int,
    *,
    damping: float = DEFAULT_DAMPING,
    damping_mode: str = DEFAULT_DAMPING_MODE,
    mode: str = DEFAULT_MODE,
    core_fallback: str = "error",
    on_fallback: Callable[[str], None] | None = None,
    split: str = "balanced",
    compute_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """IPSVD factors ``A: [out, r]``, ``B: [r, in]`` of ``weight: [out, in]`` given probes
    ``H: [in, N]``, ``Delta: [out, N]`` (definitions in the module docstring).

    ``mode``: ``"exact"`` (exact damped minimiser, any rank) or ``"core"`` (paper's appendix
    formula, rank ≤ rank of the core). ``core_fallback``: ``"error"`` (raise when ``mode="core"`` and
    the rank exceeds what the core holds) or ``"exact"`` (use the exact mode then, after calling
    ``on_fallback(reason)`` when given). ``compute_dtype``: dtype of the dense ``out×in`` work (default float64; the small SVDs are
    always float64). Returns float32 factors on ``weight.device``.
    """
    out_f, in_f, N = _check_inputs(weight, H, Delta, rank)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if core_fallback not in ("error", "exact"):
        raise ValueError(f"core_fallback must be 'error' or 'exact', got {core_fallback!r}")
    dense = compute_dtype or _F64
    lam_h, lam_d = damping_values(H, Delta, damping, damping_mode)
    U_h, D_h = _thin_svd(H, lam_h, N)
    U_d, D_d = _thin_svd(Delta, lam_d, N)
    W = weight.detach()

    if mode == "core":
        # M = D_Δ U_Δᵀ W U_H D_H  (k_Δ × k_H ≤ N × N), float64
        M = D_d[:, None] * (U_d.T @ (W.to(_F64) @ U_h)) * D_h[None, :]
        P, S, Qh = torch.linalg.svd(M, full_matrices=False)
        if rank <= S.shape[0]:
            Ul = U_d @ (P[:, :rank] / D_d[:, None])  # U_Δ D_Δ⁻¹ P_r      [out, r]
            Vr = U_h @ (Qh[:rank].T / D_h[:, None])  # U_H D_H⁻¹ Q_r      [in, r]
            A, B = _split(Ul, S[:rank], Vr, split)
            return A.float().contiguous(), B.float().contiguous()
        why = (f"N = {N} probe tokens" if S.shape[0] == min(N, in_f, out_f)
               else f"N = {N} probe tokens, rank-deficient probes")
        reason = (f"mode='core' supports rank <= {S.shape[0]} ({why}; at most min(N, in, out) = "
                  f"{min(N, in_f, out_f)}), got rank {rank}")
        if core_fallback == "error":
            raise ValueError(f"{reason}: collect more probe tokens, use mode='exact', or pass core_fallback='exact'")
        if on_fallback is not None:
            on_fallback(reason)
    # exact: S = C_δ,λ^{1/2} W C_h,λ^{1/2} (out × in), top-r SVD, map back with C^{-1/2}
    whitened = _whiten(W, (lam_h, U_h, D_h), (lam_d, U_d, D_d), dense, keep=rank, float64_spectrum=False)
    return whitened.factors(rank, split)


@dataclass
class WhitenedSVD:
    """One layer's exact IPSVD, computed once for every rank up to ``keep``: the singular values ``σ`` of the whitened
    weight ``S = C_δ,λ^{1/2} W C_h,λ^{1/2}`` (all ``min(in, out)`` of them, descending, float64: what
    :func:`weighted_spectrum` returns) and its top ``keep`` singular vectors mapped back, ``left = C_δ,λ^{-1/2} U_k``
    (``[out, keep]``) and ``right = C_h,λ^{-1/2} V_k`` (``[in, keep]``). :meth:`factors` at rank ``r ≤ keep`` is then
    what :func:`ipsvd_factors` returns (``mode="exact"``) without a second decomposition: the global rank allocation
    prices every layer with ``σ`` and keeps these to factorise
    (:func:`~iprox_lightning.compression.plan.plan_global_ranks`)."""

    singular_values: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor

    @property
    def keep(self) -> int:
        return self.left.shape[1]

    def factors(self, rank: int, split: str = "balanced") -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [out, r], B [r, in])`` float32 at rank ``r ≤ keep`` (``split``: :func:`ipsvd_factors`)."""
        if not 1 <= rank <= self.keep:
            raise ValueError(f"rank must be in [1, {self.keep}] (the singular vectors kept), got {rank}")
        A, B = _split(self.left[:, :rank], self.singular_values[:rank].to(self.left.dtype), self.right[:, :rank], split)
        return A.float().contiguous(), B.float().contiguous()


def whitened_bytes(in_features: int, out_features: int, keep: int) -> int:
    """Bytes a :class:`WhitenedSVD` keeping ``keep`` vectors holds (float64)."""
    return 8 * ((in_features + out_features) * keep + min(in_features, out_features))


def whitened_svd(
    weight: torch.Tensor,
    H: torch.Tensor,
    Delta: torch.Tensor,
    *,
    keep: int,
    damping: float = DEFAULT_DAMPING,
    damping_mode: str = DEFAULT_DAMPING_MODE,
    compute_dtype: torch.dtype | None = None,
) -> WhitenedSVD:
    """The :class:`WhitenedSVD` of ``weight`` given probes ``H``, ``Delta`` (module docstring), keeping ``keep``
    singular vectors (``0``: the spectrum alone; at most ``min(in, out)``). ``compute_dtype``: as in
    :func:`ipsvd_factors` (the dense ``out×in`` work and the mapping back; the spectrum is always float64)."""
    out_f, in_f, N = _check_inputs(weight, H, Delta, 1)
    if not 0 <= keep <= min(in_f, out_f):
        raise ValueError(f"keep must be in [0, min(in, out) = {min(in_f, out_f)}], got {keep}")
    lam_h, lam_d = damping_values(H, Delta, damping, damping_mode)
    U_h, D_h = _thin_svd(H, lam_h, N)
    U_d, D_d = _thin_svd(Delta, lam_d, N)
    return _whiten(weight.detach(), (lam_h, U_h, D_h), (lam_d, U_d, D_d), compute_dtype or _F64, keep=keep)


def _whiten(W: torch.Tensor, h_side: tuple, d_side: tuple, dense: torch.dtype, *, keep: int,
            float64_spectrum: bool = True) -> WhitenedSVD:
    """:class:`WhitenedSVD` from the probe sides ``(λ, U, D)`` of :func:`_thin_svd`; ``keep = 0``: σ only.
    ``float64_spectrum=False`` (factors only, :func:`ipsvd_factors`): σ in the dense dtype, no second eigh."""
    (lam_h, U_h, D_h), (lam_d, U_d, D_d) = h_side, d_side
    Ud, Dd, Uh, Dh = U_d.to(dense), D_d.to(dense), U_h.to(dense), D_h.to(dense)
    S_mat = _apply_sqrt(_apply_sqrt(W.to(dense), Uh, Dh, lam_h, 0.5, "right"), Ud, Dd, lam_d, 0.5, "left")
    if keep == 0:
        _, S, _ = _gram_svd(S_mat.to(_F64))
        return WhitenedSVD(S, S_mat.new_zeros(W.shape[0], 0), S_mat.new_zeros(W.shape[1], 0))
    U, S, V = _gram_svd(S_mat, keep, all_values=True)
    if dense != _F64 and float64_spectrum:  # the spectrum in float64 whatever the dense dtype (weighted_spectrum's)
        _, S, _ = _gram_svd(S_mat.to(_F64))
    left = _apply_sqrt(U[:, :keep], Ud, Dd, lam_d, -0.5, "left")  # C_δ,λ^{-1/2} U_k
    right = _apply_sqrt(V[:, :keep], Uh, Dh, lam_h, -0.5, "left")  # C_h,λ^{-1/2} V_k
    return WhitenedSVD(S, left, right)


def weighted_spectrum(
    weight: torch.Tensor,
    H: torch.Tensor,
    Delta: torch.Tensor,
    *,
    damping: float = 1e-3,
    damping_mode: str = "relative",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Singular values ``σ`` (descending, float64, ``min(in, out)`` of them) of the whitened weight
    ``S = C_δ,λ^{1/2} W C_h,λ^{1/2}``. They price truncation exactly: the exact IPSVD factors at rank
    ``r`` leave ``J_r = Σ_{i>r} σ_i²`` (and ``J(0) = Σ σ_i²``), in the same units — the expected squared
    first-order change of the per-example loss under the K-FAC model — for every layer, which is what
    makes one parameter budget comparable across layers (:func:`iprox_lightning.compression.ranks.allocate_ranks`)."""
    return whitened_svd(weight, H, Delta, keep=0, damping=damping, damping_mode=damping_mode,
                        compute_dtype=compute_dtype).singular_values


def plain_spectrum(weight: torch.Tensor) -> torch.Tensor:
    """Singular values of ``W`` itself (descending, float64): what plain SVD truncation prices,
    ``‖W − W_r‖_F² = Σ_{i>r} σ_i²``."""
    return torch.linalg.svdvals(weight.detach().to(_F64))


def svd_factors(weight: torch.Tensor, rank: int, *, compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain truncated SVD ``W ≈ (U_r Σ_r^{1/2}) (Σ_r^{1/2} V_rᵀ)`` — the paper's "w/o IPSVD" ablation
    (the best rank-r approximation in the unweighted Frobenius norm). Float32 factors."""
    out_f, in_f = weight.shape
    if not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be in [1, min(in, out) = {min(in_f, out_f)}], got {rank}")
    U, S, Vh = torch.linalg.svd(weight.detach().to(compute_dtype or torch.float32), full_matrices=False)
    A, B = _split(U[:, :rank], S[:rank], Vh[:rank].T, "paper")
    return A.float().contiguous(), B.float().contiguous()


def random_factors(weight: torch.Tensor, rank: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random factors (the paper's random-init baseline): ``LowRankLinear``'s initialisation,
    Kaiming-uniform with ``a = √5`` (``U(−1/√fan_in, 1/√fan_in)``: ``fan_in = r`` for ``A``,
    ``in`` for ``B``), from a dedicated generator seeded with ``seed``. Ignores the values of ``weight``."""
    out_f, in_f = weight.shape
    if not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be in [1, min(in, out) = {min(in_f, out_f)}], got {rank}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    A = (torch.rand(out_f, rank, generator=g) * 2 - 1) / math.sqrt(rank)
    B = (torch.rand(rank, in_f, generator=g) * 2 - 1) / math.sqrt(in_f)
    return A.to(weight.device), B.to(weight.device)


def weighted_objective(
    weight: torch.Tensor,
    A: torch.Tensor | None,
    B: torch.Tensor | None,
    H: torch.Tensor,
    Delta: torch.Tensor,
    *,
    damping: float = 1e-3,
    damping_mode: str = "relative",
) -> float:
    """``J = ‖C_δ,λ^{1/2} (W − A B) C_h,λ^{1/2}‖_F² = tr(C_δ,λ E C_h,λ Eᵀ)`` with ``E = W − A B``
    (``A = B = None``: ``E = W``, the objective of the zero matrix — divide by it for a relative error).
    Computed without dense second moments as
    ``‖Δᵀ E H‖²/N² + λ_δ ‖E H‖²/N + λ_h ‖Δᵀ E‖²/N + λ_h λ_δ ‖E‖²`` in float64."""
    N = H.shape[1]
    lam_h, lam_d = damping_values(H, Delta, damping, damping_mode)
    E = weight.detach().to(_F64)
    if A is not None:
        E = E - A.detach().to(_F64) @ B.detach().to(_F64)
    Hd, Dd = H.to(_F64), Delta.to(_F64)
    EH = E @ Hd
    DtE = Dd.T @ E
    val = (Dd.T @ EH).pow(2).sum() / N**2 + lam_d * EH.pow(2).sum() / N + lam_h * DtE.pow(2).sum() / N
    val = val + lam_h * lam_d * E.pow(2).sum()
    return float(val)


def compute_factors(
    method: str,
    weight: torch.Tensor,
    rank: int,
    H: torch.Tensor | None = None,
    Delta: torch.Tensor | None = None,
    *,
    mode: str | None = None,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
    **ipsvd_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch ``method`` ∈ {"ipsvd", "svd", "random"} to the factor functions above
    (``mode``/``damping``/... are passed to :func:`ipsvd_factors`, ``compute_dtype`` to the SVDs,
    ``seed`` to :func:`random_factors`)."""
    if method == "ipsvd":
        if H is None or Delta is None:
            raise ValueError("method='ipsvd' needs probes (H, Delta)")
        return ipsvd_factors(weight, H, Delta, rank, mode=mode or DEFAULT_MODE, compute_dtype=compute_dtype, **ipsvd_kwargs)
    if method == "svd":
        return svd_factors(weight, rank, compute_dtype=compute_dtype)
    if method == "random":
        return random_factors(weight, rank, seed=seed)
    raise ValueError(f"method must be one of ('ipsvd', 'svd', 'random'), got {method!r}")
