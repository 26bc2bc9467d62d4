"""Influence metrics: the inner product the scores are taken in.

Per tracked weight, a metric is a linear map ``M`` of gradient-shaped matrices ``[out, in]``; scores use
``⟨M g(z), M ḡ⟩`` and ``‖M g(z)‖`` (see :mod:`.influence`). Because every gradient is ``g = Σ_t δ_t h_tᵀ``,
``M`` is applied either to a matrix (:meth:`InfluenceMetric.matrix`, the validation gradients) or to the
tokens ``(h, δ)`` of a per-example gradient (:meth:`InfluenceMetric.tokens`, the scored examples).

* :class:`TracIn` — the identity: ``⟨g(z), ḡ⟩``.
* :class:`KFAC` — ``M = H^{-1/2}`` of the Kronecker-factored ``H = C_δ,λ ⊗ C_h,λ`` (Grosse et al. 2023), so
  ``⟨M g, M ḡ⟩ = ⟨g, H⁻¹ ḡ⟩``; its factors are estimated by :meth:`InfluenceMetric.fit` on training batches
  with the :class:`KFACFactors` tracker of the backward-pairs engine.

* :class:`EKFAC` — eigenvalue-corrected K-FAC (George et al. 2018): K-FAC's eigenbases with eigenvalues fitted to
  the per-example gradients; it rescales the whole per-example gradient in the Kronecker eigenbasis, so it does not
  factor over tokens (``token_factored = False``) and the trackers take the per-layer gradient it maps,
  :meth:`InfluenceMetric.gradients` (rotating the tokens first when that is cheaper, :func:`eigenbasis_gradients`),
  or project it (:mod:`.projection`).

A fitted metric's state (eigenbases, eigenvalues) is saved and reused by fingerprint (:mod:`iprox_lightning.io.factors`,
:func:`fit_or_load`). A new metric subclasses :class:`InfluenceMetric` with a class keyword ``name=``: it registers
itself once (:data:`InfluenceMetric.registry`), and ``method: <name>`` then selects it everywhere. A metric is built
from the one scoring settings object, :class:`~.config.ScoringConfig` (:meth:`InfluenceMetric.from_config`), which
declares every shared option once with its default and its check; a metric class declares which of them it reads
(``uses``, ``conventions``), its own options (``options``: name -> default, given as ``ScoringConfig(options={...})``),
its fit passes (``factor_passes``) and its memory (:meth:`InfluenceMetric.memory_parts`, what ``train.py plan`` reads).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..engine.batch import example_loss_fn
from ..engine.damping import damping_value
from ..engine.fsdp import is_sharded
from ..engine.lowrank import LowRankLinear
from ..errors import UserInputError
from ..engine.tracking import backward_pairs
from ..engine.work_split import largest_first
from ..io.factors import factors_path, load_factors, save_factors
from ..io.fingerprint import digest
from .features import WeightPairTracker, eval_mode, materialize_grads, progress_bar, slice_rows, to_device, trim_batch
from .layer_shards import OwnedLayers, equal_steps, idle_batch

if TYPE_CHECKING:
    from .config import ScoringConfig

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
    (:func:`~iprox_lightning.engine.damping.damping_value`)."""
    C = C.double()
    C = 0.5 * (C + C.t())
    lam = damping_value(float(torch.trace(C)), C.shape[0], damping, mode)
    e, Q = torch.linalg.eigh(C)
    e = e.clamp(min=0.0) + lam
    if not bool((e > 0).all()):
        raise UserInputError(f"damped K-FAC factor is singular (damping={damping}, mode={mode}, trace={float(torch.trace(C))}); "
                             "increase damping")
    return Q, e, lam


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a factor pass multiplies a batch's tokens in: theirs, at least float32 (a float64 model stays
    float64; per-batch products in float32 are kronfluence's default)."""
    return torch.promote_types(t.dtype, torch.float32)


