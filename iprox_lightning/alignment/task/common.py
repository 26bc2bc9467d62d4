"""The pieces both task terms share: per-task row masks and sums, the task reduction, the pair trackers, and the
validation directions ``ḡ_t`` (the target's, the proxy's, and the target's projected into factor space)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import nn

from ..losses import proxy_factor_layers
from ...engine.batch import check_batch, model_device, to_device
from ...engine.lowrank import LowRankLinear
from ...engine.norms import squared_norms
from ...engine.target_layers import is_linear_like
from ...engine.tracking import PairTracker, backward_pairs

SCORE_LOSSES = ("pearson", "listwise")
TASK_REDUCTIONS = ("mean", "max")
EPS = 1e-12


# ------------------------------------------------------------------------------------------------
# elementary functions
# ------------------------------------------------------------------------------------------------
def task_rows(tasks: Sequence[str], order: Optional[Sequence[str]] = None) -> dict[str, list[int]]:
    """``{task: [row, ...]}`` of a batch's ``task`` list, tasks in first-seen order (or restricted to and ordered
    as ``order``; a task of ``order`` absent from the batch gets no key)."""
    rows: dict[str, list[int]] = {}
    for r, t in enumerate(tasks):
        rows.setdefault(str(t), []).append(r)
    if order is None:
        return rows
    return {t: rows[t] for t in order if t in rows}


def _dtype(*xs: torch.Tensor) -> torch.dtype:
    dt = torch.float32
    for x in xs:
        dt = torch.promote_types(dt, x.dtype)
    return dt


def task_gradient_sums(h: torch.Tensor, delta: torch.Tensor, rows: Mapping[str, Sequence[int]]) -> torch.Tensor:
    """``[K, out, in]``: per task ``k`` (in ``rows`` order) ``Σ_{b ∈ rows_k} Σ_t δ_{b,t} h_{b,t}ᵀ`` — the sum of the
    per-example gradients of the task's rows. ``h: [B, T, in]``, ``delta: [B, T, out]``; differentiable."""
    dt = _dtype(h, delta)
    out = []
    for r in rows.values():
        idx = torch.as_tensor(list(r), device=h.device)
        out.append(delta[idx].flatten(0, 1).to(dt).t() @ h[idx].flatten(0, 1).to(dt))
    return torch.stack(out)


def reduce_tasks(per_task: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``mean`` or ``max`` (the worst task) of a ``[K]`` vector of per-task losses."""
    if reduction not in TASK_REDUCTIONS:
        raise ValueError(f"task_reduction must be one of {TASK_REDUCTIONS}, got {reduction!r}")
    return per_task.mean() if reduction == "mean" else per_task.max()


# ------------------------------------------------------------------------------------------------
# trackers (consumers of the backward-pairs engine's (h, δ))
# ------------------------------------------------------------------------------------------------
def _keep(batch: Mapping) -> torch.Tensor:
    return batch["attention_mask"].to(torch.bool).unsqueeze(-1)


class FactorPairTracker(PairTracker):
    """Per aligned :class:`LowRankLinear` ``y = A z + b``, ``z = B h``: the pairs of its two factors,
    ``pairs[name] = ((z, δ), (h, Aᵀδ))`` (``[B, T, ·]`` each, output-gradients zeroed on padding), from the layer's
    pair and the one of its ``bottleneck`` seam (matched by name, whatever the order they arrive in). With the
    engine's differentiable pairs they carry the graph."""

    def __init__(self, layers: Mapping[str, LowRankLinear]) -> None:
        self.layers = dict(layers)
        self.modules: dict[str, nn.Module] = {}
        for name, m in self.layers.items():
            self.modules[name] = m
            self.modules[f"{name}.bottleneck"] = m.bottleneck
        self.pairs: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}

    def start_step(self, batch: Mapping) -> None:
        self.keep = _keep(batch)
        self._seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pairs = {}

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        self._seen[name] = (h, delta * self.keep.to(device=delta.device, dtype=delta.dtype))

    def end_step(self) -> None:
        missing = [n for n in self.modules if n not in self._seen]
        if missing:
            raise RuntimeError(f"FactorPairTracker: no gradient reached {missing[:4]} (not used in the forward?)")
        for name in self.layers:
            h, d = self._seen[name]
            z, dz = self._seen[f"{name}.bottleneck"]
            self.pairs[name] = ((z, d), (h, dz))
        self._seen = {}


