"""Reading instruction-tuning records from files or the Hugging Face hub, with a field mapping.

Sources
    * a ``.jsonl`` file (one JSON object per line; blank lines are skipped);
    * a ``.json`` file holding a list of objects, or an object with exactly one list of objects
      (e.g. ``{"data": [...]}``);
    * a ``.parquet`` file;
    * a directory: every ``*.jsonl`` / ``*.json`` / ``*.parquet`` file below it, in sorted order;
    * a Hugging Face dataset id (anything that is not an existing path and has no file suffix),
      read with ``datasets.load_dataset(id, split=split)``; ``"owner/name:split"`` picks a split
      (default ``train``; slices such as ``train[:1000]`` work).

Schema
    The canonical record is the Dolly schema: ``instruction`` (str, non-empty), ``context`` (str,
    optional, may be empty), ``response`` (str, non-empty), ``category`` (str, the task; optional),
    ``id`` (str or int; optional). A row may instead hold a chat ``messages`` list of
    ``{"role": str, "content": str}``; the trailing assistant turn(s) are the response and all
    turns before them the prompt. A row is read as chat when it has the messages field and no
    instruction field.

    ``field_map`` maps canonical names to the source's column names, e.g.
    ``{"response": "output", "context": "input"}`` for Alpaca-style files; unmapped names keep the
    canonical column name. Missing optional fields get defaults: ``context`` = ``""``,
    ``category`` = the source's name (file stem or dataset name), ``id`` =
    ``"<source name>-<row index, 6 digits>"`` (0-based index of the record in its source).

Errors
    Every problem raises :class:`DataFormatError` (a ``ValueError``) naming the file, the line
    (JSONL, 1-based) or row (JSON / Parquet / hub, 0-based) and the field; a missing file raises
    ``FileNotFoundError`` naming the path. Ids must be unique across all sources of one read.

:func:`read_records` returns canonical records: plain dicts with keys ``id``, ``category`` and
either ``instruction``/``context``/``response`` or ``messages``, which :func:`write_records_jsonl`
writes back in the same schema (the format of the selection stage's output).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

log = logging.getLogger(__name__)

CANONICAL_FIELDS: tuple[str, ...] = ("id", "instruction", "context", "response", "category", "messages")
DEFAULT_FIELD_MAP: dict[str, str] = {f: f for f in CANONICAL_FIELDS}
FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")


class DataFormatError(ValueError):
    """Bad SFT input; the message names the file (or dataset), the line/row and the field."""


def resolve_field_map(field_map: Mapping[str, str] | None) -> dict[str, str]:
    """The full canonical-name -> column-name mapping (defaults for unmapped names)."""
    fm = dict(DEFAULT_FIELD_MAP)
    for key, col in (field_map or {}).items():
        if key not in DEFAULT_FIELD_MAP:
            raise ValueError(f"field_map: unknown field {key!r}; the canonical fields are {list(CANONICAL_FIELDS)}")
        if not isinstance(col, str) or not col:
            raise ValueError(f"field_map[{key!r}] must be a non-empty column name, got {col!r}")
        fm[key] = col
    return fm


# ----------------------------------------------------------------------------- raw rows
def decode_utf8(data: bytes, path: str | os.PathLike, *, line: int | None = None, offset: int = 0,
                error: type = None) -> str:
    """``data.decode("utf-8")``; invalid bytes raise ``error`` (default :class:`DataFormatError`) naming
    the file, the line and the byte offset in the file (``offset`` = the file offset of ``data``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        ln = line if line is not None else data.count(b"\n", 0, e.start) + 1
        bad = data[e.start:e.end].hex(" ")
        raise (error or DataFormatError)(
            f"{path}, line {ln}: invalid UTF-8 at byte offset {offset + e.start} (bytes {bad}: {e.reason}); "
            "re-encode the file as UTF-8") from None


def read_utf8(path: str | os.PathLike, error: type = None) -> str:
    """The text of a UTF-8 file; invalid bytes raise naming file, line and byte offset (:func:`decode_utf8`)."""
    with open(path, "rb") as f:
        return decode_utf8(f.read(), path, error=error)


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for each non-blank line of a JSON Lines file; ``where`` is ``"<path>, line N"``.
    A malformed line raises :class:`DataFormatError` naming the file, line and column (invalid UTF-8: the
    byte offset)."""
    with open(path, "rb") as f:
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            line = decode_utf8(raw, path, line=lineno, offset=offset)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}, line {lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            yield f"{path}, line {lineno}", row


def _iter_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}, line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if isinstance(data, dict):
        lists = [k for k, v in data.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataFormatError(
                f"{path}: expected a JSON list of records or an object with exactly one list of records, "
                f"got an object with keys {sorted(data)[:10]}"
            )
        data = data[lists[0]]
    if not isinstance(data, list):
        raise DataFormatError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}, row {i}", row


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataFormatError(f"{path}: cannot read Parquet file ({e})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}, row {i}", row


def parse_hub_id(source: str) -> tuple[str, str]:
    """``"owner/name[:split]"`` -> ``(name, split)``; the split defaults to ``"train"``."""
    name, sep, split = source.partition(":")
    return name, (split if sep and split else "train")


def _iter_hub(source: str) -> Iterator[tuple[str, Any]]:
    import datasets

    name, split = parse_hub_id(source)
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise DataFormatError(
            f"{source!r} is not an existing file or directory and could not be loaded as a Hugging Face "
            f"dataset (datasets.load_dataset({name!r}, split={split!r})): {type(e).__name__}: {e}"
        ) from e
    for i, row in enumerate(ds):
        yield f"dataset {name!r} (split {split!r}), row {i}", row


def source_name(source: str | os.PathLike) -> str:
    """The short name of a source: file stem, directory name, or the last part of a hub id."""
    s = str(source)
    p = Path(s)
    if p.exists():
        return p.name if p.is_dir() else p.stem
    if p.suffix in FILE_SUFFIXES:
        return p.stem
    return parse_hub_id(s)[0].rstrip("/").split("/")[-1]


def is_hub_id(source: str | os.PathLike) -> bool:
    """True when ``source`` would be read with ``datasets.load_dataset`` (no such local path)."""
    p = Path(str(source))
    return not p.exists() and p.suffix not in FILE_SUFFIXES and str(source) != "builtin"


def iter_rows(source: str | os.PathLike) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(source_name, where, raw_row)`` for every record of ``source`` (see module doc)."""
    p = Path(str(source))
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in FILE_SUFFIXES)
        if not files:
            raise FileNotFoundError(f"SFT data directory {p} holds no {'/'.join(FILE_SUFFIXES)} files")
        for f in files:
            yield from iter_rows(f)
        return
    if p.suffix in FILE_SUFFIXES:
        if not p.is_file():
            raise FileNotFoundError(f"SFT data file not found: {p}")
        reader = {".jsonl": iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}[p.suffix]
        for where, row in reader(p):
            yield p.stem, where, row
        return
    if p.suffix:
        raise DataFormatError(f"{p}: unsupported file type {p.suffix!r}; use one of {list(FILE_SUFFIXES)}")
    name = source_name(source)
    for where, row in _iter_hub(str(source)):
        yield name, where, row


