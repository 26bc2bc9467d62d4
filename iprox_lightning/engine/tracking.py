"""The backward-pairs engine: one forward, ONE backward, each tracked layer's ``(h, δ)`` to its consumers.

Every per-layer statistic of the project is computed from the same pairs: the layer input ``h``
(``[..., in]``) and the output-gradient ``δ = ∂loss/∂y`` (``[..., out]``) of each tracked layer. IPSVD
probes (:mod:`iprox_lightning.compression.probes`), per-example gradient features, validation gradients and K-FAC
factors (:mod:`iprox_lightning.scoring`) and the teacher projections of the alignment stage
(:mod:`iprox_lightning.alignment.losses`) are each a small :class:`PairTracker` over one hook layer
(:class:`LayerTracker`) — the kronfluence pattern.

:func:`backward_pairs` runs one step for a list of trackers:

1. ``tracker.start_step(batch)`` for every tracker;
2. the forward ``model(input_ids, attention_mask, use_cache=False)`` with the input-embedding output made a
   grad-requiring leaf (:func:`requires_grad_inputs`), so a frozen model builds a graph through every layer;
3. ``loss_fn(ce_sum, n)`` from the response tokens' cross-entropy (the LM head runs on the scored positions only,
   fused with the cross-entropy: :func:`~iprox_lightning.engine.batch.scored_ce_sums`) and ``torch.autograd.grad`` of it
   w.r.t. the embedding output only: nothing is accumulated in ``param.grad`` (frozen, trainable and sharded
   parameters alike);
4. during that backward, ``tracker.on_pair(name, h, δ)`` for every tracked layer of the tracker (in
   backward order: last layer first);
5. ``tracker.end_step()`` for every tracker.

A :class:`~iprox_lightning.engine.lowrank.LowRankLinear` ``y = A (B h)`` exposes its rank-``r`` activation
``z = B h`` as the submodule ``bottleneck`` (an identity): tracked like any other layer it gives
``(z, ∂loss/∂z)``, from which the factor gradients follow (:mod:`iprox_lightning.scoring.features`).

A tracked module that runs twice in one step raises, because its per-step statistics would mix both uses.

**Differentiable pairs** (``backward_pairs(..., create_graph=True)``, ``LayerTracker(differentiable=True)``): ``h`` is
handed over as the forward computed it (not detached) and the backward runs with ``create_graph=True``, so ``δ`` is a
node of the graph too: any statistic of the pairs (e.g. a per-example gradient inner product ``Σ_t δ_tᵀ V h_t``) can be
differentiated again w.r.t. the model's trainable parameters (Stage 2's score-space terms,
:mod:`iprox_lightning.alignment.task`). The tensor hooks are removed with the tracker, so a later backward through
the same graph (the one of the loss built from the pairs) does not hand the pairs over a second time.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from .checkpointing import recomputing
from .batch import example_mean_sum, fusable_head, lm_head, sample_targets, scored_ce_sums, scored_logits

PairFn = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]


class LayerTracker:
    """The hook layer: on each module of ``modules``, a forward hook keeps the input ``h`` and registers a
    tensor hook on the output that hands ``on_pair(name, module, h, δ)`` the output-gradient during backward.

    ``differentiable=True``: ``h`` and ``δ`` are handed over undetached (``δ`` carries a graph when the backward runs
    with ``create_graph=True``), and :meth:`remove` also removes the tensor hooks of the outputs seen so far."""

    def __init__(self, modules: Mapping[str, nn.Module], on_pair: PairFn, differentiable: bool = False) -> None:
        self.modules = dict(modules)
        self.on_pair = on_pair
        self.differentiable = differentiable
        self._handles: list = []
        self._tensor_handles: list = []
        self._uses: dict[str, int] = {}

    # life cycle -----------------------------------------------------------------------------
    def register(self) -> "LayerTracker":
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._make_hook(name)))
        return self

    def remove(self) -> None:
        for h in self._handles + self._tensor_handles:
            h.remove()
        self._handles.clear()
        self._tensor_handles.clear()

    def reset_step(self) -> None:
        """Call between steps (batches): resets the reuse check."""
        self._uses.clear()

    def __enter__(self) -> "LayerTracker":
        return self.register()

    def __exit__(self, *exc) -> None:
        self.remove()

    # hooks ----------------------------------------------------------------------------------
    def _make_hook(self, name: str):
        def hook(module: nn.Module, args, output):
            if not torch.is_grad_enabled() or recomputing():  # (a checkpointed block's recomputation: no new pair)
                return None
            self._uses[name] = self._uses.get(name, 0) + 1
            if self._uses[name] > 1:
                raise RuntimeError(
                    f"tracked layer {name!r} ran twice in one step (shared module or re-entrant "
                    "checkpointing); its per-example statistics would mix both uses"
                )
            h = args[0] if self.differentiable else args[0].detach()
            if not output.requires_grad:
                raise RuntimeError(
                    f"output of tracked layer {name!r} does not require grad: make a parameter before it "
                    "require grad or call requires_grad_inputs(model)"
                )

            def grad_hook(grad: torch.Tensor):
                self.on_pair(name, module, h, grad if self.differentiable else grad.detach())
                return None

            handle = output.register_hook(grad_hook)
            if self.differentiable:
                self._tensor_handles.append(handle)
            return None

        return hook


@contextlib.contextmanager
def requires_grad_inputs(model: nn.Module, outputs: list | None = None):
    """Make the input-embedding output a grad-requiring leaf, so a model whose parameters are all frozen
    still builds a graph through every layer (and tensor hooks on layer outputs fire). Each such leaf is
    appended to ``outputs`` when given (the tensors to take gradients against)."""
    emb = model.get_input_embeddings()

    def hook(module, args, output):
        leaf = output.detach().requires_grad_(True)
        if outputs is not None:
            outputs.append(leaf)
        return leaf

    handle = emb.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class PairTracker:
    """A consumer of the engine's pairs: one statistic over the layers of ``self.modules``
    (``{module path: module}``). Life cycle per step, driven by :func:`backward_pairs`:
    ``start_step(batch)``, ``on_pair(name, h, δ)`` once per tracked layer during the backward, ``end_step()``.
    Results are read from the tracker once its steps are done."""

    modules: dict[str, nn.Module]

    def start_step(self, batch: Mapping) -> None:
        pass

    def on_pair(self, name: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        raise NotImplementedError

    def end_step(self) -> None:
        pass


def pair_dispatch(trackers: Sequence[PairTracker]) -> tuple[dict[str, nn.Module], PairFn]:
    """``(modules, dispatch)`` for a :class:`LayerTracker` serving ``trackers``: every tracked module once (trackers
    naming one path must name the same module) and the function handing each pair to the trackers of its path."""
    modules: dict[str, nn.Module] = {}
    by_name: dict[str, list[PairTracker]] = {}
    for tracker in trackers:
        for name, module in tracker.modules.items():
            if modules.setdefault(name, module) is not module:
                raise ValueError(f"trackers disagree on the module at {name!r}")
            by_name.setdefault(name, []).append(tracker)

    def dispatch(name: str, module: nn.Module, h: torch.Tensor, delta: torch.Tensor) -> None:
        with autocast_off(h.device.type):
            for tracker in by_name[name]:
                tracker.on_pair(name, h, delta)

    return modules, dispatch


def autocast_off(device_type: str):
    """A context with autocast off: the trackers' own arithmetic runs in the dtypes they choose.

    Precision rule (``docs/GUIDE.md``, Precision): under ``bf16-mixed`` the model's forward runs under
    ``torch.autocast``, and so do the tensor hooks of its backward (autocast is thread-local state, still on while
    ``torch.autograd.grad`` runs inside the step) — there every float32 matmul a tracker does (K-FAC covariances
    ``hᵀh``, ghost dots, projections, IPSVD probe statistics, alignment losses) would silently run in bfloat16. The
    pairs ``(h, δ)`` arrive in the model's compute dtype (bfloat16 under autocast); each tracker upcasts them to its
    working dtype (float32 at least; float64 sums where a tracker keeps them) and computes with autocast off."""
    return torch.autocast(device_type=device_type, enabled=False)


def head_is_tracked(model: nn.Module, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``model``'s LM head (``get_output_embeddings()``) is among the tracked ``modules``."""
    head = lm_head(model)
    return head is not None and any(m is head for m in modules.values())


