"""One hook layer for every per-layer statistic (the kronfluence pattern).

``LayerTracker`` registers, on each tracked linear-like module, a forward hook that keeps the
layer input ``h`` (``[..., in]``) and a tensor hook on the layer output that receives the
output-gradient ``δ`` (``[..., out]``) during backward. Each (h, δ) pair is handed to
``on_pair(name, module, h, delta)`` — probe collection (IPSVD), gradient features (scoring),
K-FAC factors and the teacher projections of the alignment stage are all such callbacks.

The forward must build a graph through the tracked outputs: either some parameter before them
requires grad, or the input embeddings do (``requires_grad_inputs(model)``). Gradients can then
be taken with ``torch.autograd.grad(loss, inputs)`` so nothing is accumulated in ``param.grad``
(FSDP-safe). A module called twice within one tracked step raises, because its per-example
statistics would mix both uses.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Mapping

import torch
from torch import nn

PairFn = Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]


class LayerTracker:
    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        on_pair: PairFn,
        *,
        on_forward: Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None] | None = None,
        allow_reuse: bool = False,
    ) -> None:
        self.modules = dict(modules)
        self.on_pair = on_pair
        self.on_forward = on_forward
        self.allow_reuse = allow_reuse
        self._handles: list = []
        self._uses: dict[str, int] = {}
        self.enabled = True

    # life cycle -----------------------------------------------------------------------------
    def register(self) -> "LayerTracker":
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._make_hook(name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

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
            if not self.enabled or not torch.is_grad_enabled():
                return None
            self._uses[name] = self._uses.get(name, 0) + 1
            if self._uses[name] > 1 and not self.allow_reuse:
                raise RuntimeError(
                    f"tracked layer {name!r} ran twice in one step (shared module or re-entrant "
                    "checkpointing); its per-example statistics would mix both uses"
                )
            h = args[0].detach()
            if self.on_forward is not None:
                self.on_forward(name, module, h, output)
            if not output.requires_grad:
                raise RuntimeError(
                    f"output of tracked layer {name!r} does not require grad: make a parameter before it "
                    "require grad or call requires_grad_inputs(model)"
                )

            def grad_hook(grad: torch.Tensor):
                self.on_pair(name, module, h, grad.detach())
                return None

            output.register_hook(grad_hook)
            return None

        return hook


@contextlib.contextmanager
def requires_grad_inputs(model: nn.Module):
    """Make the input-embedding output require grad, so a model whose parameters are all frozen
    still builds a graph through every layer (and tensor hooks on layer outputs fire)."""
    emb = model.get_input_embeddings()

    def hook(module, args, output):
        return output.detach().requires_grad_(True)

    handle = emb.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
