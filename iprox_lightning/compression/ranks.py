"""Rank budget from a target sparsity ρ (paper §4.1 and Appendix "Implementation Details").

A dense ``out×in`` layer holds ``in·out`` weights; its factorised replacement ``A: [out, r]``,
``B: [r, in]`` holds ``r·(in + out)``. Keeping a fraction ``1 − ρ`` of the layer's weights gives

    r = (1 − ρ) · in · out / (in + out)

rounded to the nearest multiple of ``rank_multiple`` (the paper uses 128 for tensor cores; 1 keeps
the exact budget), and at least ``rank_multiple``. A layer whose rank would reach ``min(in, out)``
gains nothing from factorising and is kept dense (rank ``None``).

``rounding="up"`` (the reference implementation's choice, :data:`ROUNDINGS`): the rank is rounded UP to a
multiple of ``rank_multiple`` instead, and a layer whose rounded rank makes the factors hold at least as many
weights as the dense layer (``r·(in + out) ≥ in·out``, e.g. small GQA k/v projections) is kept dense. Every
factorised layer then holds at least its share of the budget, so the plan holds more weights than requested.
"""
from __future__ import annotations

import heapq
import math
from typing import Mapping

from torch import nn

from ..errors import UserInputError
from ..engine.target_layers import linear_shape

# how a rank becomes a multiple of ``rank_multiple``: "nearest" (uniform ranks to the nearest multiple; the global
# allocation spends its budget in blocks of the multiple and never exceeds it) or "up" (every rank rounded up, a
# layer whose rounded factors are no cheaper than the dense weight kept dense)
ROUNDINGS = ("nearest", "up")


def check_rounding(rounding: str) -> None:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rank_rounding must be one of {ROUNDINGS}, got {rounding!r}")


def cheaper_than_dense(rank: int, in_features: int, out_features: int) -> bool:
    """Whether factors of ``rank`` hold fewer weights than the dense layer (``r·(in + out) < in·out``) and the rank is
    below ``min(in, out)``."""
    return rank < min(in_features, out_features) and rank * (in_features + out_features) < in_features * out_features


