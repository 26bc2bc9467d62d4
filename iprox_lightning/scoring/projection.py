"""Projected per-example gradients (LoGra-style factored projection), the vectors of the gradient store.

For a tracked weight ``W: [out, in]`` with per-example gradient ``G = Σ_t δ_t h_tᵀ`` and two fixed matrices
``P_h: [k_in, in]``, ``P_δ: [k_out, out]``, the projected gradient is

    P_δ G P_hᵀ = Σ_t (P_δ δ_t)(P_h h_t)ᵀ                 ([k_out, k_in])

computed from the projected tokens, so ``G`` is never formed: cost ``T·(k_in·in + k_out·out + k_in·k_out)``
per example instead of ``T·in·out``. The projected gradients of all tracked weights, flattened and concatenated
in model order, are one example's vector (dimension ``D = Σ k_out·k_in``).

* ``P`` has i.i.d. ``N(0, 1/k)`` entries (Johnson–Lindenstrauss: inner products are preserved in expectation),
  drawn from a generator seeded by ``seed`` and the weight's key, so the same ``(seed, key, shape)`` gives the
  same matrix on every machine; the store also saves them (:mod:`iprox_lightning.io.gradient_store`).
* ``projection="pca"`` (:func:`pca_projections`): instead, the rows of ``P_h`` / ``P_δ`` are the ``k`` leading
  eigenvectors of the layer's second moments ``C_h = E[h hᵀ]`` / ``C_δ = E[δ δᵀ]`` (the K-FAC factors, fitted on
  some pool examples): the vector holds ``G``'s coordinates in the ``k × k`` block of its largest token energy —
  no sampling noise, but the part of ``G`` outside that block is dropped rather than spread over the ``k`` rows.
  The matrices are saved in the store, so a query reproduces them without the factors.
* A side whose ``k`` is ``>=`` its dimension is not projected (the identity): ``k >= max(in, out)`` everywhere gives
  the exact gradients, and then the store's scores equal exact scoring.
* An influence metric (:mod:`.metrics`) is applied first: to the tokens when it factors over them (TracIn,
  K-FAC), else to the materialised ``G`` (EK-FAC): the vector is ``P_δ (M G) P_hᵀ`` with ``M G`` in the weight's own
  coordinates. K-FAC and EK-FAC map ``G`` into their factors' eigenbases (``Q_δᵀ (·) Q_h``,
  :meth:`~.metrics.InfluenceMetric.basis`); the projections rotate back first (``P Q``, folded into the projection
  matrices: no extra cost per token), so the vector is ``P_δ Q_δ (M G) Q_hᵀ P_hᵀ``: a function of the fitted factors
  alone, not of the eigensolver's choice of eigenvectors (their signs; any basis of a repeated or null eigenvalue's
  space), which differs between builds of one store (one process or several, another machine) with the rounding.

The vectors come from the backward-pairs engine through :class:`ProjectedGradientTracker` (a
:class:`~.features.WeightPairTracker`), never from ``param.grad``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from ..engine.batch import example_loss_fn
from ..engine.tracking import backward_pairs
from .features import (
    FactorSpaceView, VirtualLinear, WeightPairTracker, eval_mode, has_response_tokens, to_device, tracked_modules,
    trim_batch, virtual_linears,
)


@dataclass
class LayerProjection:
    """The two projections of one tracked weight; ``None`` = identity (that side is not projected)."""

    key: str
    out_features: int
    in_features: int
    P_out: torch.Tensor | None  # [k_out, out]
    P_in: torch.Tensor | None  # [k_in, in]

    @property
    def k_out(self) -> int:
        return self.out_features if self.P_out is None else self.P_out.shape[0]

    @property
    def k_in(self) -> int:
        return self.in_features if self.P_in is None else self.P_in.shape[0]

    @property
    def dim(self) -> int:
        return self.k_out * self.k_in

    def tokens(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``[B, k_out·k_in]``: ``Σ_t (P_δ δ_t)(P_h h_t)ᵀ`` of tokens ``h: [B, T, in]``, ``δ: [B, T, out]``."""
        ph = h if self.P_in is None else h @ self.P_in.to(h).t()
        pd = delta if self.P_out is None else delta @ self.P_out.to(delta).t()
        return torch.bmm(pd.transpose(1, 2), ph).flatten(1)

    def matrix(self, G: torch.Tensor) -> torch.Tensor:
        """``[B, k_out·k_in]``: ``P_δ G P_hᵀ`` of gradient-shaped ``G: [B, out, in]``."""
        if self.P_out is not None:
            G = self.P_out.to(G) @ G
        if self.P_in is not None:
            G = G @ self.P_in.to(G).t()
        return G.flatten(1)


