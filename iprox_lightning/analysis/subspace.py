"""Why a selection works: subspace affinity (SA) with the validation task and diversity (1-NND).

Both metrics (paper, Table 6) act on per-example gradient vectors, given as matrices
``G_sel [n_sel, d]`` (one row per selected training example) and ``G_val [n_val, d]`` (one row per
validation example); the caller materialises or randomly projects them
(:func:`per_example_gradients` does it for small models).

**Subspace affinity** (Soltanolkotabi, Elhamifar & Candès, 2014, "Robust subspace clustering",
Def. 2.x). For subspaces ``S₁, S₂ ⊂ ℝᵈ`` of dimensions ``d₁, d₂`` with orthonormal bases
``U₁ [d, d₁]``, ``U₂ [d, d₂]`` and principal angles ``θ₁ … θ_{min(d₁,d₂)}``::

    aff(S₁, S₂) = sqrt( (cos²θ₁ + … + cos²θ_{min(d₁,d₂)}) / min(d₁, d₂) ) = ‖U₁ᵀ U₂‖_F / sqrt(min(d₁, d₂))

It is 1 when one subspace contains the other and 0 when they are orthogonal. The gradient
subspace of a set of examples is spanned by the top right-singular vectors of its gradient matrix:
a fixed ``rank``, or the smallest rank whose singular values keep an ``energy`` share of
``Σσᵢ²`` (default 90 %). The paper reports SA × 100.

**Mean 1-nearest-neighbour distance** inside the selected set::

    1-NND(G) = (1/n) Σᵢ min_{j ≠ i} ‖gᵢ − gⱼ‖₂

(optionally on unit-normalised rows, ``normalize=True``) — larger means a more diverse selection.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..engine.batch import check_batch, per_example_loss
from ..engine.lowrank import LowRankLinear
from ..engine.model_modes import eval_mode
from ..engine.target_layers import conv1d_class, find_target_linears
from ..progress import progress as progress_of


# --------------------------------------------------------------------------------------------
# subspace affinity
# --------------------------------------------------------------------------------------------
def subspace_basis(G: torch.Tensor, *, rank: int | None = None, energy: float = 0.9, rtol: float = 1e-10) -> torch.Tensor:
    """Orthonormal basis ``[d, k]`` of the dominant row space of ``G [n, d]``.

    ``k = rank`` if given (capped by the numerical rank), else the smallest ``k`` with
    ``Σ_{i≤k} σᵢ² ≥ energy · Σ σᵢ²``. Singular values below ``rtol · σ₁`` are treated as zero.
    """
    if G.dim() != 2:
        raise ValueError(f"gradient matrix must be [n, d], got shape {tuple(G.shape)}")
    if not 0 < energy <= 1:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    G = G.detach().to(torch.float64)
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)
    if S.numel() == 0 or S[0] <= 0:
        raise ValueError("gradient matrix is all zeros: its subspace is empty")
    num_rank = int((S > rtol * S[0]).sum())
    if rank is not None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        k = min(rank, num_rank)
    else:
        cum = torch.cumsum(S[:num_rank] ** 2, 0) / (S[:num_rank] ** 2).sum()
        k = int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype) - 1e-12)) + 1
        k = min(k, num_rank)
    return Vh[:k].T.contiguous()


def affinity_from_bases(U1: torch.Tensor, U2: torch.Tensor) -> float:
    """``‖U1ᵀU2‖_F / sqrt(min(k1, k2))`` for orthonormal bases (see module docstring)."""
    k = min(U1.shape[1], U2.shape[1])
    return float(torch.linalg.matrix_norm(U1.T.to(torch.float64) @ U2.to(torch.float64)) / math.sqrt(k))


def subspace_affinity(
    G_sel: torch.Tensor,
    G_val: torch.Tensor,
    *,
    rank: int | None = None,
    energy: float = 0.9,
) -> float:
    """Subspace affinity in ``[0, 1]`` between the gradient subspaces of ``G_sel`` and ``G_val``.

    Both are ``[n, d]`` with the same ``d``; see the module docstring for the definition and the
    choice of the subspace dimensions (``rank`` / ``energy``, applied to both sets).
    """
    if G_sel.dim() != 2 or G_val.dim() != 2 or G_sel.shape[1] != G_val.shape[1]:
        raise ValueError(
            f"selected and validation gradients must be [n, d] with the same d, got {tuple(G_sel.shape)} and {tuple(G_val.shape)}"
        )
    return affinity_from_bases(
        subspace_basis(G_sel, rank=rank, energy=energy), subspace_basis(G_val, rank=rank, energy=energy)
    )


# --------------------------------------------------------------------------------------------
# diversity
# --------------------------------------------------------------------------------------------
def nearest_neighbor_distances(G: torch.Tensor, *, normalize: bool = False, chunk_size: int = 1024) -> torch.Tensor:
    """``[n]`` distances ``min_{j≠i} ‖gᵢ − gⱼ‖₂`` (float64, exact pairwise differences, chunked)."""
    if G.dim() != 2 or G.shape[0] < 2:
        raise ValueError(f"1-NND needs a [n, d] matrix with n >= 2, got shape {tuple(G.shape)}")
    G = G.detach().to(torch.float64)
    if normalize:
        G = G / G.norm(dim=1, keepdim=True).clamp(min=1e-30)
    n = G.shape[0]
    out = torch.empty(n, dtype=torch.float64)
    for s in range(0, n, chunk_size):
        d = torch.cdist(G[s : s + chunk_size], G, compute_mode="donot_use_mm_for_euclid_dist")
        rows = torch.arange(d.shape[0])
        d[rows, rows + s] = float("inf")
        out[s : s + chunk_size] = d.min(dim=1).values
    return out


def mean_nn_distance(G: torch.Tensor, *, normalize: bool = False, chunk_size: int = 1024) -> float:
    """Mean 1-nearest-neighbour distance inside ``G [n, d]`` (see module docstring)."""
    return float(nearest_neighbor_distances(G, normalize=normalize, chunk_size=chunk_size).mean())


# --------------------------------------------------------------------------------------------
# per-example gradients of the tracked layers (small models / small analyses)
# --------------------------------------------------------------------------------------------
def gradient_parameters(model: nn.Module, patterns: Sequence[str] | None = None) -> dict[str, nn.Parameter]:
    """The weight parameters whose gradients make an example's gradient vector, in model order.

    One entry per targeted linear layer (``find_target_linears``): ``<layer>.weight`` for
    ``nn.Linear``/``Conv1D``, ``<layer>.A`` and ``<layer>.B`` for ``LowRankLinear``. Biases,
    embeddings and the LM head are excluded, as in the paper's influence computation.
    """
    out: dict[str, nn.Parameter] = {}
    for name, m in find_target_linears(model, patterns).items():
        if isinstance(m, LowRankLinear):
            out[f"{name}.A"], out[f"{name}.B"] = m.A, m.B
        else:
            out[f"{name}.weight"] = m.weight
    return out


def _is_conv1d(model: nn.Module, pname: str) -> bool:
    conv = conv1d_class()
    return conv is not None and isinstance(model.get_submodule(pname.rsplit(".", 1)[0]), conv)


class KroneckerProjector:
    """Fixed-seed random projection of per-layer gradient matrices, ``G ↦ P G Qᵀ``.

    For a parameter gradient ``G [p, q]`` it draws ``P [k_p, p]`` and ``Q [k_q, q]`` with i.i.d.
    ``N(0, 1/k)`` entries (``k_p = min(dim, p)``; a side with ``dim >= p`` is kept as identity), so
    ``vec(P G Qᵀ) = (P ⊗ Q) vec(G)`` (row-major) and ``E[⟨proj G, proj G'⟩] = ⟨G, G'⟩``. The factors
    of each parameter are seeded from ``(seed, crc32(name))``, so they do not depend on order or
    on which other layers are projected. Memory is ``O(dim · (p + q))`` per layer instead of the
    ``O(dim² · p · q)`` of a dense projection.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, int]], dim: int, seed: int = 0) -> None:
        if dim < 1:
            raise ValueError(f"projection dim must be >= 1, got {dim}")
        self.dim, self.seed = int(dim), int(seed)
        self.factors: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for name, (p, q) in shapes.items():
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            P = torch.randn(self.dim, p, generator=g, dtype=torch.float64) / math.sqrt(self.dim) if self.dim < p else None
            Q = torch.randn(self.dim, q, generator=g, dtype=torch.float64) / math.sqrt(self.dim) if self.dim < q else None
            self.factors[name] = (P, Q)

    def out_dim(self, name: str, shape: tuple[int, int]) -> int:
        P, Q = self.factors[name]
        return (shape[0] if P is None else P.shape[0]) * (shape[1] if Q is None else Q.shape[0])

    def project(self, name: str, G: torch.Tensor) -> torch.Tensor:
        P, Q = self.factors[name]
        G = G.to(torch.float64)
        if P is not None:
            G = P @ G
        if Q is not None:
            G = G @ Q.T
        return G.reshape(-1)


