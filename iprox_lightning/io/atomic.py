"""Every file (or directory) the package writes goes through one rule: it is written under a temporary name beside its
own (``.<name>.tmp-<pid>-<random>``, the same directory, so the same file system) and renamed onto its name
(``os.replace``, atomic) only once complete. A full disk, a stop or a crash therefore leaves the old file whole, or
no file, and never a half-written file under the name nor a temporary beside it.

:func:`atomic_path` is the rule (it yields the temporary path for a library's own writer: Parquet, safetensors,
``save_pretrained``); :func:`write_text_atomic`, :func:`write_bytes_atomic` and :func:`open_atomic` are its
common uses; :func:`~.jsonfile.write_json` writes a JSON file with it. A library's write error that carries an
operating-system error without being an ``OSError`` (safetensors' ``SafetensorError: ... (os error 28)``) is raised
as that ``OSError``, naming the file, so a full disk is one line on the command line.
"""
from __future__ import annotations

import errno as errno_
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from ..errors import UserError


def temporary_name(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside ``path`` (hidden; unique per process and call)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")


def _remove(tmp: Path) -> None:
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def as_os_error(error: BaseException, filename: str | os.PathLike, temporary: str | os.PathLike | None = None
                ) -> OSError | None:
    """``error`` as an ``OSError`` naming ``filename``: an ``OSError`` about ``temporary`` (or about no file) renamed to
    the file it stands for, or a library's error carrying an operating-system error (``(os error 28)``); ``None``
    otherwise (a user error, an error about another file, any other error)."""
    if isinstance(error, UserError) or not isinstance(error, Exception):
        return None
    if isinstance(error, OSError):
        if error.errno is None or (error.filename is not None and (
                temporary is None or not str(error.filename).startswith(str(temporary)))):
            return None
        return OSError(error.errno, error.strerror, str(filename))
    m = _OS_ERROR.search(str(error))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code) if code in errno_.errorcode else str(error), str(filename))


@contextmanager
def named_os_errors(filename: str | os.PathLike) -> Iterator[None]:
    """Run a library's write; an error carrying an operating-system error is raised as an ``OSError`` naming
    ``filename`` (:func:`as_os_error`); anything else as it is."""
    try:
        yield
    except Exception as e:
        err = as_os_error(e, filename)
        if err is None or err is e:
            raise
        raise err from e


@contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (a fresh empty directory with ``directory``) to write to; on success it
    is renamed onto ``path`` (a directory ``path`` must not exist or be empty); on any error or stop the temporary
    is removed and the old ``path`` left as it was. The parent directory is made if needed. A write error is raised
    naming ``path`` (not the temporary), as an ``OSError`` when it carries one (:func:`as_os_error`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(path)
    if directory:
        tmp.mkdir()
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        _remove(tmp)
        err = as_os_error(e, path, tmp)
        if err is None:
            raise
        raise err from e


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`); returns ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_path`); returns ``path``."""
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
    return Path(path)


@contextmanager
def open_atomic(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """``open(path, mode)`` for writing, atomically: the file appears under its name when the block ends without an
    error (:func:`atomic_path`)."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
