"""``release_freed_host_memory`` (``engine/host_memory.py``): freed tensors between live ones leave the process's
resident memory once it runs, as the exact scorer's stacking of per-column validation sums needs (issue 66)."""
from __future__ import annotations

import ctypes.util
import sys

import pytest
import torch

from iprox_lightning.engine.host_memory import release_freed_host_memory

psutil = pytest.importorskip("psutil")


def rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
                    reason="glibc's malloc_trim")
def test_freed_blocks_between_live_ones_are_returned():
    # glibc raises its mmap threshold to a freed mapped block's size: later blocks up to that size come from the heap
    # (as the scorer's column sums do, after the first large tensors were freed)
    big = torch.ones(8 << 20, dtype=torch.float32)  # 32 MiB
    del big
    blocks = [torch.ones(64 << 10, dtype=torch.float32) for _ in range(1024)]  # 1024 x 256 KiB = 256 MiB
    kept = blocks[1::2]  # every other one stays alive: no freed run reaches the heap's top
    del blocks
    before = rss()
    assert release_freed_host_memory()
    after = rss()
    assert before - after > 64 << 20, (before, after)  # of the 128 MiB freed between live blocks
    assert float(sum(float(t[0]) for t in kept)) == len(kept)  # the live ones are untouched
