"""Select the top-k examples of a score table, write them (full records, JSONL) and explain the selection.

The selection itself is :func:`iprox_lightning.selection.select.select` (also the Python API); this module is
its command-line entry.
"""
from __future__ import annotations

from ..selection.select import select

__all__ = ["select"]