FACTOR_DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""``kfac_dtype`` (:class:`~.config.ScoringConfig`) -> the least precision of the factor sums and of the stored
eigenvectors (a float64 model's are float64 whatever it says)."""

KFAC_DTYPE_UNRECORDED = "float64"
"""What K-FAC / EK-FAC summed in before ``kfac_dtype`` existed: never recorded (the scoring config, the metric's
settings, the factors' fingerprint), and what recorded settings without ``kfac_dtype`` mean
(:meth:`~.config.ScoringConfig.from_settings`). So a run recorded before the option resumes with
``kfac_dtype: float64`` (the same computation), and the float32 default never reuses its factors, scores or store."""


def factor_layer_sizes(modules: Mapping[str, nn.Module]) -> dict[str, int]:
    """Entries of the K-FAC factors (``in² + out²`` per tracked weight) of each tracked module: what a module
    partition (:func:`balanced_groups`) balances. A ``LowRankLinear`` has two weights, ``A`` (``r² + out²``) and
    ``B`` (``in² + r²``)."""
    out = {}
    for name, m in modules.items():
        if isinstance(m, LowRankLinear):
            out[name] = 2 * m.rank ** 2 + m.in_features ** 2 + m.out_features ** 2
        else:
            o, i = (m.out_features, m.in_features) if hasattr(m, "in_features") else m.weight.shape
            out[name] = int(i) ** 2 + int(o) ** 2
    return out


def balanced_groups(sizes: Mapping[str, float], n: int) -> list[list[str]]:
    """``sizes``' names in at most ``n`` non-empty groups of about equal total size: the largest first, each into
    the group that is lightest so far (the first of equal ones); each group in ``sizes``' order. The module
    partitions of a K-FAC fit (``kfac_partitions``) and each rank's share of their eigendecompositions use it, and
    so does ``train.py plan`` (:mod:`iprox_lightning.analysis.memory`)."""
    n = max(1, min(int(n), len(sizes)))
    owner = largest_first(sizes, n)  # (engine.work_split)
    return [g for g in ([k for k in sizes if owner[k] == j] for j in range(n)) if g]


def layer_owners(modules: Mapping[str, nn.Module], keys: Sequence[str], partitions: int, world: int) -> dict[str, int]:
    """``{weight key: owning rank}`` of ``shard_layers`` (:mod:`.layer_shards`): each of the ``partitions`` module
    groups (:func:`balanced_groups`, as the K-FAC fit passes) split over ``world`` ranks largest first by factor size,
    so every pass holds about ``1/world`` of its sums on each rank; a weight's owner is its module's."""
    owner = owners_by_size(factor_layer_sizes(modules), partitions, world)
    return {k: owner[_weight_module(k)] for k in keys}


def owners_by_size(sizes: Mapping[str, float], partitions: int, world: int) -> dict[str, int]:
    """``{name: rank}``: each of the ``partitions`` groups of ``sizes`` (:func:`balanced_groups`) split over ``world``
    ranks largest first (:func:`layer_owners`, and ``train.py plan`` on the layers' shapes)."""
    owner: dict[str, int] = {}
    for group in balanced_groups(sizes, partitions):
        for r, share in enumerate(balanced_groups({m: sizes[m] for m in group}, world)):
            owner.update({m: r for m in share})
    return owner


def _rank_groups(linears: Sequence[tuple[int, int]], config, world: int) -> list[list[list[int]]]:
    """Per rank counted by the plan, the module groups of a K-FAC fit (indexes into ``linears``, the model's order):
    the ``kfac_partitions`` groups of :func:`balanced_groups` (every rank's, without ``shard_layers``), or with
    ``shard_layers`` on ``world`` ranks each rank's owned share of each (:func:`owners_by_size`)."""
    sizes = {str(j): i * i + o * o for j, (i, o) in enumerate(linears)}
    groups = [sorted(int(j) for j in g) for g in balanced_groups(sizes, config.kfac_partitions)]
    if not (getattr(config, "shard_layers", False) and world > 1):
        return [groups]
    owner = owners_by_size(sizes, config.kfac_partitions, world)
    return [[[j for j in g if owner[str(j)] == r] for g in groups] for r in range(world)]


def _eigens_bytes(n: int, factor_bytes: float) -> float:
    """One side's eigendecomposition as :meth:`KFACFactors.eigens` keeps it: ``n × n`` eigenvectors in the sums'
    dtype, ``n`` float64 eigenvalues and a float64 trace."""
    return factor_bytes * n * n + 8.0 * n + 8.0


def _weight_module(key: str) -> str:
    """The tracked module of weight ``key`` (``<module>.weight``, a LowRankLinear's ``<module>.A`` / ``.B``)."""
    return key.rsplit(".", 1)[0]


class KFACFactors(WeightPairTracker):
    """Tracker: running sums of ``h hᵀ`` and ``δ δᵀ`` over the non-padding tokens, per tracked weight (each batch's
    products in the tokens' precision, at least float32; the sums in that precision, at least ``dtype``: float32,
    kronfluence's default, or float64)."""

    def __init__(self, modules: Mapping[str, nn.Module], dtype: torch.dtype = torch.float32) -> None:
        super().__init__(modules)
        self.dtype = dtype
        self.sum_hh: dict[str, torch.Tensor] = {}
        self.sum_dd: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, float] = {}
        self.examples = 0

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        m = self.keep.squeeze(-1)
        hv = h[m].to(_work_dtype(h))
        dv = delta[m].to(_work_dtype(delta))
        if key not in self.sum_hh:
            s = torch.promote_types(hv.dtype, self.dtype)
            self.sum_hh[key] = hv.new_zeros(hv.shape[-1], hv.shape[-1], dtype=s)
            self.sum_dd[key] = dv.new_zeros(dv.shape[-1], dv.shape[-1], dtype=s)
            self.tokens[key] = 0.0
        self.sum_hh[key].add_(hv.t() @ hv)
        self.sum_dd[key].add_(dv.t() @ dv)
        self.tokens[key] += float(hv.shape[0])

    def eigens(self, keys: Sequence[str], reduce: Callable | None = None, *, owned: Sequence[str] | None = None,
               device=None) -> dict[str, dict[str, torch.Tensor]]:
        """All-reduce (``reduce``), normalise to means and eigendecompose, undamped: per key ``Q_h``, ``e_h``,
        ``tr_h`` (the trace of ``C_h``), ``Q_d``, ``e_d``, ``tr_d`` — what a saved factor file holds. Each
        eigendecomposition runs in float64, one layer at a time; the eigenvectors are stored in the sums' dtype
        (float32 unless the sums are float64), the eigenvalues and traces in float64, on ``device`` (``None``: the
        sums'; ``"cpu"`` offloads them). ``owned``: under several processes, the keys this rank decomposes; the
        others' results come from their ranks (``reduce`` of this rank's zeros, so every rank ends with every key,
        exactly the owner's numbers)."""
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
            out[key] = {}
            for side, S in (("h", hh), ("d", dd)):
                if owned is None or key in owned:
                    C = S.double() / n
                    C = 0.5 * (C + C.t())
                    tr = torch.trace(C).reshape(())
                    e, Q = torch.linalg.eigh(C)
                    del C
                    part = {f"Q_{side}": Q.to(S.dtype), f"e_{side}": e, f"tr_{side}": tr}
                    del Q  # (float64: freed before the next decomposition, where it would sit beside its workspace)
                else:
                    part = {f"Q_{side}": torch.zeros_like(S), f"e_{side}": S.new_zeros(len(S), dtype=torch.float64),
                            f"tr_{side}": S.new_zeros((), dtype=torch.float64)}
                if owned is not None and reduce is not None:  # (eigh's vectors are column-major: one layout)
                    part = {f: reduce(t.contiguous()) for f, t in part.items()}
                out[key].update({f: t.to(device) if device is not None else t for f, t in part.items()})
            del hh, dd
        return out

    def metrics(self, keys: Sequence[str], damping: float, mode: str, reduce: Callable | None = None,
                dtype: torch.dtype = torch.float32) -> dict[str, LayerMetric]:
        """All-reduce (``reduce``), normalise to means, damp, eigendecompose -> ``LayerMetric``s."""
        eig = self.eigens(keys, reduce)
        return {key: layer_metric(eig[key], damping, mode, dtype) for key in keys}


def _damped(e: torch.Tensor, trace: float, damping: float, mode: str, what: str) -> torch.Tensor:
    lam = damping_value(trace, e.numel(), damping, mode)
    e = e.double().clamp(min=0.0) + lam
    if not bool((e > 0).all()):
        raise UserInputError(f"damped {what} is singular (damping={damping}, mode={mode}, trace={trace}); increase damping")
    return e


def layer_metric(eig: Mapping[str, torch.Tensor], damping: float, mode: str,
                 dtype: torch.dtype = torch.float32, device=None) -> LayerMetric:
    """The K-FAC whitening of one weight from its undamped eigendecomposition (:meth:`KFACFactors.eigens`),
    damped by the project's rule per factor (in float64), in ``dtype`` on ``device`` (``None``: the eigenvectors';
    eigenvectors already in ``dtype`` there are shared, not copied)."""
    eh = _damped(eig["e_h"], float(eig["tr_h"]), damping, mode, "K-FAC factor")
    ed = _damped(eig["e_d"], float(eig["tr_d"]), damping, mode, "K-FAC factor")
    return LayerMetric(*(t.to(dtype=dtype, device=device) for t in (eig["Q_h"], eh.rsqrt(), eig["Q_d"], ed.rsqrt())))