def _seed_of(seed: int, key: str, side: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{int(seed)}|{key}|{side}".encode()).digest()[:8], "little") & (2**63 - 1)


def gaussian_projection(k: int, dim: int, seed: int, key: str, side: str) -> torch.Tensor | None:
    """``[k, dim]`` with i.i.d. ``N(0, 1/k)`` entries (float32, CPU), reproducible from ``(seed, key, side)``;
    ``None`` (identity) when ``k >= dim``."""
    if k < 1:
        raise ValueError(f"projection size must be >= 1, got {k}")
    if k >= dim:
        return None
    g = torch.Generator().manual_seed(_seed_of(seed, key, side))
    return torch.randn(k, dim, generator=g, dtype=torch.float32) / float(k) ** 0.5


def leading_eigenvectors(Q: torch.Tensor, e: torch.Tensor, k: int) -> torch.Tensor | None:
    """``[k, dim]``: the eigenvectors (columns of ``Q``) of the ``k`` largest eigenvalues ``e``, as rows, largest
    first (float32); ``None`` (identity) when ``k >= dim``."""
    if k < 1:
        raise ValueError(f"projection size must be >= 1, got {k}")
    if k >= Q.shape[0]:
        return None
    top = torch.argsort(e.double(), descending=True, stable=True)[:k]
    return Q[:, top].t().contiguous().to(torch.float32)


def pca_projections(linears: Sequence[VirtualLinear], k: int,
                    eigens: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, LayerProjection]:
    """One :class:`LayerProjection` per tracked weight whose rows are the ``k`` leading eigenvectors of its input
    (``P_in``) and output-gradient (``P_out``) second moments: ``eigens[key]`` holds ``Q_h, e_h, Q_d, e_d`` (the
    undamped eigendecompositions of :meth:`~.metrics.KFACFactors.eigens`)."""
    out = {}
    for v in linears:
        if v.key not in eigens:
            raise ValueError(f"pca_projections: no second moments for {v.key!r}")
        eg = eigens[v.key]
        if (eg["Q_d"].shape[0], eg["Q_h"].shape[0]) != (v.out_features, v.in_features):
            raise ValueError(f"pca_projections: the second moments of {v.key!r} are {eg['Q_d'].shape[0]} x "
                             f"{eg['Q_h'].shape[0]}, the weight {v.out_features} x {v.in_features}")
        out[v.key] = LayerProjection(v.key, v.out_features, v.in_features, leading_eigenvectors(eg["Q_d"], eg["e_d"], k),
                                     leading_eigenvectors(eg["Q_h"], eg["e_h"], k))
    return out


def make_projections(linears: Sequence[VirtualLinear], k: int, seed: int) -> dict[str, LayerProjection]:
    """One :class:`LayerProjection` per tracked weight (``k`` rows on each side, identity where ``k >= dim``)."""
    return {v.key: LayerProjection(v.key, v.out_features, v.in_features,
                                   gaussian_projection(k, v.out_features, seed, v.key, "out"),
                                   gaussian_projection(k, v.in_features, seed, v.key, "in"))
            for v in linears}


def layout(projections: Mapping[str, LayerProjection]) -> dict[str, tuple[int, int]]:
    """``{key: (offset, dim)}`` of each weight's block in the concatenated vector (model order)."""
    out, off = {}, 0
    for key, p in projections.items():
        out[key] = (off, p.dim)
        off += p.dim
    return out


class ProjectedGradientTracker(WeightPairTracker):
    """Per example of a step, the projected gradient vector ``[B, D]`` (``self.vectors``, ``dtype``) of
    ``P_δ (M G) P_hᵀ`` over the tracked weights (see the module docstring); ``metric`` ``None`` = TracIn."""

    def __init__(self, modules: Mapping[str, nn.Module], projections: Mapping[str, LayerProjection], metric=None,
                 dtype: torch.dtype = torch.float32, moved: dict[str, LayerProjection] | None = None) -> None:
        super().__init__(modules)
        self.projections = dict(projections)
        self.layout = layout(self.projections)
        self.dim = sum(d for _, d in self.layout.values())
        self.metric, self.dtype = metric, dtype
        self._moved: dict[str, LayerProjection] = {} if moved is None else moved  # shared by a projector's batches

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        B, device = batch["input_ids"].shape[0], batch["input_ids"].device
        self.vectors = torch.zeros(B, self.dim, dtype=self.dtype, device=device)

    def _projection(self, key: str, like: torch.Tensor) -> LayerProjection:
        """The projections of weight ``key`` on ``like``'s device, rotated back from the metric's basis if it has
        one (``P Q``, or ``Q`` for an identity side: see the module doc)."""
        p = self._moved.get(key)
        if p is None or (p.P_in is not None and p.P_in.device != like.device):
            q = self.projections[key]
            basis = None if self.metric is None else self.metric.basis(key)

            def mv(P, Q):
                if Q is not None:  # P Q in float64, then the tracker's dtype
                    P = Q.double() if P is None else P.double() @ Q.to(device=P.device, dtype=torch.float64)
                return None if P is None else P.to(device=like.device, dtype=self.dtype)

            Q_out, Q_in = basis if basis is not None else (None, None)
            p = self._moved[key] = LayerProjection(q.key, q.out_features, q.in_features, mv(q.P_out, Q_out),
                                                   mv(q.P_in, Q_in))
        return p

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        h, delta = h.to(self.dtype), delta.to(self.dtype)
        p = self._projection(key, h)
        off, d = self.layout[key]
        if self.metric is None or getattr(self.metric, "token_factored", True):
            if self.metric is not None:
                h, delta = self.metric.tokens(key, h, delta)
            self.vectors[:, off:off + d] = p.tokens(h, delta)
        else:  # a metric of the whole per-example gradient (EK-FAC): M G per example (its gradients()), projected
            self.vectors[:, off:off + d] = p.matrix(self.metric.gradients(key, h, delta))


class ProjectionMismatch(ValueError):
    """Projections given to :class:`GradientProjector` that are not for the model's tracked weights, in its order."""


class GradientProjector:
    """The projected gradient vectors of batches of a model: ``project_batch(batch)`` returns ``{"id", "task",
    "vectors" [B, D] (the projector's dtype, CPU), "n_tokens", "zero_grad", "nonfinite"}``; an example without a response token
    gets a zero vector and ``zero_grad``, one whose vector is NaN/inf ``nonfinite``.

    ``projections``: from :func:`make_projections` (``k`` per side, ``seed``) or loaded from a store;
    ``metric``: a fitted :class:`~.metrics.InfluenceMetric` (``None``: TracIn); ``target_patterns`` as in scoring;
    ``loss_reduction``: the per-example loss (default: the metric's, else ``"mean"``).
    ``pairs_from``: a dense model (the target ``model`` was built from) whose backward gives the pairs instead, in
    ``model``'s coordinates (:class:`~.features.FactorSpaceView`): its gradients projected into ``model``'s store.
    """

    def __init__(self, model: nn.Module, *, k: int = 16, seed: int = 0, metric=None,
                 target_patterns: Sequence[str] | None = None, projections: Mapping[str, LayerProjection] | None = None,
                 dtype: torch.dtype | None = None, pairs_from: nn.Module | None = None,
                 loss_reduction: str | None = None) -> None:
        self.model = model
        self.pairs_from = pairs_from
        self.modules = tracked_modules(model, None if target_patterns is None else list(target_patterns))
        self.dense_modules = (None if pairs_from is None else
                              tracked_modules(pairs_from, None if target_patterns is None else list(target_patterns)))
        self.linears = virtual_linears(self.modules)
        if projections is None:
            projections = make_projections(self.linears, k, seed)
        want = [(v.key, v.out_features, v.in_features) for v in self.linears]
        have = [(p.key, p.out_features, p.in_features) for p in projections.values()]
        if want != have:
            j, (a, b) = next((j, (a, b)) for j, (a, b) in enumerate(zip(have + [None] * len(want), want + [None] * len(have)))
                             if a != b)
            err = ProjectionMismatch(f"the projections are for other layers than the model's tracked weights (first "
                                     f"difference: {(a, b)})")
            err.index, err.have, err.want = j, a, b
            raise err
        self.projections = dict(projections)
        self.layout = layout(self.projections)
        self.dim = sum(d for _, d in self.layout.values())
        self.metric = metric

        # the per-example loss: the metric's (its ScoringConfig's loss_reduction), or loss_reduction for TracIn
        self.loss_fn = example_loss_fn(loss_reduction or getattr(metric, "loss_reduction", "mean"))
        p = next(model.parameters())
        self.dtype = dtype or (torch.float64 if p.dtype == torch.float64 else torch.float32)
        self._moved: dict[str, LayerProjection] = {}  # the projections on the model's device (rotated: P Q), once
        self._factors_moved: dict = {}  # with pairs_from: the proxy's factors on the dense model's device, once

    def project_batch(self, batch: Mapping) -> dict:
        net = self.model if self.pairs_from is None else self.pairs_from
        device = next(net.parameters()).device
        b = to_device(batch, device)
        B = b["input_ids"].shape[0]
        n_tok = (b["labels"][:, 1:] != -100).sum(dim=1).cpu()
        keep = has_response_tokens(b).cpu()
        vectors = torch.zeros(B, self.dim, dtype=self.dtype)
        if bool(keep.any()):
            tracker = ProjectedGradientTracker(self.modules, self.projections, self.metric, self.dtype, self._moved)
            pairs = tracker if self.pairs_from is None else FactorSpaceView(self.dense_modules, tracker, self.modules,
                                                                            self._factors_moved)
            with eval_mode(net), torch.inference_mode(False), torch.enable_grad():
                backward_pairs(net, trim_batch(b, keep), [pairs], loss_fn=self.loss_fn)
            vectors[torch.nonzero(keep).flatten()] = tracker.vectors.cpu()
        nonfinite = ~torch.isfinite(vectors).all(dim=1)
        zero = ((vectors == 0).all(dim=1) | (n_tok == 0)) & ~nonfinite
        return {"id": [str(i) for i in batch["id"]], "task": list(batch["task"]) if batch.get("task") is not None
                else [None] * B, "vectors": vectors, "n_tokens": n_tok.numpy(), "zero_grad": zero.numpy(),
                "nonfinite": nonfinite.numpy()}
