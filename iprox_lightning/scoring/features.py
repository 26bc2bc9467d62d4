"""Per-example gradient features of linear layers from the hooked pairs ``(h, δ)``.

For a linear layer ``y_t = W h_t`` (``W: [out, in]``) and one example with token inputs ``h_t`` and
output-gradients ``δ_t = ∂L(z)/∂y_t``, the per-example weight gradient is

    g = Σ_t δ_t h_tᵀ                                   ([out, in])

and everything the scorers need is a dot product with fixed matrices ``V_k`` and the squared norm:

    ⟨g, V_k⟩ = Σ_t δ_tᵀ V_k h_t                        ("ghost" dot product)
    ‖g‖²     = Σ_{t,s} (h_t·h_s)(δ_t·δ_s) = 1ᵀ[(H Hᵀ) ∘ (Δ Δᵀ)]1   ("ghost" norm)

Two exact ways to get them, batched over the ``B`` examples of a batch:

* ``"ghost"``: Gram matrices ``H Hᵀ``, ``Δ Δᵀ`` (cost ≈ ``T²(in+out)`` per example) plus ``V_k h_t``
  for every token (≈ ``K·T·in·out``); per-example gradients are never formed;
* ``"materialize"``: ``g = Δᵀ H`` with one ``bmm`` (≈ ``T·in·out``), then ``‖g‖²`` and ``⟨g, V_k⟩``
  (≈ ``(K+1)·in·out``).

``choose_mode`` picks the cheaper one per layer from these counts (``"auto"``). With ``K ≥ 1``
validation directions the ghost path only wins for short sequences (``T² (in+out) ≲ 2·in·out``);
both give identical numbers (tested).

A ``LowRankLinear`` (``y = A (B h)``) is handled as two *virtual* linears: ``∇_A = Σ_t δ_t (B h_t)ᵀ``
(input ``B h``, output-gradient ``δ``) and ``∇_B = Σ_t (Aᵀ δ_t) h_tᵀ`` (input ``h``, output-gradient
``Aᵀ δ``); ``B h`` and ``∂L/∂(B h) = Aᵀ δ`` are the pair of the layer's ``bottleneck`` seam. The pairs come
from the backward-pairs engine (:mod:`iprox_lightning.engine.tracking`) through a :class:`WeightPairTracker`.

An influence metric (:mod:`.metrics`) optionally maps ``(h, δ)`` to a whitened basis first (K-FAC:
``h̃ = S_h Q_hᵀ h``, ``δ̃ = S_δ Q_δᵀ δ``), so the same two routines give ``⟨g, H⁻¹ ḡ⟩`` and ``‖H^{-1/2} g‖²``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping

import torch
from torch import nn

from ..engine.batch import IGNORE_INDEX, batch_rows, check_batch, to_device
from ..errors import UserInputError
from ..engine.lowrank import LowRankLinear
from ..engine.model_modes import eval_mode
from ..engine.target_layers import conv1d_class, find_target_linears, linear_shape
from ..engine.tracking import PairTracker
from ..progress import progress

FEATURE_MODES = ("auto", "ghost", "materialize")

# --------------------------------------------------------------------------------------------
# which parameters are tracked
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VirtualLinear:
    """One tracked weight matrix, seen as a linear map ``in_features -> out_features``.

    ``key`` names it (``"<module path>.weight"`` for a dense layer, ``".A"`` / ``".B"`` for the
    factors of a ``LowRankLinear``); gradients are always laid out as ``[out, in]`` (a GPT-2
    ``Conv1D`` stores its weight transposed, its gradient here is not).
    """

    key: str
    module_name: str
    out_features: int
    in_features: int


def tracked_modules(model: nn.Module, patterns: list[str] | None = None) -> dict[str, nn.Module]:
    """The modules whose weights are tracked: ``find_target_linears(model, patterns)`` restricted
    to ``nn.Linear`` / ``Conv1D`` / ``LowRankLinear`` (biases, norms, embeddings and the LM head are
    never tracked)."""
    found = find_target_linears(model, patterns)
    conv = conv1d_class()
    ok = (nn.Linear, LowRankLinear) + ((conv,) if conv is not None else ())
    return {n: m for n, m in found.items() if isinstance(m, ok)}


def virtual_linears(modules: Mapping[str, nn.Module]) -> list[VirtualLinear]:
    """The tracked weight matrices of ``modules`` in model order (two per ``LowRankLinear``)."""
    out: list[VirtualLinear] = []
    for name, m in modules.items():
        if isinstance(m, LowRankLinear):
            out.append(VirtualLinear(f"{name}.A", name, m.out_features, m.rank))
            out.append(VirtualLinear(f"{name}.B", name, m.rank, m.in_features))
        else:
            o, i = linear_shape(m)
            out.append(VirtualLinear(f"{name}.weight", name, o, i))
    return out


# --------------------------------------------------------------------------------------------
# ghost vs materialised per-example features
# --------------------------------------------------------------------------------------------
def feature_costs(T: int, in_features: int, out_features: int, n_vectors: int) -> dict[str, float]:
    """Multiply-add counts per example of the two exact paths (see module docstring)."""
    io = in_features * out_features
    return {
        "ghost": n_vectors * T * io + T * T * (in_features + out_features),
        "materialize": T * io + (n_vectors + 1) * io,
    }


def choose_mode(T: int, in_features: int, out_features: int, n_vectors: int, mode: str = "auto") -> str:
    """``"ghost"`` or ``"materialize"``: ``mode`` itself unless ``"auto"``, then the cheaper path."""
    if mode not in FEATURE_MODES:
        raise ValueError(f"feature mode must be one of {FEATURE_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    c = feature_costs(T, in_features, out_features, n_vectors)
    return "ghost" if c["ghost"] < c["materialize"] else "materialize"


def materialize_grads(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Per-example gradients ``g_b = Σ_t δ_{b,t} h_{b,t}ᵀ``: ``[B, T, in] × [B, T, out] -> [B, out, in]``."""
    return torch.bmm(delta.transpose(1, 2), h)