# ----------------------------------------------------------------------------- validation
def _get_str(row: Mapping, fm: Mapping[str, str], key: str, where: str, *, required: bool, non_empty: bool):
    col = fm[key]
    label = f"field {col!r}" if col == key else f"field {col!r} (mapped to {key!r})"
    if col not in row or row[col] is None:
        if required:
            present = sorted(map(str, row))[:12]
            raise DataFormatError(f"{where}: missing {label}; the record has fields {present}")
        return None
    value = row[col]
    if not isinstance(value, str):
        raise DataFormatError(f"{where}: {label} must be a string, got {type(value).__name__} {_short(value)}")
    if non_empty and not value.strip():
        raise DataFormatError(f"{where}: {label} is empty")
    return value


def _short(value: Any, n: int = 40) -> str:
    s = repr(value)
    return s if len(s) <= n else s[: n - 3] + "..."


def _check_messages(value: Any, where: str, col: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataFormatError(f"{where}: field {col!r} must be a non-empty list of messages, got {_short(value)}")
    out = []
    for j, m in enumerate(value):
        at = f"{where}: field {col!r}[{j}]"
        if not isinstance(m, Mapping):
            raise DataFormatError(f"{at} must be an object with 'role' and 'content', got {type(m).__name__}")
        for k in ("role", "content"):
            if k not in m or m[k] is None:
                raise DataFormatError(f"{at}: missing field {k!r}")
            if not isinstance(m[k], str):
                raise DataFormatError(f"{at}.{k} must be a string, got {type(m[k]).__name__}")
        if m["role"] not in CHAT_ROLES:
            raise DataFormatError(f"{at}.role must be one of {list(CHAT_ROLES)}, got {m['role']!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "assistant":
        raise DataFormatError(f"{where}: field {col!r}: the last message must be an assistant turn (the response), got {out[-1]['role']!r}")
    first_resp = len(out)
    while first_resp > 0 and out[first_resp - 1]["role"] == "assistant":
        first_resp -= 1
    if first_resp == 0:
        raise DataFormatError(f"{where}: field {col!r}: no user/system turn before the final assistant turn(s)")
    for j in range(first_resp, len(out)):
        if not out[j]["content"].strip():
            raise DataFormatError(f"{where}: field {col!r}[{j}].content is empty (response turn)")
    if not any(m["content"].strip() for m in out[:first_resp]):
        raise DataFormatError(f"{where}: field {col!r}: every prompt turn is empty")
    return out


def normalize_row(row: Any, *, field_map: Mapping[str, str], where: str, default_id: str, default_task: str) -> dict:
    """Validate one raw row and return its canonical record (see module doc)."""
    fm = resolve_field_map(field_map)
    if not isinstance(row, Mapping):
        raise DataFormatError(f"{where}: expected a JSON object (record), got {type(row).__name__} {_short(row)}")
    rid = row.get(fm["id"])
    if rid is None:
        rid = default_id
    elif isinstance(rid, bool) or not isinstance(rid, (str, int)):
        raise DataFormatError(f"{where}: field {fm['id']!r} (id) must be a string or an integer, got {type(rid).__name__}")
    rid = str(rid)
    if not rid.strip():
        raise DataFormatError(f"{where}: field {fm['id']!r} (id) is empty")
    task = _get_str(row, fm, "category", where, required=False, non_empty=False)
    task = task if task and task.strip() else default_task
    if fm["messages"] in row and fm["instruction"] not in row:
        return {"id": rid, "category": task, "messages": _check_messages(row[fm["messages"]], where, fm["messages"])}
    instruction = _get_str(row, fm, "instruction", where, required=True, non_empty=True)
    context = _get_str(row, fm, "context", where, required=False, non_empty=False) or ""
    response = _get_str(row, fm, "response", where, required=True, non_empty=True)
    return {"id": rid, "category": task, "instruction": instruction, "context": context, "response": response}


def read_records(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    field_map: Mapping[str, str] | None = None,
) -> list[dict]:
    """Read, validate and normalise every record of one or several sources (see module doc).

    Raises :class:`DataFormatError` / ``FileNotFoundError`` naming file, line/row and field, and on
    duplicate ids (naming both places).
    """
    fm = resolve_field_map(field_map)
    srcs = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not srcs:
        raise ValueError("read_records: no sources given")
    records: list[dict] = []
    seen: dict[str, str] = {}
    for src in srcs:
        counters: dict[str, int] = {}
        for name, where, row in iter_rows(src):
            idx = counters.get(name, 0)
            counters[name] = idx + 1
            rec = normalize_row(row, field_map=fm, where=where, default_id=f"{name}-{idx:06d}", default_task=name)
            if rec["id"] in seen:
                raise DataFormatError(f"{where}: duplicate id {rec['id']!r} (first seen at {seen[rec['id']]})")
            seen[rec["id"]] = where
            records.append(rec)
        if not counters:
            raise DataFormatError(f"{src}: no records")
        log.info("read %d records from %s", sum(counters.values()), src)
    return records


def write_records_jsonl(records: Iterable[Mapping], path: str | os.PathLike) -> Path:
    """Write canonical records as JSONL (the Dolly schema, ids kept); returns the path.

    Written to a temporary file and renamed, so readers never see a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(dict(r), ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