@contextlib.contextmanager
def _grad_enabled_for(params: Iterable[nn.Parameter]):
    params = list(params)
    old = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        yield
    finally:
        for p, r in zip(params, old):
            p.requires_grad_(r)


def per_example_gradients(
    model: nn.Module,
    batches: Iterable[Mapping],
    *,
    patterns: Sequence[str] | None = None,
    projection_dim: int | None = None,
    seed: int = 0,
    max_examples: int | None = None,
    progress: bool = True,
) -> tuple[list[str], torch.Tensor]:
    """Flattened per-example gradients ``∇_W L(z)`` of the tracked layers: ``(ids, G [n, d])`` (float32).

    ``L(z)`` is :func:`iprox_lightning.engine.batch.per_example_loss` (mean CE over the response tokens).
    Each example is run alone (batch size 1, padding trimmed) and differentiated with
    ``torch.autograd.grad`` w.r.t. :func:`gradient_parameters` — simple and exact, meant for small
    models and small analyses. ``Conv1D`` gradients are transposed to the ``[out, in]`` layout.
    With ``projection_dim`` each layer's gradient is projected by a :class:`KroneckerProjector`
    (fixed ``seed``), so ``d = Σ_layers min(dim, out)·min(dim, in)`` instead of the parameter count.
    An example without response tokens gets a zero row. The model is run in eval mode.
    """
    params = gradient_parameters(model, patterns)
    names = list(params)
    shapes = {}
    for n, p in params.items():
        shp = tuple(p.shape)
        shapes[n] = (shp[1], shp[0]) if _is_conv1d(model, n) else shp
    conv = {n: _is_conv1d(model, n) for n in names}
    proj = KroneckerProjector(shapes, projection_dim, seed) if projection_dim else None
    d = sum(proj.out_dim(n, shapes[n]) if proj else shapes[n][0] * shapes[n][1] for n in names)

    ids: list[str] = []
    rows: list[torch.Tensor] = []

    bar = progress_of(total=max_examples, desc="per-example gradients", unit="ex", enabled=progress)
    try:
        with eval_mode(model), _grad_enabled_for(params.values()):
            for batch in batches:
                check_batch(batch)
                for i in range(batch["input_ids"].shape[0]):
                    if max_examples is not None and len(ids) >= max_examples:
                        break
                    length = int(batch["attention_mask"][i].sum())
                    dev = next(iter(params.values())).device
                    inp = batch["input_ids"][i : i + 1, :length].to(dev)
                    mask = batch["attention_mask"][i : i + 1, :length].to(dev)
                    labels = batch["labels"][i : i + 1, :length].to(dev)
                    logits = model(input_ids=inp, attention_mask=mask).logits
                    loss, n_tok = per_example_loss(logits, labels)
                    if int(n_tok[0]) == 0:
                        rows.append(torch.zeros(d, dtype=torch.float32))
                    else:
                        grads = torch.autograd.grad(loss[0], list(params.values()), allow_unused=True)
                        parts = []
                        for n, p, g in zip(names, params.values(), grads):
                            g = torch.zeros_like(p) if g is None else g.detach()
                            if conv[n]:
                                g = g.T
                            parts.append(proj.project(n, g) if proj else g.reshape(-1).to(torch.float64))
                        rows.append(torch.cat(parts).float().cpu())
                    ids.append(str(batch["id"][i]))
                    if bar is not None:
                        bar.update(1)
                if max_examples is not None and len(ids) >= max_examples:
                    break
    finally:
        if bar is not None:
            bar.close()
    if not rows:
        raise ValueError("per_example_gradients got no example")
    return ids, torch.stack(rows)