class TaskGradientTracker(PairTracker):
    """Per tracked dense layer, the per-task sums of per-example gradients over every step
    (``sums[name]: [K, out, in]``, tasks in ``tasks`` order; a task absent from a step adds nothing). Detached."""

    def __init__(self, modules: Mapping[str, nn.Module], tasks: Sequence[str]) -> None:
        self.modules = dict(modules)
        self.tasks = list(tasks)
        self.sums: dict[str, torch.Tensor] = {}

    def start_step(self, batch: Mapping) -> None:
        self.keep = _keep(batch)
        rows = task_rows(batch["task"])
        unknown = sorted(set(rows) - set(self.tasks))
        if unknown:
            raise ValueError(f"TaskGradientTracker: tasks {unknown} are not among {self.tasks}")
        self.index = [self.tasks.index(t) for t in rows]
        self.rows = rows

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        s = task_gradient_sums(h.detach(), (delta * self.keep.to(delta.device, delta.dtype)).detach(), self.rows)
        if name not in self.sums:
            self.sums[name] = torch.zeros(len(self.tasks), *s.shape[1:], dtype=s.dtype, device=s.device)
        self.sums[name][self.index] += s


# ------------------------------------------------------------------------------------------------
# validation directions
# ------------------------------------------------------------------------------------------------
def _dense_modules(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
    found = dict(model.named_modules())
    out = {}
    for n in names:
        m = found.get(n)
        if m is None or not is_linear_like(m):
            raise ValueError(f"aligned layer {n!r} is not a linear layer of the target {type(model).__name__}")
        out[n] = m
    return out


@dataclass
class TaskDirections:
    """The validation directions of the score-space term: ``tasks`` (order of every ``[K, ...]``), the target's
    ``target[name]: [K, out, in]`` (full weight space) with ``target_sq = ‖v^T_k‖² [K]``, and the proxy's
    ``proxy[name] = (V_A [K, out, r], V_B [K, r, in])`` with ``proxy_sq [K]`` — each ``Σ_{z ∈ task} g(z)`` over the
    validation examples, detached; ``proxy_step`` the training step of the proxy's (``None`` before any)."""

    tasks: list[str]
    target: dict[str, torch.Tensor]
    target_sq: torch.Tensor
    proxy: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    proxy_sq: Optional[torch.Tensor] = None
    proxy_step: Optional[int] = None
    examples: int = 0


def _batch_tasks(batches: Iterable[Mapping]) -> tuple[list[dict], list[str]]:
    batches = list(batches)
    tasks: list[str] = []
    for b in batches:
        if "task" not in b:
            raise ValueError("validation batches need a 'task' field (the task of each example)")
        for t in b["task"]:
            if str(t) not in tasks:
                tasks.append(str(t))
    if not tasks:
        raise ValueError("no validation example to take task directions from")
    return batches, tasks


def task_directions(teacher: nn.Module, batches: Iterable[Mapping], layers: Iterable[str]) -> TaskDirections:
    """The target's per-task validation directions over ``batches`` (each row's gradient of its per-example loss,
    summed per task): one forward+backward of the frozen target per batch, :class:`TaskGradientTracker`."""
    batches, tasks = _batch_tasks(batches)
    tracker = TaskGradientTracker(_dense_modules(teacher, layers), tasks)
    device = model_device(teacher)
    for b in batches:
        check_batch(b)
        backward_pairs(teacher, to_device(b, device), [tracker])
    sq = sum(squared_norms(v, column_sum=False)[0] for v in tracker.sums.values())
    return TaskDirections(tasks=tasks, target=tracker.sums, target_sq=sq.to(next(iter(tracker.sums.values())).dtype),
                          examples=sum(len(b["id"]) for b in batches))


def proxy_directions(proxy: nn.Module, batches: Iterable[Mapping], tasks: Sequence[str],
                     layers: Optional[Iterable[str]] = None) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The proxy's per-task validation directions in factor space, ``({name: (V_A, V_B)}, ‖v_k‖² [K])``, over
    ``batches`` (tasks in ``tasks`` order; every task must occur): one forward+backward of the proxy per batch,
    detached."""
    batches = list(batches)
    lowrank = proxy_factor_layers(proxy, layers)
    tracker = FactorPairTracker(lowrank)
    device = model_device(proxy)
    sums: dict[str, list[Optional[torch.Tensor]]] = {n: [None, None] for n in lowrank}
    tasks = list(tasks)
    seen: set[str] = set()
    for b in batches:
        check_batch(b)
        rows = task_rows(b["task"])
        unknown = sorted(set(rows) - set(tasks))
        if unknown:
            raise ValueError(f"proxy_directions: tasks {unknown} are not among {tasks}")
        seen.update(rows)
        index = [tasks.index(t) for t in rows]
        backward_pairs(proxy, to_device(b, device), [tracker])
        with torch.no_grad():
            for n, ((z, d), (h, dz)) in tracker.pairs.items():
                for j, (x, g) in enumerate(((z, d), (h, dz))):
                    s = task_gradient_sums(x, g, rows)
                    if sums[n][j] is None:
                        sums[n][j] = torch.zeros(len(tasks), *s.shape[1:], dtype=s.dtype, device=s.device)
                    sums[n][j][index] += s
    if set(tasks) - seen:
        raise ValueError(f"proxy_directions: no validation example of tasks {sorted(set(tasks) - seen)}")
    V = {n: (a, b) for n, (a, b) in sums.items()}
    return V, _squared_norms(V)


def _squared_norms(V: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``‖v_k‖² [K]`` of per-task factor-space directions ``{name: (V_A [K, ...], V_B [K, ...])}`` (summed in float64,
    returned in their dtype)."""
    sq = sum(squared_norms(a, column_sum=False)[0] + squared_norms(b, column_sum=False)[0] for a, b in V.values())
    return sq.to(next(iter(V.values()))[0].dtype)


def projected_directions(proxy: nn.Module, directions: TaskDirections, layers: Optional[Iterable[str]] = None
                         ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The target's per-task validation directions in the proxy's factor space, ``P(v^T_t) = (v^T_t Bᵀ, Aᵀ v^T_t)``
    per aligned layer, as ``({name: (V_A [K, out, r], V_B [K, r, in])}, ‖v_k‖² [K])``, detached: what a proxy scored
    against its target's validation gradients (``validation_model``, :class:`~iprox_lightning.scoring.features.
    FactorSpaceView`) ranks the pool by. The score term's proxy directions under ``proxy_validation="target"``; no
    pass of either model (``directions.target`` holds ``Σ_z ∇_W`` per task)."""
    lowrank = proxy_factor_layers(proxy, layers)
    missing = [n for n in lowrank if n not in directions.target]
    if missing:
        raise ValueError(f"projected_directions: no target direction for the aligned layer {missing[0]!r}")
    V: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():
        for n, m in lowrank.items():
            vt = directions.target[n]
            A, B = (w.full_tensor() if hasattr(w, "full_tensor") else w for w in (m.A, m.B))  # FSDP2: whole factors
            A, B = A.detach().to(vt), B.detach().to(vt)
            V[n] = (vt @ B.t(), A.t() @ vt)
    return V, _squared_norms(V)
