"""Stage 2 of IProX: approximate gradient alignment in the proxy's weight space (paper §4.2).

Notation: a proxy layer ``ℓ`` is a :class:`~iprox_lightning.engine.lowrank.LowRankLinear` ``y = A (B x) + b``
with ``A: [out, r]``, ``B: [r, in]``, replacing the target's dense ``W: [out, in]`` at the same
module path. ``L`` is the response-token SFT loss of a batch (:func:`iprox_lightning.engine.batch.sft_loss`).

* **Teacher projections.** The target's weight gradient is ``∇_W L = Σ_t δ_t h_tᵀ`` (``h_t`` the
  layer input, ``δ_t = dL/dy_t`` the output-gradient at token ``t``). It is projected into the
  proxy's factor space by the chain rule through ``W = A B``:

  ``P_A = ∇_W L · Bᵀ = Σ_t δ_t (B h_t)ᵀ``   (``[out, r]``)
  ``P_B = Aᵀ · ∇_W L = Σ_t (Aᵀ δ_t) h_tᵀ``  (``[r, in]``)

  computed from ``(h, δ)`` without ever forming the ``[out, in]`` matrix ``∇_W L``
  (:func:`factor_projections`).

* **Gradient alignment** (Eq. GA), with ``d(x, y) = 1 − cos(x, y)`` over the flattened matrices:

  ``L_GA = 1/|ℒ| Σ_ℓ [ d(∇_{A_ℓ} L_proxy, sg(∇_{W_ℓ} L) B_ℓᵀ) + d(∇_{B_ℓ} L_proxy, A_ℓᵀ sg(∇_{W_ℓ} L)) ]``

  ``∇_A L_proxy`` / ``∇_B L_proxy`` come from ``torch.autograd.grad(..., create_graph=True)`` so
  ``L_GA`` can itself be differentiated (double backward). ``sg`` covers the teacher's gradient only:
  with ``grad_through_projection=True`` (default, the formula as written) the projections stay
  differentiable in the proxy's ``A``/``B``; with ``False`` the whole target ``P_A``/``P_B`` is a
  constant (cheaper: the per-token ``h``/``δ`` are dropped as soon as they are projected).

* **Output anchoring** (Eq. KD), over the response tokens of the batch (the positions whose
  next-token prediction the SFT loss scores, :func:`~iprox_lightning.engine.batch.shifted_token_mask`):

  ``L_KL = τ² · mean_t KL(softmax(f_target,t / τ) ‖ softmax(f_proxy,t / τ))``

* **Objective**: ``L = L_GA + λ_KL · L_KL`` (:func:`alignment_losses`). Terms that look at the target tasks'
  validation gradients and at the per-example TracIn scores ride on the same passes
  (:mod:`iprox_lightning.alignment.task`, opt-in).

Everything here is plain PyTorch, usable without a Trainer; :class:`~iprox_lightning.modules.ProxyAlignModule`
is the thin Lightning layer around :func:`alignment_losses`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import contextlib
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.checkpointing import checkpointed_blocks
from ..engine.batch import check_batch, micro_batches, scored_logits, shifted_token_mask, token_mean
from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import is_linear_like, linear_shape
from ..engine.tracking import LayerTracker, PairTracker, backward_pairs, pair_dispatch

__all__ = [
    "factor_projections",
    "cosine_distance",
    "gradient_alignment_loss",
    "distillation_kl",
    "proxy_factor_layers",
    "teacher_pass",
    "TeacherPass",
    "FactorProjectionTracker",
    "alignment_losses",
    "accumulated_alignment_losses",
    "AlignmentOutput",
]


# ------------------------------------------------------------------------------------------------
# elementary functions
# ------------------------------------------------------------------------------------------------
def factor_projections(
    h: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_A, P_B) = (Σ_t δ_t (B h_t)ᵀ, Σ_t (Aᵀ δ_t) h_tᵀ) = (∇_W L · Bᵀ, Aᵀ · ∇_W L)``.

    ``h: [..., in]`` layer inputs and ``delta: [..., out]`` output-gradients (same leading shape);
    ``A: [out, r]``, ``B: [r, in]``. Costs ``O(N·r·(in+out))`` and ``O(N·r)`` extra memory for
    ``N`` tokens — the ``[out, in]`` gradient is never formed. Computed in float32 (or the
    factors' dtype if wider). Differentiable in ``A``/``B`` (and in ``h``/``delta``).
    """
    n_in, n_out = B.shape[1], A.shape[0]
    if h.shape[-1] != n_in or delta.shape[-1] != n_out or h.shape[:-1] != delta.shape[:-1]:
        raise ValueError(
            f"factor_projections: h {tuple(h.shape)} / delta {tuple(delta.shape)} do not match "
            f"A {tuple(A.shape)} (out={n_out}) and B {tuple(B.shape)} (in={n_in})"
        )
    dt = torch.promote_types(A.dtype, torch.float32)
    H = h.reshape(-1, n_in).to(dt)
    D = delta.reshape(-1, n_out).to(dt)
    P_A = D.t() @ (H @ B.to(dt).t())  # [out, r]
    P_B = (D @ A.to(dt)).t() @ H  # [r, in]
    return P_A, P_B


