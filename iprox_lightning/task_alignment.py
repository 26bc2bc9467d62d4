"""Stage 2 terms that look at the target tasks (issue 22): per-task validation-gradient and score-space alignment.

The proxy is used to rank pool examples ``z`` per target task ``t`` by TracIn, ``s(z, t) = cos(g(z), ḡ_t)``
(:mod:`iprox_lightning.scoring.influence`: ``g(z)`` the gradient of ``z``'s per-example loss — the mean over its
response tokens — over the tracked weights, ``ḡ_t`` the mean of it over task ``t``'s validation examples). The
gradient-alignment loss ``L_GA`` of :mod:`iprox_lightning.alignment` aligns the gradients of pool batches, layer by
layer; nothing in it looks at the tasks' validation directions ``ḡ_t``, and its value does not track the per-task
ranking. Two opt-in terms add them beside ``L_GA + λ_KL·L_KL`` (``ProxyAlignModule(val_grad_weight=...,
score_weight=...)``). Both train on validation examples set apart from those that monitor the alignment (the data
module's ``val_train`` split, ``SFTDataModule(val_train_fraction=...)``); a third lever, training ``L_GA`` itself on
those examples, is data only (``SFTDataModule(mix_val_train=...)``).

Notation: the aligned layers ``ℓ`` are the proxy's :class:`~iprox_lightning.lowrank.LowRankLinear` layers
``y = A z + b``, ``z = B h`` (``A: [out, r]``, ``B: [r, in]``) and the target's dense ``W: [out, in]`` at the same
paths. The proxy's gradient of an example is its factor-space vector ``g^P = (∇_{A_ℓ}, ∇_{B_ℓ})_ℓ`` with
``∇_A = Σ_t δ_t z_tᵀ`` and ``∇_B = Σ_t (Aᵀδ_t) h_tᵀ``; the target's is ``g^T = (∇_{W_ℓ} = Σ_t δ_t h_tᵀ)_ℓ``; ``P`` is
the projection into factor space of :func:`~iprox_lightning.alignment.factor_projections`,
``P(∇_W) = (∇_W Bᵀ, Aᵀ ∇_W)``. ``reduce_t`` is the mean over tasks (``task_reduction="mean"``) or the worst task
(``"max"``). Tasks are the batch's ``task`` field (the validation record's ``category``).

* **Per-task validation-gradient alignment** (``val_grad_weight``): on one batch of validation examples holding a few
  of every task (:meth:`~iprox_lightning.data.SFTDataModule.task_batches`),

  ``L_val = reduce_t [1 − cos(ḡ^P_t, P(sg ḡ^T_t))]``, ``ḡ_t = Σ_{z ∈ t} g(z)`` (∝ the task's mean),

  the cosine over the whole concatenated factor-space vector (all aligned layers at once), which is what TracIn's
  cosine sees — not a mean of per-layer cosines as in ``L_GA``, which would ignore how the layers weigh against each
  other. ``sg`` covers the target's gradient only: with ``grad_through_projection`` the projection stays
  differentiable in ``A``/``B`` as in ``L_GA``. Cost: one target forward+backward and one proxy forward + double
  backward on the validation batch, all tasks in one pass (each example's pairs are summed into its task).

* **Score-space alignment** (``score_weight``): on the alignment batch ``B`` itself, per task ``t`` the proxy's and
  the target's TracIn scores ``s^P_{i,t} = cos(g^P_i, v^P_t)`` and ``s^T_{i,t} = cos(g^T_i, v^T_t)`` of the examples
  ``i`` with a response token, and

  ``L_score = reduce_t ℓ(s^P_{·,t}, s^T_{·,t})``, ``ℓ`` = ``1 − Pearson`` over the batch (``score_loss="pearson"``) or
  the listwise ``KL(softmax(ẑ(s^T)) ‖ softmax(ẑ(s^P)))`` of the standardised scores (``"listwise"``, ListNet: the
  top of the batch weighs most, where selection happens). Both are invariant to each task's scale and offset.

  - ``v^T_t`` is the target's own full-weight-space ``ḡ^T_t`` (not its projection): the ranking to reproduce is the
    target's TracIn ranking, and a projected reference would move with the proxy's factors. The target is frozen,
    so ``v^T`` is computed once per fit over every ``val_train`` example (memory: one ``[out, in]`` per task and
    aligned layer).
  - ``v^P_t = ḡ^P_t`` over the same examples, a constant between refreshes (every ``score_refresh_every`` steps): the
    loss moves the per-example proxy gradients, not the reference directions (``L_val`` moves those). With
    ``proxy_validation="target"`` instead ``v^P_t = P(v^T_t)`` (:func:`projected_directions`, detached, re-made every
    step at no pass): the direction a proxy scored against its target's validation gradients ranks the pool by.
  - Per-example gradients come from the backward-pairs engine's token-level ``(h, δ)``, never from ``param.grad``:
    ``⟨g_i, V⟩ = Σ_t δ_tᵀ V h_t`` and ``‖g_i‖²`` (:func:`example_features`; ghost or materialised, whichever costs
    less, identical numbers). On the proxy the pairs are captured **in the same forward and create-graph backward
    as** ``L_GA`` (:class:`FactorPairTracker` riding on :func:`~iprox_lightning.alignment.alignment_losses`), so they
    carry the graph and ``L_score`` is differentiated through ``δ`` and ``h`` w.r.t. every factor — no extra pass;
    the target's per-example features ride on the teacher pass of ``L_GA`` (:class:`ExampleScoreTracker`). That
    backward is of the batch's token-mean loss, whose rows are each example's own gradient scaled by
    ``n_i / N > 0`` — a cosine does not see it.
  - Only the aligned layers count, on both sides (with every targeted layer compressed — the default — that is the
    set TracIn tracks).

Everything here is plain PyTorch; ``ProxyAlignModule`` is the thin Lightning layer (options, the data module's
``val_train`` batches, the refresh schedule, logging).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .alignment import AlignmentOutput, alignment_losses, factor_projections, proxy_factor_layers
from .batch import IGNORE_INDEX, batch_rows, check_batch, model_device, to_device
from .lowrank import LowRankLinear
from .target_layers import is_linear_like
from .tracking import PairTracker, backward_pairs

__all__ = [
    "SCORE_LOSSES",
    "TASK_REDUCTIONS",
    "task_rows",
    "task_sums",
    "example_features",
    "cosine_scores",
    "pearson_loss",
    "listwise_loss",
    "reduce_tasks",
    "score_agreement_loss",
    "FactorPairTracker",
    "TaskGradientTracker",
    "ExampleScoreTracker",
    "TaskDirections",
    "task_directions",
    "proxy_directions",
    "projected_directions",
    "task_gradient_alignment",
    "score_alignment_loss",
    "ScoreOutput",
    "TaskGradientOutput",
    "TaskAlignmentOutput",
    "task_alignment_losses",
]

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


def task_sums(h: torch.Tensor, delta: torch.Tensor, rows: Mapping[str, Sequence[int]]) -> torch.Tensor:
    """``[K, out, in]``: per task ``k`` (in ``rows`` order) ``Σ_{b ∈ rows_k} Σ_t δ_{b,t} h_{b,t}ᵀ`` — the sum of the
    per-example gradients of the task's rows. ``h: [B, T, in]``, ``delta: [B, T, out]``; differentiable."""
    dt = _dtype(h, delta)
    out = []
    for r in rows.values():
        idx = torch.as_tensor(list(r), device=h.device)
        out.append(delta[idx].flatten(0, 1).to(dt).t() @ h[idx].flatten(0, 1).to(dt))
    return torch.stack(out)


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


