"""Influence metrics: the inner product the scores are taken in.

Per tracked weight, a metric is a linear map ``M`` of gradient-shaped matrices ``[out, in]``; scores use
``⟨M g(z), M ḡ⟩`` and ``‖M g(z)‖`` (see :mod:`.influence`). Because every gradient is ``g = Σ_t δ_t h_tᵀ``,
``M`` is applied either to a matrix (:meth:`InfluenceMetric.matrix`, the validation gradients) or to the
tokens ``(h, δ)`` of a per-example gradient (:meth:`InfluenceMetric.tokens`, the scored examples).

* :class:`TracIn` — the identity: ``⟨g(z), ḡ⟩``.
* :class:`KFAC` — ``M = H^{-1/2}`` of the Kronecker-factored ``H = C_δ,λ ⊗ C_h,λ`` (Grosse et al. 2023), so
  ``⟨M g, M ḡ⟩ = ⟨g, H⁻¹ ḡ⟩``; its factors are estimated by :meth:`InfluenceMetric.fit` on training batches
  with the :class:`KFACFactors` tracker of the backward-pairs engine.

A new metric subclasses :class:`InfluenceMetric` and gets a name in :func:`influence_metric`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..damping import check_damping, check_damping_mode, damping_value
from ..tracking import backward_pairs
from .features import WeightPairTracker, eval_mode, progress_bar, slice_rows, to_device, trim_batch

METRICS = ("tracin", "kfac")


# --------------------------------------------------------------------------------------------
# K-FAC factors and the whitening they give
# --------------------------------------------------------------------------------------------
@dataclass
class LayerMetric:
    """Whitening of one tracked weight's gradients: ``g ↦ S_δ Q_δᵀ g Q_h S_h``.

    With ``C_λ = Q diag(e + λ) Qᵀ`` and ``S = diag((e + λ)^{-1/2})`` this is ``H^{-1/2} g`` of the
    Kronecker-factored ``H = C_δ,λ ⊗ C_h,λ`` written in the factors' eigenbases; so
    ``⟨g̃, ṽ⟩ = ⟨g, H⁻¹ v⟩`` and ``‖g̃‖² = ‖H^{-1/2} g‖²``. For ``g = Σ_t δ_t h_tᵀ`` it is applied to
    the tokens: ``h̃_t = S_h Q_hᵀ h_t``, ``δ̃_t = S_δ Q_δᵀ δ_t``.
    """

    Q_h: torch.Tensor
    s_h: torch.Tensor
    Q_d: torch.Tensor
    s_d: torch.Tensor

    def tokens(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (h @ self.Q_h) * self.s_h, (delta @ self.Q_d) * self.s_d

    def matrix(self, G: torch.Tensor) -> torch.Tensor:
        """Whiten gradient-shaped matrices ``G: [..., out, in]``."""
        return self.s_d[:, None] * (self.Q_d.t() @ G @ self.Q_h) * self.s_h

    def to(self, dtype: torch.dtype, device=None) -> "LayerMetric":
        return LayerMetric(*(t.to(dtype=dtype, device=device) for t in (self.Q_h, self.s_h, self.Q_d, self.s_d)))


def damped_eigh(C: torch.Tensor, damping: float, mode: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(Q, e + λ, λ)`` with ``C = Q diag(e) Qᵀ`` (float64) and ``λ`` the project's damping rule
    (:func:`~iprox_lightning.damping.damping_value`)."""
    C = C.double()
    C = 0.5 * (C + C.t())
    lam = damping_value(float(torch.trace(C)), C.shape[0], damping, mode)
    e, Q = torch.linalg.eigh(C)
    e = e.clamp(min=0.0) + lam
    if not bool((e > 0).all()):
        raise ValueError(f"damped K-FAC factor is singular (damping={damping}, mode={mode}, trace={float(torch.trace(C))}); "
                         "increase damping")
    return Q, e, lam


class KFACFactors(WeightPairTracker):
    """Tracker: running sums of ``h hᵀ`` and ``δ δᵀ`` (float64) over the non-padding tokens, per tracked weight."""

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        super().__init__(modules)
        self.sum_hh: dict[str, torch.Tensor] = {}
        self.sum_dd: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, float] = {}
        self.examples = 0

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        m = self.keep.squeeze(-1)
        hv = h[m].to(torch.float64)
        dv = delta[m].to(torch.float64)
        if key not in self.sum_hh:
            self.sum_hh[key] = hv.new_zeros(hv.shape[-1], hv.shape[-1])
            self.sum_dd[key] = dv.new_zeros(dv.shape[-1], dv.shape[-1])
            self.tokens[key] = 0.0
        self.sum_hh[key].addmm_(hv.t(), hv)
        self.sum_dd[key].addmm_(dv.t(), dv)
        self.tokens[key] += float(hv.shape[0])

    def metrics(self, keys: Sequence[str], damping: float, mode: str, reduce: Callable | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, LayerMetric]:
        """All-reduce (``reduce``), normalise to means, damp, eigendecompose -> ``LayerMetric``s."""
        out = {}
        for key in keys:
            if key not in self.sum_hh:
                raise RuntimeError(f"no K-FAC statistics were collected for {key!r}: is the factor data empty?")
            hh, dd = self.sum_hh[key], self.sum_dd[key]
            n = torch.tensor([self.tokens[key]], dtype=torch.float64, device=hh.device)
            if reduce is not None:
                hh, dd, n = reduce(hh), reduce(dd), reduce(n)
            n = float(n.item())
            if n <= 0:
                raise RuntimeError(f"K-FAC factors of {key!r} saw no token")
            Qh, eh, _ = damped_eigh(hh / n, damping, mode)
            Qd, ed, _ = damped_eigh(dd / n, damping, mode)
            out[key] = LayerMetric(Qh, eh.rsqrt(), Qd, ed.rsqrt()).to(dtype)
        return out


