"""Brute-force references of the selection rules, shared by the tests that check a selection against one."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def balanced_brute(ids: Sequence[str], columns: Sequence[Sequence[float]], k: int | None = None
                   ) -> tuple[list[int], list[int]]:
    """The task-balanced rule written out: each column standardised (``(v - mean) / std``; a constant column only
    centred), columns take turns, each picking its best remaining example by z-score (ties by id), until ``k``
    (default: all) are picked. Returns the picked row indices in order and the column that picked each."""
    queues = []
    for v in columns:
        v = np.asarray(v, np.float64)
        z = (v - v.mean()) / v.std() if v.std() > 0 else v - v.mean()
        queues.append(sorted(range(len(v)), key=lambda j, z=z: (-z[j], ids[j])))
    k = len(ids) if k is None else k
    taken: set[int] = set()
    order: list[int] = []
    picker: list[int] = []
    while len(order) < k:
        for t, q in enumerate(queues):
            j = next((j for j in q if j not in taken), None)
            if j is not None and len(order) < k:
                taken.add(j)
                order.append(j)
                picker.append(t)
    return order, picker