def cosine_similarity_flat(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``cos(x, y) = <x, y> / (‖x‖ ‖y‖)`` over all entries, in float32; ``0`` if either is ~0."""
    x = x.reshape(-1).float()
    y = y.reshape(-1).float()
    denom = (x.norm() * y.norm()).clamp_min(eps)
    return (x @ y) / denom


def cosine_distance(x: torch.Tensor, y: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``d(x, y) = 1 − cos(x, y)`` over the flattened tensors (the paper's distance, in ``[0, 2]``)."""
    return 1.0 - cosine_similarity_flat(x, y, eps)


def gradient_alignment_loss(
    proxy_grads: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    projections: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``L_GA = mean_ℓ [d(∇_A, P_A) + d(∇_B, P_B)]`` with ``d = 1 − cos``.

    ``proxy_grads[name] = (∇_A L_proxy, ∇_B L_proxy)`` and ``projections[name] = (P_A, P_B)``.
    Returns ``(L_GA, cos_A, cos_B)`` where ``cos_A[name] = cos(∇_A, P_A)`` (and likewise for B) —
    so ``L_GA = mean_ℓ (2 − cos_A − cos_B)``. The per-layer cosines are returned detached.
    """
    if set(proxy_grads) != set(projections):
        missing = sorted(set(proxy_grads) ^ set(projections))
        raise ValueError(f"gradient_alignment_loss: proxy gradients and teacher projections differ on layers {missing}")
    if not proxy_grads:
        raise ValueError("gradient_alignment_loss: no layer to align (the proxy has no LowRankLinear layer)")
    total = 0.0
    cos_a: dict[str, torch.Tensor] = {}
    cos_b: dict[str, torch.Tensor] = {}
    for name, (g_a, g_b) in proxy_grads.items():
        p_a, p_b = projections[name]
        if g_a.shape != p_a.shape or g_b.shape != p_b.shape:
            raise ValueError(
                f"layer {name!r}: proxy gradient shapes {tuple(g_a.shape)}, {tuple(g_b.shape)} != "
                f"projection shapes {tuple(p_a.shape)}, {tuple(p_b.shape)}"
            )
        ca = cosine_similarity_flat(g_a, p_a)
        cb = cosine_similarity_flat(g_b, p_b)
        total = total + (1.0 - ca) + (1.0 - cb)
        cos_a[name], cos_b[name] = ca.detach(), cb.detach()
    return total / len(proxy_grads), cos_a, cos_b


def distillation_kl(
    teacher_logits: torch.Tensor,
    proxy_logits: torch.Tensor,
    temperature: float = 2.0,
) -> torch.Tensor:
    """``L_KL = τ² · mean over response tokens of KL(softmax(f_t/τ) ‖ softmax(f_p/τ))``.

    ``teacher_logits``/``proxy_logits``: ``[N, V]``, the logits of the batch's response tokens (the positions whose
    next-token prediction is scored, :func:`~iprox_lightning.engine.batch.scored_logits`; from full ``[B, T, V]`` logits:
    ``logits[shifted_token_mask(labels)]``). Computed in float32; the teacher side is detached. Returns ``0`` (with
    a graph) when the batch has no response token.
    """
    if teacher_logits.shape != proxy_logits.shape or teacher_logits.dim() != 2:
        raise ValueError(f"distillation_kl: expects [N, V] logits of one shape, got {tuple(teacher_logits.shape)} "
                         f"and {tuple(proxy_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"distillation_kl: temperature must be > 0, got {temperature}")
    if teacher_logits.shape[0] == 0:
        return proxy_logits.sum() * 0.0
    t = teacher_logits.detach().float() / temperature
    s = proxy_logits.float() / temperature
    log_p_t = F.log_softmax(t, dim=-1)
    log_p_s = F.log_softmax(s, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=-1)
    return temperature**2 * kl.mean()


# ------------------------------------------------------------------------------------------------
# model-level passes
# ------------------------------------------------------------------------------------------------
def proxy_factor_layers(proxy: nn.Module, layers: Iterable[str] | None = None) -> dict[str, LowRankLinear]:
    """The proxy's :class:`LowRankLinear` layers (``path -> module``) in model order — the aligned layers ℒ.

    ``layers`` restricts to the given module paths (error naming any path that is not a LowRankLinear).
    """
    found = {n: m for n, m in proxy.named_modules() if isinstance(m, LowRankLinear)}
    if layers is not None:
        layers = list(layers)
        bad = [n for n in layers if n not in found]
        if bad:
            raise ValueError(f"layers {bad} are not LowRankLinear layers of the proxy (it has {list(found)[:8]}...)")
        found = {n: found[n] for n in layers}
    if not found:
        raise ValueError(
            f"the proxy {type(proxy).__name__} has no LowRankLinear layer: compress it first "
            "(IPSVDCallback / compress_model) or load a saved proxy"
        )
    return found


class FactorProjectionTracker(PairTracker):
    """Per aligned layer, the teacher's ``(h, δ)`` projected into the proxy's factor space with
    :func:`factor_projections` (``projections[name] = (P_A, P_B)``, ``O(proxy)`` memory), or, with
    ``keep_tokens=True``, kept flattened (``tokens[name] = (H [N, in], Δ [N, out])``) so the projections
    can be recomputed differentiably in ``A``/``B``."""

    def __init__(self, modules: Mapping[str, nn.Module], factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 keep_tokens: bool) -> None:
        self.modules = dict(modules)
        self.factors = {n: (A.detach(), B.detach()) for n, (A, B) in factors.items()}
        self.keep_tokens = keep_tokens
        self.projections: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        if self.keep_tokens:
            self.tokens[name] = (h.reshape(-1, h.shape[-1]), delta.reshape(-1, delta.shape[-1]))
        else:  # (FSDP2's sharded factors, ``reshard_proxy``: this layer's gathered for its projections, a collective)
            A, B = (x.full_tensor() if hasattr(x, "full_tensor") else x for x in self.factors[name])
            self.projections[name] = factor_projections(h, delta, A, B)


@dataclass
class TeacherPass:
    """Result of :func:`teacher_pass`: the detached logits of the response tokens (``[N, V]``), the SFT loss value and, per aligned layer, either
    the projections ``(P_A, P_B)`` (``keep_tokens=False``) or the flattened ``(H [N, in], Δ [N, out])``."""

    logits: torch.Tensor
    loss: torch.Tensor
    projections: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def projections_for(self, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``(P_A, P_B)`` per layer; recomputed from the kept tokens with ``factors`` (differentiable) if kept."""
        if self.tokens:
            return {n: factor_projections(H, D, *factors[n]) for n, (H, D) in self.tokens.items()}
        return self.projections


def teacher_pass(
    teacher: nn.Module,
    batch: Mapping,
    factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    keep_tokens: bool = False,
    trackers: Sequence[PairTracker] = (),
    checkpointing: bool = False,
) -> TeacherPass:
    """Forward + backward of the frozen teacher's SFT loss, projecting ``∇_W L`` of each layer.

    ``factors[name] = (A, B)`` for each aligned layer path; the teacher's linear at the same path is
    tracked by a :class:`FactorProjectionTracker` over one step of the backward-pairs engine
    (:func:`iprox_lightning.engine.tracking.backward_pairs`, loss :func:`~iprox_lightning.engine.batch.token_mean`, the SFT loss): the
    backward is a ``torch.autograd.grad`` w.r.t. the embedding output, so no teacher parameter ever gets ``.grad``.
    ``trackers``: more consumers of the same step's pairs (e.g. per-example features, :mod:`.task_alignment`).
    ``checkpointing``: the teacher's decoder blocks run checkpointed
    (:func:`~iprox_lightning.engine.checkpointing.checkpointed_blocks`; the same pairs).
    """
    check_batch(batch)
    modules = dict(teacher.named_modules())
    tracked: dict[str, nn.Module] = {}
    for name, (A, B) in factors.items():
        m = modules.get(name)
        if m is None or not is_linear_like(m):
            raise ValueError(f"aligned layer {name!r} is not a linear layer of the teacher {type(teacher).__name__}")
        if linear_shape(m) != (A.shape[0], B.shape[1]):
            raise ValueError(
                f"layer {name!r}: teacher weight is [out, in] = {list(linear_shape(m))} but proxy factors give "
                f"[{A.shape[0]}, {B.shape[1]}]"
            )
        tracked[name] = m
    tracker = FactorProjectionTracker(tracked, factors, keep_tokens)
    with checkpointed_blocks(teacher, checkpointing):
        step = backward_pairs(teacher, batch, [tracker, *trackers], loss_fn=token_mean, keep_logits=True)
    missing = [n for n in tracked if n not in (tracker.tokens if keep_tokens else tracker.projections)]
    if missing:
        raise RuntimeError(f"teacher_pass: no gradient reached layers {missing} (not used in the forward?)")
    return TeacherPass(logits=step.logits, loss=step.loss, projections=tracker.projections, tokens=tracker.tokens)


@dataclass
class AlignmentOutput:
    """What :func:`alignment_losses` returns. ``loss`` carries the graph (when built with ``create_graph``)."""

    loss: torch.Tensor  # L_GA + λ_KL · L_KL
    l_ga: torch.Tensor
    l_kl: torch.Tensor
    proxy_sft: torch.Tensor  # detached SFT loss of the proxy on the batch
    teacher_sft: torch.Tensor  # detached SFT loss of the teacher on the batch
    cos_a: dict[str, torch.Tensor]
    cos_b: dict[str, torch.Tensor]

    def mean_cosines(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack(list(self.cos_a.values())).mean(), torch.stack(list(self.cos_b.values())).mean()


def alignment_losses(
    teacher: nn.Module,
    proxy: nn.Module,
    batch: Mapping,
    *,
    kl_weight: float = 0.1,
    temperature: float = 2.0,
    grad_through_projection: bool = True,
    create_graph: bool = True,
    layers: Iterable[str] | None = None,
    factor_tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    teacher_trackers: Sequence[PairTracker] = (),
    proxy_trackers: Sequence[PairTracker] = (),
    checkpointing: bool = False,
    blocks=None,
) -> AlignmentOutput:
    """``L = L_GA + λ_KL · L_KL`` on one batch (see the module docstring for the definitions).

    1. teacher forward/backward → ``(P_A, P_B)`` per aligned layer and the teacher logits;
    2. proxy forward → ``L_proxy`` (response-token SFT loss) and logits;
    3. ``(∇_A, ∇_B) = autograd.grad(L_proxy, factors, create_graph=create_graph)``;
    4. ``L_GA`` from the cosines, ``L_KL`` from the logits (skipped when ``kl_weight == 0``).

    The caller runs ONE backward of ``loss`` (under DDP that single backward is what gets all-reduced).
    ``factor_tensors`` overrides which tensors the gradients are taken against (e.g. the unsharded
    parameters FSDP2 actually used in the forward); default: each layer's ``A``/``B`` parameters.
    ``create_graph=False`` gives the same numbers without a differentiable ``loss`` (evaluation).
    ``teacher_trackers`` get the teacher pass's pairs; ``proxy_trackers`` the proxy's, captured during step 3's
    backward as differentiable pairs (``h`` and ``δ`` carry the graph with ``create_graph``): the per-example terms of
    :mod:`iprox_lightning.alignment.task` need no pass of their own.
    ``checkpointing``: both forwards run their decoder blocks checkpointed
    (:func:`~iprox_lightning.engine.checkpointing.checkpointed_blocks`): the same losses and gradients, each
    backward recomputing the blocks (the proxy's twice: the ``create_graph`` backward and the one of ``loss``).
    ``blocks`` (FSDP2 with ``reshard_proxy``: :class:`~iprox_lightning.alignment.fsdp.ProxyBlocks`, whose context the
    call runs in): the projections read each layer's factors regathered, one layer at a time.
    """
    lowrank = proxy_factor_layers(proxy, layers)
    names = list(lowrank)
    t = teacher_pass(teacher, batch, {n: (m.A, m.B) for n, m in lowrank.items()},
                     keep_tokens=grad_through_projection and create_graph, trackers=teacher_trackers,
                     checkpointing=checkpointing)

    with torch.enable_grad():
        logits, l_proxy, factors, proxy_grads = _proxy_factor_grads(proxy, batch, lowrank, factor_tensors,
                                                                    proxy_trackers, create_graph, checkpointing)
        if t.tokens:
            projections = t.projections_for({n: factors[n] for n in names} if blocks is None else
                                            blocks.lazy({n: factors[n] for n in names}, _projection_dtype(factors)))
        else:
            projections = t.projections
        l_ga, cos_a, cos_b = gradient_alignment_loss(proxy_grads, projections)
        if kl_weight != 0:
            l_kl = distillation_kl(t.logits, logits, temperature)
            loss = l_ga + kl_weight * l_kl
        else:
            with torch.no_grad():
                l_kl = distillation_kl(t.logits, logits.detach(), temperature)
            loss = l_ga
    return AlignmentOutput(
        loss=loss,
        l_ga=l_ga.detach(),
        l_kl=l_kl.detach(),
        proxy_sft=l_proxy.detach(),
        teacher_sft=t.loss,
        cos_a=cos_a,
        cos_b=cos_b,
    )


def _projection_dtype(factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.dtype:
    """The dtype :func:`factor_projections` computes in for these factors."""
    return torch.promote_types(next(iter(factors.values()))[0].dtype, torch.float32)


def _proxy_factor_grads(proxy: nn.Module, batch: Mapping, lowrank: Mapping[str, nn.Module],
                        factor_tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None,
                        proxy_trackers: Sequence[PairTracker], create_graph: bool, checkpointing: bool = False,
                        on_grad=None):
    """Steps 2–3 of :func:`alignment_losses`: the proxy's forward (``L_proxy`` over the response tokens, and the
    logits) and ``(∇_A, ∇_B)`` of every aligned layer by ``autograd.grad`` against the factor tensors the forward
    really used (recorded by forward pre-hooks unless ``factor_tensors`` names them), with ``proxy_trackers``
    capturing their pairs through both. ``(logits, L_proxy, factors, {layer: (∇_A, ∇_B)})``; raises when a layer did
    not run, its factors do not require grad or it got no gradient. ``on_grad(layer, i, grad)``: each factor's
    gradient (with ``create_graph`` its graph) is handed to it as the backward computes it, and not kept (the returned
    ones are zeros that hold no memory)."""
    names = list(lowrank)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    if factor_tensors is None:
        # record the factor tensors the forward really uses (plain params, or FSDP2's unsharded copies)
        def make_pre_hook(name):
            def pre_hook(module, args):
                captured[name] = (module.A, module.B)
            return pre_hook

        handles = [m.register_forward_pre_hook(make_pre_hook(n)) for n, m in lowrank.items()]
    pairs = contextlib.nullcontext()
    if proxy_trackers:
        for tracker in proxy_trackers:
            tracker.start_step(batch)
        pairs = LayerTracker(*pair_dispatch(proxy_trackers), differentiable=True)
    with pairs:  # (the proxy trackers' hooks: through the forward and step 3's backward)
        try:
            with checkpointed_blocks(proxy, checkpointing):
                logits, scored = scored_logits(proxy, batch, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        factors = dict(factor_tensors) if factor_tensors is not None else captured
        missing = [n for n in names if n not in factors]
        if missing:
            raise RuntimeError(f"alignment_losses: proxy layers {missing} did not run in the forward")
        l_proxy = token_mean(*scored.ce_sums(logits))
        flat = [x for n in names for x in factors[n]]
        not_req = [n for n in names if not (factors[n][0].requires_grad and factors[n][1].requires_grad)]
        if not_req:
            raise RuntimeError(f"alignment_losses: factors of {not_req[:4]} do not require grad")
        hooks = []
        if on_grad is not None:
            def make_hook(name, i):
                def hook(grad):
                    on_grad(name, i, grad)
                    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
                return hook

            hooks = [x.register_hook(make_hook(n, i)) for n in names for i, x in enumerate(factors[n])]
        try:
            grads = torch.autograd.grad(l_proxy, flat, create_graph=create_graph, allow_unused=True)
        finally:
            for h in hooks:
                h.remove()
    for tracker in proxy_trackers:
        tracker.end_step()
    proxy_grads = {}
    for i, n in enumerate(names):
        g_a, g_b = grads[2 * i], grads[2 * i + 1]
        if g_a is None or g_b is None:
            raise RuntimeError(f"alignment_losses: layer {n!r} got no gradient from the proxy SFT loss")
        proxy_grads[n] = (g_a, g_b)
    return logits, l_proxy, factors, proxy_grads


# ------------------------------------------------------------------------------------------------
# micro-batches: the full batch's objective, accumulated exactly
# ------------------------------------------------------------------------------------------------
def accumulated_alignment_losses(
    teacher: nn.Module,
    proxy: nn.Module,
    batch: Mapping,
    micro_batch_size: int,
    *,
    kl_weight: float = 0.1,
    temperature: float = 2.0,
    grad_through_projection: bool = True,
    create_graph: bool = True,
    layers: Iterable[str] | None = None,
    checkpointing: bool = False,
    shards=None,
    blocks=None,
) -> AlignmentOutput:
    """:func:`alignment_losses` of the whole ``batch``, computed ``micro_batch_size`` rows at a time: the same loss
    and the same gradient of ``loss`` w.r.t. the factors (up to float summation order), with every pass's memory
    bounded by one micro-batch.

    ``L_GA`` is not a sum over micro-batches (a cosine of summed gradients), but its arguments are: with ``w_m =
    N_m / N`` (the micro-batch's share of the batch's response tokens; every mean is a token mean) the batch's
    proxy gradient is ``g = Σ_m w_m g_m``, its projected teacher gradient ``P = Σ_m w_m P_m`` and ``L_KL = Σ_m w_m
    L_KL,m``. So, exactly:

    1. pass 1, per micro-batch without a graph: ``g_m``, ``P_m``, ``L_KL,m`` → ``g``, ``P``, the loss values and the
       cotangents ``c_g = ∂L_GA/∂g``, ``c_P = ∂L_GA/∂P`` (one small backward over the cosines);
    2. pass 2 (``create_graph``), per micro-batch: the teacher pass again and the proxy's ``g_m`` with its graph, the
       surrogate ``s_m = w_m (⟨c_g, g_m⟩ + ⟨c_P, P_m⟩ + λ_KL L_KL,m)`` (``⟨c_P, P_m⟩`` only with
       ``grad_through_projection``), whose gradient ``∂s_m/∂θ`` is micro-batch ``m``'s share of ``∂L/∂θ``; each but the
       last is differentiated at once (its graph freed) and summed into ``a``.

    The returned ``loss`` has the value ``L_GA + λ_KL·L_KL`` of the whole batch and the graph of ``s_last + ⟨a, θ⟩``:
    ONE backward of it (the caller's, e.g. Lightning's, under DDP the one that all-reduces) gives ``∂L/∂θ``. Costs per
    step: two teacher passes and two proxy passes (one plain, one with the double backward) per micro-batch.
    ``create_graph=False`` (evaluation): pass 1 only. One micro-batch: :func:`alignment_losses` itself.

    Memory: three factor-sized float32 buffers (``g`` and ``P``, then ``c_g``, ``c_P`` and ``a``) beside one
    micro-batch's passes; a micro-batch's ``P_m``, ``g_m`` and shares go into them one tensor at a time as they are made
    (tensor hooks in the backward; a layer's projections right after they are made), and ``c`` enters the surrogate
    through :class:`_GatheredDot`, added to the gradient right before the node that consumes it.

    ``shards`` (FSDP2, :class:`~iprox_lightning.alignment.fsdp.FactorShards`): the objective is that of the **global**
    batch, every rank's rows together (``N`` the response tokens of all ranks), and the three factor-sized buffers are
    sharded: each rank keeps its rows of ``g``, ``P`` (summed over the ranks by a reduce-scatter per micro-batch and
    layer), of the cotangents and of the summed shares. The cosines' dot products and squared norms are per-layer
    scalars summed over the ranks (one all-reduce); a cotangent enters pass 2's surrogate through
    :class:`_GatheredDot`, which gathers it (one layer's, transient) only in the backward. Each rank's returned
    ``loss`` is scaled so that FSDP2's mean of the ranks' gradients is ``∂L/∂θ`` of the global batch; every rank runs
    the same number of passes (a rank with fewer micro-batches repeats its last one with weight 0).
    ``blocks``: as :func:`alignment_losses`'s.
    """
    if isinstance(micro_batch_size, bool) or int(micro_batch_size) < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    check_batch(batch)
    common = dict(kl_weight=kl_weight, temperature=temperature, grad_through_projection=grad_through_projection,
                  layers=layers, checkpointing=checkpointing)
    parts = micro_batches(batch, int(micro_batch_size))
    counts = [int(shifted_token_mask(p["labels"]).sum()) for p in parts]
    total = sum(counts)
    if shards is None and (len(parts) == 1 or total == 0):
        return alignment_losses(teacher, proxy, batch, create_graph=create_graph, blocks=blocks, **common)
    if shards is None:  # one process (or DDP: each rank its own batch's objective), the buffers whole
        shards = _WholeBuffers(proxy_factor_layers(proxy, layers), batch["input_ids"].device)
    return _sharded_accumulated(teacher, proxy, batch, parts, counts, shards, create_graph=create_graph, blocks=blocks,
                                **common)


# ------------------------------------------------------------------------------------------------
# micro-batches under FSDP2: the global batch, the accumulation buffers sharded over the ranks
# ------------------------------------------------------------------------------------------------
class _WholeBuffers:
    """:class:`~iprox_lightning.alignment.fsdp.FactorShards`'s calls on one process: every buffer whole (a rank's
    rows are all the rows), sums over one rank."""

    world, rank = 1, 0

    def __init__(self, lowrank: Mapping[str, nn.Module], device) -> None:
        self.lowrank, self.device = lowrank, device

    def scatter(self, full: torch.Tensor) -> torch.Tensor:
        return full

    def gather(self, local: torch.Tensor, full_rows: int) -> torch.Tensor:
        return local

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def max(self, n: int) -> int:
        return int(n)

    def local_factors(self, names) -> list[torch.Tensor]:
        return [x for n in names for x in (self.lowrank[n].A, self.lowrank[n].B)]


class _RankSum(torch.autograd.Function):
    """``Σ_ranks t`` of per-rank partial sums in the forward; the backward passes the gradient through (every rank
    computes the same function of the summed values, so a rank's partial gets the sum's gradient)."""

    @staticmethod
    def forward(ctx, t, shards):
        return shards.sum(t)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatheredDot(torch.autograd.Function):
    """The gradient of ``⟨c, x⟩`` for a full ``x`` whose ``c`` each rank holds only in rows (``c_local``,
    :meth:`~iprox_lightning.alignment.fsdp.FactorShards.gather`), with ``c`` gathered as late as the backward allows:
    the value is not computed (``0``: the surrogates are used for their gradient only); the backward passes a zero
    that holds no memory (an expanded scalar) and a pre-hook on ``x``'s own backward node replaces it by ``grad · c``,
    gathered right before that node runs (the nodes of all layers would otherwise receive their full ``c`` at the
    start of the backward and hold them until they run). No graph holds a full ``c``."""

    @staticmethod
    def forward(ctx, x, c_local, shards):
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        ctx.cell = []  # the upstream gradient (a scalar), for the pre-hook
        node = x.grad_fn
        if node is None:
            raise RuntimeError("_GatheredDot: x must be the output of a differentiable operation")
        rows, nr = x.shape[0], x.output_nr

        def prehook(grad_outputs):
            up = ctx.cell.pop() if ctx.cell else None
            if up is None:
                return None
            grads = list(grad_outputs)
            add = (up * shards.gather(c_local, rows)).to(ctx.dtype)
            grads[nr] = add if grads[nr] is None else grads[nr] + add
            return tuple(grads)

        node.register_prehook(prehook)
        return torch.zeros((), dtype=torch.float32, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        ctx.cell.append(grad)
        return torch.zeros((), dtype=ctx.dtype, device=ctx.device).expand(ctx.shape), None, None


def _sharded_cosines(g: Mapping[str, Sequence[torch.Tensor]], p: Mapping[str, Sequence[torch.Tensor]], shards,
                     eps: float = 1e-12):
    """:func:`gradient_alignment_loss` of the full tensors whose rows each rank holds in ``g``/``p``: per layer and
    factor ``⟨g, P⟩``, ``‖g‖²``, ``‖P‖²`` summed over the ranks (one all-reduce), differentiable in the local rows."""
    names = list(g)
    partial = []
    for n in names:
        for x, y in zip(g[n], p[n]):
            x, y = x.reshape(-1).float(), y.reshape(-1).float()
            partial += [x @ y, x @ x, y @ y]
    dot, xx, yy = _RankSum.apply(torch.stack(partial), shards).view(len(names), 2, 3).unbind(-1)
    # (a clamp before the square root: its gradient at an all-zero tensor is 0, as the norm's, never inf · 0)
    cos = dot / (xx.clamp_min(eps**2).sqrt() * yy.clamp_min(eps**2).sqrt()).clamp_min(eps)
    l_ga = (2.0 - cos.sum(-1)).sum() / len(names)
    cos = cos.detach()
    return l_ga, {n: cos[i, 0] for i, n in enumerate(names)}, {n: cos[i, 1] for i, n in enumerate(names)}


def _sharded_accumulated(teacher, proxy, batch, parts, counts, shards, *, kl_weight, temperature,
                         grad_through_projection, create_graph, layers, checkpointing, blocks=None) -> AlignmentOutput:
    """:func:`accumulated_alignment_losses` with ``shards`` (see there): the global batch, the buffers in rows."""
    lowrank = proxy_factor_layers(proxy, layers)
    names = list(lowrank)
    # a micro-batch with no response token has no share (one with weight 0 is kept if none has any)
    parts, counts = zip(*([(p, c) for p, c in zip(parts, counts) if c] or [(parts[-1], 0)]))
    parts, counts = list(parts), list(counts)
    n_parts = shards.max(len(parts))
    total = float(shards.sum(torch.tensor(float(sum(counts)), dtype=torch.float64, device=shards.device)))
    weights = [c / total if total else 0.0 for c in counts]
    # the same number of passes on every rank (their FSDP2 gathers are collectives): the last one again, weight 0
    parts, weights = list(parts) + [parts[-1]] * (n_parts - len(parts)), weights + [0.0] * (n_parts - len(parts))

    def factors_now():
        return {n: (m.A, m.B) for n, m in lowrank.items()}

    # pass 1: this rank's rows of the global batch's g and P, and the loss values
    g_rows: dict[str, list[torch.Tensor]] = {}
    p_rows: dict[str, list[torch.Tensor]] = {}
    values = torch.zeros(3, dtype=torch.float64, device=shards.device)  # L_KL, proxy SFT, teacher SFT
    def add_rows(acc: dict, n: str, i: int, rows: torch.Tensor) -> None:
        acc.setdefault(n, [None, None])
        acc[n][i] = rows if acc[n][i] is None else acc[n][i] + rows

    for part, w in zip(parts, weights):
        t = teacher_pass(teacher, part, factors_now(), checkpointing=checkpointing)
        for n in names:  # (the full projections freed before the proxy's pass)
            for i, x in enumerate(t.projections.pop(n)):
                add_rows(p_rows, n, i, shards.scatter(w * x.float()))
        with torch.enable_grad():  # each factor's gradient into its rows as the backward computes it
            logits, l_proxy, _, _ = _proxy_factor_grads(
                proxy, part, lowrank, None, (), False, checkpointing,
                on_grad=lambda n, i, g: add_rows(g_rows, n, i, shards.scatter(w * g.detach().float())))
        with torch.no_grad():
            kl = distillation_kl(t.logits, logits.detach(), temperature)
        values += w * torch.stack([kl.double(), l_proxy.detach().double(), t.loss.detach().double()])
        del t, logits
    l_kl, proxy_sft, teacher_sft = (v.float() for v in shards.sum(values))
    g_leaves = {n: tuple(x.requires_grad_(True) for x in g_rows[n]) for n in names}
    p_leaves = {n: tuple(x.requires_grad_(grad_through_projection) for x in p_rows[n]) for n in names}
    with torch.enable_grad():
        l_ga, cos_a, cos_b = _sharded_cosines(g_leaves, p_leaves, shards)
    loss_value = (l_ga + kl_weight * l_kl).detach() if kl_weight != 0 else l_ga.detach()
    out = AlignmentOutput(loss=loss_value, l_ga=l_ga.detach(), l_kl=l_kl, proxy_sft=proxy_sft,
                          teacher_sft=teacher_sft, cos_a=cos_a, cos_b=cos_b)
    if not create_graph:
        return out
    leaves = [x for n in names for x in g_leaves[n]]
    if grad_through_projection:
        leaves += [x for n in names for x in p_leaves[n]]
    cot = torch.autograd.grad(l_ga, leaves)
    del leaves, g_leaves, p_leaves, g_rows, p_rows
    c_g = {n: cot[2 * i: 2 * i + 2] for i, n in enumerate(names)}
    c_p = {n: cot[2 * len(names) + 2 * i: 2 * len(names) + 2 * i + 2] for i, n in enumerate(names)}
    del cot

    # pass 2: each micro-batch's share of ∂L/∂θ; the earlier ones' summed over the ranks into this rank's rows
    acc: list[torch.Tensor] | None = None
    for i, (part, w) in enumerate(zip(parts, weights)):
        t = teacher_pass(teacher, part, factors_now(), keep_tokens=grad_through_projection,
                         checkpointing=checkpointing)
        with torch.enable_grad():
            # each factor's gradient (with its graph) enters its surrogate term as the backward makes it, and each
            # layer's projections right after they are made: neither is held for every layer at once
            terms: list[torch.Tensor] = []
            logits, _, factors, _ = _proxy_factor_grads(
                proxy, part, lowrank, None, (), True, checkpointing,
                on_grad=lambda n, j, g: terms.append(_GatheredDot.apply(g, c_g[n][j], shards)))
            if grad_through_projection:
                # (FSDP2 with reshard_proxy: each layer's factors regathered when its projections are made)
                read = factors if blocks is None else blocks.lazy(factors, _projection_dtype(factors))
                for n in names:
                    proj = factor_projections(*t.tokens.pop(n), *read[n])
                    terms += [_GatheredDot.apply(x, c, shards) for c, x in zip(c_p[n], proj)]
                    del proj
            s = torch.stack(terms).sum()
            if kl_weight != 0:
                s = s + kl_weight * distillation_kl(t.logits, logits, temperature)
            s = w * s
            flat = [x for n in names for x in factors[n]]
            del t, logits, terms
            if i < len(parts) - 1:
                # each share into its rows as the backward computes it (the returned zeros hold no memory)
                rows: list = [None] * len(flat)

                def make_hook(k):
                    def hook(grad):
                        rows[k] = shards.scatter(grad.float())
                        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
                    return hook

                hooks = [x.register_hook(make_hook(k)) for k, x in enumerate(flat)]
                try:
                    torch.autograd.grad(s, flat)
                finally:
                    for h in hooks:
                        h.remove()
                acc = rows if acc is None else [a + r for a, r in zip(acc, rows)]
            else:
                # FSDP2 averages the ranks' gradients: this micro-batch's share ×world; the summed shares (already
                # this rank's rows of the sum over the ranks) straight into the sharded factors' gradients
                s = shards.world * s
                if acc is not None:
                    local = shards.local_factors(names)
                    s = s + torch.stack([(a * x.float()).sum() for a, x in zip(acc, local)]).sum()
    out.loss = s - s.detach() + loss_value
    return out
