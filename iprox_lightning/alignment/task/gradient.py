"""Per-task validation-gradient alignment ``L_val``: ``reduce_t [1 − cos(ḡ^P_t, P(sg ḡ^T_t))]`` over the whole
factor space (see the package doc)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..losses import factor_projections, proxy_factor_layers
from ...engine.batch import batch_rows, check_batch
from ...engine.lowrank import LowRankLinear
from ...engine.tracking import PairTracker, backward_pairs
from .common import EPS, FactorPairTracker, _dense_modules, _dtype, _keep, reduce_tasks, task_rows, task_gradient_sums


# ------------------------------------------------------------------------------------------------
# L_val: the per-task validation-gradient term
# ------------------------------------------------------------------------------------------------
@dataclass
class TaskGradientOutput:
    """:func:`task_gradient_alignment`: ``loss`` (with the graph when built with ``create_graph``) and, per task,
    the detached cosine of the proxy's and the projected target's summed validation gradients."""

    loss: torch.Tensor
    cos: dict[str, torch.Tensor]


class _DensePairTracker(PairTracker):
    def __init__(self, modules: Mapping[str, nn.Module]) -> None:
        self.modules = dict(modules)
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def start_step(self, batch: Mapping) -> None:
        self.keep = _keep(batch)

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        self.pairs[name] = (h, delta * self.keep.to(delta.device, delta.dtype))


def _in_order(x: torch.Tensor, present: Sequence[str], order: Sequence[str]) -> torch.Tensor:
    """``x [len(present), ...]`` (one slice per task of ``present``) as ``[len(order), ...]``: zeros for a task of
    ``order`` that ``present`` lacks."""
    if list(present) == list(order):
        return x
    at = torch.as_tensor([list(order).index(t) for t in present], device=x.device)
    return torch.zeros((len(order), *x.shape[1:]), dtype=x.dtype, device=x.device).index_add(0, at, x)


def _proxy_task_sums(proxy: nn.Module, batch: Mapping, lowrank: Mapping[str, LowRankLinear], order: Sequence[str],
                     create_graph: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per aligned layer the proxy's per-task gradient sums ``(ḡ_A [K, out, r], ḡ_B [K, r, in])`` over ``batch``'s
    rows, tasks in ``order`` (a task without a row of ``batch``: zeros); differentiable with ``create_graph``."""
    pairs = FactorPairTracker(lowrank)
    backward_pairs(proxy, batch, [pairs], create_graph=create_graph)
    present = task_rows(batch["task"])
    out = {}
    for name in lowrank:
        (z, d), (h, dz) = pairs.pairs[name]
        out[name] = (_in_order(task_gradient_sums(z, d, present), present, order),
                     _in_order(task_gradient_sums(h, dz, present), present, order))
    return out


def _task_inner(x: torch.Tensor, d: torch.Tensor, present: Mapping[str, Sequence[int]], order: Sequence[str],
                w: torch.Tensor) -> torch.Tensor:
    """``Σ_t ⟨Σ_{b ∈ present_t} Σ_τ d_{b,τ} x_{b,τ}ᵀ, w_t⟩`` (``w: [K, out, in]`` in ``order``; ``x: [B, T, in]``,
    ``d: [B, T, out]``) without forming a task's ``[out, in]`` sum: ``Σ (d w_t) ⊙ x``; differentiable."""
    total = x.new_zeros((), dtype=_dtype(x, d, w))
    for task, r in present.items():
        idx = torch.as_tensor(list(r), device=x.device)
        dt = total.dtype
        total = total + ((d[idx].to(dt) @ w[list(order).index(task)].to(dt)) * x[idx].to(dt)).sum()
    return total


