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
``Aᵀ δ``). Both come from activations and their autograd gradients (``B h`` and ``∂L/∂(B h) = Aᵀ δ``
are captured on the intermediate tensor of the layer's own forward), never from the parameters,
so no step reads a parameter that FSDP may have resharded.

A ``LayerMetric`` optionally maps ``(h, δ)`` to a whitened basis first (K-FAC: ``h̃ = S_h Q_hᵀ h``,
``δ̃ = S_δ Q_δᵀ δ``), so the same two routines give ``⟨g, H⁻¹ ḡ⟩`` and ``‖H^{-1/2} g‖²``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from ..batch import IGNORE_INDEX, check_batch, per_example_loss
from ..lowrank import LowRankLinear
from ..models.targets import Conv1D, find_target_linears, linear_shape
from ..tracking import LayerTracker, requires_grad_inputs

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
    ok = (nn.Linear, LowRankLinear) + ((Conv1D,) if Conv1D else ())
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
        dots = None if V is None else (g.flatten(1) @ V.flatten(1).t()).double()
        return sq, dots
    sq = ghost_sq_norms(h, delta).double()
    return sq, (None if V is None else ghost_dots(h, delta, V).double())


# --------------------------------------------------------------------------------------------
# metric (identity for TracIn, whitening by the damped K-FAC factors for influence functions)
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


# --------------------------------------------------------------------------------------------
# one forward + one backward of Σ_z L(z), handing (key, h, δ) of every tracked weight
# --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _capture_input_embeddings(model: nn.Module, store: list) -> Iterator[None]:
    emb = model.get_input_embeddings()
    handle = emb.register_forward_hook(lambda m, a, out: store.append(out))
    try:
        yield
    finally:
        handle.remove()


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


def backward_pairs(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    batch: Mapping,
    on_pair: Callable[[str, torch.Tensor, torch.Tensor], None],
) -> torch.Tensor:
    """Run one forward and ONE backward of ``Σ_z L(z)`` over ``batch`` and call
    ``on_pair(key, h [B, T, in], δ [B, T, out])`` for every tracked weight (``VirtualLinear.key``).

    ``L(z)`` is the mean response-token cross-entropy of example ``z``, so the rows of ``δ`` are
    exactly each example's own output-gradients (no mean-over-batch scaling). ``δ`` is zeroed on
    padding positions (``attention_mask == 0``); prompt positions keep their (generally non-zero)
    output-gradients. Nothing is written to ``param.grad`` (gradients are taken with respect to
    the input embeddings only), so this works with frozen and with sharded parameters.
    Returns the number of response tokens per example (``[B]``).
    """
    with torch.inference_mode(False), torch.enable_grad():
        # clones: tensors made under inference mode (Lightning's predict loop) cannot enter autograd
        ids, mask, labels = (batch[k].clone() for k in ("input_ids", "attention_mask", "labels"))
        return _backward_pairs(model, modules, ids, mask, labels, on_pair)


def _backward_pairs(model, modules, ids, mask, labels, on_pair) -> torch.Tensor:
    keep = mask.to(torch.bool).unsqueeze(-1)
    inner: dict[str, torch.Tensor] = {}  # LowRankLinear name -> B h of this step

    def pair(name, module, h, delta):
        if h.dim() != 3:
            raise RuntimeError(f"tracked layer {name!r} received a {h.dim()}-D input; expected [B, T, in]")
        d = delta * keep.to(delta.device)
        if isinstance(module, LowRankLinear):
            on_pair(f"{name}.A", inner.pop(name), d)
        else:
            on_pair(f"{name}.weight", h, d)

    def inner_pair(name, h, grad_z):  # ∂L/∂(B h) = Aᵀ δ arrives after δ
        on_pair(f"{name}.B", h, grad_z * keep.to(grad_z.device))

    embs: list[torch.Tensor] = []
    with requires_grad_inputs(model), _capture_input_embeddings(model, embs), \
            _split_lowrank(modules, inner, inner_pair), LayerTracker(modules, pair):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        loss, n_tok = per_example_loss(out.logits, labels)
        if not embs:
            raise RuntimeError("the input-embedding module did not run; cannot take gradients")
        torch.autograd.grad(loss.sum(), embs, allow_unused=True)
    return n_tok.detach()


@contextlib.contextmanager
def _split_lowrank(modules: Mapping[str, nn.Module], inner: dict, inner_pair) -> Iterator[None]:
    """Give every tracked ``LowRankLinear`` a forward that exposes its intermediate ``z = B h``:
    ``z`` is stored in ``inner[name]`` and a tensor hook hands ``∂L/∂z`` to ``inner_pair``. Same
    arithmetic as ``LowRankLinear.forward``; the instance attribute is removed on exit."""
    import torch.nn.functional as F

    patched = []
    for name, m in modules.items():
        if not isinstance(m, LowRankLinear):
            continue

        def forward(x, _m=m, _name=name):
            z = F.linear(x, _m.B)
            if torch.is_grad_enabled() and z.requires_grad:
                inner[_name] = z.detach()
                h = x.detach()
                z.register_hook(lambda g, _h=h: inner_pair(_name, _h, g.detach()))
            return F.linear(z, _m.A, _m.bias)

        m.forward = forward
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def has_response_tokens(batch: Mapping) -> torch.Tensor:
    """Bool ``[B]``: the example has at least one scored response token."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1)
