"""The one damping rule of the project's second moments (IPSVD probes and K-FAC factors).

A second moment ``C: [dim, dim]`` is damped to ``C_λ = C + λ I`` with

* ``mode="relative"``: ``λ = damping · tr(C) / dim`` — a fraction of the mean eigenvalue, so scaling the
  loss (hence the output-gradients) by a constant changes nothing; a ``C`` whose trace is 0 gets
  ``λ = damping``, so ``C_λ`` is invertible all the same;
* ``mode="absolute"``: ``λ = damping``.

``damping`` must be > 0 (the damped moment must be invertible).
"""
from __future__ import annotations

from ..errors import UserInputError

DAMPING_MODES = ("relative", "absolute")


def check_damping_mode(mode: str) -> None:
    """Raise a ``ValueError`` unless ``mode`` is a damping mode (for options that are checked before it is known
    whether they will be used, e.g. the K-FAC options of a TracIn scoring config)."""
    if mode not in DAMPING_MODES:
        raise UserInputError(f"damping_mode must be one of {DAMPING_MODES}, got {mode!r}")


def check_damping(damping: float, mode: str) -> None:
    """Raise a ``ValueError`` unless ``mode`` is a damping mode and ``damping > 0``."""
    check_damping_mode(mode)
    if not damping > 0:
        raise UserInputError(f"damping must be > 0 (the damped second moments must be invertible), got {damping}")


def damping_value(trace: float, dim: int, damping: float, mode: str) -> float:
    """``λ`` for a second moment of size ``dim`` and trace ``trace`` (see the module docstring)."""
    check_damping(damping, mode)
    if mode == "absolute" or not trace > 0:
        return float(damping)
    return damping * trace / dim
