"""Stage 2 terms that look at the target tasks (issue 22): per-task validation-gradient and score-space alignment.

The proxy is used to rank pool examples ``z`` per target task ``t`` by TracIn, ``s(z, t) = cos(g(z), ḡ_t)``
(:mod:`iprox_lightning.scoring.influence`: ``g(z)`` the gradient of ``z``'s per-example loss — the mean over its
response tokens — over the tracked weights, ``ḡ_t`` the mean of it over task ``t``'s validation examples). The
gradient-alignment loss ``L_GA`` of :mod:`iprox_lightning.alignment.losses` aligns the gradients of pool batches, layer by
layer; nothing in it looks at the tasks' validation directions ``ḡ_t``, and its value does not track the per-task
ranking. Two opt-in terms add them beside ``L_GA + λ_KL·L_KL`` (``ProxyAlignModule(val_grad_weight=...,
score_weight=...)``). Both train on validation examples set apart from those that monitor the alignment (the data
module's ``val_train`` split, ``SFTDataModule(val_train_fraction=...)``); a third lever, training ``L_GA`` itself on
those examples, is data only (``SFTDataModule(mix_val_train=...)``).

Notation: the aligned layers ``ℓ`` are the proxy's :class:`~iprox_lightning.engine.lowrank.LowRankLinear` layers
``y = A z + b``, ``z = B h`` (``A: [out, r]``, ``B: [r, in]``) and the target's dense ``W: [out, in]`` at the same
paths. The proxy's gradient of an example is its factor-space vector ``g^P = (∇_{A_ℓ}, ∇_{B_ℓ})_ℓ`` with
``∇_A = Σ_t δ_t z_tᵀ`` and ``∇_B = Σ_t (Aᵀδ_t) h_tᵀ``; the target's is ``g^T = (∇_{W_ℓ} = Σ_t δ_t h_tᵀ)_ℓ``; ``P`` is
the projection into factor space of :func:`~iprox_lightning.alignment.losses.factor_projections`,
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
    as** ``L_GA`` (:class:`FactorPairTracker` riding on :func:`~iprox_lightning.alignment.losses.alignment_losses`), so they
    carry the graph and ``L_score`` is differentiated through ``δ`` and ``h`` w.r.t. every factor — no extra pass;
    the target's per-example features ride on the teacher pass of ``L_GA`` (:class:`ExampleScoreTracker`). That
    backward is of the batch's token-mean loss, whose rows are each example's own gradient scaled by
    ``n_i / N > 0`` — a cosine does not see it.
  - Only the aligned layers count, on both sides (with every targeted layer compressed — the default — that is the
    set TracIn tracks).

Everything here is plain PyTorch; ``ProxyAlignModule`` is the thin Lightning layer (options, the data module's
``val_train`` batches, the refresh schedule, logging).
"""
from .common import (
    SCORE_LOSSES, TASK_REDUCTIONS, FactorPairTracker, TaskDirections, TaskGradientTracker, projected_directions,
    proxy_directions, reduce_tasks, task_directions, task_rows, task_gradient_sums,
)
from .gradient import TaskGradientOutput, task_gradient_alignment
from .losses import TaskAlignmentOutput, task_alignment_losses
from .score import (
    ExampleScoreTracker, ScoreOutput, cosines_from_dots, example_features, listwise_loss, pearson_loss,
    score_agreement_loss, score_alignment_loss,
)

__all__ = [
    "SCORE_LOSSES",
    "TASK_REDUCTIONS",
    "task_rows",
    "task_gradient_sums",
    "example_features",
    "cosines_from_dots",
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
