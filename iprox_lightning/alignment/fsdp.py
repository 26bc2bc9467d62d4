"""FSDP2 handling of Stage 2's proxy: shard it, gather / free its factors around a step, rebuild it unsharded.

The alignment step differentiates the proxy's gradients (double backward), so under ``ModelParallelStrategy`` the
proxy is sharded per decoder block with its unsharded parameters kept alive through both backward passes
(``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``); :func:`unshard_proxy` gathers the factors
before a step (the teacher pass projects its gradients with the very ``A``/``B`` the proxy forward then uses) and
:func:`reshard_proxy` frees them after it (after each optimiser step, so the next forward all-gathers the updated
shards). The teacher stays replicated. Every function is a no-op on an unsharded proxy.
"""
from __future__ import annotations

import copy

from torch import nn

from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import set_submodule
from ..training.causal_lm import apply_fully_shard, is_sharded


def shard_proxy(proxy: nn.Module, mesh) -> None:
    """Shard ``proxy`` over the data-parallel dimension of ``mesh`` (tensor parallelism is refused)."""
    dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                         "tensor_parallel_size=1) for FSDP2")
    apply_fully_shard(proxy, dp, reshard_after_forward=False)
    for m in sharded_modules(proxy):
        m.set_reshard_after_backward(False)


def sharded_modules(proxy: nn.Module | None) -> list:
    """The proxy's FSDP2-sharded modules (none when it is not sharded)."""
    if proxy is None or not is_sharded(proxy):
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in proxy.modules() if isinstance(m, FSDPModule)]


def unshard_proxy(proxy: nn.Module | None) -> None:
    """Gather the full parameters (before a step)."""
    for m in sharded_modules(proxy):
        m.unshard()


def reshard_proxy(proxy: nn.Module | None) -> None:
    """Free the gathered parameters (after a step, a validation batch, a scoring pass)."""
    for m in sharded_modules(proxy):
        m.reshard()


def unsharded_copy(teacher: nn.Module, proxy: nn.Module, state_dict: dict) -> nn.Module:
    """A plain (unsharded, CPU) proxy holding ``state_dict``: the teacher's architecture with ``proxy``'s
    ``LowRankLinear`` layers (ranks read from the factor shapes)."""
    model = copy.deepcopy(teacher).to("cpu")
    for name, m in proxy.named_modules():
        if isinstance(m, LowRankLinear):
            A = state_dict[f"{name}.A"]
            set_submodule(model, name, LowRankLinear(m.in_features, m.out_features, A.shape[1],
                                                      bias=m.bias is not None, dtype=A.dtype))
    model.load_state_dict(state_dict, strict=True)
    return model
