"""FSDP2 handling of Stage 2's models: shard the proxy and the teacher, gather / free the proxy's parameters around a
step (or, with ``reshard_proxy``, one decoder block at a time through the step: :class:`ProxyBlocks`), rebuild the
proxy unsharded.

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
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import set_submodule
from ..training.causal_lm import apply_fully_shard, is_sharded
from .losses import proxy_factor_layers


def _data_parallel(mesh):
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                         "tensor_parallel_size=1) for FSDP2")
    return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh


def shard_proxy(proxy: nn.Module, mesh, per_block: bool = False) -> None:
    """Shard ``proxy`` over the data-parallel dimension of ``mesh`` (tensor parallelism is refused): gathered whole
    for a step (:func:`unshard_proxy`), or with ``per_block`` one decoder block at a time (FSDP2's default reshard
    after forward and after backward; the step runs in :class:`ProxyBlocks`)."""
    apply_fully_shard(proxy, _data_parallel(mesh), reshard_after_forward=per_block)
    if not per_block:
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


# ------------------------------------------------------------------------------------------------
# the proxy resharded per decoder block through the double backward (AlignConfig.reshard_proxy)
# ------------------------------------------------------------------------------------------------
def _managed_parameters(proxy: nn.Module) -> list[tuple[nn.Module, list[tuple[nn.Module, str]]]]:
    """Per FSDP2 module of ``proxy`` (the decoder blocks, the root), the ``(submodule, name)`` of every parameter it
    manages (those under no nested FSDP2 module)."""
    fsdp = sharded_modules(proxy)
    units = set(map(id, fsdp))
    out = []
    for unit in fsdp:
        slots: list[tuple[nn.Module, str]] = []

        def walk(m: nn.Module) -> None:
            slots.extend((m, n) for n, p in m._parameters.items() if p is not None)
            for child in m.children():
                if id(child) not in units:
                    walk(child)

        walk(unit)
        out.append((unit, slots))
    return out


class _Regathered(torch.autograd.Function):
    """A parameter's full value for a read after its block's forward (the projections into factor space), gathered
    from its shards (one layer at a time; registered so the graph saves a handle, not the copy); the gradient goes
    to ``param``, the unsharded parameter the forward used (FSDP2 reduce-scatters it into the shards)."""

    @staticmethod
    def forward(ctx, param, blocks, slot, dtype):
        return blocks.full(slot, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


class _LazyFactors(dict):
    """``{layer: (A, B)}`` whose pairs are regathered when read (one layer at a time)."""

    def __init__(self, blocks: "ProxyBlocks", factors, dtype) -> None:
        super().__init__(factors)
        self.blocks, self.dtype = blocks, dtype

    def __getitem__(self, name):
        return tuple(self.blocks.regather(x, self.dtype) for x in super().__getitem__(name))


class _Casts(TorchDispatchMode):
    """Registers a cast (``aten._to_copy``: autocast's bfloat16 copies under ``bf16-mixed``, a dtype promotion) of a
    gathered parameter as gathered too, so the graph saves a handle for it and not the copy."""

    def __init__(self, blocks: "ProxyBlocks") -> None:
        super().__init__()
        self.blocks = blocks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and isinstance(out, torch.Tensor) and args \
                and isinstance(args[0], torch.Tensor):
            slot = self.blocks.slot_of(args[0])
            if slot is not None:
                self.blocks._remember(out, slot, out.dtype)
        return out


class ProxyBlocks:
    """The Stage 2 step of a proxy FSDP2 gathers one decoder block at a time (:func:`shard_proxy` with
    ``per_block=True``: each block resharded after its forward and after its backward) through the ``create_graph``
    double backward.

    FSDP2 frees a block's gathered parameters after its forward (and again after its backward), but the graph of the
    proxy's gradients (``autograd.grad(..., create_graph=True)``) and the loss's backward read them later, outside
    FSDP2's hooks. Inside ``with ProxyBlocks(proxy):`` a saved tensor of the graph that lives in a gathered parameter
    (recorded at each FSDP2 module's forward) is packed as a handle ``(module, name, size, stride, offset, dtype)``
    (``torch.autograd.graph.saved_tensors_hooks``) and unpacked by gathering that parameter again (the unsharded
    parameter itself while FSDP2 holds it gathered, else ``DTensor.full_tensor()``, a collective: every rank unpacks
    in the same order, as it runs the same graph). A read outside the block's forward (the projections of the
    teacher's gradient into factor space) goes through :meth:`regather` (one layer at a time, its gradient to the
    unsharded parameter). Under autocast (bf16-mixed) its copies of the gathered factors are registered too
    (:class:`_Casts`) and not cached. Not combined with activation checkpointing (its recomputation runs outside
    FSDP2's hooks) nor with the task terms: AlignConfig refuses both."""

    def __init__(self, proxy: nn.Module) -> None:
        self._weakref = weakref.ref
        self.units = _managed_parameters(proxy)
        self.owners: dict[int, list] = {}  # storage id -> [(its weakref, slot, dtype, the tensor's dtype/offset/numel)]
        self.handles: list = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._param_slots: dict[int, tuple[nn.Module, str]] = {}

    # -- recording which storages are gathered parameters
    def _remember(self, t: torch.Tensor, slot, dtype=None) -> None:
        # (a weak reference to the storage: alive as long as any tensor uses it, so a freed storage's id reused by
        # another one is never taken for it)
        storage = t.untyped_storage()
        entries = self.owners.setdefault(storage._cdata, [])
        entries[:] = [e for e in entries if e[0]() is storage and e[1] != slot]
        entries.append((self._weakref(storage), slot, dtype, t.dtype, t.storage_offset(), t.numel()))

    def _pre_forward(self, slots):
        def hook(module, args):
            for slot in slots:
                p = getattr(*slot)
                if not hasattr(p, "full_tensor"):  # gathered (a plain tensor while FSDP2 holds it unsharded)
                    self._remember(p, slot)
                    self._param_slots[id(p)] = slot
        return hook

    @staticmethod
    def _storage(t: torch.Tensor):
        """``t``'s storage, or ``None`` for a tensor that is no plain strided one (a DTensor, sparse, meta...)."""
        if hasattr(t, "full_tensor") or t.layout != torch.strided or t.device.type == "meta":
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # (a tensor subclass without a storage of its own)
            return None

    def slot_of(self, t: torch.Tensor):
        """The slot of the gathered parameter ``t`` is the whole of (``None``: not one)."""
        storage = self._storage(t)
        if storage is None:
            return None
        for ref, slot, dtype, owner_dtype, start, numel in self.owners.get(storage._cdata, ()):
            if ref() is storage and owner_dtype == t.dtype and t.storage_offset() == start and t.numel() == numel:
                return slot
        return None

    def _pack(self, t: torch.Tensor):
        storage = self._storage(t)
        if storage is None:
            return t
        for ref, slot, dtype, owner_dtype, start, numel in self.owners.get(storage._cdata, ()):
            if ref() is storage and owner_dtype == t.dtype and start <= t.storage_offset() < start + numel:
                return ("ProxyBlocks", slot, dtype, t.size(), t.stride(), t.storage_offset() - start)
        return t

    def _unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 6 and packed[0] == "ProxyBlocks":
            _, slot, dtype, size, stride, offset = packed
            full = self.full(slot, dtype)
            return full.as_strided(size, stride, full.storage_offset() + offset)
        return packed

    # -- gathering
    def full(self, slot, dtype=None) -> torch.Tensor:
        """The full value of the parameter at ``slot`` (``dtype``: converted), registered as gathered."""
        p = getattr(*slot)
        if hasattr(p, "full_tensor"):
            full = p.detach().full_tensor()  # (a collective)
        else:
            if p.untyped_storage().size() == 0:
                raise RuntimeError(f"ProxyBlocks: {type(slot[0]).__name__}.{slot[1]} is freed and not sharded")
            full = p.detach()
        if dtype is not None and full.dtype != dtype:
            full = full.to(dtype)
        self._remember(full, slot, dtype)
        return full

    def regather(self, param: torch.Tensor, dtype=None) -> torch.Tensor:
        """``param`` (an unsharded parameter a block's forward used, possibly freed since) gathered again, as
        ``dtype``; differentiable (its gradient goes to ``param``)."""
        slot = self._param_slots.get(id(param))
        if slot is None:
            return param if dtype is None else param.to(dtype)
        return _Regathered.apply(param, self, slot, dtype)

    def lazy(self, factors, dtype=None) -> "_LazyFactors":
        """``factors`` (``{layer: (A, B)}`` of the forward's tensors) regathered one layer at a time when read."""
        return _LazyFactors(self, factors, dtype)

    def __enter__(self) -> "ProxyBlocks":
        self.handles = [unit.register_forward_pre_hook(self._pre_forward(slots)) for unit, slots in self.units]
        self._hooks.__enter__()
        # autocast (bf16-mixed): its copies of the gathered parameters registered (_Casts), and not cached for the
        # step (the cache would hold every block's copy)
        self._autocast_cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        self._casts = _Casts(self)
        self._casts.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._casts.__exit__(*exc)
        torch.set_autocast_cache_enabled(self._autocast_cache)
        self._hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.handles = []
