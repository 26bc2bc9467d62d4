"""Stage 1 at scale: which process decomposes which layer, which layers share a probe pass, and how the processes
exchange what they computed.

* **Share** (:func:`assign_layers`): under several processes each rank decomposes a share of the layers, largest
  first (longest-processing-time: every layer, by decreasing cost ``in·out·min(in, out)`` — the whitened Gram and
  its eigendecomposition — goes to the rank with the least work so far; ties by rank, then by layer order), as
  bergson splits its Hessian factors. One process: every layer is its own.
* **Groups** (:func:`probe_groups`): a rank collects the probes of ``group_layers`` of its layers at a time (its
  layers in model order, consecutive layers together, as GPTQ / SVD-LLM calibrate block by block), so its probe
  columns are those of one group, not of the whole model; ``None``: all its layers in one pass (the single pass of
  one process, the default).
* **Kept decompositions** (:func:`kept_whitened`): the global allocation keeps a layer's exact IPSVD
  (:class:`~iprox_lightning.compression.ipsvd.WhitenedSVD`) for its factors while the kept ones fit in a room of
  bytes — a pure function of the layer shapes and the probe count, so that every rank and every world size keeps the
  same layers (and so computes bitwise the same factors).
* **Exchange** (:class:`Exchange`): the collectives Stage 1 needs, ``all_gather`` of small Python objects (spectra,
  layer records) and ``broadcast`` of factor tensors, with the failure of any rank sent to all of them
  (:meth:`Exchange.gather`) instead of leaving the others waiting for the process group's timeout.
  :class:`TorchExchange` is ``torch.distributed``'s (gloo, NCCL).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine.work_split import largest_first
from .ipsvd import whitened_bytes
from .ranks import dense_rank


def decomposition_cost(out_features: int, in_features: int) -> int:
    """The work of one layer's exact IPSVD, up to a constant: the whitened ``[out, in]`` Gram of size
    ``min(in, out)²`` (``out·in·min``) and its eigendecomposition (``min³ ≤ out·in·min``)."""
    return out_features * in_features * min(out_features, in_features)


def assign_layers(shapes: Mapping[str, tuple[int, int]], world_size: int) -> dict[str, int]:
    """``{layer: rank}``: largest first, each to the rank with the least work so far (module docstring;
    :func:`~iprox_lightning.engine.work_split.largest_first`)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return largest_first({n: decomposition_cost(*shape) for n, shape in shapes.items()}, world_size)


def probe_groups(names: Sequence[str], group_layers: Optional[int]) -> list[list[str]]:
    """``names`` (model order) in consecutive groups of ``group_layers`` (``None``: one group)."""
    names = list(names)
    if not names:
        return []
    if group_layers is None:
        return [names]
    if group_layers < 1:
        raise ValueError(f"probe_group_layers must be >= 1 or None, got {group_layers}")
    return [names[i:i + group_layers] for i in range(0, len(names), group_layers)]


def whitened_keep(out_features: int, in_features: int) -> int:
    """The singular vectors a kept :class:`~iprox_lightning.compression.ipsvd.WhitenedSVD` holds: up to the rank at
    which the layer stays dense (no allocated rank reaches it)."""
    return min(dense_rank(in_features, out_features), min(in_features, out_features))


def whitened_room(shapes: Mapping[str, tuple[int, int]], probed: Sequence[str], num_tokens: int,
                  group_layers: Optional[int]) -> int:
    """The bytes the kept decompositions may take: what the float32 probe columns of the probed layers take in one
    pass (``4·N·Σ(in + out)``; with ``group_layers`` the ``group_layers`` largest layers', one group's at most)."""
    sizes = sorted((shapes[n][0] + shapes[n][1] for n in probed), reverse=True)
    if group_layers is not None:
        sizes = sizes[:group_layers]
    return 4 * num_tokens * sum(sizes)


def kept_whitened(shapes: Mapping[str, tuple[int, int]], layers: Sequence[str], room: int) -> set[str]:
    """The layers (of ``layers``, in that order) whose :class:`~iprox_lightning.compression.ipsvd.WhitenedSVD` is kept:
    each while it fits in what is left of ``room``."""
    kept = set()
    for name in layers:
        out_f, in_f = shapes[name]
        size = whitened_bytes(in_f, out_f, whitened_keep(out_f, in_f))
        if size <= room:
            kept.add(name)
            room -= size
    return kept


class StageOneFailed(RuntimeError):
    """Another rank's Stage 1 failed (its error in the message)."""


class Exchange:
    """The collectives of a multi-process Stage 1 (one process: :class:`Exchange` itself, ``rank 0`` of 1)."""

    rank: int = 0
    world_size: int = 1

    def __init__(self) -> None:
        self.failure_sent = False

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        return [obj]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` of rank ``src`` into every rank's ``tensor`` (in place)."""

    def gather(self, work: Callable[[], Any]) -> list[Any]:
        """Run ``work()`` here, then every rank's result, by rank. A failure on any rank raises on every rank: its own
        error where it failed, :class:`StageOneFailed` naming the rank and its error on the others."""
        try:
            mine, error = work(), None
        except BaseException as e:  # noqa: BLE001 (re-raised below, once the other ranks are told)
            mine, error = None, e
        got = self.all_gather((mine, None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            self.failure_sent = True
            raise error
        for r, (_, failure) in enumerate(got):
            if failure is not None:
                self.failure_sent = True
                raise StageOneFailed(f"Stage 1 failed on rank {r} ({failure})")
        return [m for m, _ in got]

    def fail(self, error: BaseException) -> None:
        """Tell the other ranks, waiting in :meth:`gather`, that this rank failed (once; nothing if it already said
        so there)."""
        if self.world_size > 1 and not self.failure_sent:
            self.failure_sent = True
            self.all_gather((None, f"{type(error).__name__}: {error}"))


class TorchExchange(Exchange):
    """:class:`Exchange` over the default ``torch.distributed`` process group; tensors travel on ``device`` (a GPU
    under NCCL) and are copied back where they live."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(device) if device is not None else None

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        buf = tensor if self.device is None or tensor.device == self.device else tensor.to(self.device)
        dist.broadcast(buf, src=src)
        if buf is not tensor:
            tensor.copy_(buf)
