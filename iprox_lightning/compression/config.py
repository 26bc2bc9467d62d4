"""The settings of Stage 1: :class:`CompressionConfig` (what :func:`~iprox_lightning.compression.apply.compress` is told), the
method and allocation names it accepts and the default allocation. Its own file so that the plan
(:mod:`iprox_lightning.compression.plan`) and the apply step (:mod:`iprox_lightning.compression.apply`) both read it, neither
importing the other for it; ``iprox_lightning.compression.apply`` re-exports every name here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..engine.damping import check_damping_mode
from ..errors import UserInputError
from .influence_weights import RANK_WEIGHTINGS
from .ipsvd import DEFAULT_DAMPING, DEFAULT_DAMPING_MODE, DEFAULT_MODE, MODES
from .probes import PROBE_LABELS
from .ranks import ROUNDINGS

METHODS = ("ipsvd", "svd", "random")
ALLOCATIONS = ("uniform", "global")

# Defaults = the v2 fidelity benchmark (bench/fidelity_v2.py, docs/BENCHMARKS.md; warmed-up SmolLM2-135M,
# 512 stratified pool examples, all 375 few-shot validation examples, ρ = 0.5): the exact damped optimum
# (relative damping 1e-3, so the δ-side weighting is kept) with ONE parameter budget spent over all layers
# by their weighted spectra ("global") keeps the target's ranking (Spearman 0.52, length-partialled 0.33)
# where plain SVD at uniform ranks keeps nothing (−0.03) and Layer Extraction much less (0.21 / 0.12).
# The old default (core mode, absolute damping 0.1: an input-weighted SVD restricted to the probe span,
# worse than plain SVD on its own objective) and the paper's setting (core, absolute 1e-3) stay one
# argument away. ``allocation=None`` means "global" for exact IPSVD and "uniform" otherwise (a spectrum
# of the weighted objective is what prices one layer against another).
# (DEFAULT_MODE, DEFAULT_DAMPING, DEFAULT_DAMPING_MODE are defined in ipsvd.py, so ipsvd_factors has the same ones.)
DEFAULT_ALLOCATION = "global"


def resolve_allocation(allocation: str | None, method: str, mode: str) -> str:
    """``allocation``, or — when ``None`` — :data:`DEFAULT_ALLOCATION` for exact IPSVD and ``"uniform"``
    for core IPSVD, SVD and random factors."""
    if allocation is not None:
        return allocation
    return DEFAULT_ALLOCATION if (method == "ipsvd" and mode == "exact") else "uniform"


@dataclass(frozen=True)
class CompressionConfig:
    """The settings of Stage 1 (how :func:`compress` turns a model into a proxy), checked when built.

    Parsed as is by the CLI (``IPSVDCallback``'s options), passed unchanged to :func:`compress`, kept in
    :attr:`CompressionReport.compression` and written verbatim into the proxy manifest (``"compression"``).

    Args:
        sparsity: ρ, the share of the targeted layers' weights removed (0.5 keeps half).
        method: how factors are initialised: ``"ipsvd"`` (influence-preserving, needs probes), ``"svd"`` (plain
            truncated SVD of each weight) or ``"random"``.
        mode: IPSVD solution: ``"exact"`` (the damped weighted optimum) or ``"core"`` (the paper's, restricted to the
            probe span).
        damping: IPSVD damping λ of the probe covariances.
        damping_mode: ``"relative"`` (λ times the mean eigenvalue) or ``"absolute"`` (λ as is).
        num_probe_tokens: N, the probe tokens collected per layer.
        rank_multiple: every rank is a multiple of this (paper: 128 on GPUs); how it is rounded: ``rank_rounding``.
        targets: regexes of the layer leaf names to compress (default: every attention/MLP projection).
        seed: seed of the probe sample and of random factors.
        core_fallback: what ``mode="core"`` does where the probe span cannot hold the rank: ``"exact"`` (use the
            exact mode for that layer, logged) or ``"error"``.
        allocation: ``"uniform"`` (every layer at ρ), ``"global"`` (one budget over all layers, spent where
            truncation costs most) or ``None`` (global for exact IPSVD, else uniform).
        keep_dense: regexes of full layer names kept dense (charged to the budget under ``"global"``).
        drop_blocks: d, the least important decoder blocks (Layer Extraction importance on the probe batches) removed
            before compressing; the remaining layers get the whole-model budget of ρ (0: no block removed).
        probe_labels: the tokens whose loss the probes' output-gradients ``δ`` are taken of: ``"response"`` (default:
            the response tokens, the loss the influence scores use) or ``"all"`` (every non-pad token, the reference
            implementation's choice; :func:`~iprox_lightning.compression.probes.collect_probes`).
        rank_rounding: ``"nearest"`` (default: uniform ranks to the nearest multiple of ``rank_multiple``; the global
            allocation spends its budget in blocks of ``rank_multiple`` and never exceeds it) or ``"up"`` (the
            reference implementation's: every rank rounded up to a multiple of ``rank_multiple``, a layer whose rounded
            factors hold at least as many weights as the dense layer kept dense; the plan then holds more weights than
            requested; :mod:`iprox_lightning.compression.ranks`).
        rank_weighting: ``"none"`` (default) or ``"influence"`` (``allocation="global"`` only): every layer's marginal
            gain in the allocation weighted by its share of the target's per-task TracIn score signal, measured on the
            validation examples (per task) and the probe examples (:mod:`iprox_lightning.compression.influence_weights`;
            :func:`compress` then needs a ``val_dataloader``).
        rank_weight_mix: λ ∈ [0, 1] of ``rank_weighting="influence"``: weight ``(1 − λ) + λ·ŵ`` (1: the influence
            weights alone; 0: the unweighted allocation).
    """

    sparsity: float = 0.5
    method: str = "ipsvd"
    mode: str = DEFAULT_MODE
    damping: float = DEFAULT_DAMPING
    damping_mode: str = DEFAULT_DAMPING_MODE
    num_probe_tokens: int = 1024
    rank_multiple: int = 1
    targets: Optional[tuple[str, ...]] = None
    seed: int = 0
    core_fallback: str = "exact"
    allocation: Optional[str] = None
    keep_dense: Optional[tuple[str, ...]] = None
    drop_blocks: int = 0
    probe_labels: str = "response"
    rank_rounding: str = "nearest"
    rank_weighting: str = "none"
    rank_weight_mix: float = 1.0

    def __post_init__(self) -> None:
        for name in ("targets", "keep_dense"):  # lists from YAML / callers: frozen as tuples
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if self.method not in METHODS:
            raise UserInputError(f"method must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.drop_blocks, bool) or not isinstance(self.drop_blocks, int) or self.drop_blocks < 0:
            raise UserInputError(f"drop_blocks must be an integer >= 0, got {self.drop_blocks!r}")
        if self.method == "ipsvd":
            if self.mode not in MODES:
                raise UserInputError(f"mode must be one of {MODES}, got {self.mode!r}")
            check_damping_mode(self.damping_mode)
        allocation = self.resolved_allocation
        if allocation not in ALLOCATIONS:
            raise UserInputError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
        if allocation == "global" and self.method == "random":
            raise UserInputError("allocation='global' prices truncation with a spectrum: use method 'ipsvd' or 'svd'")
        if allocation == "global" and self.method == "ipsvd" and self.mode != "exact":
            raise UserInputError("allocation='global' prices each layer with the exact weighted spectrum: use mode='exact'")
        if self.probe_labels not in PROBE_LABELS:
            raise UserInputError(f"probe_labels must be one of {PROBE_LABELS}, got {self.probe_labels!r}")
        if self.rank_rounding not in ROUNDINGS:
            raise UserInputError(f"rank_rounding must be one of {ROUNDINGS}, got {self.rank_rounding!r}")
        if self.rank_weighting not in RANK_WEIGHTINGS:
            raise UserInputError(f"rank_weighting must be one of {RANK_WEIGHTINGS}, got {self.rank_weighting!r}")
        if self.rank_weighting != "none" and allocation != "global":
            raise UserInputError(f"rank_weighting={self.rank_weighting!r} weights the global rank allocation: use "
                             f"allocation='global' (got {allocation!r})")
        if not 0.0 <= float(self.rank_weight_mix) <= 1.0:
            raise UserInputError(f"rank_weight_mix must be in [0, 1], got {self.rank_weight_mix!r}")

    @property
    def resolved_allocation(self) -> str:
        """:attr:`allocation`, with ``None`` resolved (:func:`resolve_allocation`)."""
        return resolve_allocation(self.allocation, self.method, self.mode)
