"""Score-space alignment ``L_score``: per task, the proxy's and the target's TracIn scores of the alignment batch,
compared by ``1 − Pearson`` or the listwise KL (see the package doc)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.batch import IGNORE_INDEX
from ...engine.tracking import PairTracker
from .common import EPS, SCORE_LOSSES, FactorPairTracker, TaskDirections, _dtype, _keep, reduce_tasks


def example_features(h: torch.Tensor, delta: torch.Tensor, V: torch.Tensor, mode: str = "auto"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(‖g_b‖² [B], ⟨g_b, V_k⟩ [B, K])`` of the per-example gradients ``g_b = Σ_t δ_{b,t} h_{b,t}ᵀ`` of one linear
    layer, without ``param.grad``: ``h: [B, T, in]``, ``delta: [B, T, out]`` (zero on positions that do not count),
    ``V: [K, out, in]``. ``"ghost"``: ``Σ_{t,s} (h_t·h_s)(δ_t·δ_s)`` and ``Σ_t δ_tᵀ V_k h_t`` (the gradient never
    formed); ``"materialize"``: ``g_b = Δ_bᵀ H_b`` then norms and dots; ``"auto"`` the cheaper by multiply-adds
    (``K·T·in·out + T²(in+out)`` vs ``T·in·out + (K+1)·in·out`` per example). Same numbers; in float32 (or wider);
    differentiable in ``h``, ``delta`` and ``V`` (no square root: safe at a zero gradient)."""
    if mode not in ("auto", "ghost", "materialize"):
        raise ValueError(f"example_features: mode must be auto, ghost or materialize, got {mode!r}")
    B, T, n_in = h.shape
    K, n_out, _ = V.shape
    if delta.shape[:2] != (B, T) or delta.shape[-1] != n_out or V.shape[-1] != n_in:
        raise ValueError(f"example_features: h {tuple(h.shape)}, delta {tuple(delta.shape)}, V {tuple(V.shape)} "
                         "do not match ([B, T, in], [B, T, out], [K, out, in])")
    dt = _dtype(h, delta, V)
    h, delta, V = h.to(dt), delta.to(dt), V.to(dt)
    if mode == "auto":
        io = n_in * n_out
        mode = "ghost" if K * T * io + T * T * (n_in + n_out) < T * io + (K + 1) * io else "materialize"
    if mode == "materialize":
        g = torch.bmm(delta.transpose(1, 2), h)  # [B, out, in]
        return g.pow(2).sum(dim=(1, 2)), g.flatten(1) @ V.flatten(1).t()
    sq = (torch.bmm(h, h.transpose(1, 2)) * torch.bmm(delta, delta.transpose(1, 2))).sum(dim=(1, 2))
    vh = (h.reshape(B * T, n_in) @ V.reshape(K * n_out, n_in).t()).view(B, T, K, n_out)
    return sq, torch.einsum("btko,bto->bk", vh, delta)


def cosines_from_dots(dots: torch.Tensor, sq: torch.Tensor, v_sq: torch.Tensor) -> torch.Tensor:
    """TracIn scores ``[B, K]``: ``⟨g_b, v_k⟩ / (‖g_b‖ ‖v_k‖)`` from ``dots [B, K]``, ``sq = ‖g_b‖² [B]`` and
    ``v_sq = ‖v_k‖² [K]``; ``0`` for a zero gradient (never NaN, and a finite gradient there)."""
    return dots / (sq[:, None] * v_sq[None, :]).clamp_min(EPS * EPS).sqrt()


