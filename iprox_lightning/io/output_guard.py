"""Outputs never replace inputs: one guard, by file identity, for every command that writes.

Two paths name the same file when ``os.stat`` (which follows symbolic links) gives the same device and inode: a
hard link, a symbolic link, a bind mount or a path spelled another way (``a/../b``, a different case on a
case-insensitive file system) are all caught, where comparing resolved path strings misses the hard link and the
bind mount. :func:`check_output_not_input` refuses an output that

* is an input file (``plan --output <model>/config.json``, ``random_scores --output <a hard link of the pool>``),
* is an input directory or lies inside one (the next read of that input would take the output for its data, or a
  run would write over it),
* contains an input, for an output directory replaced as a whole (the input would go with it).

Inputs that are not paths on this machine (a hub id, ``builtin``, a list of records) are skipped.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import UserInputError


def _key(path: str | os.PathLike) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` are one file or directory (device and inode, links followed); ``False`` when either
    does not exist."""
    ka = _key(a)
    return ka is not None and ka == _key(b)


def _above(path: str | os.PathLike) -> list[tuple[Path, tuple[int, int]]]:
    """``(p, identity)`` of each existing directory above ``path``, nearest first. Both the path as given (made
    absolute) and with its links resolved are walked: ``dir/link/out`` is inside the link's target as well as
    inside ``dir``."""
    out: list[tuple[Path, tuple[int, int]]] = []
    seen: set[tuple[int, int]] = set()
    for start in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for p in start.parents:
            k = _key(p)
            if k is not None and k not in seen:
                seen.add(k)
                out.append((p, k))
    return out


def _inputs(inputs: Mapping[str, Any]) -> Iterable[tuple[str, Path]]:
    for name, value in inputs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, (str, os.PathLike)) and str(v) and os.path.exists(v):
                yield name, Path(v)


def check_output_not_input(output: str | os.PathLike, inputs: Mapping[str, Any], option: str, *,
                           replaced_whole: bool = False) -> None:
    """Refuse (:class:`~iprox_lightning.errors.UserInputError`, one line naming ``option``, the output and the input)
    an ``output`` that is one of ``inputs`` (``{name: path or list of paths}``) or lies inside an input directory;
    with ``replaced_whole`` (an output directory replaced as a whole), also one that contains an input. See the
    module doc."""
    out = Path(output)
    above = _above(out)
    out_key = _key(out)
    for name, src in _inputs(inputs):
        k = _key(src)
        if k is None:
            continue
        if out_key is not None and out_key == k:
            what = "directory" if os.path.isdir(src) else "file"
            raise UserInputError(f"{option} {output} is the {name} {what} {src}: writing it would replace the {name} "
                                 "(the same file by device and inode, links followed); choose another output")
        if os.path.isdir(src) and any(key == k for _, key in above):
            why = (f"writing it would replace a file of the {name}" if out_key is not None else
                   f"writing there would change the {name}: the next read of the {name} would take it for {name} data")
            raise UserInputError(f"{option} {output} is inside the {name} directory {src}: {why}; choose another "
                                 "output")
        if replaced_whole and out_key is not None and os.path.isdir(out) and any(key == out_key for _, key in _above(src)):
            what = "directory" if os.path.isdir(src) else "file"
            raise UserInputError(f"{option} {output} contains the {name} {what} {src}: replacing or clearing the output would "
                                 f"take the {name} with it; choose another output")
