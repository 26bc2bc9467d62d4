"""Scoring state split across ranks by layer (``ScoringConfig.shard_layers``): each rank owns a share of the tracked
weights and holds only their K-FAC / EK-FAC factor sums, factors and validation gradients.

Every rank still runs the model on its own batches. In each tracked weight's backward hook the ranks send that
weight's pairs ``(h, δ)`` (``[B, T, in]``, ``[B, T, out]``: the small per-layer quantity) to the weight's owner
(:class:`OwnedLayers`, one ``gather`` per pair side), which runs the statistic — the covariance sums, the EK-FAC
eigenvalue sums, the validation gradient sums, the scores' inner products — on the rows of every rank at once. A
per-example result (a score's ``‖M g‖²`` and ``⟨M g, V_k⟩``) is a sum over weights: each rank adds its owned
weights' part for every rank's rows and one ``all_reduce`` per step completes it. So per rank the bytes held are its
share of the factors, sums and validation gradients, plus one weight's gathered pairs (``world · B · T · (in + out)``)
and the statistic's per-row transients for ``world · B`` rows; the traffic per step is each rank's pairs once.

Gathering one layer's factors at a time to every rank instead would move ``in² + out²`` per weight per step (all
factors, every step); moving the pairs moves ``B · T · (in + out)``, less whenever ``world · B · T`` is below the
layer's width, and keeps no rank above its share.

Every rank must make the same steps (each step is a sequence of collectives in the backward order of the same
model): a rank with fewer batches makes idle steps, whose rows are sent as none (:func:`equal_steps`). Ownership
(:func:`~.metrics.layer_owners`) is the largest-first split of each K-FAC partition's layers (by ``in² + out²``) over the
ranks, so every pass holds about ``1/world`` of its sums on each rank.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from .features import WeightPairTracker


class OwnedLayers(WeightPairTracker):
    """A :class:`WeightPairTracker` that sends each weight's pairs to its owner (``owners``: key -> rank), where
    ``inner`` (a tracker of the same weights) gets the rows of every rank at once: ``inner.start_step`` sees a batch of
    ``Σ_r B_r`` rows (the ranks' active rows in rank order, padded to the longest ``T``: ``attention_mask`` 0 there)
    and ``inner.on_weight`` those rows' pairs, on the owner only. ``inner.row_fields`` (per-row results, e.g. the
    scores' ``sq`` and ``dots``) are summed over the ranks after the step and cut back to this rank's rows.

    ``active`` (set before a step, ``[B]`` bool; ``None``: every row): the rows sent (an idle step sends none)."""

    def __init__(self, inner: WeightPairTracker, owners: Mapping[str, int], rank: int, world: int) -> None:
        super().__init__({n: m for n, m in inner.modules.items() if n not in inner.seams})
        self.inner, self.owners, self.rank, self.world = inner, dict(owners), int(rank), int(world)
        self.active: torch.Tensor | None = None

    def start_step(self, batch: Mapping) -> None:
        super().start_step(batch)
        ids = batch["input_ids"]
        B, T = ids.shape
        act = torch.ones(B, dtype=torch.bool, device=ids.device) if self.active is None else self.active.to(ids.device)
        self.rows = act
        shapes = [torch.zeros(2, dtype=torch.long, device=ids.device) for _ in range(self.world)]
        dist.all_gather(shapes, torch.tensor([int(act.sum()), T], device=ids.device))
        self.counts = [int(s[0]) for s in shapes]
        self.Bmax, self.Tmax = max(max(self.counts), 1), max(int(s[1]) for s in shapes)
        mask = self._pad(batch["attention_mask"][act].to(torch.long))
        masks = [torch.empty_like(mask) for _ in range(self.world)]
        dist.all_gather(masks, mask)
        combined = {"input_ids": torch.zeros(sum(self.counts), self.Tmax, dtype=torch.long, device=ids.device),
                    "attention_mask": self._rows(masks)}
        if hasattr(self.inner, "group_of") and batch.get("task") is not None:  # (validation sums: each row's task)
            tasks = [t for t, a in zip(batch["task"], act.tolist()) if a]
            every: list = [None] * self.world
            dist.all_gather_object(every, tasks)
            combined["task"] = [t for ts in every for t in ts]
        self.inner.start_step(combined)

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (``[b, T, ...]``) padded with zeros to ``[Bmax, Tmax, ...]``."""
        out = t.new_zeros((self.Bmax, self.Tmax, *t.shape[2:]))
        out[:t.shape[0], :t.shape[1]] = t
        return out

    def _rows(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The ranks' real rows of padded ``parts``, in rank order."""
        return torch.cat([p[:n] for p, n in zip(parts, self.counts)])

    def on_weight(self, key: str, h: torch.Tensor, delta: torch.Tensor) -> None:
        owner = self.owners[key]
        mine = owner == self.rank
        out = []
        for t in (h, delta):
            t = self._pad(t[self.rows.to(t.device)].contiguous())
            parts = [torch.empty_like(t) for _ in range(self.world)] if mine else None
            dist.gather(t, parts, dst=owner)
            out.append(self._rows(parts) if mine else None)
        if mine:
            self.inner.on_weight(key, *out)

    def end_step(self) -> None:
        self.inner.end_step()
        start = sum(self.counts[:self.rank])
        for field in getattr(self.inner, "row_fields", ()):
            t = getattr(self.inner, field).contiguous()
            dist.all_reduce(t)
            mine = t.new_zeros((len(self.rows), *t.shape[1:]))
            mine[self.rows.to(t.device)] = t[start:start + self.counts[self.rank]]
            setattr(self.inner, field, mine)


def idle_batch(batch: Mapping) -> dict:
    """A batch to make an idle step on (its rows are sent as none): ``batch`` with every attended token a label, so
    the backward reaches every tracked layer whatever its own labels."""
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    return {**batch, "labels": labels}


def equal_steps(items: Iterable, rank: int, world: int) -> Iterator[tuple[object, bool]]:
    """This rank's share (``j % world == rank``) of ``items`` as ``(item, True)``, then ``(last item seen, False)``
    idle steps until it has made as many steps as the rank with the most (``ceil(J / world)`` for ``J`` items), so
    every rank makes the same number of steps."""
    n = mine = 0
    last = None
    for j, item in enumerate(items):
        n, last = j + 1, item
        if j % world == rank:
            mine += 1
            yield item, True
    for _ in range(math.ceil(n / world) - mine):
        yield last, False
