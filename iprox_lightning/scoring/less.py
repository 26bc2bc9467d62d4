"""LESS's training gradients (Xia et al. 2024): the Adam update direction of each scored example's gradient, from a
checkpoint's optimiser state, scored against plain (SGD) validation gradients: ``method: less``.

For a tracked weight with the checkpoint's Adam moments ``m``, ``v`` (after ``t`` steps, betas ``β1``, ``β2``, ``ε``;
:mod:`iprox_lightning.io.optimizer_state`) and an example's gradient ``g`` folded in as the next step would,

    m' = β1 m + (1 − β1) g,      v' = β2 v + (1 − β2) g²          (elementwise)

the example's training gradient is the update direction

* ``adam: "paper"`` (default; the paper's Eq. 2, Adam's bias correction at step ``t + 1``):
  ``Γ(g) = m̂ / (√v̂ + ε)``, ``m̂ = m' / (1 − β1^{t+1})``, ``v̂ = v' / (1 − β2^{t+1})``;
* ``adam: "less_repo"`` (princeton-nlp/LESS's ``obtain_gradients_with_adam``): ``Γ(g) = m' / √(v' + ε)``, no bias
  correction.

The validation gradients are not mapped (``matrix`` is the identity: LESS's SGD validation gradients), so a score is
``cos(Γ(g(z)), ḡ)`` per task (LESS then takes the max over subtasks: ``select --rule max``), and a gradient store's
rows are ``P Γ(g)`` while its query projects the plain validation gradients (``symmetric = False``). ``Γ`` is not
linear in ``g``: per-example gradients are materialised per tracked weight (``[B, out, in]``; LoRA adapters are
small). Summed over checkpoints weighted by their learning rates, this is LESS's score (``--checkpoints``).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import UserInputError
from ..io.optimizer_state import read_adam_state
from .features import materialize_grads
from .metrics import InfluenceMetric

ADAM_VARIANTS = ("paper", "less_repo")


def adam_direction(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, betas: tuple[float, float],
                   eps: float, variant: str = "paper") -> torch.Tensor:
    """``Γ(g)`` (the module docstring) of gradients ``g: [..., out, in]`` with the moments ``m``, ``v: [out, in]`` of
    a checkpoint after ``step`` steps; in ``g``'s dtype (the moments widened to it)."""
    b1, b2 = betas
    m, v = m.to(g), v.to(g)
    m1 = b1 * m + (1 - b1) * g
    v1 = b2 * v + (1 - b2) * g * g
    if variant == "less_repo":
        return m1 / (v1 + eps).sqrt()
    t = step + 1
    return (m1 / (1 - b1 ** t)) / ((v1 / (1 - b2 ** t)).sqrt() + eps)


class LESS(InfluenceMetric, name="less"):
    """LESS's Adam-preconditioned training gradients against SGD validation gradients (see the module docstring).
    The checkpoint's optimiser state is given by :meth:`use_optimizer_state` (the scoring commands read it from the
    scored adapter directory, :func:`attach_optimizer_state`) before :meth:`fit`."""

    token_factored = False  # Γ acts on the whole per-example gradient
    symmetric = False  # validation gradients unmapped (SGD)
    needs_optimizer_state: ClassVar[bool] = True
    options = {"adam": "paper"}
    memory_levers = {"adam_moments": "LoRA adapters (fewer tracked weights)"}

    @classmethod
    def memory_parts(cls, linears):
        """The checkpoint's two Adam moments of every tracked weight, float32, on the device (``train.py plan``)."""
        return {"adam_moments": sum(2 * 4.0 * i * o for i, o in linears)}

    def __init__(self, config) -> None:
        super().__init__(config)
        if self.own_options["adam"] not in ADAM_VARIANTS:
            raise UserInputError(f"options.adam of method less must be one of {ADAM_VARIANTS}, "
                                 f"got {self.own_options['adam']!r}")
        self.state = None
        self.moments: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def use_optimizer_state(self, state) -> "LESS":
        """The checkpoint's :class:`~iprox_lightning.io.optimizer_state.AdamState`."""
        self.state = state
        return self

    @property
    def fitted(self) -> bool:
        return bool(self.moments)

    def fit(self, model, modules, keys, batches, *, dtype, shard=(0, 1), reduce=None, progress=False):
        """The moments of each tracked weight ``<module>.weight`` (named as the model names its parameters, which
        are the names the optimiser state records), on the model's device in ``dtype``."""
        if self.state is None:
            raise UserInputError("method less needs the checkpoint's Adam optimizer state: score an adapter "
                                 "directory a LoRA warm-up saved (adapters/epoch_<n>, which holds "
                                 "optimizer_state.safetensors)")
        device = next(model.parameters()).device
        self.moments = {}
        for key in keys:
            m, v, step = self.state.moments(key)
            self.moments[key] = (m.to(device, dtype), v.to(device, dtype), step)
        steps = sorted({s for _, _, s in self.moments.values()})
        return {"adam_step": steps[-1], "adam_lr": self.state.lr}

    def matrix(self, key, G):
        return G

    def gradients(self, key, h, delta):
        m, v, step = self.moments[key]
        return adam_direction(materialize_grads(h, delta), m, v, step, self.state.betas, self.state.eps,
                              self.own_options["adam"])


def attach_optimizer_state(metric: InfluenceMetric, source: Any) -> InfluenceMetric:
    """Give a metric that needs a checkpoint's optimiser state (LESS) the one saved in ``source`` (an adapter directory
    holding ``optimizer_state.safetensors``); other metrics as they are."""
    if getattr(metric, "needs_optimizer_state", False) and getattr(metric, "state", None) is None:
        if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__"):
            raise UserInputError("method less needs the checkpoint's Adam optimizer state: score an adapter directory "
                                 "(from Python: metric.use_optimizer_state(read_adam_state(dir)))")

        metric.use_optimizer_state(read_adam_state(source))
    return metric
