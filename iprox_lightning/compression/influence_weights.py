"""Influence weights of the global rank allocation (``CompressionConfig.rank_weighting="influence"``): how much of
the target's per-task TracIn score signal each targeted layer carries, so the parameter budget goes where the
scores live and not only where the weighted reconstruction error ``J`` is largest.

Definitions, on the target (the uncompressed model, after any ``drop_blocks`` cut). For a targeted layer ``ℓ``
(``W_ℓ: [out, in]``) and an example ``z``, ``g_ℓ(z) = Σ_t δ_t h_tᵀ`` is the gradient of the per-example SFT loss
``L(z)`` (mean over the response tokens: the loss the scores use) restricted to ``W_ℓ``:

* the validation direction of task ``T`` (the batch's ``task``; one task ``"all"`` without one):
  ``v_{T,ℓ} = mean over the validation examples of T of g_ℓ(z')``;
* for each probe example ``z_i`` with a non-zero gradient, ``‖g(z_i)‖² = Σ_ℓ ‖g_ℓ(z_i)‖²`` over the targeted layers
  and the layer's part of the task's TracIn score ``cos(g(z_i), v_T) = Σ_ℓ c_{i,T,ℓ} / ‖v_T‖``:
  ``c_{i,T,ℓ} = ⟨g_ℓ(z_i), v_{T,ℓ}⟩ / ‖g(z_i)‖``;
* the layer's share of task ``T``'s score signal: ``s_{T,ℓ} = Var_i c_{i,T,ℓ} / Σ_ℓ' Var_i c_{i,T,ℓ'}`` (population
  variance over the probe examples; ``Σ_ℓ s_{T,ℓ} = 1``). A ranking is made of differences between examples: a
  layer whose part hardly varies over the examples moves no example past another, whatever its mean. A variance, not
  a standard deviation: a relative error ``ε_ℓ`` of the layer's gradients adds a score noise of variance
  ``≈ ε_ℓ² Var_i c_{i,T,ℓ}``, and ``J`` is itself a squared error, so the weighted ``w_ℓ J_ℓ`` stays in squared units;
* the weight ``ŵ_ℓ = max_T s_{T,ℓ}``, rescaled to mean 1 over the layers, mixed with the unweighted allocation:
  ``w_ℓ = (1 − λ) + λ ŵ_ℓ`` (``λ = CompressionConfig.rank_weight_mix``, default 1). The greedy allocator
  (:func:`iprox_lightning.compression.ranks.allocate_ranks`) multiplies every marginal gain ``Σσ²`` of layer ``ℓ`` by ``w_ℓ``.

Why the maximum over tasks: the proxy is used one target task at a time and the task it serves worst is what fails
(issue 22: the pooled ranking and MMLU's survive compression, BBH's and TyDiQA's do not). With the max, a layer is as
important as it is to the task that needs it most, so the layers that carry one task's signal are not outvoted by the
other tasks (the mean over ``K`` tasks would divide a layer that only one task needs by ``K``). Why ``λ``: a layer
with almost no score signal gets a weight near 0 and falls to the minimum rank, which can break the proxy's function
for every layer after it (the output-gradients ``δ`` carry the downstream error; block 0's MLP in the fidelity
diagnosis); ``λ < 1`` keeps a floor of ``1 − λ``.

Everything comes from the backward-pairs engine (:mod:`iprox_lightning.engine.tracking`, one backward per batch, no
``param.grad``): a validation pass sums ``δᵀh`` per task and layer; a probe pass forms each example's ``g_ℓ = δᵀh``
(one ``bmm`` per layer, never a flat per-example gradient) for its squared norm and its inner products with the
``v_{T,ℓ}``. Extra cost: one forward + backward of the target over the validation and the probe examples, plus the
``K`` validation directions (``K × Σ in·out`` numbers) in memory.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np
import torch
from torch import nn
from ..progress import progress as progress_of

from ..engine.batch import IGNORE_INDEX, check_batch, to_device
from ..engine.model_modes import eval_mode
from ..engine.target_layers import linear_shape
from ..engine.tracking import PairTracker, backward_pairs

log = logging.getLogger(__name__)

RANK_WEIGHTINGS = ("none", "influence")
ALL_TASKS = "all"


@dataclass
class RankWeights:
    """What ``rank_weighting="influence"`` measured (``CompressionPlan.rank_weighting``; the manifest's
    ``"rank_weighting"``)."""

    weights: dict[str, float]  # layer -> w_ℓ, the factor of its marginal gains
    shares: dict[str, dict[str, float]]  # task -> layer -> s_{T,ℓ} (each task's sum to 1)
    tasks: list[str]
    mix: float  # λ
    validation_examples: dict[str, int] = field(default_factory=dict)  # task -> examples
    probe_examples: int = 0  # probe examples with a non-zero gradient (the variance is over them)
    time_s: float = 0.0


# ------------------------------------------------------------------------------------------------ the math
def score_parts(dots: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """``c_{i,T,ℓ} = ⟨g_ℓ(z_i), v_{T,ℓ}⟩ / ‖g(z_i)‖`` (``[N', L, K]``) of the examples with ``‖g(z_i)‖ > 0``, from
    ``dots[i, ℓ, T] = ⟨g_ℓ(z_i), v_{T,ℓ}⟩`` (``[N, L, K]``) and ``sq[i, ℓ] = ‖g_ℓ(z_i)‖²`` (``[N, L]``)."""
    dots, sq = np.asarray(dots, dtype=np.float64), np.asarray(sq, dtype=np.float64)
    norm = np.sqrt(sq.sum(axis=1))
    keep = norm > 0
    return dots[keep] / norm[keep, None, None]


def layer_shares(dots: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """``s[T, ℓ] = Var_i c_{i,T,ℓ} / Σ_ℓ' Var_i c_{i,T,ℓ'}`` (``[K, L]``, population variance; a task whose parts do
    not vary at all gets a row of zeros). Inputs as :func:`score_parts`; at least two examples with a gradient."""
    c = score_parts(dots, sq)
    if c.shape[0] < 2:
        raise ValueError(f"influence weights need at least 2 probe examples with a non-zero gradient (a response "
                         f"token), got {c.shape[0]}")
    var = c.var(axis=0).T  # [K, L]
    total = var.sum(axis=1, keepdims=True)
    return np.divide(var, total, out=np.zeros_like(var), where=total > 0)


def weights_from_shares(shares: np.ndarray, mix: float = 1.0) -> np.ndarray:
    """``w_ℓ = (1 − λ) + λ ŵ_ℓ`` with ``ŵ_ℓ = max_T s[T, ℓ]`` rescaled to mean 1 (``[L]``)."""
    shares = np.asarray(shares, dtype=np.float64)
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"rank_weight_mix must be in [0, 1], got {mix}")
    top = shares.max(axis=0)
    if not top.sum() > 0:
        raise ValueError("influence weights: no task's score varies over the probe examples (every validation or "
                         "probe gradient is zero?)")
    return (1.0 - mix) + mix * top / top.mean()


# ------------------------------------------------------------------------------------------------ the trackers
class _Pairs(PairTracker):
    """Base: the step's padding mask; ``δ`` zeroed on padding before use."""

    def __init__(self, modules: Mapping[str, nn.Module], dtype: torch.dtype) -> None:
        self.modules, self.dtype = dict(modules), dtype

    def start_step(self, batch: Mapping) -> None:
        self.mask = batch["attention_mask"].to(torch.bool).unsqueeze(-1)

    def _pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if h.dim() != 3:
            raise RuntimeError(f"tracked layer {name!r} received a {h.dim()}-D input; expected [B, T, in]")
        return h.to(self.dtype), (delta * self.mask.to(delta.device)).to(self.dtype)


class TaskGradientSums(_Pairs):
    """Per layer and task: ``Σ_z g_ℓ(z) = Σ_z Σ_t δ_t h_tᵀ`` over the examples of the task (``sums[name][task]``)."""

    def __init__(self, modules: Mapping[str, nn.Module], dtype: torch.dtype) -> None:
        super().__init__(modules, dtype)
        self.sums: dict[str, dict[str, torch.Tensor]] = {n: {} for n in self.modules}

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        rows: dict[str, list[int]] = {}
        for r, task in enumerate(_tasks(batch)):
            rows.setdefault(task, []).append(r)
        self.rows = {t: torch.tensor(r, device=batch["input_ids"].device) for t, r in rows.items()}

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        h, d = self._pair(name, h, delta)
        acc = self.sums[name]
        for task, rows in self.rows.items():
            G = d[rows].flatten(0, 1).t() @ h[rows].flatten(0, 1)
            acc[task] = G if task not in acc else acc[task] + G


class ProbeScoreParts(_Pairs):
    """Per example of the step and layer: ``sq[name] = ‖g_ℓ(z)‖²`` (``[B]``) and ``dots[name] = ⟨g_ℓ(z), V_k⟩``
    (``[B, K]``) for the fixed directions ``V[name]: [K, out, in]`` (float64 results)."""

    def __init__(self, modules: Mapping[str, nn.Module], V: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__(modules, dtype)
        self.V = V

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        self.sq: dict[str, torch.Tensor] = {}
        self.dots: dict[str, torch.Tensor] = {}

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        h, d = self._pair(name, h, delta)
        g = torch.bmm(d.transpose(1, 2), h)  # [B, out, in], one example's gradient per row
        self.sq[name] = torch.linalg.vector_norm(g, dim=2).double().pow(2).sum(dim=1)
        self.dots[name] = (g.flatten(1) @ self.V[name].flatten(1).t()).double()


def _check_reached(reached: Iterable[str], names: list[str], where: str) -> None:
    """Raise when a tracked layer got no pair in a step that ran."""
    got = set(reached)
    missing = [n for n in names if n not in got]
    if missing:
        raise RuntimeError(f"influence weights: no output-gradient reached layer(s) {missing[:5]} on the {where} "
                           "examples: are they modules of this model, used in its forward pass?")


def _tasks(batch: Mapping) -> list[str]:
    B = batch["input_ids"].shape[0]
    tasks = batch.get("task")
    return [ALL_TASKS] * B if tasks is None else [str(t) for t in tasks]


def _has_response(batch: Mapping) -> bool:
    return bool((batch["labels"][:, 1:] != IGNORE_INDEX).any())


# ------------------------------------------------------------------------------------------------ the weights
def influence_rank_weights(
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    validation_batches: Iterable[Mapping],
    probe_batches: Iterable[Mapping],
    *,
    mix: float = 1.0,
    progress: bool = True,
) -> RankWeights:
    """The influence weights of the layers ``modules`` of ``model`` (module docstring) from the validation batches
    (grouped by their ``task``) and the probe batches (project batch format). The model runs in eval mode (restored
    after); no ``.grad`` is touched."""
    t0 = time.perf_counter()
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"rank_weight_mix must be in [0, 1], got {mix}")
    modules = dict(modules)
    names = list(modules)
    p = next(model.parameters())
    device, dtype = p.device, (torch.float64 if p.dtype == torch.float64 else torch.float32)
    sums = TaskGradientSums(modules, dtype)
    counts: dict[str, int] = {}
    ran = False
    with eval_mode(model):
        for i, batch in enumerate(progress_of(validation_batches, desc="influence weights (validation)", unit="batch", enabled=progress, leave=True)):
            try:
                check_batch(batch)
            except ValueError as e:
                raise ValueError(f"validation batch {i}: {e}") from None
            for task in _tasks(batch):
                counts[task] = counts.get(task, 0) + 1
            if _has_response(batch):
                backward_pairs(model, to_device(batch, device), [sums])
                ran = True
        if not counts:
            raise ValueError("rank_weighting='influence' needs validation examples: the validation data is empty")
        tasks = sorted(counts)
        if ran:
            _check_reached([n for n, acc in sums.sums.items() if acc], names, "validation")
        V = {}  # name -> [K, out, in]: v_{T,ℓ}, the mean validation gradient of each task
        for n in names:
            acc, (out_f, in_f) = sums.sums.pop(n), linear_shape(modules[n])
            V[n] = torch.stack([acc[t] / counts[t] if t in acc else torch.zeros(out_f, in_f, dtype=dtype, device=device)
                                for t in tasks])
        parts = ProbeScoreParts(modules, V, dtype)
        dots, sq = [], []
        for i, batch in enumerate(progress_of(probe_batches, desc="influence weights (probes)", unit="batch", enabled=progress, leave=True)):
            try:
                check_batch(batch)
            except ValueError as e:
                raise ValueError(f"probe batch {i}: {e}") from None
            if not _has_response(batch):
                continue
            backward_pairs(model, to_device(batch, device), [parts])
            _check_reached(parts.sq, names, "probe")
            dots.append(torch.stack([parts.dots[n] for n in names], dim=1).cpu().numpy())  # [B, L, K]
            sq.append(torch.stack([parts.sq[n] for n in names], dim=1).cpu().numpy())  # [B, L]
    if not dots:
        raise ValueError("influence weights: no probe example has a response token")
    dots_all, sq_all = np.concatenate(dots), np.concatenate(sq)
    shares = layer_shares(dots_all, sq_all)
    for t, row in zip(tasks, shares):
        if not row.sum() > 0:
            log.warning("influence weights: task %r's score does not vary over the probe examples; it weighs nothing",
                        t)
    w = weights_from_shares(shares, mix)
    n_probe = int((sq_all.sum(axis=1) > 0).sum())
    rw = RankWeights(weights={n: float(x) for n, x in zip(names, w)},
                     shares={t: {n: float(x) for n, x in zip(names, row)} for t, row in zip(tasks, shares)},
                     tasks=tasks, mix=float(mix), validation_examples={t: counts[t] for t in tasks},
                     probe_examples=n_probe, time_s=time.perf_counter() - t0)
    top = sorted(rw.weights.items(), key=lambda kv: -kv[1])[:3]
    log.info("influence weights over %d tasks, %d probe examples (%.1fs): largest %s", len(tasks), n_probe, rw.time_s,
             ", ".join(f"{n} {x:.3g}" for n, x in top))
    return rw
