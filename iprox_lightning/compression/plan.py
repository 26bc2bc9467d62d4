"""Stage 1's plan: which decoder blocks are dropped, which layers are factorised and at which rank.

:func:`iprox_lightning.compression.apply.compress` is *plan, then apply*:

1. :func:`plan_compression` (the model untouched) — the targeted layers, the whole-model parameter budget, with
   ``drop_blocks`` the blocks to remove (Layer Extraction importance, :func:`~iprox_lightning.engine.blocks.block_importance`)
   and the budget left to the remaining layers (checked before anything is cut), the layers the ``keep_dense`` patterns spare,
   and the ranks of the ``"uniform"`` allocation;
2. :func:`cut_planned_blocks` — the block surgery the plan names (:func:`~iprox_lightning.engine.blocks.remove_blocks`);
3. :func:`plan_global_ranks` — ``allocation="global"`` only: the ranks, from the weighted spectra of the probes of
   the (cut) model (with ``rank_weighting="influence"`` each layer's spectrum weighted by its share of the target's
   per-task score signal, :mod:`iprox_lightning.compression.influence_weights`; with ``rank_rounding="up"`` the allocation at
   rank granularity 1, every rank then rounded up to a multiple of ``rank_multiple``);
4. the apply step, :func:`iprox_lightning.compression.apply.apply_plan`, factorises every planned layer at its rank.

A :class:`CompressionPlan` is plain data (``to_dict``: the ranks, the spared layers, the allocation, the dropped
blocks and the influence weights, with the values the proxy manifest records in
``layers``/``allocation``/``block_drop``/``rank_weighting``).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional

from torch import nn

from ..engine.blocks import block_importance, decoder_blocks, most_important_blocks, remove_blocks
from ..progress import progress as progress_of
from .config import CompressionConfig
from .influence_weights import RankWeights
from .ipsvd import WhitenedSVD, plain_spectrum, whitened_svd
from .probes import Probes
from .schedule import kept_whitened, whitened_keep
from .ranks import (
    allocate_ranks, minimum_allocation, plan_ranks, requested_layer_params, round_plan_up, uniform_plan_for_budget,
)
from ..engine.target_layers import count_parameters, find_target_linears, linear_shape, linear_weight


log = logging.getLogger(__name__)


@dataclass
class BlockDropReport:
    """What ``drop_blocks`` did (``CompressionReport.block_drop``; the manifest's ``"block_drop"``)."""

    dropped: list[int]  # original indices of the removed blocks
    kept: list[int]  # original indices of the kept blocks (now 0 .. len(kept) − 1)
    importance: list[float]  # I_LE of every original block (blocks.block_importance)
    num_blocks_before: int
    num_blocks_after: int
    params_dropped: int  # parameters of the removed blocks
    importance_tokens: int  # real tokens the importance was averaged over (the probe batches)
    layer_budget: float  # weights the remaining targeted layers may hold (params_requested − everything else)
    layer_sparsity: float | None = None  # uniform allocation: the one sparsity ρ' solved for the remaining layers
    time_s: float = 0.0


@dataclass
class CompressionPlan:
    """What :func:`~iprox_lightning.compression.apply.apply_plan` does to a model. Layer names are those of the model the
    plan applies to (after the dropped blocks are cut and the kept ones renumbered); parameter counts are the
    original model's."""

    ranks: dict[str, Optional[int]]  # every targeted layer -> its rank (None: kept dense)
    shapes: dict[str, tuple[int, int]]  # every targeted layer -> (out_features, in_features)
    allocation: str  # "uniform" or "global" (resolved)
    dense_layers: list[str] = field(default_factory=list)  # layers spared by the CompressionConfig.keep_dense patterns
    params_before: int = 0  # the whole original model
    target_params_before: int = 0  # the original model's targeted layers
    params_requested: float = 0.0  # whole model at exactly (1 − ρ) of every targeted layer
    block_drop: Optional[BlockDropReport] = None  # drop_blocks > 0: the blocks removed before factorising
    path: str = ""  # drop_blocks > 0: the module path of the decoder block list
    rank_weighting: Optional[RankWeights] = None  # rank_weighting="influence": the layer weights of the allocation
    # global IPSVD allocation: the layers' exact IPSVD computed for their spectra, kept (within the probes' own memory)
    # so that apply_plan factorises them without a second decomposition; not part of the plan's record
    whitened: dict[str, WhitenedSVD] = field(default_factory=dict, repr=False, compare=False)

    @property
    def layer_budget(self) -> Optional[float]:
        """The weights the remaining layers may hold (``drop_blocks > 0``), else ``None`` (``(1 − ρ)·Σ in·out``)."""
        return self.block_drop.layer_budget if self.block_drop is not None else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with the values the proxy manifest records (``allocation``, ``params_requested``,
        ``block_drop``, ``rank_weighting`` — only when influence-weighted; ``ranks`` = ``{layer["name"]:
        layer["rank"]}`` of its ``layers``)."""
        d = {"allocation": self.allocation, "ranks": dict(self.ranks), "dense_layers": list(self.dense_layers),
             "params_requested": int(round(self.params_requested)),
             "block_drop": asdict(self.block_drop) if self.block_drop is not None else None}
        if self.rank_weighting is not None:
            d["rank_weighting"] = asdict(self.rank_weighting)
        return d


def plan_compression(model: nn.Module, config: CompressionConfig, probe_batches: Optional[list] = None, *,
                     progress: bool = True) -> CompressionPlan:
    """The plan of ``config`` for ``model``, before any probe (the model is left as it is; a refused setting raises
    here). With ``drop_blocks`` the blocks are chosen on ``probe_batches`` and the budget left to the remaining
    layers is checked; the ranks are final for ``"uniform"``, to be set by :func:`plan_global_ranks` for
    ``"global"``."""
    targets = list(config.targets) if config.targets is not None else None
    modules = find_target_linears(model, targets)
    params_before = count_parameters(model)
    target_before = sum(linear_shape(m)[0] * linear_shape(m)[1] for m in modules.values())
    requested_total = params_before - target_before + sum(
        requested_layer_params(linear_shape(m)[1], linear_shape(m)[0], config.sparsity) for m in modules.values()
    )
    block_drop, path = None, ""
    if config.drop_blocks:  # chosen on the uncut model; its layers renamed as they will be once the blocks are cut
        block_drop, path = _choose_blocks(model, probe_batches, config.drop_blocks, progress)
        modules = {new: m for n, m in modules.items() if (new := _renamed(n, path, block_drop)) is not None}
    spared = _match_layers(modules, list(config.keep_dense) if config.keep_dense is not None else None)
    ranks = plan_ranks(modules, config.sparsity, config.rank_multiple, config.rank_rounding)
    for name in spared:
        ranks[name] = None
    plan = CompressionPlan(ranks=ranks, shapes={n: linear_shape(m) for n, m in modules.items()},
                           allocation=config.resolved_allocation, dense_layers=spared, params_before=params_before,
                           target_params_before=target_before, params_requested=requested_total,
                           block_drop=block_drop, path=path)
    if block_drop is not None:
        plan = _plan_remaining_layers(plan, modules, config)
    return plan


def _plan_remaining_layers(plan: CompressionPlan, modules: Mapping[str, nn.Module],
                           config: CompressionConfig) -> CompressionPlan:
    """``drop_blocks``: the budget of the remaining layers, checked feasible; under ``"uniform"`` their ranks at the
    one sparsity ``ρ'`` that spends it."""
    bd, dense = plan.block_drop, {n: True for n in plan.dense_layers}
    bd.layer_budget = _remaining_budget(modules, plan.params_before, plan.params_requested, config.sparsity, bd)
    try:
        if plan.allocation == "uniform":
            ranks, bd.layer_sparsity = uniform_plan_for_budget(plan.shapes, bd.layer_budget,
                                                               rank_multiple=config.rank_multiple, dense=dense,
                                                               rounding=config.rank_rounding)
            return replace(plan, ranks=ranks)
        minimum_allocation(plan.shapes, bd.layer_budget, rank_multiple=config.rank_multiple, dense=dense)
    except ValueError as e:
        raise ValueError(f"drop_blocks={config.drop_blocks}, sparsity {config.sparsity}, remaining layers: {e}") from None
    return plan


def cut_planned_blocks(model: nn.Module, plan: CompressionPlan, targets: Optional[list[str]]) -> None:
    """Remove, in place, the blocks ``plan`` drops (config lists cut, ``layer_idx`` renumbered); the cut model's
    targeted layers must be the plan's layers."""
    if plan.block_drop is None:
        return
    remove_blocks(model, plan.block_drop.kept, inplace=True)
    cut = list(find_target_linears(model, targets))
    if cut != list(plan.shapes):  # pragma: no cover (invariant)
        raise RuntimeError(f"drop_blocks: the cut model's layers {cut[:4]}... are not the renamed "
                           f"remaining layers {list(plan.shapes)[:4]}...")


def layers_to_probe(plan: CompressionPlan) -> list[str]:
    """The layers whose probes the rest of the plan and the apply step need: every factorised layer, and under
    ``"global"`` every layer not spared (its spectrum prices it)."""
    spared = set(plan.dense_layers)
    return [n for n, r in plan.ranks.items()
            if r is not None or (plan.allocation == "global" and n not in spared)]


def plan_global_ranks(plan: CompressionPlan, modules: Mapping[str, nn.Module], config: CompressionConfig,
                      probes: Optional[Probes], *, compute_dtype=None, progress: bool = True,
                      weights: Optional[RankWeights] = None) -> CompressionPlan:
    """``allocation="global"``: ``plan`` with the ranks of one budget (default ``(1 − ρ)·Σ in·out``; with
    ``drop_blocks`` the remaining layers' budget) spent over all targeted layers where truncation costs most, by
    their weighted spectra (IPSVD, from ``probes``) or plain singular values (SVD). Other allocations: ``plan``.

    ``weights`` (``rank_weighting="influence"``, :func:`~iprox_lightning.compression.influence_weights.influence_rank_weights`):
    every marginal gain of layer ``ℓ`` multiplied by ``weights.weights[ℓ]``; recorded as ``plan.rank_weighting``.
    ``config.rank_rounding == "up"``: the budget is spent at rank granularity 1 and every rank then rounded UP to a
    multiple of ``rank_multiple`` (:func:`~iprox_lightning.compression.ranks.round_plan_up`: a layer whose rounded factors are no
    cheaper than dense stays dense), so the plan holds up to ``(rank_multiple − 1)·(in + out)`` more weights per
    layer than the budget."""
    if plan.allocation != "global":
        return plan
    spectra: dict = {}
    whitened: dict[str, WhitenedSVD] = {}
    # the exact IPSVD of a layer serves both its spectrum and its factors: kept for apply_plan while the kept ones
    # fit in the memory the probes themselves take (float32 H, Δ), recomputed there otherwise
    room = 0 if probes is None else sum(4 * (t.numel()) for d in (probes.H, probes.Delta) for t in d.values())
    kept = kept_whitened(plan.shapes, [n for n in modules if n not in plan.dense_layers], room)
    for name, module in progress_of(list(modules.items()), desc="rank allocation (spectra)", enabled=progress,
                                    unit="layer"):
        if name in plan.dense_layers:
            continue
        spectra[name], w = layer_spectrum(name, module, config, probes, keep=name in kept, compute_dtype=compute_dtype)
        if w is not None:
            whitened[name] = w
    return replace(allocate_global(plan, spectra, config, weights), whitened=whitened)


def layer_spectrum(name: str, module: nn.Module, config: CompressionConfig, probes: Optional[Probes], *, keep: bool,
                   compute_dtype=None) -> tuple[Any, Optional[WhitenedSVD]]:
    """One layer's spectrum for the global allocation: ``(σ, its WhitenedSVD)`` — IPSVD: the exact IPSVD from its
    probes, kept (``keep``: the vectors up to the rank at which the layer stays dense) or not (``None``, σ alone);
    SVD: the plain singular values of ``W`` (and ``None``)."""
    W = linear_weight(module).detach()
    if config.method != "ipsvd":
        return plain_spectrum(W), None
    if probes is None or name not in probes.H:
        raise ValueError(f"layer {name!r}: global allocation needs its probes")
    out_f, in_f = W.shape
    w = whitened_svd(W, probes.H[name].to(W.device), probes.Delta[name].to(W.device),
                     keep=whitened_keep(out_f, in_f) if keep else 0,
                     damping=config.damping, damping_mode=config.damping_mode, compute_dtype=compute_dtype)
    return w.singular_values, (w if keep else None)


def allocate_global(plan: CompressionPlan, spectra: Mapping[str, Any], config: CompressionConfig,
                    weights: Optional[RankWeights] = None) -> CompressionPlan:
    """``plan`` with the ranks of the global allocation of every layer's ``spectra`` (:func:`plan_global_ranks`)."""
    budget = plan.layer_budget
    if budget is None:
        budget = sum((1.0 - config.sparsity) * o * i for o, i in plan.shapes.values())
    up = config.rank_rounding == "up"
    try:
        ranks = allocate_ranks(spectra, plan.shapes, budget, rank_multiple=1 if up else config.rank_multiple,
                               dense={n: True for n in plan.dense_layers},
                               weights=None if weights is None else weights.weights)
    except ValueError as e:
        if plan.block_drop is None:
            raise
        raise ValueError(f"drop_blocks={config.drop_blocks}, sparsity {config.sparsity}, remaining layers: {e}") from None
    if up:
        ranks = round_plan_up(ranks, plan.shapes, config.rank_multiple)
    return replace(plan, ranks=ranks, rank_weighting=weights)


def _match_layers(modules: Mapping[str, nn.Module], patterns: list[str] | None) -> list[str]:
    """Names of ``modules`` matched by any regex of ``patterns``; a pattern matching nothing is an error."""
    if not patterns:
        return []
    out = []
    for pat in patterns:
        rx = re.compile(pat)
        hits = [n for n in modules if rx.search(n)]
        if not hits:
            raise ValueError(f"keep_dense pattern {pat!r} matches no targeted layer (e.g. {next(iter(modules), '')!r})")
        out.extend(h for h in hits if h not in out)
    return out


def _choose_blocks(model: nn.Module, batches: list, drop: int, progress: bool) -> tuple[BlockDropReport, str]:
    """The ``drop`` least important decoder blocks of ``model`` (Layer Extraction importance on ``batches``),
    not yet removed: ``(report, path of the block list)``; ``layer_budget`` is filled in by the caller."""
    path, blocks = decoder_blocks(model)
    L = len(blocks)
    if drop >= L:
        raise ValueError(f"drop_blocks={drop} must be below the model's number of decoder blocks ({L}): at least one "
                         "block is kept")
    t0 = time.perf_counter()
    imp = block_importance(model, batches, progress=progress)
    keep = most_important_blocks(imp, L - drop)
    dropped = [i for i in range(L) if i not in keep]
    kept_ids = {id(p) for i in keep for p in blocks[i].parameters()}
    params_dropped = sum(p.numel() for p in {id(p): p for i in dropped for p in blocks[i].parameters()}.values()
                         if id(p) not in kept_ids)  # a tensor shared with a kept block (or counted twice) stays
    tokens = int(sum(int(b["attention_mask"].sum()) for b in batches))
    log.info("drop_blocks=%d: removing blocks %s of %d (Layer Extraction importance %s)", drop, dropped, L,
             [round(float(x), 4) for x in imp])
    return BlockDropReport(dropped=dropped, kept=keep, importance=[float(x) for x in imp], num_blocks_before=L,
                           num_blocks_after=len(keep), params_dropped=params_dropped, importance_tokens=tokens,
                           layer_budget=float("nan"), time_s=time.perf_counter() - t0), path


def _renamed(name: str, path: str, bd: BlockDropReport) -> str | None:
    """A layer's name once the blocks are cut and renumbered (``None``: inside a dropped block)."""
    if not name.startswith(path + "."):
        return name
    idx, _, tail = name[len(path) + 1:].partition(".")
    i = int(idx)
    return None if i in bd.dropped else f"{path}.{bd.kept.index(i)}.{tail}"


def _remaining_budget(modules: Mapping[str, nn.Module], params_before: int, requested_total: float, sparsity: float,
                      bd: BlockDropReport) -> float:
    """Weights the remaining targeted layers ``modules`` may hold so the cut model totals ``requested_total``
    parameters; raises when that is at least their dense size (nothing left to compress at equal budget)."""
    dense = sum(linear_shape(m)[0] * linear_shape(m)[1] for m in modules.values())
    rest = params_before - bd.params_dropped - dense  # every parameter of the cut model but these layers' weights
    budget = requested_total - rest
    if budget >= dense:
        raise ValueError(
            f"drop_blocks={len(bd.dropped)}, sparsity {sparsity}: the whole model may hold {requested_total:,.0f} "
            f"parameters; after removing {len(bd.dropped)} of {bd.num_blocks_before} blocks everything but the "
            f"remaining targeted layers holds {rest:,}, which leaves {budget:,.0f} weights for layers that hold only "
            f"{dense:,} dense: the budget cannot be spent; drop fewer blocks or raise the sparsity")
    return float(budget)