def row_sq_norms(X: torch.Tensor) -> torch.Tensor:
    """``‖X_b‖²`` of the rows of ``X: [B, D]`` as one batched product (no ``[B, D]`` temporary, unlike
    ``X.pow(2).sum(1)``): ``[B]``."""
    return torch.bmm(X.unsqueeze(1), X.unsqueeze(2)).reshape(X.shape[0])


def ghost_sq_norms(h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``‖g_b‖² = Σ_{t,s} (h_t·h_s)(δ_t·δ_s)`` without forming ``g_b``: ``[B]``."""
    return (torch.bmm(h, h.transpose(1, 2)) * torch.bmm(delta, delta.transpose(1, 2))).sum(dim=(1, 2))


def ghost_dots(h: torch.Tensor, delta: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``⟨g_b, V_k⟩ = Σ_t δ_{b,t}ᵀ V_k h_{b,t}`` for ``V: [K, out, in]``: ``[B, K]``."""
    B, T, i = h.shape
    K, o, _ = V.shape
    vh = (h.reshape(B * T, i) @ V.reshape(K * o, i).t()).view(B, T, K, o)
    return torch.einsum("btko,bto->bk", vh, delta)


def layer_features(
    h: torch.Tensor, delta: torch.Tensor, V: torch.Tensor | None, mode: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(‖g_b‖² [B], ⟨g_b, V_k⟩ [B, K] or None)`` (float64) for one linear layer.

    ``h: [B, T, in]``, ``delta: [B, T, out]`` (zero on positions that must not count, e.g. padding),
    ``V: [K, out, in]`` or ``None``. ``mode``: ``"auto"`` (cheaper path), ``"ghost"`` or ``"materialize"``.
    """
    K = 0 if V is None else V.shape[0]
    m = choose_mode(h.shape[1], h.shape[-1], delta.shape[-1], K, mode)
    if m == "materialize":
        g = materialize_grads(h, delta)  # [B, out, in]
        # row norms then a float64 sum: accurate (a float32 dot over out*in elements errs ~1e-4) and
        # no [B, out, in] temporary
        sq = torch.linalg.vector_norm(g, dim=2).double().pow(2).sum(dim=1)
        # [K, out·in] @ [out·in, B]: the directions as the row-major left operand (about 1.6× faster on one CPU
        # thread than the [B, out·in] @ [out·in, K] form for a few examples and directions; the same products)
        dots = None if V is None else (V.flatten(1) @ g.flatten(1).t()).t().double()
        return sq, dots
    sq = ghost_sq_norms(h, delta).double()
    return sq, (None if V is None else ghost_dots(h, delta, V).double())


# --------------------------------------------------------------------------------------------
# per-weight pairs from the backward-pairs engine
# --------------------------------------------------------------------------------------------
class WeightPairTracker(PairTracker):
    """Base of the scoring trackers: turns the engine's per-layer pairs into per-weight pairs and hands
    ``on_weight(key, h [B, T, in], δ [B, T, out])`` to the subclass for every tracked weight
    (``VirtualLinear.key``), ``δ`` zeroed on padding positions (``attention_mask == 0``; prompt positions
    keep their generally non-zero output-gradients).

    A dense layer gives its own pair. A ``LowRankLinear`` ``y = A z + b``, ``z = B h``, is tracked together
    with its ``bottleneck`` seam: the layer's pair ``(h, δ)`` arrives first in the backward, the seam's
    ``(z, ∂L/∂z = Aᵀ δ)`` right after, and then ``A`` gets ``(z, δ)`` and ``B`` gets ``(h, Aᵀ δ)``. Both come
    from activations and their autograd gradients, never from the parameters, so no step reads a parameter
    that FSDP may have resharded.
    """

    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.modules: dict[str, nn.Module] = {}
        self.seams: dict[str, str] = {}  # bottleneck path -> its LowRankLinear's path
        for name, m in modules.items():
            self.modules[name] = m
            if isinstance(m, LowRankLinear):
                self.modules[f"{name}.bottleneck"] = m.bottleneck
                self.seams[f"{name}.bottleneck"] = name
        self.lowrank = set(self.seams.values())

    def start_step(self, batch: Mapping) -> None:
        self.keep = batch["attention_mask"].to(torch.bool).unsqueeze(-1)
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # LowRankLinear path -> (h, δ)

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        if h.dim() != 3:
            raise RuntimeError(f"tracked layer {name!r} received a {h.dim()}-D input; expected [B, T, in]")
        d = delta * self.keep.to(delta.device)
        layer = self.seams.get(name)
        if layer is not None:
            h_layer, d_layer = self.pending.pop(layer)
            self.on_weight(f"{layer}.A", h, d_layer)
            self.on_weight(f"{layer}.B", h_layer, d)
        elif name in self.lowrank:
            self.pending[name] = (h, d)
        else:
            self.on_weight(f"{name}.weight", h, d)

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        raise NotImplementedError


class FactorSpaceView(WeightPairTracker):
    """Runs on a dense model (``dense_modules``: its tracked modules) and hands each weight's pair to ``inner``, a
    :class:`WeightPairTracker` of another model (``modules``: the scored proxy's tracked modules, same paths), in that
    model's coordinates: a ``LowRankLinear`` ``W ≈ A B`` there gets ``A: (B h, δ)`` and ``B: (h, Aᵀ δ)`` -- summed over
    tokens, ``∇W·Bᵀ`` and ``Aᵀ·∇W``, the gradients its factors would get from the dense model's ``h`` and ``δ``
    (:func:`iprox_lightning.alignment.losses.factor_projections`, what Stage 2 aligns the proxy's own factor gradients to);
    a layer dense in both gets its pair as is. So a proxy's pool can be scored against its target's validation
    gradients without forming an ``[out, in]`` matrix (:meth:`.influence.InfluenceScorer.collect_validation`,
    :class:`.projection.GradientProjector`)."""

    def __init__(self, dense_modules: Mapping[str, nn.Module], inner: WeightPairTracker,
                 modules: Mapping[str, nn.Module], moved: dict | None = None) -> None:
        check_same_layers(dense_modules, modules)
        super().__init__({n: dense_modules[n] for n in modules})
        self.inner = inner
        self.factors = {n: m for n, m in modules.items() if isinstance(m, LowRankLinear)}
        sharded = [n for n, m in self.factors.items() if hasattr(m.A, "full_tensor") or hasattr(m.B, "full_tensor")]
        if sharded:  # the factors are read here, outside the proxy's forward: a sharded DTensor would need a gather
            raise UserInputError(f"validation_model: the scored proxy's factors are sharded (FSDP; {sharded[0]!r}); "
                                 "scoring against another model's validation gradients needs them whole: score with "
                                 "DDP or one process")
        # the factors on the dense model's device and dtype, once (``moved``: shared by the views of one caller's batches)
        self._moved: dict[str, tuple[torch.Tensor, torch.Tensor]] = {} if moved is None else moved

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        self.inner.start_step(batch)

    def end_step(self) -> None:
        self.inner.end_step()

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        name = key.removesuffix(".weight")
        m = self.factors.get(name)
        if m is None:
            self.inner.on_weight(key, h, delta)
            return
        ab = self._moved.get(name)
        if ab is None or ab[0].device != h.device or ab[0].dtype != h.dtype:
            ab = self._moved[name] = (m.A.detach().to(h), m.B.detach().to(h))
        A, B = ab
        self.inner.on_weight(f"{name}.A", h @ B.t(), delta)
        self.inner.on_weight(f"{name}.B", h, delta @ A)


def check_same_layers(dense_modules: Mapping[str, nn.Module], modules: Mapping[str, nn.Module]) -> None:
    """``dense_modules`` (a dense model's tracked modules) and ``modules`` track the same paths, each with the same
    ``[out, in]`` shape (as compression keeps them: a proxy of that model); a clear error otherwise."""
    low = [n for n, m in dense_modules.items() if isinstance(m, LowRankLinear)]
    if low:
        raise UserInputError(f"validation_model: must be a dense model (the target), but its {low[0]!r} (and "
                             f"{len(low) - 1} more) is low-rank")
    missing = [n for n in modules if n not in dense_modules]
    if missing:
        raise UserInputError(f"validation_model: the scored model tracks {missing[0]!r} (and {len(missing) - 1} more), "
                             "which the validation model has not under that path: give the target the scored proxy "
                             "was built from (a proxy with dropped blocks cannot take its target's gradients)")
    extra = [n for n in dense_modules if n not in modules]
    if extra:  # a proxy that dropped blocks renumbers the rest: same paths, same shapes, other layers
        raise UserInputError(f"validation_model: it tracks {extra[0]!r} (and {len(extra) - 1} more), which the scored "
                             "model has not: a proxy that dropped blocks (Layer Extraction, drop_blocks) renumbers the "
                             "blocks it keeps, so its layers are not the target's under the same path")
    for n, m in modules.items():
        shape = (m.out_features, m.in_features) if isinstance(m, LowRankLinear) else linear_shape(m)
        if tuple(shape) != tuple(linear_shape(dense_modules[n])):
            raise UserInputError(f"validation_model: {n!r} is [out, in] = {list(linear_shape(dense_modules[n]))} there "
                                 f"but {list(shape)} in the scored model")


class ValidationGradientTracker(WeightPairTracker):
    """Per tracked weight and per group of examples (``group_of(batch)`` names each row's group, e.g. its
    validation task), the sum of the per-example gradients ``Σ_z g(z) = Σ_z Σ_t δ_t h_tᵀ`` (``sums[key][group]``)."""

    def __init__(self, modules: Mapping[str, nn.Module], keys: list[str], group_of, dtype: torch.dtype,
                 groups: Collection[str] | None = None, device: torch.device | str | None = None) -> None:
        """``groups``: only these groups' sums are kept (``None``: every group's); ``device``: where the sums are
        accumulated (``None``: where the gradients are computed; the same additions, so the same numbers)."""
        super().__init__(modules)
        self.sums: dict[str, dict[str, torch.Tensor]] = {k: {} for k in keys}
        self.group_of = group_of
        self.dtype = dtype
        self.groups = None if groups is None else set(groups)
        self.device = None if device is None else torch.device(device)

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        index: dict[str, list[int]] = {}
        for r, g in enumerate(self.group_of(batch)):
            index.setdefault(g, []).append(r)
        self.rows = {g: torch.tensor(r, device=batch["input_ids"].device) for g, r in index.items()}
        self.row_lists = index

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        h, delta = h.to(self.dtype), delta.to(self.dtype)
        acc = self.sums[key]
        if len(self.rows) > 1 and len(self.rows) == h.shape[0]:  # one example per group: one batched product
            G = materialize_grads(h, delta)
            for g, (j,) in self.row_lists.items():
                if self.groups is None or g in self.groups:
                    self._add(acc, g, G[j])
            return
        for g, rows in self.rows.items():
            if self.groups is None or g in self.groups:
                self._add(acc, g, delta[rows].flatten(0, 1).t() @ h[rows].flatten(0, 1))

    def _add(self, acc: dict[str, torch.Tensor], g: str, G: torch.Tensor) -> None:
        if self.device is not None:
            G = G.to(self.device)
        if g not in acc:
            acc[g] = G.clone() if G._base is not None else G  # a row of a batched product: its own memory
        else:
            acc[g].add_(G)  # in place: a new sum per step fragments the heap (RSS 16.8 GiB for 3.2 live)


class ScoreFeatureTracker(WeightPairTracker):
    """Per example of a step, summed over the tracked weights: ``sq = ‖M g(z)‖²`` and ``dots[:, k] = ⟨M g(z), V_k⟩``
    (float64), ``M`` the influence metric's map applied to the tokens (:meth:`.metrics.InfluenceMetric.tokens`)
    and ``V[key]: [K, out, in]`` fixed (whitened validation) directions; :func:`layer_features` per weight."""

    row_fields = ("sq", "dots")  # per-row sums over the weights (shard_layers: completed across the ranks)

    def __init__(self, modules: Mapping[str, nn.Module], metric, V: Mapping[str, torch.Tensor], n_directions: int,
                 dtype: torch.dtype, feature_mode: str, dual: Mapping[str, torch.Tensor] | None = None) -> None:
        super().__init__(modules)
        self.metric, self.V, self.K, self.dtype, self.feature_mode = metric, V, n_directions, dtype, feature_mode
        self.dual = dual  # W with <G, W_k> = <M G, V_k> (EK-FAC's dual): dots on raw tokens; sq is then ‖G‖²

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        B, device = batch["input_ids"].shape[0], batch["input_ids"].device
        self.sq = torch.zeros(B, dtype=torch.float64, device=device)
        self.dots = torch.zeros(B, self.K, dtype=torch.float64, device=device)

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        h, delta = h.to(self.dtype), delta.to(self.dtype)
        if self.dual is not None:  # only the inner products are needed: no rotation of the tokens
            s, dt = layer_features(h, delta, self.dual[key].to(h), self.feature_mode)
            self.sq.add_(s)
            self.dots.add_(dt)
            return
        if not getattr(self.metric, "token_factored", True):  # e.g. EK-FAC: M G per example, [B, out, in]
            MG = self.metric.gradients(key, h, delta).flatten(1)  # [B, out·in], the tracker's dtype like tokens
            self.sq.add_(row_sq_norms(MG).double())
            self.dots.add_((MG @ self.V[key].to(MG).flatten(1).t()).double())
            return
        h, delta = self.metric.tokens(key, h, delta)
        # validation gradients held on the host or in bfloat16 (ScoringConfig.validation_gradients): this layer's
        # moved and widened while it is used; held as computed, the same tensor (no copy)
        s, dt = layer_features(h, delta, self.V[key].to(device=h.device, dtype=h.dtype), self.feature_mode)
        self.sq.add_(s.double())
        self.dots.add_(dt.double())

    def end_step(self) -> None:
        release = getattr(self.metric, "release_step", None)  # a metric's per-step reuse (EK-FAC's rotated inputs)
        if release is not None:
            release()


# --------------------------------------------------------------------------------------------
# batch plumbing
# --------------------------------------------------------------------------------------------
def slice_rows(batch: Mapping, n: int) -> dict:
    """The first ``n`` examples of ``batch`` (:func:`iprox_lightning.engine.batch.batch_rows`)."""
    return batch_rows(batch, slice(0, n))


def progress_bar(it, enabled: bool, desc: str, total=None):
    """``it`` with progress (:func:`iprox_lightning.progress.progress`): tqdm's bar on a terminal when ``enabled``,
    a line a minute off a terminal."""
    return progress(it, desc=desc, total=total, enabled=enabled, unit="batch")


def trim_batch(batch: Mapping, keep: torch.Tensor | None = None) -> dict:
    """Copy of ``batch`` with only the rows ``keep`` (bool ``[B]``) and the trailing all-padding
    columns dropped (right padding beyond the longest kept example costs compute, never changes results)."""
    check_batch(batch)
    mask = batch["attention_mask"]
    rows = torch.arange(mask.shape[0]) if keep is None else torch.nonzero(keep.cpu(), as_tuple=False).flatten()
    out = {}
    valid_cols = (mask[rows.to(mask.device)] != 0).any(dim=0) if len(rows) else torch.zeros(mask.shape[1], dtype=torch.bool)
    T = int(torch.nonzero(valid_cols).max()) + 1 if bool(valid_cols.any()) else 1
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == mask.shape[0]:
            v = v[rows.to(v.device)]
            if v.dim() == 2 and k in ("input_ids", "attention_mask", "labels"):
                v = v[:, :T]
            out[k] = v
        elif isinstance(v, (list, tuple)) and len(v) == mask.shape[0]:
            out[k] = [v[int(r)] for r in rows]
        else:
            out[k] = v
    return out


def has_response_tokens(batch: Mapping) -> torch.Tensor:
    """Bool ``[B]``: the example has at least one scored response token."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1)