def cosine_scores(dots: torch.Tensor, sq: torch.Tensor, v_sq: torch.Tensor) -> torch.Tensor:
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


def reduce_tasks(per_task: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``mean`` or ``max`` (the worst task) of a ``[K]`` vector of per-task losses."""
    if reduction not in TASK_REDUCTIONS:
        raise ValueError(f"task_reduction must be one of {TASK_REDUCTIONS}, got {reduction!r}")
    return per_task.mean() if reduction == "mean" else per_task.max()


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
        s = task_sums(h.detach(), (delta * self.keep.to(delta.device, delta.dtype)).detach(), self.rows)
        if name not in self.sums:
            self.sums[name] = torch.zeros(len(self.tasks), *s.shape[1:], dtype=s.dtype, device=s.device)
        self.sums[name][self.index] += s


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
    sq = sum(v.double().pow(2).sum(dim=(1, 2)) for v in tracker.sums.values())
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
                    s = task_sums(x, g, rows)
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
    sq = sum(a.double().pow(2).sum(dim=(1, 2)) + b.double().pow(2).sum(dim=(1, 2)) for a, b in V.values())
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


# ------------------------------------------------------------------------------------------------
# the two terms
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
        out[name] = (_in_order(task_sums(z, d, present), present, order),
                     _in_order(task_sums(h, dz, present), present, order))
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
    sp = cosine_scores(dots, sq, directions.proxy_sq.to(dots.dtype))
    st = cosine_scores(target_features.dots, target_features.sq, directions.target_sq.to(target_features.dots.dtype))
    valid = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1).to(sp.device)
    loss, per_task = score_agreement_loss(sp, st.to(sp.dtype), valid, kind, reduction)
    return ScoreOutput(loss=loss, per_task=dict(zip(directions.tasks, per_task)),
                       proxy_scores=sp.detach(), target_scores=st.detach())


@dataclass
class TaskAlignmentOutput(AlignmentOutput):
    """:func:`task_alignment_losses`: :class:`~iprox_lightning.alignment.AlignmentOutput` with ``loss`` the total
    ``L_GA + λ_KL·L_KL + w_val·L_val + w_score·L_score`` and the terms that were on (``None`` otherwise)."""

    l_val_grad: Optional[torch.Tensor] = None
    l_score: Optional[torch.Tensor] = None
    val_grad_cos: dict[str, torch.Tensor] = field(default_factory=dict)
    score_per_task: dict[str, torch.Tensor] = field(default_factory=dict)


def task_alignment_losses(
    teacher: nn.Module,
    proxy: nn.Module,
    batch: Mapping,
    *,
    val_batch: Optional[Mapping] = None,
    val_grad_weight: float = 0.0,
    val_grad_chunk: Optional[int] = None,
    directions: Optional[TaskDirections] = None,
    score_weight: float = 0.0,
    score_loss: str = "pearson",
    task_reduction: str = "mean",
    kl_weight: float = 0.1,
    temperature: float = 2.0,
    grad_through_projection: bool = True,
    create_graph: bool = True,
    layers: Optional[Iterable[str]] = None,
) -> TaskAlignmentOutput:
    """``L_GA + λ_KL·L_KL`` on ``batch`` (:func:`~iprox_lightning.alignment.alignment_losses`) plus
    ``val_grad_weight · L_val`` on ``val_batch`` (:func:`task_gradient_alignment`, ``val_grad_chunk`` rows per
    create-graph backward) and ``score_weight · L_score`` on
    ``batch`` against ``directions`` (:func:`score_alignment_loss`; its features ride on the passes of ``L_GA``).
    A term whose weight is 0 is not computed. The caller runs one backward of ``loss``."""
    proxy_tr: list[PairTracker] = []
    teacher_tr: list[PairTracker] = []
    if score_weight:
        if directions is None or directions.proxy_sq is None:
            raise ValueError("task_alignment_losses: score_weight > 0 needs the task directions (target and proxy)")
        if not create_graph:
            raise ValueError("task_alignment_losses: the score term is a training loss (create_graph=True)")
        lowrank = proxy_factor_layers(proxy, layers)
        pairs = FactorPairTracker(lowrank)
        features = ExampleScoreTracker(_dense_modules(teacher, lowrank), directions.target)
        proxy_tr, teacher_tr = [pairs], [features]
    base = alignment_losses(teacher, proxy, batch, kl_weight=kl_weight, temperature=temperature,
                            grad_through_projection=grad_through_projection, create_graph=create_graph,
                            layers=layers, teacher_trackers=teacher_tr, proxy_trackers=proxy_tr)
    loss = base.loss
    out = TaskAlignmentOutput(**{f: getattr(base, f) for f in AlignmentOutput.__dataclass_fields__})
    if score_weight:
        s = score_alignment_loss(pairs, features, directions, batch, kind=score_loss, reduction=task_reduction)
        loss = loss + score_weight * s.loss
        out.l_score, out.score_per_task = s.loss.detach(), s.per_task
    if val_grad_weight:
        if val_batch is None:
            raise ValueError("task_alignment_losses: val_grad_weight > 0 needs a batch of validation examples")
        v = task_gradient_alignment(teacher, proxy, val_batch, layers=layers, reduction=task_reduction,
                                    grad_through_projection=grad_through_projection, create_graph=create_graph,
                                    chunk_size=val_grad_chunk)
        loss = loss + val_grad_weight * v.loss
        out.l_val_grad, out.val_grad_cos = v.loss.detach(), v.cos
    out.loss = loss
    return out
