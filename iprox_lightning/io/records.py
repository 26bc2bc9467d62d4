"""The on-disk record format that pool files and the selection file share: UTF-8 / JSON Lines reading
whose errors name the file, line and byte offset, and the canonical SFT record (Dolly schema or a chat
``messages`` list) with its validation, :func:`normalize_row`. Which sources hold records and how they are
read (files, directories, the hub) is :mod:`iprox_lightning.data.sources`; its module doc describes the schema."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Iterator, Mapping

from ..errors import UserInputError

CANONICAL_FIELDS: tuple[str, ...] = ("id", "instruction", "context", "response", "category", "messages")

MAX_ID_BYTES = 4096
"""The longest id a record may have (UTF-8 bytes). Ids travel with every row into score tables, selections and a
gradient store's shard headers (safetensors keeps a shard's metadata under 100 MB): a pool of 1 MB ids made
``build_store`` grow to 875 MB and fail inside safetensors, leaving the store unfinished. Refused when read."""
MAX_ID_CHARS = MAX_ID_BYTES // 4  # below this many characters an id is within MAX_ID_BYTES whatever its characters
DEFAULT_FIELD_MAP: dict[str, str] = {f: f for f in CANONICAL_FIELDS}
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant")


class DataFormatError(UserInputError):
    """Bad SFT input; the message names the file (or dataset), the line/row and the field."""


def resolve_field_map(field_map: Mapping[str, str] | None) -> dict[str, str]:
    """The full canonical-name -> column-name mapping (defaults for unmapped names)."""
    fm = dict(DEFAULT_FIELD_MAP)
    for key, col in (field_map or {}).items():
        if key not in DEFAULT_FIELD_MAP:
            raise UserInputError(f"field_map: unknown field {key!r}; the canonical fields are {list(CANONICAL_FIELDS)}")
        if not isinstance(col, str) or not col:
            raise UserInputError(f"field_map[{key!r}] must be a non-empty column name, got {col!r}")
        fm[key] = col
    return fm


# ----------------------------------------------------------------------------- text and JSON Lines
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


class IntId(str):
    """A record id the pool gave as a JSON integer. It is the id's text everywhere inside (score tables, digests,
    lookups, ordering: a ``str``), and :func:`json_id` gives the integer back, so a file written from the records
    (a selection, a pool sample) keeps each id with its JSON type: ``7`` stays ``7`` and ``"7b"`` stays ``"7b"``."""

    __slots__ = ()

    def __reduce__(self):  # pickled (DataLoader workers) as what it is
        return IntId, (str(self),)


def json_id(rid: Any) -> Any:
    """The id as the pool's JSON had it: an :class:`IntId` as an ``int``, anything else as it is."""
    return int(rid) if isinstance(rid, IntId) else rid


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
    rid = IntId(rid) if isinstance(rid, int) else str(rid)  # the text inside; the JSON type kept for writers
    if not rid.strip():
        raise DataFormatError(f"{where}: field {fm['id']!r} (id) is empty")
    if len(rid) > MAX_ID_CHARS and len(rid.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise DataFormatError(f"{where}: field {fm['id']!r} (id) is {len(rid.encode('utf-8', 'surrogatepass')):,} "
                              f"bytes, more than an id may be ({MAX_ID_BYTES:,} bytes of UTF-8): ids are kept in every "
                              "score table, selection and store shard; give the row a shorter id")
    task = _get_str(row, fm, "category", where, required=False, non_empty=False)
    task = task if task and task.strip() else default_task
    if fm["messages"] in row and fm["instruction"] not in row:
        return {"id": rid, "category": task, "messages": _check_messages(row[fm["messages"]], where, fm["messages"])}
    instruction = _get_str(row, fm, "instruction", where, required=True, non_empty=True)
    context = _get_str(row, fm, "context", where, required=False, non_empty=False) or ""
    response = _get_str(row, fm, "response", where, required=True, non_empty=True)
    return {"id": rid, "category": task, "instruction": instruction, "context": context, "response": response}


def records_digest(records: Iterable[Mapping]) -> dict:
    """``{"n": count, "content": digest}`` of canonical records, taken in id order: the same records under the same
    ids give the same digest whatever their order; a record edited, added or removed, or ids that moved to other
    records (a re-sorted pool whose ids are row numbers) change it."""
    h = hashlib.sha256()
    rows = sorted((str(r["id"]), json.dumps(dict(r), sort_keys=True, ensure_ascii=False)) for r in records)
    for _, line in rows:
        h.update(line.encode() + b"\n")
    return {"n": len(rows), "content": h.hexdigest()[:16]}
