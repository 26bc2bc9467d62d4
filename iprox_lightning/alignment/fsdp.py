"""FSDP2 handling of Stage 2's models: shard the proxy and the teacher, gather / free the proxy's parameters around a
step, rebuild the proxy unsharded.

The alignment step differentiates the proxy's gradients (double backward), so under ``ModelParallelStrategy`` the
proxy is sharded per decoder block with its unsharded parameters kept alive through both backward passes
(``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``); :func:`unshard_proxy` gathers the factors
before a step (the teacher pass projects its gradients with the very ``A``/``B`` the proxy forward then uses) and
:func:`reshard_proxy` frees them after it (after each optimiser step, so the next forward all-gathers the updated
shards). The proxy is therefore gathered whole for a step: the create_graph backward's graph holds the unsharded
parameters the forward used, and freeing them (FSDP2 frees a resharded parameter's storage) breaks the double backward
(``setStorage: sizes [...] out of bounds for storage of size 0``), also with checkpointed blocks, whose recomputation
saves the gathered parameters into that graph again. :func:`shard_teacher` shards the frozen teacher per decoder block
with the default reshard after forward (its pass is a plain forward + backward: one block gathered at a time) and keeps
a skeleton of it (parameters on the meta device, buffers on the host) for :func:`unsharded_copy`. Every function is a
no-op on an unsharded proxy. :class:`FactorShards` shards the micro-batch path's accumulation buffers over the ranks
(:func:`~iprox_lightning.alignment.losses.accumulated_alignment_losses`).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import set_submodule
from ..training.causal_lm import apply_fully_shard, is_sharded
from .losses import proxy_factor_layers


def _data_parallel(mesh):
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                         "tensor_parallel_size=1) for FSDP2")
    return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh


def shard_proxy(proxy: nn.Module, mesh) -> None:
    """Shard ``proxy`` over the data-parallel dimension of ``mesh`` (tensor parallelism is refused)."""
    apply_fully_shard(proxy, _data_parallel(mesh), reshard_after_forward=False)
    for m in sharded_modules(proxy):
        m.set_reshard_after_backward(False)


def shard_teacher(teacher: nn.Module, mesh) -> nn.Module:
    """Shard the frozen ``teacher`` per decoder block over the data-parallel dimension of ``mesh`` (each block gathered
    for its forward and again for its backward, then freed). Returns its skeleton: the same modules with every
    parameter on the meta device (no memory) and the buffers copied to the host, for :func:`unsharded_copy`."""
    memo: dict = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                  for p in teacher.parameters()}
    memo.update({id(b): b.detach().to("cpu", copy=True) for b in teacher.buffers()})
    skeleton = copy.deepcopy(teacher, memo)
    apply_fully_shard(teacher, _data_parallel(mesh), reshard_after_forward=True)
    return skeleton


def sharded_modules(proxy: nn.Module | None) -> list:
    """The proxy's FSDP2-sharded modules (none when it is not sharded)."""
    if proxy is None or not is_sharded(proxy):
        return []

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
    ``LowRankLinear`` layers (ranks read from the factor shapes). ``teacher``: the unsharded teacher, or the skeleton
    :func:`shard_teacher` returned (its meta parameters take ``state_dict``'s tensors)."""
    skeleton = any(p.is_meta for p in teacher.parameters())
    model = copy.deepcopy(teacher) if skeleton else copy.deepcopy(teacher).to("cpu")
    for name, m in proxy.named_modules():
        if isinstance(m, LowRankLinear):
            A = state_dict[f"{name}.A"]
            set_submodule(model, name, LowRankLinear(m.in_features, m.out_features, A.shape[1],
                                                      bias=m.bias is not None, dtype=A.dtype))
    if skeleton:
        # own storage per tensor (the gathered ones may be views of a larger buffer, which save_proxy refuses)
        model.load_state_dict({k: v.clone() for k, v in state_dict.items()}, strict=True, assign=True)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # (assign gives tied names their own tensors)
    else:
        model.load_state_dict(state_dict, strict=True)
    return model


class FactorShards:
    """Stage 2's accumulation buffers (:func:`~iprox_lightning.alignment.losses.accumulated_alignment_losses`) sharded
    over the data-parallel ranks of ``mesh``: each rank keeps its rows (dim 0, in ``torch.chunk``'s chunks over the
    ranks, as FSDP2's ``Shard(0)`` holds the factors themselves) of each full-size tensor.

    :meth:`scatter` sums a full-size tensor over the ranks and keeps this rank's rows (a reduce-scatter),
    :meth:`gather` rebuilds a full tensor from every rank's rows (an all-gather), :meth:`sum` all-reduces (sum).
    Every rank must make the same calls in the same order (they are collectives)."""

    def __init__(self, mesh, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.group = _data_parallel(mesh).get_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        not_sharded = [n for n, pair in factors.items() if not all(isinstance(x, DTensor) for x in pair)]
        if not_sharded:
            raise RuntimeError(f"FactorShards: the factors of {not_sharded[:4]} are not FSDP2's sharded parameters "
                               "(call it between steps, before the proxy is unsharded)")
        self.factors = dict(factors)
        for pair in self.factors.values():
            for x in pair:
                start, stop, _ = self.rows(x.shape[0])
                if x.to_local().shape[0] != stop - start:
                    raise RuntimeError(f"FactorShards: FSDP2 holds {x.to_local().shape[0]} rows of a factor of "
                                       f"{x.shape[0]} rows on rank {self.rank}, not {stop - start}")
        self.device = next(iter(self.factors.values()))[0].device

    def local_factors(self, names) -> list[torch.Tensor]:
        """The sharded factors' local rows (``A``, ``B`` of each layer of ``names``), differentiable: a gradient of
        them goes straight into the sharded parameter's gradient (beside FSDP2's reduced one, which it adds to)."""
        return [x.to_local() for n in names for x in self.factors[n]]
    def rows(self, full_rows: int) -> tuple[int, int, int]:
        """``(start, stop, chunk)``: this rank's rows of a ``full_rows``-row tensor and the chunk size."""
        chunk = -(-full_rows // self.world)
        start = min(self.rank * chunk, full_rows)
        return start, min(start + chunk, full_rows), chunk

    def scatter(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``Σ_ranks full`` (every rank passes its own ``full``, of the same shape)."""
        n = full.shape[0]
        start, stop, chunk = self.rows(n)
        padded = full.new_zeros((chunk * self.world, *full.shape[1:]))
        padded[:n] = full
        out = full.new_empty((chunk, *full.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, op=dist.ReduceOp.SUM, group=self.group)
        return out[: stop - start].clone()

    def gather(self, local: torch.Tensor, full_rows: int) -> torch.Tensor:
        """The full ``full_rows``-row tensor whose rows each rank holds (its :meth:`rows`) in ``local``."""
        start, stop, chunk = self.rows(full_rows)
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: stop - start] = local
        out = local.new_empty((chunk * self.world, *local.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=self.group)
        return out[:full_rows]

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``Σ_ranks t`` (a copy)."""
        out = t.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def max(self, n: int) -> int:
        """The largest ``n`` over the ranks."""
        out = torch.tensor([int(n)], dtype=torch.long, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return int(out)


def factor_shards(proxy: nn.Module | None, mesh, layers=None) -> FactorShards | None:
    """:class:`FactorShards` of ``proxy``'s aligned factors (``layers``: as ``AlignConfig.layers``) over ``mesh`` when
    FSDP2 shards ``proxy`` (call it between steps), else ``None`` (the buffers stay whole, as on one process)."""
    if not sharded_modules(proxy) or mesh is None:
        return None

    return FactorShards(mesh, {n: (m.A, m.B) for n, m in proxy_factor_layers(proxy, layers).items()})
