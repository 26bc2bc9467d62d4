"""Reading the project's JSON artifacts (a proxy's ``config.json`` and ``iprox_proxy.json``, a store's ``store.json``,
score ``settings.json``, selection ``.meta.json``, cache sidecars, stage records) with one rule: a file that is cut
short, not UTF-8, not JSON, or whose fields have the wrong type or an impossible value is refused in one line that
names the file and the field (:func:`read_json`, :class:`Fields`), never with a raw ``JSONDecodeError``, ``KeyError``
or ``TypeError`` from deep inside the reader. :func:`write_json` writes one, atomically (:mod:`.atomic`).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import UserInputError
from .atomic import write_text_atomic

_MISSING = object()


def read_json(path: str | os.PathLike, *, error: type[Exception] = UserInputError, what: str = "",
              object_: bool = True, fix: str = "restore or re-create it") -> Any:
    """The parsed JSON of ``path``; ``error`` (naming the file and, when given, ``what`` it is, and saying ``fix``)
    when it cannot be read as UTF-8 JSON — cut short, edited, binary — or, with ``object_``, is not a JSON object."""
    p = Path(path)
    kind = f" ({what})" if what else ""
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{p}{kind}: not UTF-8 text (byte offset {e.start}); the file is damaged or not this artifact")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " — the file is cut short" if text.rstrip()[-1:] not in ("}", "]") else ""
        raise error(f"{p}{kind}: malformed JSON ({e.msg} at line {e.lineno} column {e.colno}{cut})"
                    + (f"; {fix}" if fix else "")) from None
    if object_ and not isinstance(data, dict):
        raise error(f"{p}{kind}: holds a JSON {_json_type(data)}, not an object")
    return data


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = False,
               default=None, ensure_ascii: bool = True, newline: bool = False) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (:func:`~.atomic.write_text_atomic`: a full disk or a stop
    leaves the old file whole or none, never a cut one); ``newline`` ends the file with one. Returns ``path``."""
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, default=default, ensure_ascii=ensure_ascii)
    return write_text_atomic(path, text + ("\n" if newline else ""))


def _json_type(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


class Fields:
    """Checked access to the fields of one JSON file: each error names the file and the field's dotted path."""

    def __init__(self, path: str | os.PathLike, error: type[Exception] = UserInputError) -> None:
        self.path, self.error = Path(path), error

    def fail(self, field: str, message: str) -> Exception:
        return self.error(f"{self.path}: field {field!r} {message}")

    def get(self, obj: Mapping, key: str, kind: str, *, at: str = "", default: Any = _MISSING, minimum: float | None = None,
            choices: Iterable | None = None) -> Any:
        """``obj[key]``, checked: ``kind`` is ``"int"``, ``"number"``, ``"str"``, ``"bool"``, ``"object"``, ``"list"`` or
        a ``|``-joined choice of them (``"str|null"``); ``minimum`` for numbers; ``choices`` for values. A missing key
        is an error unless ``default`` is given. ``at``: the dotted path of ``obj`` in the file."""
        name = f"{at}.{key}" if at else key
        if not isinstance(obj, Mapping) or key not in obj:
            if default is not _MISSING:
                return default
            raise self.fail(name, "is missing")
        v = obj[key]
        self.check(name, v, kind, minimum=minimum, choices=choices)
        return v

    def check(self, name: str, v: Any, kind: str, *, minimum: float | None = None, choices: Iterable | None = None) -> Any:
        ok = any(_is(v, k) for k in kind.split("|"))
        if not ok:
            raise self.fail(name, f"is {_short(v)} (a JSON {_json_type(v)}), not {_kind_words(kind)}")
        if minimum is not None and _is(v, "number") and v < minimum:
            raise self.fail(name, f"is {v!r}, must be >= {minimum:g}")
        if choices is not None:
            choices = list(choices)
            if v not in choices:
                raise self.fail(name, f"is {_short(v)}, not one of {choices}")
        return v


def _is(v: Any, kind: str) -> bool:
    if kind in ("int", "number"):
        return isinstance(v, int if kind == "int" else (int, float)) and not isinstance(v, bool)
    if kind == "object":
        return isinstance(v, Mapping)
    if kind == "null":
        return v is None
    return type(v) is {"str": str, "bool": bool, "list": list}[kind]


def _kind_words(kind: str) -> str:
    words = {"int": "an integer", "number": "a number", "str": "a string", "bool": "true or false",
             "object": "an object", "list": "a list", "null": "null"}
    return " or ".join(words.get(k, k) for k in kind.split("|"))


def _short(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


SAFETENSORS_HEADER_LIMIT = 100 * 2**20
"""The largest safetensors header read (the safetensors library's own limit)."""
_ST_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
                  "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


def read_safetensors_header(path: str | os.PathLike, *, error: type[Exception] = UserInputError) -> dict:
    """The JSON header of a safetensors file, checked against the file's size before anything else reads it: the
    header's length, each tensor's ``dtype``, ``shape`` and ``data_offsets`` (inside the data, the size its shape and
    dtype need). ``error`` names the file and the tensor (a cut download, a damaged or hand-made file) instead of the
    library's ``SafetensorError`` without a file name."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise error(f"{p}: not a readable safetensors file: {size} bytes, cut short?")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8 or n > SAFETENSORS_HEADER_LIMIT:
            raise error(f"{p}: not a readable safetensors file: its header claims {n} bytes, the file has {size}"
                        + (" (more than the 100 MB a header may take)" if n <= size - 8 else "")
                        + ": cut short, damaged or not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{p}: not a readable safetensors file: its header is not JSON ({e}); the file is damaged") from None
    if not isinstance(header, dict):
        raise error(f"{p}: not a readable safetensors file: its header is a JSON {_json_type(header)}, not an object")
    data = size - 8 - n
    fields = Fields(p, error)
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        at = f"tensor {name}"
        fields.check(at, spec, "object")
        dtype = fields.get(spec, "dtype", "str", at=at, choices=_ST_ITEM_BYTES)
        shape = fields.get(spec, "shape", "list", at=at)
        for j, d in enumerate(shape):
            fields.check(f"{at}.shape[{j}]", d, "int", minimum=0)
        offsets = fields.get(spec, "data_offsets", "list", at=at)
        if len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
            raise fields.fail(f"{at}.data_offsets", f"is {_short(offsets)}, not two integers")
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data or end - begin != numel * _ST_ITEM_BYTES[dtype]:
            raise error(f"{p}: not a readable safetensors file: tensor {name!r} ({dtype} {shape}, {numel * _ST_ITEM_BYTES[dtype]} bytes) lies at bytes "
                        f"{begin}..{end} of the {data} data bytes the file holds: cut short or damaged")
    return header
