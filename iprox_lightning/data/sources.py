"""Reading instruction-tuning records from files or the Hugging Face hub, with a field mapping.

Sources
    * a ``.jsonl`` file (one JSON object per line; blank lines are skipped);
    * a ``.json`` file holding a list of objects, or an object with exactly one list of objects
      (e.g. ``{"data": [...]}``);
    * a ``.parquet`` file;
    * a directory: every ``*.jsonl`` / ``*.json`` / ``*.parquet`` file below it, in sorted order; files and
      folders whose name starts with ``.`` (``.ipynb_checkpoints/``, ``.cache/``) are skipped, counted in a warning;
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

import datasets
import pyarrow.parquet as pq

from ..errors import InputNotFoundError, UserInputError
from ..io.atomic import open_atomic
from ..io.records import DataFormatError, iter_jsonl, json_id, normalize_row, read_utf8, resolve_field_map
from ..models.hub import check_dataset_source

log = logging.getLogger(__name__)

FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet")


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
    name, split = parse_hub_id(source)
    check_dataset_source(name, f"data source {source!r}: data set")
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


def is_hub_dataset(source: str | os.PathLike) -> bool:
    """True when ``source`` would be read with ``datasets.load_dataset`` (no such local path)."""
    p = Path(str(source))
    return not p.exists() and p.suffix not in FILE_SUFFIXES and str(source) != "builtin"


def is_hidden(path: Path, root: Path) -> bool:
    """True when a file or folder name on ``path`` below ``root`` starts with ``'.'`` (``.ipynb_checkpoints/``,
    ``.cache/``, editor swap files): never data."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def data_files(directory: Path) -> tuple[list[Path], list[Path]]:
    """``(data files, hidden data files)`` below ``directory``, each in sorted order: the files with a data suffix,
    split by :func:`is_hidden` (the hidden ones are skipped by :func:`iter_rows`)."""
    found = sorted(f for f in directory.rglob("*") if f.is_file() and f.suffix in FILE_SUFFIXES)
    return [f for f in found if not is_hidden(f, directory)], [f for f in found if is_hidden(f, directory)]


def iter_rows(source: str | os.PathLike) -> Iterator[tuple[str, str, Any]]:
    """Yield ``(source_name, where, raw_row)`` for every record of ``source`` (see module doc)."""
    p = Path(str(source))
    if p.is_dir():
        files, hidden = data_files(p)
        if hidden:
            log.warning("%s: skipped %d hidden file(s) (a name or folder starting with '.', e.g. %s)", p, len(hidden),
                        ", ".join(str(f.relative_to(p)) for f in hidden[:3]))
        if not files:
            raise InputNotFoundError(f"SFT data directory {p} holds no {'/'.join(FILE_SUFFIXES)} files"
                                     + (f" (besides {len(hidden)} hidden one(s), skipped)" if hidden else ""))
        for f in files:
            yield from iter_rows(f)
        return
    if p.suffix in FILE_SUFFIXES:
        if not p.is_file():
            raise InputNotFoundError(f"SFT data file not found: {p}")
        reader = {".jsonl": iter_jsonl, ".json": _iter_json, ".parquet": _iter_parquet}[p.suffix]
        for where, row in reader(p):
            yield p.stem, where, row
        return
    if p.suffix:
        raise DataFormatError(f"{p}: unsupported file type {p.suffix!r}; use one of {list(FILE_SUFFIXES)}")
    name = source_name(source)
    for where, row in _iter_hub(str(source)):
        yield name, where, row


def read_records(
    sources: str | os.PathLike | Sequence[str | os.PathLike],
    field_map: Mapping[str, str] | None = None,
    keep_fields: Sequence[str] = (),
) -> list[dict]:
    """Read, validate and normalise every record of one or several sources (see module doc).

    ``keep_fields``: raw fields copied onto each canonical record as they are (e.g. ``("source",)`` to stratify a
    sample by it); a row without one of them raises :class:`DataFormatError` naming the row.

    Raises :class:`DataFormatError` / ``FileNotFoundError`` naming file, line/row and field, and on
    duplicate ids (naming both places).
    """
    fm = resolve_field_map(field_map)
    srcs = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not srcs:
        raise UserInputError("read_records: no sources given")
    records: list[dict] = []
    seen: dict[str, str] = {}
    for src in srcs:
        counters: dict[str, int] = {}
        for name, where, row in iter_rows(src):
            idx = counters.get(name, 0)
            counters[name] = idx + 1
            rec = normalize_row(row, field_map=fm, where=where, default_id=f"{name}-{idx:06d}", default_task=name)
            for field in keep_fields:
                if not isinstance(row, Mapping) or field not in row:
                    raise DataFormatError(f"{where}: no field {field!r} (asked to keep it); the row's fields: "
                                          f"{sorted(row) if isinstance(row, Mapping) else type(row).__name__}")
                rec[field] = row[field]
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

    Written to a temporary file and renamed, so readers never see a half-written file (and a failed write, e.g. a
    full disk, leaves none).
    """
    path = Path(path)
    with open_atomic(path) as f:
        for r in records:
            line = {**r, "id": json_id(r["id"])} if "id" in r else dict(r)  # an integer id stays one
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    return path