def _target_pairs(teacher: nn.Module, batch: Mapping, lowrank: Mapping[str, LowRankLinear]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One backward pass of the target over ``batch``: per aligned layer (the dense layer at the proxy factor's path)
    its token inputs and output-gradients ``(h, δ)``."""
    dense = _DensePairTracker(_dense_modules(teacher, lowrank))
    backward_pairs(teacher, batch, [dense])
    return dense.pairs


def _chunk_inner(teacher: nn.Module, proxy: nn.Module, batch: Mapping, lowrank: Mapping[str, LowRankLinear],
                 order: Sequence[str], u: Mapping, u_p: Optional[Mapping]) -> torch.Tensor:
    """``⟨ḡ^P_batch(θ), u⟩ + ⟨P_θ(ḡ^T_batch), u_P⟩`` (the second when ``u_p`` is given) over ``batch``'s rows, from the
    token pairs of one create-graph proxy pass (and one target pass), never forming a task's per-layer sum:
    ``⟨Σ δ zᵀ, u_A⟩ = Σ (δ u_A) ⊙ z``, ``⟨ḡ^T Bᵀ, u_PA⟩ = Σ (δ u_PA) ⊙ (B h)``, ``⟨Aᵀ ḡ^T, u_PB⟩ = Σ (δ A u_PB) ⊙ h``."""
    present = task_rows(batch["task"])
    pairs = FactorPairTracker(lowrank)
    backward_pairs(proxy, batch, [pairs], create_graph=True)
    inner = 0.0
    for name in lowrank:
        (z, d), (h, dz) = pairs.pairs[name]
        inner = inner + _task_inner(z, d, present, order, u[name][0]) + _task_inner(h, dz, present, order, u[name][1])
    if u_p is not None:
        target = _target_pairs(teacher, batch, lowrank)
        for name, m in lowrank.items():
            th, td = (x.detach() for x in target[name])
            dt = _dtype(th, m.B)
            inner = inner + _task_inner(th.to(dt) @ m.B.to(dt).t(), td, present, order, u_p[name][0]) \
                + _task_inner(th, td.to(dt) @ m.A.to(dt), present, order, u_p[name][1])
    return inner


def _target_projections(teacher: nn.Module, batch: Mapping, lowrank: Mapping[str, LowRankLinear],
                        order: Sequence[str], live: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per aligned layer the target's per-task gradient sums over ``batch``'s rows projected into the proxy's factor
    space, ``P(ḡ^T) = (ḡ^T Bᵀ [K, out, r], Aᵀ ḡ^T [K, r, in])``, tasks in ``order`` (zeros for an absent one); the
    target's gradient is a constant, ``A``/``B`` are differentiated when ``live``."""
    target = _target_pairs(teacher, batch, lowrank)
    present = task_rows(batch["task"])
    out = {}
    for name, m in lowrank.items():
        A, B = (m.A, m.B) if live else (m.A.detach(), m.B.detach())
        th, td = target[name]
        ps = [factor_projections(th[r].detach(), td[r].detach(), A, B) for r in
              (torch.as_tensor(list(v), device=th.device) for v in present.values())]
        out[name] = (_in_order(torch.stack([q[0] for q in ps]), present, order),
                     _in_order(torch.stack([q[1] for q in ps]), present, order))
    return out


def _task_cosines(g: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                  p: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[K]``: per task the cosine of the concatenated factor-space vectors ``g`` and ``p`` (all layers at once)."""
    dot = gg = pp = 0.0
    for name, (g_a, g_b) in g.items():
        p_a, p_b = p[name]
        dt = _dtype(g_a, p_a)
        g_a, g_b, p_a, p_b = g_a.to(dt), g_b.to(dt), p_a.to(dt), p_b.to(dt)
        dot = dot + (g_a * p_a).sum(dim=(1, 2)) + (g_b * p_b).sum(dim=(1, 2))
        gg = gg + g_a.pow(2).sum(dim=(1, 2)) + g_b.pow(2).sum(dim=(1, 2))
        pp = pp + p_a.pow(2).sum(dim=(1, 2)) + p_b.pow(2).sum(dim=(1, 2))
    return dot / (gg * pp).clamp_min(EPS * EPS).sqrt()


def task_gradient_alignment(
    teacher: nn.Module,
    proxy: nn.Module,
    batch: Mapping,
    *,
    layers: Optional[Iterable[str]] = None,
    reduction: str = "mean",
    grad_through_projection: bool = True,
    create_graph: bool = True,
    chunk_size: Optional[int] = None,
) -> TaskGradientOutput:
    """``L_val = reduce_t [1 − cos(ḡ^P_t, P(sg ḡ^T_t))]`` on ``batch`` (validation examples with their ``task``; see
    the module docstring): one target forward+backward and one proxy forward+backward (differentiable pairs with
    ``create_graph``), both of the sum of per-example losses, each row's pairs summed into its task.

    ``chunk_size = c`` bounds the memory to ``c`` rows at a time, for the same loss and gradient. ``ḡ^P`` and the
    target's ``ḡ^T`` are sums over rows and ``P`` is linear in ``ḡ^T``: a first pass without graph, chunk by chunk,
    sums ``ḡ^P`` and ``P(ḡ^T)``, from which ``u = ∂L_val/∂ḡ^P`` and ``u_P = ∂L_val/∂P``; the gradient is then
    ``Σ_chunks ∇_θ [⟨ḡ^P_chunk(θ), u⟩ + ⟨P_θ(ḡ^T_chunk), u_P⟩]`` (the second term with ``grad_through_projection``), one
    create-graph backward per chunk (and one more target pass) whose graph is freed before the next
    (``torch.autograd.grad``, so ``param.grad`` is untouched). The returned ``loss`` is ``L_val``'s value plus
    ``Σ_θ ⟨G_θ, θ⟩ − sg(·)`` (gradient ``G``, value 0): one backward of ``loss`` by the caller, as without chunks.
    Costs one more plain proxy pass and one more target pass over the batch."""
    check_batch(batch)
    if "task" not in batch:
        raise ValueError("task_gradient_alignment: the batch needs a 'task' field")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"task_gradient_alignment: chunk_size must be a positive int or None, got {chunk_size!r}")
    reduce_tasks(torch.zeros(1), reduction)  # checks the name
    lowrank = proxy_factor_layers(proxy, layers)
    order = list(task_rows(batch["task"]))
    n = batch["input_ids"].shape[0]
    through = grad_through_projection and create_graph
    if not (create_graph and chunk_size is not None and chunk_size < n):
        with torch.set_grad_enabled(create_graph):
            proj = _target_projections(teacher, batch, lowrank, order, through)
            cos = _task_cosines(_proxy_task_sums(proxy, batch, lowrank, order, create_graph), proj)
            loss = reduce_tasks(1.0 - cos, reduction)
        return TaskGradientOutput(loss=loss, cos={t: c for t, c in zip(order, cos.detach())})

    def add(acc: dict, parts: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for name, (a, b) in parts.items():
            if name in acc:
                acc[name] = (acc[name][0] + a, acc[name][1] + b)
            else:
                acc[name] = (a, b)

    chunks = [batch_rows(batch, list(range(i, min(i + chunk_size, n)))) for i in range(0, n, chunk_size)]
    g_hat: dict = {}
    proj: dict = {}
    for c in chunks:  # first pass, no graph: the summed per-task gradients of both sides (target: projected)
        with torch.no_grad():
            add(proj, _target_projections(teacher, c, lowrank, order, False))
        add(g_hat, _proxy_task_sums(proxy, c, lowrank, order, False))
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for side in (g_hat, proj) for ab in side.values() for x in ab]
        k = 2 * len(g_hat)
        named = lambda xs: dict(zip(g_hat, zip(xs[0::2], xs[1::2])))  # noqa: E731
        cos = _task_cosines(named(leaves[:k]), named(leaves[k:]))
        value = reduce_tasks(1.0 - cos, reduction)
        grads = torch.autograd.grad(value, leaves)
    u, u_p = named(grads[:k]), named(grads[k:])
    del g_hat, proj, leaves, grads
    params = [p for m in lowrank.values() for p in (m.A, m.B) if p.requires_grad]
    G: list[Optional[torch.Tensor]] = [None] * len(params)
    for c in chunks:  # second pass: one create-graph backward per chunk, its graph freed before the next
        with torch.enable_grad():
            inner = _chunk_inner(teacher, proxy, c, lowrank, order, u, u_p if through else None)
            if not (params and torch.is_tensor(inner) and inner.requires_grad):
                continue  # no factor to train
            got = torch.autograd.grad(inner, params, allow_unused=True)
        G = [a if b is None else b if a is None else a + b for a, b in zip(G, got)]
    with torch.enable_grad():
        carried = sum((g.detach().to(p.dtype) * p).sum() for g, p in zip(G, params) if g is not None)
        loss = value.detach() + (carried - carried.detach() if torch.is_tensor(carried) else 0.0)
    return TaskGradientOutput(loss=loss, cos={t: c for t, c in zip(order, cos.detach())})