def _centred_unit(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-wise ``x − mean`` and its sum of squares (``[B, K]``, ``[K]``)."""
    c = x - x.mean(dim=0, keepdim=True)
    return c, c.pow(2).sum(dim=0)


def pearson_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``1 − Pearson(p[:, k], t[:, k])`` per column ``k`` (``[K]``, in ``[0, 2]``): ``p``/``t`` are ``[B, K]`` scores
    of the same ``B`` examples; a constant column gives correlation 0 (loss 1)."""
    pc, pss = _centred_unit(p)
    tc, tss = _centred_unit(t.to(p.dtype))
    return 1.0 - (pc * tc).sum(dim=0) / (pss * tss).clamp_min(EPS * EPS).sqrt()


def listwise_loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """ListNet per column: ``KL(softmax(ẑ(t)) ‖ softmax(ẑ(p)))`` over the ``B`` rows, ``ẑ`` the column standardised
    to mean 0 and (population) standard deviation 1 (``[K]``, ``≥ 0``; 0 when the standardised columns agree)."""
    def z(x: torch.Tensor) -> torch.Tensor:
        c, ss = _centred_unit(x)
        return c / (ss / x.shape[0] + EPS).sqrt()

    log_q = F.log_softmax(z(p), dim=0)
    log_pt = F.log_softmax(z(t.to(p.dtype)), dim=0)
    return (log_pt.exp() * (log_pt - log_q)).sum(dim=0)


def score_agreement_loss(proxy_scores: torch.Tensor, target_scores: torch.Tensor, valid: torch.Tensor,
                         kind: str = "pearson", reduction: str = "mean") -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_score, per-task losses [K])``: :func:`pearson_loss` or :func:`listwise_loss` over the rows ``valid``
    (bool ``[B]``: the examples with a response token) of ``[B, K]`` scores, reduced over tasks. Fewer than two
    valid rows rank nothing: ``0`` (with a graph) and NaN per task."""
    if kind not in SCORE_LOSSES:
        raise ValueError(f"score_loss must be one of {SCORE_LOSSES}, got {kind!r}")
    if proxy_scores.shape != target_scores.shape or proxy_scores.dim() != 2 or valid.shape != proxy_scores.shape[:1]:
        raise ValueError(f"score_agreement_loss: scores {tuple(proxy_scores.shape)} / {tuple(target_scores.shape)}, "
                         f"valid {tuple(valid.shape)}")
    if int(valid.sum()) < 2:
        return proxy_scores.sum() * 0.0, torch.full(proxy_scores.shape[1:], float("nan"), device=proxy_scores.device)
    p, t = proxy_scores[valid], target_scores[valid].detach()
    per_task = pearson_loss(p, t) if kind == "pearson" else listwise_loss(p, t)
    return reduce_tasks(per_task, reduction), per_task.detach()


class ExampleScoreTracker(PairTracker):
    """Per example of a step, summed over the tracked dense layers: ``sq = ‖g_b‖²`` and ``dots[:, k] = ⟨g_b, V_k⟩``
    (``V[name]: [K, out, in]`` fixed directions), by :func:`example_features`. Detached (the target side)."""

    def __init__(self, modules: Mapping[str, nn.Module], V: Mapping[str, torch.Tensor], mode: str = "auto") -> None:
        self.modules = dict(modules)
        self.V = dict(V)
        self.mode = mode

    def start_step(self, batch: Mapping) -> None:
        self.keep = _keep(batch)
        self.sq: Optional[torch.Tensor] = None
        self.dots: Optional[torch.Tensor] = None

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        with torch.no_grad():
            sq, dots = example_features(h, delta * self.keep.to(delta.device, delta.dtype), self.V[name], self.mode)
        self.sq = sq if self.sq is None else self.sq + sq
        self.dots = dots if self.dots is None else self.dots + dots


@dataclass
class ScoreOutput:
    """:func:`score_alignment_loss`: ``loss`` (with the graph), per-task losses, and both sides' scores ``[B, K]``
    (detached)."""

    loss: torch.Tensor
    per_task: dict[str, torch.Tensor]
    proxy_scores: torch.Tensor
    target_scores: torch.Tensor


def score_alignment_loss(
    proxy_pairs: FactorPairTracker,
    target_features: ExampleScoreTracker,
    directions: TaskDirections,
    batch: Mapping,
    *,
    kind: str = "pearson",
    reduction: str = "mean",
    mode: str = "auto",
) -> ScoreOutput:
    """``L_score`` on ``batch`` from the proxy's pairs of it (:class:`FactorPairTracker`, differentiable when captured
    in a create-graph backward) and the target's per-example features (:class:`ExampleScoreTracker` with
    ``directions.target``), against ``directions.proxy`` (see the module docstring)."""
    if directions.proxy_sq is None:
        raise ValueError("score_alignment_loss: the proxy's validation directions are not computed (proxy_directions)")
    sq = dots = None
    for name, ((z, d), (h, dz)) in proxy_pairs.pairs.items():
        v_a, v_b = directions.proxy[name]
        for x, g, v in ((z, d, v_a), (h, dz, v_b)):
            s, dt = example_features(x, g, v, mode)
            sq = s if sq is None else sq + s
            dots = dt if dots is None else dots + dt
    sp = cosines_from_dots(dots, sq, directions.proxy_sq.to(dots.dtype))
    st = cosines_from_dots(target_features.dots, target_features.sq, directions.target_sq.to(target_features.dots.dtype))
    valid = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).to(sp.device)
    loss, per_task = score_agreement_loss(sp, st.to(sp.dtype), valid, kind, reduction)
    return ScoreOutput(loss=loss, per_task=dict(zip(directions.tasks, per_task)),
                       proxy_scores=sp.detach(), target_scores=st.detach())
