"""Compress a causal LM into an IProX proxy (paper Stage 1), count its parameters, save and load it.

``compress_model`` replaces, in place, every targeted linear layer (attention and MLP projections
of the decoder blocks, fused ones and GPT-2 ``Conv1D`` included; never embeddings or LM head) by a
:class:`~iprox_lightning.engine.lowrank.LowRankLinear` whose factors come from IPSVD (or plain SVD /
random init), at the rank the sparsity budget gives (:mod:`iprox_lightning.compression.ranks`). Layers whose rank
would reach ``min(in, out)`` stay dense. The returned :class:`CompressionReport` holds per-layer
rank, weighted objective, time, and the requested vs achieved parameter counts of the whole model
(embeddings and LM head included), so users see the true proxy size.

``drop_blocks = d > 0`` (:attr:`CompressionConfig.drop_blocks`) first removes the ``d`` least important
decoder blocks as the Layer Extraction baseline does (:mod:`iprox_lightning.engine.blocks`:
ShortGPT importance on the probe batches, blocks cut and renumbered), then compresses the remaining blocks
at the SAME whole-model parameter budget as ``d = 0`` would request: the weights freed by the dropped blocks
go back to the remaining layers (see :func:`compress`).

A proxy directory (``save_proxy`` / ``load_proxy``, defined in :mod:`iprox_lightning.io.proxy`) holds
``config.json``, the tokenizer files, every weight (factors included) in ``iprox_proxy.safetensors`` and the
manifest ``iprox_proxy.json``; it loads as a proxy or not at all. Nothing is unpickled on load.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..engine.blocks import remove_blocks
from ..errors import UserInputError
from ..progress import progress as progress_of
from .ipsvd import WhitenedSVD, compute_factors, weighted_objective
from ..engine.lowrank import LowRankLinear
from ..engine.settings import takes_settings
from ..engine.target_layers import (
    count_parameters, find_target_linears, is_compressed, linear_shape, linear_weight, lowrank_layers, set_submodule,
)
from .influence_weights import RankWeights, influence_rank_weights
from .probes import Probes, collect_probes
from .ranks import requested_layer_params
from .config import ALLOCATIONS, DEFAULT_ALLOCATION, METHODS, CompressionConfig, resolve_allocation
from .plan import (
    BlockDropReport, CompressionPlan, allocate_global, cut_planned_blocks, layer_spectrum, layers_to_probe,
    plan_compression, plan_global_ranks,
)
from .schedule import Exchange, assign_layers, kept_whitened, probe_groups, whitened_room

log = logging.getLogger(__name__)

from ..io.proxy import MANIFEST_VERSION, PROXY_MANIFEST, PROXY_WEIGHTS
def _layer_bias(module: nn.Module) -> torch.Tensor | None:
    b = getattr(module, "bias", None)
    return b if isinstance(b, torch.Tensor) else None


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
@dataclass
class LayerReport:
    name: str
    in_features: int
    out_features: int
    rank: int | None  # None: kept dense
    bias: bool
    params_before: int
    params_after: int
    params_requested: float
    mode: str | None = None  # factor mode actually used (ipsvd), e.g. "exact" after a core fallback
    objective: float | None = None  # weighted objective J(A B)
    objective_dense: float | None = None  # J(0) = weighted norm of W: objective / objective_dense is the relative error
    time_s: float = 0.0

    @property
    def relative_objective(self) -> float | None:
        if self.objective is None or not self.objective_dense:
            return None
        return self.objective / self.objective_dense


@dataclass
class CompressionReport:
    """What ``compress_model`` did. Parameter counts are for the whole model unless prefixed ``target_``."""

    sparsity: float
    method: str
    mode: str | None
    damping: float | None
    damping_mode: str | None
    rank_multiple: int
    seed: int
    num_probe_tokens: int  # requested N
    probe_tokens: int  # collected N
    probe_examples: int
    params_before: int
    params_after: int
    params_requested: int  # whole model at exactly (1 − ρ) of every targeted layer
    target_params_before: int
    target_params_after: int
    time_probes_s: float
    time_factors_s: float
    layers: list[LayerReport] = field(default_factory=list)
    allocation: str = "uniform"
    keep_dense: list[str] | None = None
    time_allocation_s: float = 0.0
    health: dict[str, float] | None = None  # proxy vs target on held-out batches (IPSVDCallback)
    compression: CompressionConfig | None = None  # the settings as given (written verbatim into the manifest)
    block_drop: BlockDropReport | None = None  # drop_blocks > 0: the removed blocks (counts above: original model)
    rank_weighting: RankWeights | None = None  # rank_weighting="influence": the allocation's layer weights
    untargeted_matmul_params: int | None = None  # weights of the linear maps no plan touches (the LM head, tied or not)

    # -------------------------------------------------------------- what the proxy cannot compress
    @property
    def fixed_param_share(self) -> float:
        """Share of the target's parameters outside the targeted layers (embedding, LM head, norms): no ρ reaches
        them."""
        return 1.0 - self.target_params_before / max(self.params_before, 1)

    @property
    def fixed_flop_share(self) -> float | None:
        """Share of the per-token matmul FLOPs (2 per weight of every linear map, the LM head included; the
        sequence-length-dependent attention products not counted) in linear maps outside the targeted layers."""
        if self.untargeted_matmul_params is None:
            return None
        return self.untargeted_matmul_params / max(self.untargeted_matmul_params + self.target_params_before, 1)

    @property
    def param_saving(self) -> float:
        """Whole-model parameter saving: ``1 − params_after / params_before``."""
        return 1.0 - self.params_after / max(self.params_before, 1)

    def saving_warning(self) -> str | None:
        """One line when ρ cannot buy the saving it names: the whole model saves less than half of ρ (most of the
        model is what the proxy does not compress, e.g. a 262k-token embedding); ``None`` otherwise."""
        if self.sparsity <= 0 or self.block_drop is not None or self.param_saving >= self.sparsity / 2:
            return None
        flops = (f" and {self.fixed_flop_share:.0%} of the per-token matmul FLOPs (LM head)"
                 if self.fixed_flop_share is not None else "")
        return (f"sparsity {self.sparsity} saves only {self.param_saving:.0%} of the whole model's parameters "
                f"({self.params_before:,} -> {self.params_after:,}): {self.fixed_param_share:.0%} of them{flops} are "
                "outside the layers IPSVD compresses (embedding, LM head, norms), so the proxy is hardly cheaper "
                "than the target; a higher sparsity or drop_blocks buys more")

    @property
    def ranks(self) -> dict[str, int | None]:
        return {lr.name: lr.rank for lr in self.layers}

    @property
    def achieved_sparsity(self) -> float:
        """Sparsity actually reached on the targeted layers."""
        return 1.0 - self.target_params_after / max(self.target_params_before, 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["achieved_sparsity"] = self.achieved_sparsity
        for k in ("block_drop", "rank_weighting"):  # only when used
            if d[k] is None:
                del d[k]
        return d

    def summary(self) -> str:
        n_low = sum(lr.rank is not None for lr in self.layers)
        rel = [lr.relative_objective for lr in self.layers if lr.relative_objective is not None]
        mean_rel = f", mean relative weighted error {sum(rel) / len(rel):.4g}" if rel else ""
        bd = self.block_drop
        dropped = (f", dropped blocks {bd.dropped} of {bd.num_blocks_before} (Layer Extraction importance)"
                   + (f", remaining layers at sparsity {bd.layer_sparsity:.4f}" if bd.layer_sparsity is not None else "")
                   if bd is not None else "")
        rw = self.rank_weighting
        weighted = (f", influence-weighted allocation ({len(rw.tasks)} tasks, weights {min(rw.weights.values()):.3g}"
                    f"..{max(rw.weights.values()):.3g}, {rw.time_s:.1f}s)" if rw is not None else "")
        flops = (f", {self.fixed_flop_share:.1%} of the per-token matmul FLOPs (LM head)"
                 if self.fixed_flop_share is not None else "")
        return (
            f"{self.method}{'/' + self.mode if self.mode else ''} at sparsity {self.sparsity}: "
            f"{n_low}/{len(self.layers)} layers factorised, parameters {self.params_before:,} -> "
            f"{self.params_after:,} ({self.param_saving:.1%} saved; requested {self.params_requested:,}; targeted "
            f"layers {self.target_params_before:,} -> {self.target_params_after:,}, achieved sparsity "
            f"{self.achieved_sparsity:.4f}; not compressible: {self.fixed_param_share:.1%} of the parameters "
            f"(embedding, LM head, norms){flops}), probes {self.probe_tokens} tokens in {self.time_probes_s:.1f}s, "
            f"factors in {self.time_factors_s:.1f}s{mean_rel}{dropped}{weighted}"
        )


# ------------------------------------------------------------------------------------------------
# compression
# ------------------------------------------------------------------------------------------------
@takes_settings(CompressionConfig, "compression", positional=("sparsity",))
def compress_model(
    model: nn.Module,
    probe_dataloader: Iterable[Mapping] | None,
    *,
    compute_dtype: torch.dtype | None = None,
    progress: bool = True,
    probes: Probes | None = None,
    val_dataloader: Iterable[Mapping] | None = None,
    compression: CompressionConfig | None = None,
) -> CompressionReport:
    """:func:`compress` with the :class:`CompressionConfig` given as keyword arguments (its fields: same names, same
    defaults; ``sparsity`` also third by position) or whole as ``compression=``."""
    return compress(model, probe_dataloader, compression, compute_dtype=compute_dtype, progress=progress,
                    probes=probes, val_dataloader=val_dataloader)


def compress(
    model: nn.Module,
    probe_dataloader: Iterable[Mapping] | None,
    config: CompressionConfig,
    *,
    compute_dtype: torch.dtype | None = None,
    progress: bool = True,
    probes: Probes | None = None,
    val_dataloader: Iterable[Mapping] | None = None,
    probe_group_layers: int | None = None,
    exchange: Exchange | None = None,
) -> CompressionReport:
    """Replace the targeted linears of ``model`` in place by ``LowRankLinear`` layers.

    ``config`` (:class:`CompressionConfig`) says how. ``method``: ``"ipsvd"`` (needs ``probe_dataloader``),
    ``"svd"`` or ``"random"``. When a probe dataloader is given, probes are collected for every method so the report holds the weighted
    objective ``J`` (see :mod:`iprox_lightning.compression.ipsvd`) of each layer, measured with the given
    ``damping``/``damping_mode`` whatever the method — comparable across methods.
    ``mode``/``damping``/``damping_mode``/``core_fallback``/``compute_dtype``: see
    :func:`~iprox_lightning.compression.ipsvd.ipsvd_factors` (a core→exact fallback is logged and recorded as the
    layer's ``mode``). ``targets``: regex patterns of layer leaf names (default: all attention/MLP
    projections). ``probes``: reuse probes collected beforehand by
    :func:`~iprox_lightning.compression.probes.collect_probes` on this model (not consumed; e.g. for a sweep)
    instead of collecting them from ``probe_dataloader``.
    ``allocation`` (``None``: :func:`resolve_allocation`): ``"uniform"`` — every layer at the rank of sparsity ρ (:func:`~iprox_lightning.compression.ranks.plan_ranks`);
    ``"global"`` — one budget of ``(1 − ρ)·Σ in·out`` weights for all targeted layers, spent greedily where
    truncation costs most (:func:`~iprox_lightning.compression.ranks.allocate_ranks` over each layer's
    :func:`~iprox_lightning.compression.ipsvd.weighted_spectrum` for IPSVD, its plain singular values for SVD): the
    parameter count is the uniform one's, the ranks differ per layer. ``keep_dense``: regex patterns of
    full layer names (``re.search``, e.g. ``"layers\\.0\\.mlp"``) kept dense; under ``"global"`` they are
    charged to the same budget. Factors are cast to the dtype/device of the replaced weight; biases are kept
    (frozen). Raises if the model is already compressed.

    ``drop_blocks = d > 0``: the probe batches (read once into a list) first give the Layer Extraction block
    importance (:func:`~iprox_lightning.engine.blocks.block_importance`, every real token of every
    probe batch — the same data as the probes, no second sample); the ``d`` least important blocks are removed
    in place (:func:`~iprox_lightning.engine.blocks.remove_blocks`: config lists cut, ``layer_idx``
    renumbered), and the probes are collected on the cut model (its blocks see new inputs). The remaining
    targeted layers then get ``params_requested`` (the whole original model at ``(1 − ρ)`` of every targeted
    layer, as for ``d = 0``) minus every other parameter of the cut model: ``"global"`` spends that one budget;
    ``"uniform"`` solves for the one sparsity ``ρ'`` of the remaining layers whose plan comes closest to it
    (:func:`~iprox_lightning.compression.ranks.uniform_plan_for_budget`). ``keep_dense`` patterns match the cut model's
    (renumbered) layer names and are charged to the budget under either allocation. Precollected ``probes``
    are refused (they were taken before the cut). Raises, naming the numbers, when ``d`` is not below the number
    of blocks or the budget left is infeasible (at least the remaining layers' dense size, or below their
    smallest plan). Parameter counts of the report (``params_before``, ``target_params_before``,
    ``params_requested``) are the original model's; ``report.block_drop`` records the blocks.

    ``rank_weighting="influence"`` (``"global"`` only) reads ``val_dataloader`` (batches with a ``task``) and the probe batches a second time (read once into a list; precollected ``probes`` alone are not enough) for the influence
    weights of the (cut) target's layers (:func:`~iprox_lightning.compression.influence_weights.influence_rank_weights`,
    recorded in ``report.rank_weighting``; its time is part of ``time_allocation_s``); ``rank_rounding`` and
    ``probe_labels``: :class:`CompressionConfig`.

    At scale (:mod:`iprox_lightning.compression.schedule`): ``probe_group_layers = k`` collects the probes of ``k``
    layers at a time (a probe pass per group, twice under ``"global"``: the spectra, then the factors and their
    objectives; every pass on the uncompressed model, whose layers are swapped once all factors are computed), so
    the probe columns held are one group's; ``exchange`` (several processes: every rank calls ``compress`` on the same
    model with the same probe batches) makes each rank decompose its share of the layers, largest first, and gather
    the others' spectra, factors and records. The probe columns are the single pass's, bitwise (the token positions
    are drawn from ``seed`` alone, the forward and backward are the same), and so are the spectra and the ranks. The
    factors are too under any number of processes with the same ``probe_group_layers`` (the same functions on the same
    columns, the same layers keeping their decompositions: :func:`~iprox_lightning.compression.schedule.kept_whitened`,
    from the shapes alone); a smaller group keeps fewer decompositions (its room is one group's probe bytes), and a
    layer not kept is decomposed again at its rank — the same eigendecomposition, its vectors sliced before rather
    than after the products that map them back (equal to rounding).
    """
    if config.method == "ipsvd" and probe_dataloader is None and probes is None:
        raise UserInputError("method='ipsvd' needs a probe_dataloader (or precollected probes)")
    drop = config.drop_blocks
    if drop and probes is not None:
        raise UserInputError(f"drop_blocks={drop}: precollected probes were taken before the blocks are removed (the "
                             "remaining blocks see new inputs); pass the probe_dataloader instead")
    if drop and probe_dataloader is None:
        raise UserInputError(f"drop_blocks={drop} needs the probe batches (block importance): give a probe_dataloader")
    influence = config.rank_weighting == "influence"
    if influence and (probe_dataloader is None or val_dataloader is None):
        raise UserInputError("rank_weighting='influence' needs the probe batches and a val_dataloader (the per-task "
                         "validation examples): give both (precollected probes alone are not enough)")
    if is_compressed(model):
        raise UserInputError("model already holds LowRankLinear layers (already compressed)")
    if drop or influence:  # read once: block importance / influence weights, then probes of the cut model
        probe_dataloader = list(probe_dataloader)
    targets = list(config.targets) if config.targets is not None else None
    plan = plan_compression(model, config, probe_dataloader, progress=progress)  # refused settings: model untouched
    cut_planned_blocks(model, plan, targets)
    modules = find_target_linears(model, targets)

    if probe_group_layers is not None or (exchange is not None and exchange.world_size > 1):
        if probes is not None:
            raise UserInputError("precollected probes are one pass of every layer: give the probe_dataloader for "
                                 "probe_group_layers or several processes")
        if probe_dataloader is not None:
            probe_dataloader = list(probe_dataloader)  # read once: one pass per group (twice under "global")
        weights = influence_rank_weights(model, modules, val_dataloader, probe_dataloader,
                                         mix=config.rank_weight_mix, progress=progress) if influence else None
        plan, layers, info, times = _scheduled(model, plan, modules, config, probe_dataloader, weights,
                                               probe_group_layers, exchange or Exchange(), compute_dtype, progress)
        return _finish(_report(model, plan, config, layers, info, *times))

    t0 = time.perf_counter()
    own_probes = probes is None
    if probes is None and probe_dataloader is not None:
        wanted = set(layers_to_probe(plan))
        to_probe = {n: m for n, m in modules.items() if n in wanted}
        if to_probe:
            probes = collect_probes(model, probe_dataloader, to_probe, num_tokens=config.num_probe_tokens,
                                    seed=config.seed, progress=progress, labels=config.probe_labels)
    t_probes = time.perf_counter() - t0
    t_alloc = time.perf_counter()
    weights = influence_rank_weights(model, modules, val_dataloader, probe_dataloader,
                                     mix=config.rank_weight_mix, progress=progress) if influence else None
    plan = plan_global_ranks(plan, modules, config, probes, compute_dtype=compute_dtype, progress=progress,
                             weights=weights)
    t_alloc = time.perf_counter() - t_alloc

    t1 = time.perf_counter()
    layers = apply_plan(model, plan, config, probes, consume_probes=own_probes, compute_dtype=compute_dtype,
                        progress=progress)
    return _finish(_report(model, plan, config, layers, probes, t_probes, time.perf_counter() - t1, t_alloc))


def _finish(report: CompressionReport) -> CompressionReport:
    log.info(report.summary())
    warning = report.saving_warning()
    if warning is not None and warning not in _WARNED:  # once per process and model: a sweep over ρ says it once each
        _WARNED.add(warning)
        log.warning(warning)
    return report


_WARNED: set[str] = set()


def apply_plan(model: nn.Module, plan: CompressionPlan, config: CompressionConfig, probes: Probes | None, *,
               consume_probes: bool = False, compute_dtype: torch.dtype | None = None,
               progress: bool = True) -> list[LayerReport]:
    """The apply step: replace, in place, every layer ``plan`` gives a rank by a ``LowRankLinear`` of that rank
    (factors from ``config.method``; ``probes`` give IPSVD its ``(H, Δ)`` and every factorised layer its weighted
    objective); one :class:`LayerReport` per targeted layer, dense ones included. ``consume_probes`` frees each
    layer's probes once used."""
    modules = find_target_linears(model, list(config.targets) if config.targets is not None else None)
    if list(modules) != list(plan.shapes):
        raise ValueError(f"the plan is for layers {list(plan.shapes)[:4]}..., the model has {list(modules)[:4]}...")
    layers: list[LayerReport] = []
    for name, module in progress_of(list(modules.items()), desc=f"IPSVD factors ({config.method})", enabled=progress,
                                    unit="layer"):
        out_f, in_f = linear_shape(module)
        layers.append(LayerReport(name=name, in_features=in_f, out_features=out_f, rank=plan.ranks[name],
                                  bias=_layer_bias(module) is not None, params_before=in_f * out_f,
                                  params_after=in_f * out_f,
                                  params_requested=requested_layer_params(in_f, out_f, config.sparsity)))
        if plan.ranks[name] is not None:
            _factorise_layer(model, name, module, layers[-1], config, probes, consume_probes, len(layers),
                             compute_dtype, plan.whitened.pop(name, None))
    plan.whitened.clear()
    return layers


def _factorise_layer(model: nn.Module, name: str, module: nn.Module, lr: LayerReport, config: CompressionConfig,
                     probes: Probes | None, consume_probes: bool, index: int, compute_dtype,
                     whitened: WhitenedSVD | None = None) -> None:
    """Swap the layer ``name`` for its ``LowRankLinear`` at rank ``lr.rank``; fills ``lr`` (objective, mode, time).
    ``whitened``: the layer's exact IPSVD from the global allocation (:func:`~iprox_lightning.compression.plan.plan_global_ranks`),
    whose factors at the rank are those :func:`~iprox_lightning.compression.ipsvd.ipsvd_factors` computes (exact mode)."""
    ts = time.perf_counter()
    A, B = _layer_factors(name, module, lr, config, probes, consume_probes, index, compute_dtype, whitened)
    _swap_layer(model, name, module, A, B)
    lr.time_s = time.perf_counter() - ts


def _layer_factors(name: str, module: nn.Module, lr: LayerReport, config: CompressionConfig, probes: Probes | None,
                   consume_probes: bool, index: int, compute_dtype, whitened: WhitenedSVD | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of the layer ``name`` at rank ``lr.rank``, on the weight's device and in its dtype; fills ``lr``
    (objective, mode, ``params_after``). ``whitened``: :func:`_factorise_layer`."""
    W, rank = linear_weight(module).detach(), lr.rank
    H = Delta = None
    if probes is not None:
        if name not in probes.H:
            raise ValueError(f"layer {name!r}: no probes collected for it")
        H, Delta = probes.pop(name) if consume_probes else (probes.H[name], probes.Delta[name])
        H, Delta = H.to(W.device), Delta.to(W.device)
    used_mode = config.mode if config.method == "ipsvd" else None
    kwargs: dict[str, Any] = dict(seed=config.seed + index, compute_dtype=compute_dtype)
    fallbacks: list[str] = []
    if config.method == "ipsvd":
        kwargs.update(damping=config.damping, damping_mode=config.damping_mode, core_fallback=config.core_fallback,
                      on_fallback=fallbacks.append)
    try:
        if whitened is not None and config.method == "ipsvd" and used_mode == "exact":
            A, B = whitened.factors(rank)
            A, B = A.to(W.device), B.to(W.device)
        else:
            A, B = compute_factors(config.method, W, rank, H, Delta, mode=used_mode, **kwargs)
    except ValueError as e:
        raise ValueError(f"layer {name!r}: {e}") from None
    if fallbacks:
        log.warning("layer %s: %s -> falling back to mode='exact'", name, fallbacks[0])
        used_mode = "exact"
    if H is not None:
        obj_kw = dict(damping=config.damping, damping_mode=config.damping_mode)
        lr.objective = weighted_objective(W, A, B, H, Delta, **obj_kw)
        lr.objective_dense = (float(whitened.singular_values.pow(2).sum()) if whitened is not None  # ‖S‖_F² = Σ σ²
                              else weighted_objective(W, None, None, H, Delta, **obj_kw))
    lr.params_after = rank * (lr.in_features + lr.out_features)
    lr.mode = used_mode
    return A.to(W.device, W.dtype), B.to(W.device, W.dtype)


def _swap_layer(model: nn.Module, name: str, module: nn.Module, A: torch.Tensor, B: torch.Tensor) -> None:
    """Replace ``module`` (the layer ``name`` of ``model``) by the ``LowRankLinear`` of factors ``A``, ``B`` (on the
    weight's device and in its dtype), its bias kept, its train mode kept."""
    bias = _layer_bias(module)
    new = LowRankLinear.from_factors(A, B, None if bias is None else bias.detach())
    new.train(module.training)
    set_submodule(model, name, new)


def _scheduled(model: nn.Module, plan: CompressionPlan, modules: Mapping[str, nn.Module], config: CompressionConfig,
               batches: list | None, weights: RankWeights | None, group_layers: int | None, exchange: Exchange,
               compute_dtype, progress: bool) -> tuple[CompressionPlan, list[LayerReport], Probes | None, tuple]:
    """:func:`compress`'s probes, allocation and factors with ``probe_group_layers`` and / or ``exchange`` (its
    docstring): ``(plan, layer reports, the probe counts (a :class:`Probes` without columns), (t_probes, t_factors,
    t_alloc))``. The model is swapped last, every layer from the factors of the rank that computed it."""
    t_probes = 0.0
    order = list(modules)
    probed = layers_to_probe(plan)
    owner = assign_layers({n: plan.shapes[n] for n in probed}, exchange.world_size)
    groups = probe_groups([n for n in probed if owner[n] == exchange.rank], group_layers)
    info: list[Probes] = []

    def probes_of(group: list[str]) -> Probes | None:
        nonlocal t_probes
        if batches is None:
            return None
        t = time.perf_counter()
        got = collect_probes(model, batches, {n: modules[n] for n in group}, num_tokens=config.num_probe_tokens,
                             seed=config.seed, progress=progress, labels=config.probe_labels,
                             warn_short=not info)
        t_probes += time.perf_counter() - t
        if not info:
            info.append(Probes({}, {}, got.num_tokens, got.num_valid_tokens, got.num_examples, got.mean_loss,
                               got.batch_shares))
        return got

    held: Probes | None = None  # one group: its probes serve the spectra and the factors (one pass, as compress's)
    kept: dict[str, WhitenedSVD] = {}
    t_alloc = time.perf_counter()  # the spectra and the allocation (their probe passes counted in t_probes)
    if plan.allocation == "global":
        def spectra() -> dict[str, torch.Tensor]:
            nonlocal held
            out, keep = {}, None
            for group in groups:
                got = probes_of(group) if config.method == "ipsvd" or len(groups) == 1 else None
                if keep is None:  # the same layers as one process's single pass keeps, whatever the share or group
                    n = got.num_tokens if got is not None else 0
                    keep = kept_whitened(plan.shapes, [m for m in order if m in owner],
                                         whitened_room(plan.shapes, probed, n, group_layers))
                for name in group:
                    out[name], w = layer_spectrum(name, modules[name], config, got, keep=name in keep,
                                                  compute_dtype=compute_dtype)
                    if w is not None:
                        kept[name] = w
                    out[name] = out[name].cpu()
                held = got if len(groups) == 1 else None
            return out

        every = {}
        for part in exchange.gather(spectra):
            every.update(part)
        plan = allocate_global(plan, every, config, weights)
    t_alloc = time.perf_counter() - t_alloc - t_probes
    t1, t_probes_before = time.perf_counter(), t_probes

    reports = {n: LayerReport(name=n, in_features=plan.shapes[n][1], out_features=plan.shapes[n][0],
                              rank=plan.ranks[n], bias=_layer_bias(modules[n]) is not None,
                              params_before=plan.shapes[n][0] * plan.shapes[n][1],
                              params_after=plan.shapes[n][0] * plan.shapes[n][1],
                              params_requested=requested_layer_params(plan.shapes[n][1], plan.shapes[n][0],
                                                                      config.sparsity)) for n in order}

    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # this rank's factors (never pickled: broadcast below)

    def factors() -> tuple[dict, dict]:
        records = {}
        for group in groups:
            todo = [n for n in group if plan.ranks[n] is not None]
            if not todo:
                continue
            got = held if held is not None else probes_of(todo)
            for name in todo:
                ts = time.perf_counter()
                lr = reports[name]
                mine[name] = _layer_factors(name, modules[name], lr, config, got, True, order.index(name) + 1,
                                           compute_dtype, kept.pop(name, None))
                lr.time_s = time.perf_counter() - ts
                records[name] = lr
        return records, dict(plan.ranks)

    for r, (records, ranks) in enumerate(exchange.gather(factors)):
        if ranks != plan.ranks:  # pragma: no cover (invariant: the same allocation from the same spectra)
            raise RuntimeError(f"rank {r} planned other ranks than rank {exchange.rank}")
        reports.update(records)
    for name in progress_of(order, desc="IPSVD factors (swap)", enabled=progress and len(order) > 1, unit="layer"):
        lr, module = reports[name], modules[name]
        if lr.rank is None:
            continue
        if owner[name] == exchange.rank:
            A, B = mine.pop(name)
        else:
            W = linear_weight(module)
            A = torch.empty(lr.out_features, lr.rank, dtype=W.dtype, device=W.device)
            B = torch.empty(lr.rank, lr.in_features, dtype=W.dtype, device=W.device)
        exchange.broadcast(A, src=owner[name])
        exchange.broadcast(B, src=owner[name])
        _swap_layer(model, name, module, A, B)
    t_factors = time.perf_counter() - t1 - (t_probes - t_probes_before)
    times = (t_probes, t_factors, t_alloc, plan.block_drop.time_s if plan.block_drop else 0.0)
    counts = info[0] if info else None
    if exchange.world_size > 1:  # the slowest rank's times, any rank's probe counts: one report on every rank
        got = exchange.all_gather((times, counts))
        times = tuple(max(t) for t in zip(*(t for t, _ in got)))
        counts = next((c for _, c in got if c is not None), None)  # a rank with no layer collected no probes
    if plan.block_drop is not None:
        plan.block_drop.time_s = times[3]
    return plan, [reports[n] for n in order], counts, times[:3]


def apply_report_structure(model: nn.Module, report: CompressionReport) -> None:
    """Give ``model`` (the uncompressed model ``report`` was made from), in place, the structure of the compressed one
    without computing any factor: the blocks ``report.block_drop`` removed cut, every layer ``report.layers`` gives a
    rank a :class:`LowRankLinear` of that rank, on the weight's device and dtype, its bias copied, its train mode
    kept. The factors are left as initialised — the same draws of the global random generator as
    :meth:`LowRankLinear.from_factors` makes in :func:`compress`, so a process that runs this instead of ``compress``
    keeps its generator in step — and the caller fills them (e.g. from a saved proxy's state dict)."""
    if is_compressed(model):
        raise UserInputError("model already holds LowRankLinear layers (already compressed)")
    if report.block_drop is not None:
        remove_blocks(model, report.block_drop.kept, inplace=True)
    targets = list(report.compression.targets) if report.compression and report.compression.targets else None
    modules = find_target_linears(model, targets)
    for lr in report.layers:
        if lr.rank is None:
            continue
        module = modules.get(lr.name)
        if module is None or linear_shape(module) != (lr.out_features, lr.in_features):
            raise ValueError(f"layer {lr.name!r} of the report ({lr.out_features}x{lr.in_features}) is not in the model "
                             f"as such ({None if module is None else linear_shape(module)})")
        weight, bias = linear_weight(module), _layer_bias(module)
        new = LowRankLinear(lr.in_features, lr.out_features, lr.rank, bias=bias is not None, device=weight.device,
                            dtype=weight.dtype)
        if bias is not None:
            with torch.no_grad():
                new.bias.copy_(bias)
        new.train(module.training)
        set_submodule(model, lr.name, new)


def _report(model: nn.Module, plan: CompressionPlan, config: CompressionConfig, layers: list[LayerReport],
            probes: Probes | None, t_probes: float, t_factors: float, t_alloc: float) -> CompressionReport:
    return CompressionReport(
        sparsity=config.sparsity, method=config.method,
        mode=config.mode if config.method == "ipsvd" else None,
        damping=config.damping,
        damping_mode=config.damping_mode,
        rank_multiple=config.rank_multiple, seed=config.seed, num_probe_tokens=config.num_probe_tokens,
        probe_tokens=probes.num_tokens if probes is not None else 0,
        probe_examples=probes.num_examples if probes is not None else 0,
        params_before=plan.params_before, params_after=count_parameters(model),
        params_requested=int(round(plan.params_requested)),
        target_params_before=plan.target_params_before, target_params_after=sum(lr.params_after for lr in layers),
        time_probes_s=t_probes, time_factors_s=t_factors, layers=layers,
        allocation=plan.allocation, keep_dense=list(config.keep_dense) if config.keep_dense else None,
        time_allocation_s=t_alloc, compression=config, block_drop=plan.block_drop,
        rank_weighting=plan.rank_weighting,
        untargeted_matmul_params=sum(m.weight.numel() for n, m in model.named_modules()
                                     if isinstance(m, nn.Linear) and n not in {lr.name for lr in layers}),
    )


# ------------------------------------------------------------------------------------------------
# save / load: the proxy directory's one home is iprox_lightning.io.proxy (re-exported here)
# ------------------------------------------------------------------------------------------------
from ..io.proxy import build_manifest, load_proxy, read_manifest, save_proxy