def eigenbasis_gradients(h: torch.Tensor, delta: torch.Tensor, Q_h: torch.Tensor, Q_d: torch.Tensor,
                         rotate_h: Callable | None = None) -> torch.Tensor:
    """Per-example gradients in the Kronecker eigenbasis, ``Q_δᵀ (Σ_t δ_t h_tᵀ) Q_h``: ``[B, T, in] × [B, T, out]
    -> [B, out, in]``, in the order with fewer multiply-adds: rotating the ``T`` tokens first
    (``T (out² + in²) + T out in``, cheaper while ``T`` is below about the layer's width) or the formed gradient
    (``T out in + out² in + out in²``). Both are the same matrix up to rounding. ``rotate_h(h, Q_h)``: what computes
    ``h @ Q_h`` (default: the product; :class:`RotatedInputs` reuses it across weights that share their input)."""
    T, i, o = h.shape[1], h.shape[2], delta.shape[2]
    if T * (o * o + i * i) <= o * i * (o + i):
        hq = h @ Q_h if rotate_h is None else rotate_h(h, Q_h)
        return torch.bmm((delta @ Q_d).transpose(1, 2), hq)
    return Q_d.t() @ materialize_grads(h, delta) @ Q_h


class RotatedInputs:
    """``h @ Q_h`` reused within one backward step: the weights fed one input (q/k/v, gate/up) have the same input
    factor ``C_h``, so the same eigenbasis (made one tensor by :func:`share_equal`), and their tokens are rotated
    once. A hit needs the same ``Q_h`` object and the same memory of ``h`` unchanged since (the cached ``h`` is held,
    so its memory cannot be reused by another tensor; its version counter tells in-place changes): identical
    numbers. The last few inputs are kept until :meth:`clear` (end of the step)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.entries: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = []

    def __call__(self, h: torch.Tensor, Q_h: torch.Tensor) -> torch.Tensor:
        for ch, version, cq, out in self.entries:
            if cq is Q_h and ch.data_ptr() == h.data_ptr() and ch.shape == h.shape and ch.stride() == h.stride() \
                    and ch.dtype == h.dtype and ch._version == version == h._version:
                return out
        out = h @ Q_h
        self.entries = ([(h, h._version, Q_h, out)] + self.entries)[:self.keep]
        return out

    def clear(self) -> None:
        self.entries = []


def share_equal(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with equal ones (same shape, dtype and values) made one object (the first of them)."""
    out: dict[str, torch.Tensor] = {}
    seen: list[torch.Tensor] = []
    for k, t in tensors.items():
        out[k] = next((u for u in seen if u.shape == t.shape and u.dtype == t.dtype and torch.equal(u, t)), t)
        if out[k] is t:
            seen.append(t)
    return out


