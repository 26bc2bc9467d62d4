"""Errors about the user's input, raised by the project's own checks with a message that names the file, field or
option and says what to do.

``python train.py`` prints such an error as ``error: <message>`` on stderr (exit status 2) instead of a traceback
(:func:`iprox_lightning.cli.main`; ``--debug`` or ``IPROX_DEBUG=1`` keeps the traceback). Anything else — a bug, a
library's own error — keeps its traceback. Each class also derives from the built-in error it replaces
(``ValueError``, ``FileNotFoundError``, ``FileExistsError``, ...), so ``except ValueError`` and
``pytest.raises(ValueError)`` keep catching it.

Raise :class:`UserInputError` for a bad value (a file's content, an option, an artifact made from other inputs),
:class:`InputNotFoundError` for a missing input file or directory, :class:`OutputExistsError` for an output that is
not replaced, :class:`OutputIsDirectoryError` / :class:`OutputNotDirectoryError` for an output of the wrong kind. The
formats' own errors (``DataFormatError``, ``EvalDataError``, ``ProxyFormatError``, ``StoreFormatError``,
``FingerprintMismatch``, ``OutputLocked``) are :class:`UserError` s too.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path


class UserError(Exception):
    """An error about the user's input whose message says everything (see the module doc)."""


class UserInputError(UserError, ValueError):
    """A bad value: a file's content, an option, an artifact made from other inputs than this run's."""


class InputNotFoundError(UserError, FileNotFoundError):
    """An input file or directory that does not exist (or holds nothing to read)."""


class OutputExistsError(UserError, FileExistsError):
    """An output that exists and is not replaced."""


class OutputIsDirectoryError(UserError, IsADirectoryError):
    """An output file named by a directory."""


class OutputNotDirectoryError(UserError, NotADirectoryError):
    """An output directory named by a file."""


DEBUG_FLAG = "--debug"
"""Anywhere on a command line (or ``IPROX_DEBUG=1``): a :class:`UserError` keeps its traceback instead of the one
``error:`` line."""


def debug_requested(argv) -> bool:
    """True when ``argv`` holds :data:`DEBUG_FLAG` or the environment sets ``IPROX_DEBUG`` (1 / true / yes)."""
    return DEBUG_FLAG in argv or os.environ.get("IPROX_DEBUG", "").lower() in ("1", "true", "yes")


def run_command_line(fn, argv=None):
    """``fn(argv)`` for a module's own command line (``python -m iprox_lightning.io.proxy ...``): ``argv`` (default
    ``sys.argv[1:]``) without :data:`DEBUG_FLAG`; a :class:`UserError` is printed as one ``error:`` line on stderr
    (exit status 2), like ``python train.py`` does, unless :func:`debug_requested`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        return fn([a for a in argv if a != DEBUG_FLAG])
    except UserError as e:
        if debug:
            raise
        print(f"error: {e} (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


PROXY_VALIDATIONS = ("target", "proxy")
"""Whose validation gradients score a proxy: its target's (mapped into the proxy's factor space) or its own."""


def check_output_dir(path, option: str) -> None:
    """Raise :class:`OutputNotDirectoryError` naming ``option`` when ``path`` (an output directory, made later) or a
    folder above it exists as something other than a directory."""
    for p in (Path(path), *Path(path).parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                what = "is" if p == Path(path) else f"lies under {p}, which is"
                raise OutputNotDirectoryError(f"{option} {path} {what} a file, not a directory: pass a directory "
                                              "(it is made if missing)")
            return


def check_choice(name: str, value, choices) -> None:
    """Raise :class:`UserInputError` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        opts = [repr(c) for c in choices]
        told = opts[0] if len(opts) == 1 else ", ".join(opts[:-1]) + " or " + opts[-1]
        raise UserInputError(f"{name} must be {told}, got {value!r}")
