"""Public names imported on first use (PEP 562): a package's ``__getattr__`` / ``__dir__`` from one table, so that
importing the package (and ``python train.py --help``) loads neither torch nor Lightning until a name needs them."""
from __future__ import annotations

import sys
from importlib import import_module
from typing import Callable, Mapping


def lazy_names(package: str, homes: Mapping[str, str], *,
               subpackages: bool = False) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``homes[name]`` is the module (relative to the package) holding the
    public ``name``, imported on first use and then kept in the package's namespace. ``subpackages``: any other name
    is tried as a subpackage (``ipx.scoring``) before it is an ``AttributeError``."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is not None:
            value = getattr(import_module(home, package), name)
        elif subpackages:
            try:
                value = import_module(f".{name}", package)
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return __getattr__, __dir__
