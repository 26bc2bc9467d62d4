"""Handing freed host memory back to the operating system.

glibc's allocator keeps the pages of a freed block that lies between live ones: many small tensors freed after being
copied into a larger one (per-column sums stacked into ``[K, out, in]``) stay in the process's resident memory while
the copy is allocated elsewhere. Measured on SmolLM2-135M's LESS validation pass (93 columns, LoRA r 128 on q/k/v/o,
5.1 GiB of float32 sums): 16.1 GiB peak resident for 3.2 GiB of live tensors after the pass. ``malloc_trim`` returns
those pages; elsewhere (another C library, another OS) :func:`release_freed_host_memory` does nothing."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def release_freed_host_memory() -> bool:
    """Return the host pages of freed blocks to the OS (glibc ``malloc_trim(0)``); whether it could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
