"""Rank budget from a target sparsity ρ (paper §4.1 and Appendix "Implementation Details").

A dense ``out×in`` layer holds ``in·out`` weights; its factorised replacement ``A: [out, r]``,
``B: [r, in]`` holds ``r·(in + out)``. Keeping a fraction ``1 − ρ`` of the layer's weights gives

    r = (1 − ρ) · in · out / (in + out)

rounded to the nearest multiple of ``rank_multiple`` (the paper uses 128 for tensor cores; 1 keeps
the exact budget), and at least ``rank_multiple``. A layer whose rank would reach ``min(in, out)``
gains nothing from factorising and is kept dense (rank ``None``).
"""
from __future__ import annotations

from typing import Mapping

from torch import nn

from .models.targets import linear_shape


def rank_for_sparsity(in_features: int, out_features: int, sparsity: float, rank_multiple: int = 1) -> int | None:
    """The rank of one ``out×in`` layer at sparsity ``ρ``; ``None`` when it is kept dense."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if rank_multiple < 1:
        raise ValueError(f"rank_multiple must be >= 1, got {rank_multiple}")
    exact = (1.0 - sparsity) * in_features * out_features / (in_features + out_features)
    r = max(rank_multiple, int(round(exact / rank_multiple)) * rank_multiple)
    if r >= min(in_features, out_features):
        return None
    return r


def plan_ranks(modules: Mapping[str, nn.Module], sparsity: float, rank_multiple: int = 1) -> dict[str, int | None]:
    """``{layer name: rank or None (kept dense)}`` for the given linear-like modules."""
    plan = {}
    for name, m in modules.items():
        out_f, in_f = linear_shape(m)
        plan[name] = rank_for_sparsity(in_f, out_f, sparsity, rank_multiple)
    return plan


def requested_layer_params(in_features: int, out_features: int, sparsity: float) -> float:
    """Weights a layer should hold at sparsity ``ρ``: ``(1 − ρ)·in·out`` (before rounding)."""
    return (1.0 - sparsity) * in_features * out_features