class EigenCorrection(WeightPairTracker):
    """Tracker: per tracked weight, ``Σ_z (Q_δᵀ G(z) Q_h)²`` (elementwise; each batch in the tokens' precision, at
    least float32, summed in that precision, at least ``dtype``) of the per-example gradients ``G(z) = Σ_t δ_t h_tᵀ``
    in the K-FAC eigenbases (George et al. 2018, EK-FAC's corrected eigenvalues)."""

    def __init__(self, modules: Mapping[str, nn.Module], bases: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(modules)
        self.bases = dict(bases)
        self.dtype = dtype
        self.sums: dict[str, torch.Tensor] = {}
        self.examples = 0

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        w = _work_dtype(h)
        Q_h, Q_d = self.bases[key]
        if Q_h.dtype != w or Q_h.device != h.device:  # converted once per weight
            Q_h, Q_d = self.bases[key] = (Q_h.to(h.device, w).contiguous(), Q_d.to(h.device, w).contiguous())
        R = eigenbasis_gradients(h.to(w), delta.to(w), Q_h, Q_d)
        s = torch.einsum("boi,boi->oi", R, R).to(torch.promote_types(w, self.dtype))
        if key in self.sums:
            self.sums[key].add_(s)
        else:
            self.sums[key] = s


# --------------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------------
class InfluenceMetric:
    """The metric of the scores (see the module docstring). ``name`` is what ``method:`` selects in configs.

    A metric maps a weight's per-example gradient ``G`` to ``M G``. It either factors over the tokens
    (``token_factored = True``: :meth:`tokens` maps ``(h, δ)`` so that ``Σ_t δ̃_t h̃_tᵀ = M G``; TracIn, K-FAC) and
    scoring never forms ``G``, or it does not (``False``: EK-FAC) and the trackers take ``M G`` per example from
    :meth:`gradients`. A metric fitted on data saves and loads its fitted state (:meth:`state_dict`,
    :meth:`load_state_dict`: tensors only, written as safetensors by :mod:`iprox_lightning.io.factors`).

    Everything about a metric is declared on its class: ``name`` (the class keyword), ``uses`` (the shared
    :class:`~.config.ScoringConfig` options it reads, recorded in its settings), ``conventions`` (the loss and
    curvature conventions it honours, recorded when not the default), ``options`` (its own options, name -> default:
    ``ScoringConfig(options={...})``, YAML ``options: {...}``; recorded in its settings), ``factor_passes`` (passes
    :meth:`fit` makes over the training batches) and :meth:`memory_parts` / ``memory_levers`` (its memory, which
    ``train.py plan`` adds to the scoring stage). It is built from the scoring settings by :meth:`from_config`."""

    registry: ClassVar[dict[str, type["InfluenceMetric"]]] = {}  # name -> class, filled by __init_subclass__
    name: ClassVar[str]
    factor_passes: ClassVar[int] = 0  # passes fit() makes over the training batches (0: nothing to fit)
    token_factored: ClassVar[bool] = True  # tokens() exists; False: matrix() on materialised per-example gradients
    symmetric: ClassVar[bool] = True  # a store's query maps the validation gradients as its rows (False: LESS, unmapped)
    uses: ClassVar[tuple[str, ...]] = ()  # the shared ScoringConfig options the metric reads (its settings)
    conventions: ClassVar[tuple[str, ...]] = ("loss_reduction",)  # conventions recorded when not the default
    options: ClassVar[Mapping[str, Any]] = {}  # the metric's own options, name -> default (ScoringConfig.options)
    memory_levers: ClassVar[Mapping[str, str]] = {}  # memory part -> the setting that lowers it (train.py plan)

    def __init_subclass__(cls, name: str | None = None, **kwargs) -> None:
        """``class MyMetric(InfluenceMetric, name="mine")`` registers it as ``method: mine``; a subclass without a
        ``name`` (a helper base) is not registered."""
        super().__init_subclass__(**kwargs)
        if name is not None:
            if name in InfluenceMetric.registry:
                raise TypeError(f"influence metric name {name!r} is taken by {InfluenceMetric.registry[name].__name__}")
            cls.name = name
            InfluenceMetric.registry[name] = cls

    def __init__(self, config: "ScoringConfig") -> None:
        """``config``: the scoring settings, checked when built (:meth:`~.config.ScoringConfig.build_metric` builds a
        metric; ``influence_metric(name, **options)`` from keywords)."""
        self.config = config
        # the loss and curvature conventions (docs/GUIDE.md, "To match kronfluence / bergson / LESS"): the per-example
        # loss (mean or sum of the response tokens' cross-entropies) for the scored, validation and factor gradients;
        # the curvature from the labels or sampled ones (factor passes only); K-FAC damps each factor or their product
        self.loss_reduction, self.fisher, self.damping_target = config.loss_reduction, config.fisher, config.damping_target
        self.own_options = {**self.options, **dict(config.options or {})}

    @classmethod
    def from_config(cls, config: "ScoringConfig") -> "InfluenceMetric":
        """The metric built from the scoring settings (:meth:`~.influence.ScoringConfig.build_metric`)."""
        return cls(config)

    @classmethod
    def memory_parts(cls, linears: Sequence[tuple[int, int]]) -> dict[str, float]:
        """Bytes per device the metric's own state adds to scoring, by part (``{}``: none), for the tracked weights'
        ``(in_features, out_features)`` (what ``train.py plan`` adds to the scoring stage; ``memory_levers`` names
        the setting that lowers each part). A metric whose memory depends on the scoring settings takes them as a
        second parameter ``config`` (the run's :class:`~.config.ScoringConfig`; K-FAC's ``kfac_*`` options)."""
        return {}

    @classmethod
    def fit_moments(cls, linears: Sequence[tuple[int, int]], *settings, world: int = 1) -> list[dict[str, Any]]:
        """The moments of most memory per device while :meth:`fit` runs, in their order (``[]``: nothing to fit;
        ``settings`` as :meth:`memory_parts` takes them): dicts of bytes by part, each with a ``phase``: ``"pass"``
        (a pass over the factor data: the caller adds one batch's activations) or ``"decompose"`` (after a pass).
        ``train.py plan`` counts the largest of them, or the scoring's parts if those are larger."""
        return []

    @property
    def needs_factor_data(self) -> bool:
        """Whether :meth:`fit` reads training batches."""
        return self.factor_passes > 0

    @property
    def loss_fn(self):
        """The ``loss_fn`` of :func:`~iprox_lightning.engine.tracking.backward_pairs` for :attr:`loss_reduction`."""
        return example_loss_fn(self.loss_reduction)

    def convention_settings(self, *names: str) -> dict:
        """The conventions among ``names`` that differ from the scoring settings' defaults (so settings and
        fingerprints of runs with the defaults are as before the options)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.config)}
        return {n: getattr(self, n) for n in names if getattr(self, n) != defaults[n]}

    def fit(self, model: nn.Module, modules: Mapping[str, nn.Module], keys: Sequence[str],
            batches: Iterable[Mapping] | None, *, dtype: torch.dtype, shard=(0, 1), reduce=None,
            progress: bool = False) -> dict[str, float]:
        """Estimate the metric on ``batches`` for the tracked ``modules`` (weights ``keys``); returns statistics
        for the scorer's settings. Under several processes each takes the batches ``j % world == rank`` and
        ``reduce`` all-reduces a tensor by sum."""
        raise NotImplementedError

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` (or :meth:`load_state_dict`) has run."""
        return not self.needs_factor_data

    def matrix(self, key: str, G: torch.Tensor) -> torch.Tensor:
        """``M G`` for gradient-shaped ``G: [..., out, in]`` of weight ``key``."""
        raise NotImplementedError

    def gradients(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``M G`` of the per-example gradients ``G = Σ_t δ_t h_tᵀ`` of tokens ``h: [B, T, in]``, ``δ: [B, T, out]``
        (``[B, out, in]``; what the trackers use when the metric is not ``token_factored``). A metric may override
        it with a cheaper order than forming ``G`` first."""
        return self.matrix(key, materialize_grads(h, delta))

    def tokens(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``(h̃, δ̃)`` with ``Σ_t δ̃_t h̃_tᵀ = M Σ_t δ_t h_tᵀ`` (only when ``token_factored``)."""
        raise NotImplementedError(f"metric {self.name!r} does not factor over tokens: use matrix() on gradients")

    def basis(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(Q_out, Q_in)``, orthonormal, when :meth:`matrix` / :meth:`tokens` return weight ``key``'s mapped gradient
        in other coordinates than the weight's own (``Q_outᵀ (·) Q_in``: K-FAC, EK-FAC, the factors' eigenbases);
        ``None`` for the weight's own coordinates. Inner products do not depend on it; a projection does
        (:mod:`.projection` rotates back first)."""
        return None

    def settings(self) -> dict:
        """The metric's options, for the score settings (and the fingerprints of what it scored): the shared options
        it ``uses``, its own ``options`` and its ``conventions`` that differ from the defaults."""
        return {**{n: getattr(self.config, n) for n in self.uses}, **self.own_options,
                **self.convention_settings(*self.conventions)}

    def fit_settings(self) -> dict:
        """The options the fitted state depends on (its file's fingerprint; damping is applied after loading)."""
        return {"method": self.name}

    def base_metric(self) -> "KFAC | None":
        """A :class:`KFAC` whose fitted factors this metric's fit starts from (``fit(..., eigenbases=)``), shared on
        disk by :func:`fit_or_load`; ``None`` for a metric fitted from scratch."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fitted state as named tensors (``{}`` for a metric without one)."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], keys: Sequence[str], *,
                        dtype: torch.dtype = torch.float32) -> None:
        """Set the fitted state of weights ``keys`` from :meth:`state_dict`'s output."""


class TracIn(InfluenceMetric, name="tracin"):
    """The identity metric: plain gradient inner products."""

    def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False):
        return {}

    def matrix(self, key, G):
        return G

    def tokens(self, key, h, delta):
        return h, delta


_EIG_FIELDS = ("Q_h", "e_h", "tr_h", "Q_d", "e_d", "tr_d")


FISHER_SEED = 0
"""Seed of a sampled Fisher's labels: batch ``j`` of the factor data draws with ``FISHER_SEED + j`` (the same labels
whatever the number of processes, in both EK-FAC passes)."""


def _factor_batches(model, batches, examples: int, shard, progress: bool, desc: str, trackers,
                    metric: "InfluenceMetric | None" = None, owners: Mapping[str, int] | None = None) -> int:
    """Run ``trackers`` over the first ``examples`` examples of ``batches`` (this rank's share), with ``metric``'s
    per-example loss and Fisher (its conventions, :class:`InfluenceMetric`); returns the count. ``owners`` (key ->
    rank, ``shard_layers``): the pairs go to each weight's owner (:class:`~.layer_shards.OwnedLayers`), every rank
    making the same number of steps."""
    loss_fn = example_loss_fn("mean") if metric is None else metric.loss_fn
    sampled = metric is not None and metric.fisher == "sampled"
    rank, world = shard
    device = next(model.parameters()).device

    def taken():  # (j, the batch's first examples up to the limit)
        seen = 0
        for j, batch in enumerate(progress_bar(batches, progress, desc)):
            if seen >= examples:
                break
            take = min(batch["input_ids"].shape[0], examples - seen)
            seen += take
            yield j, slice_rows(batch, take)

    done = 0
    with eval_mode(model):
        if owners is None and not is_sharded(model):
            for j, batch in taken():
                if j % world != rank:
                    continue
                backward_pairs(model, trim_batch(to_device(batch, device)), trackers, loss_fn=loss_fn,
                               sample_seed=FISHER_SEED + j if sampled else None)
                done += batch["input_ids"].shape[0]
            return done

        # every rank the same steps: under FSDP each forward is a collective, under shard_layers each pair
        owned = trackers if owners is None else [OwnedLayers(t, owners, rank, world) for t in trackers]
        for (j, batch), real in equal_steps(taken(), rank, world):
            b = trim_batch(to_device(batch if real else idle_batch(batch), device))
            for t in owned if owners is not None else ():
                t.active = None if real else torch.zeros(b["input_ids"].shape[0], dtype=torch.bool)
            backward_pairs(model, b, owned if real or owners is not None else [], loss_fn=loss_fn,
                           sample_seed=FISHER_SEED + j if sampled else None)
            done += b["input_ids"].shape[0] if real else 0
    return done


class KFAC(InfluenceMetric, name="kfac"):
    """``M = H^{-1/2}``, ``H = C_δ,λ ⊗ C_h,λ`` per tracked weight: ``C_h = E[h hᵀ]``, ``C_δ = E[δ δᵀ]`` over the
    non-padding tokens of the first ``examples`` training examples, damped by the project's rule
    (``damping``, ``damping_mode``: :mod:`iprox_lightning.engine.damping`).

    At scale (:class:`~.config.ScoringConfig`): the sums are float32 (``kfac_dtype``; float64 on request, and for a
    float64 model), each eigendecomposition float64 one layer at a time, its eigenvectors stored in the sums' dtype;
    ``kfac_partitions`` passes over the factor data fit one group of the tracked layers each (:func:`balanced_groups`),
    so only one group's sums are held; ``kfac_offload`` keeps the finished factors on the host and brings each layer's
    whitening to the device when it is applied; under several processes each rank decomposes its share of a group's
    layers (largest first) and the ranks exchange the results."""

    factor_passes = 1  # the factors C_h, C_δ
    uses = ("damping", "damping_mode", "kfac_examples", "kfac_dtype")
    conventions = ("loss_reduction", "fisher", "damping_target")
    memory_levers = {"kfac_factors": "kfac_offload true (the factors on the host, one layer on the device at a time), "
                                     "or method tracin, or a store",
                     "kfac_factor_sums": "kfac_partitions (one group of layers' sums per pass)"}

    @classmethod
    def memory_parts(cls, linears, config: "ScoringConfig", world: int = 1):
        """Bytes per device, for the tracked weights' ``(in_features, out_features)`` and the scoring settings
        ``config`` (a float32 scoring dtype, as for a bf16 / float32 model) on ``world`` ranks:

        * ``kfac_factors``: what the fitted metric holds on the device — the eigenvectors (``in² + out²`` per weight,
          ``kfac_dtype``), float64 eigenvalues and traces, and the whitening in float32 (K-FAC: its scale vectors,
          the float32 eigenvectors are shared; ``damping_target: product`` / EK-FAC: its float32 scales ``[out,
          in]``, in ``ekfac_corrections`` for EK-FAC). With ``kfac_offload`` all of it is on the host and the device
          holds the largest weight's float32 whitening while it is applied.
        * ``kfac_factor_sums``: the sums of the largest of the ``kfac_partitions`` groups, held during a fit pass
          (EK-FAC's eigenvalue sums of a group, ``in·out`` per weight, are smaller). Under several processes each
          rank decomposes a share of the layers, but every rank holds the whole group's sums and, after the
          exchange, every weight's factors (scoring applies them all), so the bytes do not shrink with the ranks.
          With ``shard_layers`` on several ranks they do: each rank holds its owned weights' factors and, per pass,
          its owned share of the group's sums (:func:`owners_by_size`); the rank holding the most is counted.
        * ``kfac_eigh``: one layer's float64 eigendecomposition (an estimate: the matrix and its temporaries, the
          eigenvectors and LAPACK's workspace, ``5 · 8 · n²`` for the widest side ``n``)."""
        return cls._memory_parts(linears, config, world)[0]

    @classmethod
    def _memory_parts(cls, linears, config: "ScoringConfig", world: int = 1) -> tuple[dict[str, float], list[int]]:
        """``(memory_parts, the layers (indexes into linears) of the rank counted)``."""
        c = config
        fb = 8.0 if c.kfac_dtype == "float64" else 4.0
        scaled = c.method == "ekfac" or c.damping_target == "product"  # M G = Q_δᵀ G Q_h / sqrt(Λ + λ)
        copy = 4.0 if fb != 4.0 else 0.0  # float32 whitening eigenvectors beside float64 factors

        def whitening(i, o):  # float32, on the device
            return copy * (i * i + o * o) + (8.0 + 4.0 * i * o if scaled else 4.0 * (i + o))

        rank_groups = _rank_groups(linears, c, world)
        ranks = [sorted(j for g in rg for j in g) for rg in rank_groups]  # the layers each rank holds
        groups = [g for rg in rank_groups for g in rg]
        if c.kfac_offload:
            held = max((4.0 * (i * i + o * o) + (4.0 * i * o if scaled else 4.0 * (i + o)) for i, o in linears),
                       default=0.0)
            mine = ranks[0]
        else:
            per = [fb * (i * i + o * o) + 8.0 * (i + o) + 16.0 + whitening(i, o) for i, o in linears]
            mine = max(ranks, key=lambda r: sum(per[j] for j in r))
            held = sum(per[j] for j in mine)
        sums = max((fb * sum(linears[j][0] ** 2 + linears[j][1] ** 2 for j in g) for g in groups), default=0.0)
        eigh = 5 * 8.0 * max((max(i, o) ** 2 for i, o in linears), default=0)
        return {"kfac_factors": held, "kfac_factor_sums": sums, "kfac_eigh": eigh}, mine

    @classmethod
    def fit_moments(cls, linears, config: "ScoringConfig", world: int = 1) -> list[dict[str, Any]]:
        """See :meth:`InfluenceMetric.fit_moments`: per module group (``kfac_partitions``, :func:`balanced_groups` as
        :meth:`fit` makes them) its pass (the group's sums, ``kfac_factor_sums``) and then each of its weights'
        two float64 eigendecompositions, input side first (``kfac_eigh``: ``5 · 8 · n²`` for the side's ``n``, as
        :meth:`memory_parts`), beside the sums; each moment with ``kfac_factors``, the factors decomposed before it
        and held on the device (the eigenvectors in the sums' dtype, float64 eigenvalues and traces; none with
        ``kfac_offload``, which moves each side's to the host when it is made). So a partitioned fit holds the early
        groups' factors beside a later group's sums, never every factor beside the largest sums. With
        ``shard_layers`` on several ranks each rank sums and decomposes its owned share of each group (every rank's
        moments are listed); without it every rank holds the group's sums and, after each weight, its factors."""
        fb = 8.0 if config.kfac_dtype == "float64" else 4.0
        moments = []
        for rank_groups in _rank_groups(linears, config, world):
            held = 0.0
            for g in rank_groups:
                sums = fb * sum(i * i + o * o for i, o in (linears[j] for j in g))
                moments.append({"phase": "pass", "kfac_factors": held, "kfac_factor_sums": sums})
                for j in g:
                    for n in linears[j]:  # (in, out): C_h, then C_δ
                        moments.append({"phase": "decompose", "kfac_factors": held, "kfac_factor_sums": sums,
                                        "kfac_eigh": 5 * 8.0 * n * n})
                        held += 0.0 if config.kfac_offload else _eigens_bytes(n, fb)
        return moments

    def __init__(self, config: "ScoringConfig") -> None:
        super().__init__(config)
        c = self.config
        self.damping, self.damping_mode, self.examples = float(c.damping), c.damping_mode, int(c.kfac_examples)
        self.factor_dtype = FACTOR_DTYPES[c.kfac_dtype]
        self.partitions, self.offload = int(c.kfac_partitions), bool(c.kfac_offload)
        self.layers: dict[str, LayerMetric] | None = None
        self.eigens: dict[str, dict[str, torch.Tensor]] = {}
        self.scales: dict[str, torch.Tensor] | None = None  # damping_target="product" / EK-FAC: 1/sqrt(Λ + λ)

    @property
    def fitted(self) -> bool:
        return self.layers is not None

    def _reduced_count(self, n: int, device, reduce) -> int:
        t = torch.tensor([float(n)], dtype=torch.float64, device=device)
        return int((reduce(t) if reduce is not None else t).item())

    def groups(self, modules: Mapping[str, nn.Module], keys: Sequence[str]) -> list[tuple[list[str], list[str]]]:
        """The module partitions of the fit: ``kfac_partitions`` groups ``(module paths, their weights' keys)``,
        balanced by factor size (:func:`balanced_groups`)."""
        out = []
        for mods in balanced_groups(factor_layer_sizes(modules), self.partitions):
            ms = set(mods)
            out.append((mods, [k for k in keys if _weight_module(k) in ms]))
        return out

    def _owned(self, modules, group: list[str], keys: Sequence[str], shard, reduce) -> set[str] | None:
        """This rank's share of a group's weights to decompose (its largest-first balanced share), ``None`` with one
        process."""
        rank, world = shard
        if world <= 1 or reduce is None:
            return None
        share = balanced_groups(factor_layer_sizes({m: modules[m] for m in group}), world)
        mine = set(share[rank]) if rank < len(share) else set()
        return {k for k in keys if _weight_module(k) in mine}

    def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False,
            eigenbases: "KFAC | None" = None, owners: Mapping[str, int] | None = None):
        """See :meth:`InfluenceMetric.fit`; ``eigenbases``: a fitted :class:`KFAC` on the same inputs whose factors
        are taken instead of fitting them (EK-FAC corrects the eigenvalues of a saved K-FAC fit). ``owners`` (weight
        key -> rank, ``shard_layers``: :func:`~.layer_shards.layer_owners`): this rank sums, decomposes and keeps
        only the weights it owns (every rank's pairs of a weight are sent to its owner)."""
        if batches is None:
            raise ValueError(f"method={self.name!r} needs training batches to estimate the K-FAC factors")
        self.device = next(model.parameters()).device
        mine = list(keys) if owners is None else [k for k in keys if owners[k] == shard[0]]
        if eigenbases is not None:
            self.eigens = {k: {f: eigenbases.eigens[k][f] for f in _EIG_FIELDS} for k in mine}
            stats = {"kfac_factors_reused": True}
        else:
            t0 = time.perf_counter()
            self.eigens, groups, done, decomposed = {}, self.groups(modules, keys), 0, 0
            for j, (mods, gkeys) in enumerate(groups):
                factors = KFACFactors({m: modules[m] for m in mods}, self.factor_dtype)
                desc = "K-FAC factors" + (f" {j + 1}/{len(groups)}" if len(groups) > 1 else "")
                done = _factor_batches(model, batches, self.examples, shard, progress, desc, [factors], self, owners)
                where = "cpu" if self.offload else None
                if owners is None:
                    owned = self._owned(modules, mods, gkeys, shard, reduce)
                    decomposed += len(gkeys if owned is None else owned)
                    self.eigens.update(factors.eigens(gkeys, reduce, owned=owned, device=where))
                else:  # the owner's sums hold every rank's tokens: no reduction, no exchange
                    gmine = [k for k in gkeys if owners[k] == shard[0]]
                    decomposed += len(gmine)
                    self.eigens.update(factors.eigens(gmine, device=where))
                del factors
            missing = [k for k in mine if k not in self.eigens]
            if missing:
                raise RuntimeError(f"no K-FAC statistics were collected for {missing[0]!r}: is it a tracked weight?")
            self.eigens = {k: self.eigens[k] for k in mine}
            n = self._reduced_count(done, self.device, reduce)
            stats = {"kfac_examples_used": n, "kfac_seconds": time.perf_counter() - t0, "kfac_passes": len(groups),
                     "kfac_weights_decomposed": decomposed}
        stats.update(self._fit_more(model, modules, keys, batches, shard=shard, reduce=reduce, progress=progress,
                                    owners=owners))
        self._build(mine, dtype)
        return stats

    def _fit_more(self, model, modules, keys, batches, *, shard, reduce, progress, owners=None) -> dict:
        return {}

    def _target(self):
        """Where the whitening is kept: the host with ``kfac_offload`` (each layer is moved to the device when
        applied), else the model's device (``None``: where the factors are)."""
        return "cpu" if self.offload else getattr(self, "device", None)

    def _build(self, keys, dtype) -> None:
        if self.damping_target == "product":  # Λ = e_δ e_hᵀ damped as a whole: not token-factored (as EK-FAC)
            self.token_factored = False
            self._build_scales(keys, dtype, lambda k: torch.outer(self.eigens[k]["e_d"].double().clamp(min=0.0),
                                                                  self.eigens[k]["e_h"].double().clamp(min=0.0)),
                               "K-FAC eigenvalue product")
            return
        self.token_factored = type(self).token_factored
        self.scales = None
        self.layers = {k: layer_metric(self.eigens[k], self.damping, self.damping_mode, dtype, self._target())
                       for k in keys}

    def _build_scales(self, keys, dtype, lams: Callable[[str], torch.Tensor], what: str) -> None:
        """``M G = (Q_δᵀ G Q_h) / sqrt(Λ + λ)`` per weight from the eigenvalue matrices ``lams(key)`` (``[out, in]``,
        float64, made one weight at a time), damped as a whole by the project's rule (``λ = damping·mean(Λ)``,
        relative)."""
        self.layers = {}
        self.scales: dict[str, torch.Tensor] | None = {}
        to = dict(dtype=dtype, device=self._target())
        # weights fed one input share one eigenbasis object (their tokens are then rotated once: RotatedInputs)
        Q_h = share_equal({k: self.eigens[k]["Q_h"].to(**to) for k in keys})
        for k in keys:
            lam = lams(k)
            d = _damped(lam.reshape(-1), float(lam.sum()), self.damping, self.damping_mode, what)
            self.scales[k] = d.rsqrt().reshape(lam.shape).to(**to)
            self.layers[k] = LayerMetric(Q_h[k], torch.ones(1, **to), self.eigens[k]["Q_d"].to(**to),
                                         torch.ones(1, **to))

    def _layer(self, key: str, like: torch.Tensor | None = None) -> LayerMetric:
        """Weight ``key``'s whitening, on ``like``'s device (an offloaded one is copied there)."""
        if self.layers is None:
            raise RuntimeError(f"the {self.name} metric has no factors yet: call fit first")
        L = self.layers[key]
        if like is not None and L.Q_h.device != like.device:
            L = L.to(L.Q_h.dtype, like.device)
        return L

    def matrix(self, key, G):
        if self.scales is not None:
            L = self._layer(key)
            return (L.Q_d.t().to(G) @ G @ L.Q_h.to(G)) * self.scales[key].to(G)
        return self._layer(key, G).matrix(G)

    def gradients(self, key, h, delta):
        if self.scales is not None:
            L = self._layer(key)
            Q_h = L.Q_h if L.Q_h.dtype == h.dtype and L.Q_h.device == h.device else L.Q_h.to(h)
            rotated = self.__dict__.setdefault("_rotated", RotatedInputs())
            return eigenbasis_gradients(h, delta, Q_h, L.Q_d.to(h), rotated).mul_(self.scales[key].to(h))
        return InfluenceMetric.gradients(self, key, h, delta)

    def release_step(self) -> None:
        """Drop the step's rotated inputs (:class:`RotatedInputs`), kept while one backward step runs."""
        if "_rotated" in self.__dict__:
            self._rotated.clear()

    def tokens(self, key, h, delta):
        if not self.token_factored:
            return InfluenceMetric.tokens(self, key, h, delta)
        return self._layer(key, h).tokens(h, delta)

    def basis(self, key):
        L = self._layer(key)
        return L.Q_d, L.Q_h

    def settings(self) -> dict:
        out = {**super().settings(), "damping": self.damping, "kfac_examples": self.examples}  # as float, int
        if out["kfac_dtype"] == KFAC_DTYPE_UNRECORDED:  # as recorded before the option
            del out["kfac_dtype"]
        return out

    def fit_settings(self) -> dict:
        dtype = {} if self.config.kfac_dtype == KFAC_DTYPE_UNRECORDED else {"kfac_dtype": self.config.kfac_dtype}
        return {"method": self.name, "kfac_examples": self.examples, **dtype,
                **self.convention_settings("loss_reduction", "fisher")}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{key}|{f}": t for key, e in self.eigens.items() for f, t in e.items()}

    def load_state_dict(self, state, keys, *, dtype=torch.float32, device=None) -> None:
        """See :meth:`InfluenceMetric.load_state_dict`; the tensors keep their saved dtypes (float32 eigenvectors
        stay float32), and the whitening is built on ``device`` (``None``: the host; ``kfac_offload``: the host)."""
        fields = _EIG_FIELDS + getattr(self, "extra_fields", ())
        missing = [f"{k}|{f}" for k in keys for f in fields if f"{k}|{f}" not in state]
        if missing:
            raise UserInputError(f"the saved {self.name} factors lack {len(missing)} tensor(s), e.g. {missing[0]!r}: "
                                 "they were fitted for other layers")
        self.eigens = {k: {f: state[f"{k}|{f}"] for f in fields} for k in keys}
        if device is not None:
            self.device = torch.device(device)
        self._build(keys, dtype)


class EKFAC(KFAC, name="ekfac"):
    """Eigenvalue-corrected K-FAC (George et al. 2018; kronfluence's default): the K-FAC eigenbases ``Q_h``, ``Q_δ``
    with the eigenvalues replaced by ``Λ = E_z[(Q_δᵀ G(z) Q_h)²]`` (elementwise, over the per-example gradients of the
    first ``examples`` training examples), damped by the project's rule on ``Λ`` (``λ = damping·mean(Λ)``, relative);
    ``M G = (Q_δᵀ G Q_h) / sqrt(Λ + λ)``, so ``⟨M g, M v⟩ = ⟨g, H⁻¹ v⟩`` with
    ``H = (Q_δ ⊗ Q_h) diag(Λ + λ) (Q_δ ⊗ Q_h)ᵀ``. Not token-factored: per-example gradients are materialised per
    layer (``[B, out, in]``, never one flat vector). The eigenvalue sums are in K-FAC's factor dtype, and fitted over
    the same module partitions (one group per pass)."""

    factor_passes = 2  # K-FAC's factors, then the eigenvalues in their eigenbases
    token_factored = False
    extra_fields = ("lambda", "n")
    conventions = ("loss_reduction", "fisher")  # EK-FAC damps its eigenvalue matrix as a whole whatever damping_target says
    memory_levers = {**KFAC.memory_levers, "ekfac_corrections": "method kfac or tracin"}

    @classmethod
    def memory_parts(cls, linears, config: "ScoringConfig", world: int = 1):
        """K-FAC's parts (:meth:`KFAC.memory_parts`), with the float32 scales ``[out, in]`` per tracked weight (the
        damped eigenbasis corrections) on the device as ``ekfac_corrections`` (with ``kfac_offload``: in
        ``kfac_factors``, the largest weight's while applied; with ``shard_layers``: the owned weights'). The
        corrections' sums stay on the host."""
        c = config
        parts, mine = KFAC._memory_parts(linears, dataclasses.replace(c, method="ekfac"), world)
        scales = 0.0 if c.kfac_offload else sum(4.0 * linears[j][0] * linears[j][1] for j in mine)
        return {**parts, "kfac_factors": parts["kfac_factors"] - scales, "ekfac_corrections": scales}

    @classmethod
    def fit_moments(cls, linears, config: "ScoringConfig", world: int = 1) -> list[dict[str, Any]]:
        """K-FAC's fit moments (:meth:`KFAC.fit_moments`), then per group the pass of the eigenvalue corrections:
        every factor of the rank held (on the device unless ``kfac_offload``) beside the group's correction sums
        (``in · out`` per weight in the sums' dtype); each group's corrections go to the host after its pass."""
        c = dataclasses.replace(config, method="ekfac")
        fb = 8.0 if c.kfac_dtype == "float64" else 4.0
        moments = KFAC.fit_moments(linears, c, world)
        for rank_groups in _rank_groups(linears, c, world):
            held = 0.0 if c.kfac_offload else sum(_eigens_bytes(n, fb) for g in rank_groups for j in g
                                                  for n in linears[j])
            moments += [{"phase": "pass", "kfac_factors": held,
                         "kfac_factor_sums": fb * sum(linears[j][0] * linears[j][1] for j in g)} for g in rank_groups]
        return moments

    def base_metric(self) -> KFAC:
        """The K-FAC metric whose eigenbases this one corrects (same options): its factors are shared on disk."""
        return KFAC(dataclasses.replace(self.config, method="kfac"))

    def _fit_more(self, model, modules, keys, batches, *, shard, reduce, progress, owners=None) -> dict:
        t0 = time.perf_counter()
        groups = self.groups(modules, keys)
        examples = 0
        for j, (mods, gkeys) in enumerate(groups):
            if owners is not None:  # the owner's sums hold every rank's examples: no reduction
                gkeys = [k for k in gkeys if owners[k] == shard[0]]
            corr = EigenCorrection({m: modules[m] for m in mods},
                                   {k: (self.eigens[k]["Q_h"], self.eigens[k]["Q_d"]) for k in gkeys},
                                   self.factor_dtype)
            desc = "EK-FAC eigenvalues" + (f" {j + 1}/{len(groups)}" if len(groups) > 1 else "")
            examples = _factor_batches(model, batches, self.examples, shard, progress, desc, [corr], self, owners)
            for k in gkeys:
                s = corr.sums.pop(k, None)
                if s is None:
                    s = torch.zeros(len(self.eigens[k]["e_d"]), len(self.eigens[k]["e_h"]),
                                    dtype=torch.promote_types(self.eigens[k]["Q_h"].dtype, self.factor_dtype))
                if reduce is not None and owners is None:
                    s = reduce(s)
                self.eigens[k]["lambda"] = s.cpu()
            del corr
        n = torch.tensor(float(examples), dtype=torch.float64)
        if reduce is not None:
            device = next(model.parameters()).device
            n = reduce(n.reshape(1).to(device)).cpu().reshape(())
        for k in self.eigens:
            self.eigens[k]["n"] = n
        return {"ekfac_seconds": time.perf_counter() - t0}

    def _build(self, keys, dtype) -> None:
        for k in keys:
            if float(self.eigens[k]["n"]) <= 0:
                raise RuntimeError(f"EK-FAC eigenvalues of {k!r} saw no example")
        self._build_scales(keys, dtype, lambda k: self.eigens[k]["lambda"].double() / float(self.eigens[k]["n"]),
                           "EK-FAC eigenvalue matrix")

    def dual(self, key, V):
        """``Q_δ (s ⊙ V) Q_hᵀ`` of ``matrix``-mapped directions ``V: [K, out, in]``: the directions ``W`` with
        ``⟨G, W_k⟩ = ⟨gradients(G), V_k⟩`` for every per-example gradient ``G`` (``Q`` orthogonal), so a pass that
        needs only the inner products (not ``‖M G‖``) takes them on the raw gradients, rotating no training token."""
        L = self._layer(key)
        return L.Q_d.to(V) @ (V * self.scales[key].to(V)) @ L.Q_h.t().to(V)


def metric_names() -> tuple[str, ...]:
    """The registered metric names (``method:`` values)."""
    return tuple(InfluenceMetric.registry)


def fit_or_load(metric: InfluenceMetric, model: nn.Module, modules: Mapping[str, nn.Module], keys: Sequence[str],
                batches: Iterable[Mapping] | None, *, factors_dir: str | None, fingerprint: Mapping | None,
                dtype: torch.dtype, shard=(0, 1), reduce=None, progress: bool = False, save: bool = True,
                owners: Mapping[str, int] | None = None) -> dict:
    """``metric.fit(...)``, or, with a ``factors_dir``, load the factors fitted before on the same inputs
    (``fingerprint``: model identity and factor-data digest; the metric's fit settings, the tracked weights and
    ``dtype`` are added here) and save newly fitted ones there (``save``: rank 0 only under several processes).
    Returns the fit statistics (``factors``: the file, ``factors_reused``). ``owners`` (``shard_layers``: weight key
    -> rank): each rank fits and keeps its own weights' factors (:meth:`KFAC.fit`); not with a ``factors_dir``."""
    if owners is not None and metric.needs_factor_data:
        if factors_dir is not None:
            raise UserInputError("factors_dir: the factors of shard_layers are split across the ranks (each holds its "
                                 "share) and are not saved or loaded; leave factors_dir out, or shard_layers false")
        return metric.fit(model, modules, keys, batches, dtype=dtype, shard=shard, reduce=reduce, progress=progress,
                          owners=owners)
    if factors_dir is None or not metric.needs_factor_data:
        return metric.fit(model, modules, keys, batches, dtype=dtype, shard=shard, reduce=reduce, progress=progress)

    def where(m):
        fp = {**dict(fingerprint or {}), **m.fit_settings(), "weights": digest(list(keys)), "dtype": str(dtype)}
        return factors_path(factors_dir, m.name, fp), fp

    path, fp = where(metric)
    if path.exists():
        on = {"device": next(model.parameters()).device} if isinstance(metric, KFAC) else {}
        metric.load_state_dict(load_factors(path, method=metric.name, fingerprint=fp), keys, dtype=dtype, **on)
        return {"factors": str(path), "factors_reused": True}
    base = metric.base_metric()
    if base is None:
        stats = metric.fit(model, modules, keys, batches, dtype=dtype, shard=shard, reduce=reduce, progress=progress)
    else:  # (EK-FAC) on the base's factors of the same inputs: loaded when a base run saved them, else saved for one
        base_path, base_fp = where(base)
        reuse = base_path.exists()
        if reuse:
            base.load_state_dict(load_factors(base_path, method=base.name, fingerprint=base_fp), keys, dtype=dtype)
        stats = metric.fit(model, modules, keys, batches, dtype=dtype, shard=shard, reduce=reduce, progress=progress,
                           eigenbases=base if reuse else None)
        if save and not reuse:
            base.eigens = {k: {f: metric.eigens[k][f] for f in _EIG_FIELDS} for k in keys}
            save_factors(base_path, base.state_dict(), method=base.name, fingerprint=base_fp)
    if save:
        save_factors(path, metric.state_dict(), method=metric.name, fingerprint=fp)
    return {**stats, "factors": str(path), "factors_reused": False}