# --------------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------------
class InfluenceMetric:
    """The metric of the scores (see the module docstring). ``name`` is what ``method:`` selects in configs."""

    name: str
    needs_factor_data = False  # fit() reads training batches

    def fit(self, model: nn.Module, modules: Mapping[str, nn.Module], keys: Sequence[str],
            batches: Iterable[Mapping] | None, *, dtype: torch.dtype, shard=(0, 1), reduce=None,
            progress: bool = False) -> dict[str, float]:
        """Estimate the metric on ``batches`` for the tracked ``modules`` (weights ``keys``); returns statistics
        for the scorer's settings. Under several processes each takes the batches ``j % world == rank`` and
        ``reduce`` all-reduces a tensor by sum."""
        raise NotImplementedError

    def matrix(self, key: str, G: torch.Tensor) -> torch.Tensor:
        """``M G`` for gradient-shaped ``G: [..., out, in]`` of weight ``key``."""
        raise NotImplementedError

    def tokens(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``(h̃, δ̃)`` with ``Σ_t δ̃_t h̃_tᵀ = M Σ_t δ_t h_tᵀ``."""
        raise NotImplementedError

    def settings(self) -> dict:
        """The metric's options, for the score settings."""
        raise NotImplementedError


class TracIn(InfluenceMetric):
    """The identity metric: plain gradient inner products."""

    name = "tracin"

    def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False):
        return {}

    def matrix(self, key, G):
        return G

    def tokens(self, key, h, delta):
        return h, delta

    def settings(self) -> dict:
        return {}


class KFAC(InfluenceMetric):
    """``M = H^{-1/2}``, ``H = C_δ,λ ⊗ C_h,λ`` per tracked weight: ``C_h = E[h hᵀ]``, ``C_δ = E[δ δᵀ]`` over the
    non-padding tokens of the first ``examples`` training examples, damped by the project's rule
    (``damping``, ``damping_mode``: :mod:`iprox_lightning.damping`)."""

    name = "kfac"
    needs_factor_data = True

    def __init__(self, damping: float = 1e-3, damping_mode: str = "relative", examples: int = 1024) -> None:
        check_damping(damping, damping_mode)
        if examples < 1:
            raise ValueError(f"kfac_examples must be >= 1, got {examples}")
        self.damping, self.damping_mode, self.examples = float(damping), damping_mode, int(examples)
        self.layers: dict[str, LayerMetric] | None = None

    def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False):
        if batches is None:
            raise ValueError("method='kfac' needs training batches to estimate the K-FAC factors")
        rank, world = shard
        device = next(model.parameters()).device
        factors = KFACFactors(modules)
        seen = 0
        t0 = time.perf_counter()
        with eval_mode(model):
            for j, batch in enumerate(progress_bar(batches, progress, "K-FAC factors")):
                if seen >= self.examples:
                    break
                take = min(batch["input_ids"].shape[0], self.examples - seen)
                seen += take
                if j % world != rank:
                    continue
                backward_pairs(model, trim_batch(to_device(slice_rows(batch, take), device)), [factors])
                factors.examples += take
        n_ex = torch.tensor([float(factors.examples)], dtype=torch.float64, device=device)
        if reduce is not None:
            n_ex = reduce(n_ex)
        self.layers = factors.metrics(keys, self.damping, self.damping_mode, reduce, dtype)
        return {"kfac_examples_used": int(n_ex.item()), "kfac_seconds": time.perf_counter() - t0}

    def _layer(self, key: str) -> LayerMetric:
        if self.layers is None:
            raise RuntimeError("the K-FAC metric has no factors yet: call fit first")
        return self.layers[key]

    def matrix(self, key, G):
        return self._layer(key).matrix(G)

    def tokens(self, key, h, delta):
        return self._layer(key).tokens(h, delta)

    def settings(self) -> dict:
        return {"damping": self.damping, "damping_mode": self.damping_mode, "kfac_examples": self.examples}


def influence_metric(name: str, *, damping: float = 1e-3, damping_mode: str = "relative",
                     kfac_examples: int = 1024) -> InfluenceMetric:
    """The metric called ``name`` (``"tracin"`` | ``"kfac"``, the ``method:`` of the scoring configs); the
    K-FAC options are checked whatever the name, so a config is valid or not independently of ``method``."""
    if name not in METRICS:
        raise ValueError(f"method must be one of {METRICS}, got {name!r}")
    check_damping_mode(damping_mode)
    if kfac_examples < 1:
        raise ValueError(f"kfac_examples must be >= 1, got {kfac_examples}")
    if name == "kfac":
        return KFAC(damping, damping_mode, kfac_examples)
    return TracIn()