def round_up(rank: int, in_features: int, out_features: int, rank_multiple: int) -> int | None:
    """``rank`` rounded up to a multiple of ``rank_multiple`` (at least one multiple); ``None`` (kept dense) when the
    rounded factors would be no cheaper than the dense layer (:func:`cheaper_than_dense`)."""
    r = max(rank_multiple, -(-int(rank) // rank_multiple) * rank_multiple)
    return r if cheaper_than_dense(r, in_features, out_features) else None


def rank_for_sparsity(in_features: int, out_features: int, sparsity: float, rank_multiple: int = 1,
                      rounding: str = "nearest") -> int | None:
    """The rank of one ``out×in`` layer at sparsity ``ρ``; ``None`` when it is kept dense (module docstring;
    ``rounding``: :data:`ROUNDINGS`)."""
    if not 0.0 <= sparsity < 1.0:
        raise UserInputError(f"sparsity must be in [0, 1), got {sparsity}")
    if rank_multiple < 1:
        raise UserInputError(f"rank_multiple must be >= 1, got {rank_multiple}")
    check_rounding(rounding)
    exact = (1.0 - sparsity) * in_features * out_features / (in_features + out_features)
    if rounding == "up":  # 1e-9: an exact multiple computed as 128.00000000000003 stays 128
        return round_up(math.ceil(exact / rank_multiple - 1e-9) * rank_multiple, in_features, out_features,
                        rank_multiple)
    r = max(rank_multiple, int(round(exact / rank_multiple)) * rank_multiple)
    if r >= min(in_features, out_features):
        return None
    return r


def plan_ranks(modules: Mapping[str, nn.Module], sparsity: float, rank_multiple: int = 1,
               rounding: str = "nearest") -> dict[str, int | None]:
    """``{layer name: rank or None (kept dense)}`` for the given linear-like modules."""
    plan = {}
    for name, m in modules.items():
        out_f, in_f = linear_shape(m)
        plan[name] = rank_for_sparsity(in_f, out_f, sparsity, rank_multiple, rounding)
    return plan


def round_plan_up(plan: Mapping[str, int | None], shapes: Mapping[str, tuple[int, int]],
                  rank_multiple: int) -> dict[str, int | None]:
    """Every rank of ``plan`` rounded up to a multiple of ``rank_multiple`` (:func:`round_up`; ``None`` stays
    dense, and a layer whose rounded factors are no cheaper than dense becomes dense). ``shapes[name] = (out, in)``."""
    return {n: (None if r is None else round_up(r, shapes[n][1], shapes[n][0], rank_multiple))
            for n, r in plan.items()}


def plan_weights(plan: Mapping[str, int | None], shapes: Mapping[str, tuple[int, int]]) -> int:
    """Weights the layers of ``plan`` hold: ``r·(in + out)`` per factorised layer, ``in·out`` per dense one."""
    return sum(o * i if r is None else r * (i + o) for n, r in plan.items() for o, i in [shapes[n]])


def requested_layer_params(in_features: int, out_features: int, sparsity: float) -> float:
    """Weights a layer should hold at sparsity ``ρ``: ``(1 − ρ)·in·out`` (before rounding)."""
    return (1.0 - sparsity) * in_features * out_features


def dense_rank(in_features: int, out_features: int) -> int:
    """The smallest rank at which the factors hold at least as many weights as the dense layer
    (``r·(in + out) ≥ in·out``), capped at ``min(in, out)``: from there on the layer stays dense."""
    r = -(-in_features * out_features // (in_features + out_features))  # ceil
    return min(r, min(in_features, out_features))


def minimum_allocation(
    shapes: Mapping[str, tuple[int, int]],
    budget: float,
    *,
    rank_multiple: int = 1,
    min_rank: int | None = None,
    dense: Mapping[str, bool] | None = None,
) -> tuple[dict[str, int | None], float]:
    """Where :func:`allocate_ranks` starts: ``(plan, weights)`` with every layer at ``min_rank`` (default
    ``rank_multiple``) and the ``dense`` ones dense; raises when that already exceeds ``budget``."""
    r0 = int(rank_multiple) if min_rank is None else int(min_rank)
    dense = dense or {}
    plan: dict[str, int | None] = {}
    spent = 0.0
    for name, (out_f, in_f) in shapes.items():
        if dense.get(name):
            plan[name] = None
            spent += in_f * out_f
        else:
            r = min(r0, min(in_f, out_f))
            plan[name] = r
            spent += r * (in_f + out_f)
    if spent > budget:
        raise UserInputError(f"budget {budget:,.0f} weights is below the minimum allocation ({spent:,.0f}: "
                             f"dense layers + rank {r0} everywhere); raise the budget (lower sparsity)")
    return plan, spent


def allocate_ranks(
    spectra: Mapping[str, "torch.Tensor | list[float]"],
    shapes: Mapping[str, tuple[int, int]],
    budget: float,
    *,
    rank_multiple: int = 1,
    min_rank: int | None = None,
    dense: Mapping[str, bool] | None = None,
    weights: Mapping[str, float] | None = None,
) -> dict[str, int | None]:
    """Global rank allocation: one parameter ``budget`` for all layers, spent where truncation costs most.

    ``spectra[name]``: the layer's singular values ``σ`` (descending) of the matrix whose truncation is
    priced, so that keeping the top ``r`` costs ``Σ_{i>r} σ_i²`` (the whitened weight for IPSVD,
    :func:`iprox_lightning.compression.ipsvd.weighted_spectrum`; ``W`` for plain SVD). ``shapes[name] = (out, in)``.
    ``budget``: weights all these layers may hold together (e.g. ``(1 − ρ)·Σ in·out``).
    ``dense[name] = True`` forces a layer dense (its ``in·out`` is charged first). ``weights[name] ≥ 0``
    (default 1) multiplies the layer's ``σ²`` — every marginal gain of the greedy below — e.g. the influence weights
    of :mod:`iprox_lightning.compression.influence_weights` (all 1: exactly the unweighted plan).

    Greedy: every layer starts at ``min_rank`` (default ``rank_multiple``); then, repeatedly, the block of
    ``rank_multiple`` next components with the largest ``Σσ² / (block·(in + out))`` — loss kept per
    weight spent — is added while it fits. A layer whose factors would hold as many weights as the dense
    layer (:func:`dense_rank`) is kept dense (``None``). Within a layer the gains fall (``σ`` sorted), so
    for equal ``in + out`` this is the exact optimum of the budgeted problem, and otherwise the optimum
    of its fractional relaxation up to the last block that did not fit.
    Returns ``{name: rank or None (dense)}``; raises if even the minimum ranks exceed the budget.
    """
    mult = int(rank_multiple)
    if mult < 1:
        raise UserInputError(f"rank_multiple must be >= 1, got {rank_multiple}")
    r0 = mult if min_rank is None else int(min_rank)
    dense = dict(dense or {})
    sig2 = _weighted_energies(spectra, shapes, dense, dict(weights or {}))
    plan, spent = minimum_allocation(shapes, budget, rank_multiple=mult, min_rank=r0, dense=dense)

    def next_block(name: str, r: int) -> tuple[float, float, bool]:
        """(gain, cost, to_dense) of the layer's next step from rank ``r``: ``rank_multiple`` more
        components, or — when that reaches :func:`dense_rank` — the switch to the dense layer, which
        keeps every remaining component."""
        out_f, in_f = shapes[name]
        if r + mult >= dense_rank(in_f, out_f):
            return sum(sig2[name][r:]), float(in_f * out_f - r * (in_f + out_f)), True
        return sum(sig2[name][r : r + mult]), float(mult * (in_f + out_f)), False

    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        r = plan[name]
        if r is None:
            return
        gain, cost, _ = next_block(name, r)
        heapq.heappush(heap, (-gain / max(cost, 1.0), name))

    for name in shapes:
        push(name)
    while heap:
        _, name = heapq.heappop(heap)
        gain, cost, to_dense = next_block(name, plan[name])
        if spent + cost > budget:
            continue  # does not fit: this layer stops here (cheaper steps of other layers may still fit)
        spent += cost
        if to_dense:
            plan[name] = None
        else:
            plan[name] += mult
            push(name)
    return plan


def _weighted_energies(spectra: Mapping[str, "torch.Tensor | list[float]"], shapes: Mapping[str, tuple[int, int]],
                       dense: Mapping[str, bool], weights: Mapping[str, float]) -> dict[str, list[float]]:
    """``{layer: [w·σ_i²]}`` for :func:`allocate_ranks`, after checking its inputs: every forced-dense layer is
    known, every weight finite and ``≥ 0``, every layer not forced dense has a spectrum, each spectrum descending."""
    unknown = set(dense) - set(shapes)
    if unknown:
        raise ValueError(f"dense: unknown layer(s) {sorted(unknown)[:5]}")
    bad = {n: w for n, w in weights.items() if not (float(w) >= 0.0 and math.isfinite(float(w)))}
    if bad:
        raise ValueError(f"weights must be finite and >= 0, got {dict(list(bad.items())[:5])}")
    sig2: dict[str, list[float]] = {}
    for name in shapes:
        if name not in spectra and not dense.get(name):
            raise ValueError(f"layer {name!r}: no spectrum given")
        if name in spectra:
            s = [float(x) for x in (spectra[name].tolist() if hasattr(spectra[name], "tolist") else spectra[name])]
            if any(b > a * (1 + 1e-9) + 1e-300 for a, b in zip(s, s[1:])):
                raise ValueError(f"layer {name!r}: spectrum must be sorted in descending order")
            w = float(weights.get(name, 1.0))
            sig2[name] = [x * x for x in s] if name not in weights else [w * x * x for x in s]
    return sig2


def uniform_plan_for_budget(
    shapes: Mapping[str, tuple[int, int]],
    budget: float,
    *,
    rank_multiple: int = 1,
    dense: Mapping[str, bool] | None = None,
    rounding: str = "nearest",
) -> tuple[dict[str, int | None], float]:
    """``(plan, ρ')``: ONE sparsity ``ρ'`` for every layer (:func:`rank_for_sparsity`) whose plan holds the
    number of weights closest to ``budget`` (ties: the plan that does not exceed it, then ``ρ'`` nearest the
    continuous solution ``1 − (budget − dense)/Σ in·out``).

    ``shapes[name] = (out, in)``; ``dense[name] = True`` keeps a layer dense and charges its ``in·out`` to the
    budget. A plan is piecewise constant in ``ρ'`` (ranks are rounded), so every piece is tried: the ranks
    change where ``(1 − ρ')·in·out/(in + out)`` crosses a half multiple of ``rank_multiple``. The continuous
    solution is itself a candidate, so with ``rank_multiple = m`` the plan is within ``m/2 · Σ (in + out)``
    weights of ``budget`` wherever no rank is clamped at ``m`` or switched to dense at that solution.
    Raises (naming the numbers) when ``budget`` is at least the dense layers' ``Σ in·out`` (nothing left to
    compress) or below the smallest plan (rank ``rank_multiple`` everywhere). ``rounding="up"``: the ranks of
    :func:`rank_for_sparsity` with that rounding (they change where ``(1 − ρ')·c/m`` crosses a whole multiple).
    """
    check_rounding(rounding)
    mult = int(rank_multiple)
    if mult < 1:
        raise UserInputError(f"rank_multiple must be >= 1, got {rank_multiple}")
    dense = dict(dense or {})
    unknown = set(dense) - set(shapes)
    if unknown:
        raise ValueError(f"dense: unknown layer(s) {sorted(unknown)[:5]}")
    groups: dict[tuple[int, int], int] = {}  # (out, in) -> how many factorised layers have that shape
    charged = 0.0
    for name, (out_f, in_f) in shapes.items():
        if dense.get(name):
            charged += in_f * out_f
        else:
            groups[(out_f, in_f)] = groups.get((out_f, in_f), 0) + 1
    full = charged + sum(n * o * i for (o, i), n in groups.items())
    if budget >= full:
        raise UserInputError(f"budget {budget:,.0f} weights is at least what the layers hold dense ({full:,.0f}): "
                             "nothing to compress")
    if not groups:
        raise UserInputError("every layer is kept dense: no sparsity to solve for")

    def total(rho: float) -> float:
        t = charged
        for (o, i), n in groups.items():
            r = rank_for_sparsity(i, o, rho, mult, rounding)
            t += n * (o * i if r is None else r * (i + o))
        return t

    breaks = {0.0, 1.0}
    half = 0.5 if rounding == "nearest" else 0.0
    for o, i in groups:
        k = 0
        while True:  # ρ' where (1 − ρ')·c/m = k + ½ (nearest) or k (up), c = in·out/(in + out)
            rho = 1.0 - (k + half) * mult * (i + o) / (i * o)
            if rho <= 0.0:
                break
            breaks.add(rho)
            k += 1
    pts = sorted(breaks)
    smallest = total(0.5 * (pts[-2] + pts[-1]))  # the last piece below ρ' = 1: the smallest ranks
    if budget < smallest:
        raise UserInputError(f"budget {budget:,.0f} weights is below the smallest plan ({smallest:,.0f}: dense layers + "
                             f"rank {mult} everywhere); raise the budget (lower sparsity)")
    rho_c = 1.0 - (budget - charged) / (full - charged)
    cands = {r: total(r) for r in [min(max(rho_c, 0.0), pts[-2])] + [0.5 * (a + b) for a, b in zip(pts, pts[1:])]}
    best = min(cands, key=lambda r: (abs(cands[r] - budget), cands[r] > budget, abs(r - rho_c)))
    plan = {name: (None if dense.get(name) else rank_for_sparsity(i, o, best, mult, rounding))
            for name, (o, i) in shapes.items()}
    return plan, best