@dataclass
class BackwardStep:
    """What :func:`backward_pairs` returns: the detached logits of the scored positions (``[N, V]``, in the order of
    :class:`~iprox_lightning.engine.batch.ScoredTokens`; ``None`` unless asked for with ``keep_logits=True``) and the
    detached loss it differentiated."""

    logits: torch.Tensor | None
    loss: torch.Tensor


def backward_pairs(
    model: nn.Module,
    batch: Mapping,
    trackers: Sequence[PairTracker],
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = example_mean_sum,
    create_graph: bool = False,
    keep_logits: bool = False,
    sample_seed: int | None = None,
) -> BackwardStep:
    """One step of the engine over ``batch`` (``input_ids``, ``attention_mask``, ``labels``) for ``trackers``
    (see the module docstring). ``loss_fn(ce_sum, n)`` (per example: summed response-token cross-entropy, response
    tokens) gives the scalar whose gradient ``δ`` is (default :func:`~iprox_lightning.engine.batch.example_mean_sum`;
    :func:`~iprox_lightning.engine.batch.token_mean` is the batch's SFT loss). Works inside ``torch.inference_mode()`` (Lightning's predict loop):
    the step runs with inference mode off, on copies of the input tensors. ``create_graph=True``: differentiable
    pairs (module docstring; the returned logits and loss stay detached). The LM head runs fused with the
    cross-entropy (:func:`~iprox_lightning.engine.batch.scored_ce_sums`: no ``[N, V]`` logits) unless ``keep_logits=True``
    (the step's logits are returned), ``create_graph=True`` (a second derivative through the softmax) or a tracker
    tracks the head itself. ``sample_seed``: the cross-entropy is taken against next tokens sampled from the model's
    own predictive distribution (:func:`~iprox_lightning.engine.batch.sample_targets`, seeded), not the labels — a
    sampled Fisher's pass (the head then runs unfused)."""
    modules, dispatch = pair_dispatch(trackers)

    with torch.inference_mode(False), torch.enable_grad():
        # copies: tensors made under inference mode cannot enter autograd
        ids, mask, labels = (batch[k].clone() for k in ("input_ids", "attention_mask", "labels"))
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        fused = not (keep_logits or create_graph or sample_seed is not None or head_is_tracked(model, modules)) and (
            fusable_head(model, inputs, use_cache=False) is not None)  # (checked before any hook is in place)
        device_type = ids.device.type
        with autocast_off(device_type):
            for tracker in trackers:
                tracker.start_step({**batch, **inputs})
        leaves: list[torch.Tensor] = []
        with requires_grad_inputs(model, leaves), LayerTracker(modules, dispatch, differentiable=create_graph):
            if fused:  # the LM head fused with the cross-entropy: no [N, V] logits
                logits = None
                loss = loss_fn(*scored_ce_sums(model, inputs, use_cache=False)[:2])
            else:
                logits, scored = scored_logits(model, inputs, use_cache=False)
                if sample_seed is not None:
                    scored = dataclasses.replace(scored, targets=sample_targets(logits, sample_seed))
                loss = loss_fn(*scored.ce_sums(logits))
            if not leaves:
                raise RuntimeError("the input-embedding module did not run; cannot take gradients")
            if create_graph:
                torch.autograd.grad(loss, leaves, allow_unused=True, create_graph=True)
            else:
                torch.autograd.grad(loss, leaves, allow_unused=True)
        with autocast_off(device_type):
            for tracker in trackers:
                tracker.end_step()
    return BackwardStep(logits=None if logits is None else logits.detach(), loss=loss.detach())
