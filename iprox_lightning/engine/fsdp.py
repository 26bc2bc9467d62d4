"""FSDP2 (``fully_shard``) per decoder block: the one sharding rule of every stage that shards a model (warm-up /
fine-tune, Stage 2's teacher and proxy, scoring), and the test whether a model is sharded."""
from __future__ import annotations

from torch import nn

try:
    from torch.distributed.fsdp import FSDPModule, fully_shard
except ImportError:  # pragma: no cover - torch without FSDP2 (before 2.6): no model is sharded
    FSDPModule = fully_shard = None


def apply_fully_shard(model: nn.Module, mesh, *, reshard_after_forward: bool = True, offload_policy=None) -> int:
    """FSDP2: ``fully_shard`` each decoder block (classes in ``model._no_split_modules``), then the root.
    ``offload_policy``: FSDP2's (e.g. :func:`~iprox_lightning.training.memory_levers.cpu_offload_policy`). Returns the
    number of blocks sharded."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    extra = {} if offload_policy is None else {"offload_policy": offload_policy}
    for m in blocks:
        fully_shard(m, mesh=mesh, reshard_after_forward=reshard_after_forward, **extra)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, **extra)
    return len(blocks)


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) manages ``model`` or one of its submodules."""
    if FSDPModule is None:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_frozen_per_block(model: nn.Module, mesh) -> None:
    """Shard ``model`` per decoder block over a ``ModelParallelStrategy`` mesh's data-parallel dimension for a pass
    that takes no parameter gradient (scoring, the store build): frozen first, so nothing is reduce-scattered; each
    block regathered for its backward."""
    model.requires_grad_(False)
    apply_fully_shard(model, data_parallel_mesh(mesh), reshard_after_forward=True)


def data_parallel_mesh(mesh):
    """The data-parallel dimension of a ``ModelParallelStrategy`` mesh (tensor parallelism is refused)."""
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                         "tensor_parallel_size=1) for FSDP2")
    return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
