"""The selection file: the only reader and writer of ``select``'s output.

One format (:data:`SCHEMA_VERSION` 1): a JSON Lines file, one selected example per line, best first, each
line ``{"id", "score", <record fields>}`` — the record fields (Dolly schema: ``category``,
``instruction``, ``context``, ``response``, or ``messages``) are present on every line when a pool was
given, on none otherwise. ``<file>.meta.json`` next to it records ``schema_version``, ``records`` (whether
the lines carry the records), the score table and its fingerprint, the settings, the selected ids with
scores, how many flagged rows were skipped, and the explanation.

:func:`read_selection` reads the lines by what the meta says (no guessing): records as they are, or ids
resolved against the pool. A hand-made file without meta is read line by line: a line with
``instruction``/``response`` (or ``messages``) is a record, a line with only ``id`` (and ``score``) is
resolved against the pool.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import UserInputError
from .atomic import open_atomic
from .jsonfile import read_json
from .scores import write_json_atomic

SCHEMA_VERSION = 1
RECORD_KEYS = ("instruction", "response", "messages")


def meta_path(path: str | os.PathLike) -> Path:
    return Path(f"{path}.meta.json")


def write_selection(path: str | os.PathLike, rows: Sequence[tuple[str, float]], records: Mapping[str, dict] | None,
                    meta: Mapping[str, Any]) -> Path:
    """Write ``rows`` (``(id, score)``, best first) with their pool ``records`` (or ``None``) and the meta."""
    from .records import json_id  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    out = Path(path)
    with open_atomic(out) as f:
        for i, s in rows:
            line = {"id": i, "score": s}
            if records is not None:  # the pool's id, with its JSON type (an integer id stays an integer)
                line = {"id": json_id(records[i].get("id", i)), "score": s}
                line.update({k: v for k, v in records[i].items() if k != "id"})
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    write_json_atomic(meta_path(out), {"schema_version": SCHEMA_VERSION, "records": records is not None, **meta})
    return out


def read_meta(path: str | os.PathLike) -> dict | None:
    p = meta_path(path)
    if not p.exists():
        return None

    return read_json(p, what="selection meta")


def read_selection(path: str | os.PathLike, pool_records: Sequence[dict] | Callable | None = None,
                   pool_name: Any = None) -> list[dict]:
    """The selected examples as canonical records (file order). Lines without records are resolved by id
    against ``pool_records`` (a list, or a callable returning it, called only when needed); raises naming the file and line on a bad line or an id not in the pool."""
    from .records import DataFormatError, iter_jsonl, normalize_row  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    meta = read_meta(path)
    if meta is not None and meta.get("schema_version", SCHEMA_VERSION) > SCHEMA_VERSION:
        raise UserInputError(f"{meta_path(path)}: selection schema version {meta['schema_version']} is newer than this "
                             f"version of iprox_lightning reads ({SCHEMA_VERSION})")
    with_records = None if meta is None else bool(meta.get("records", True))
    by_id = None
    out: list = []
    missing: list[str] = []
    for where, row in iter_jsonl(path):
        if not isinstance(row, dict) or "id" not in row:
            raise DataFormatError(f"{where}: missing field 'id'")
        has = any(k in row for k in RECORD_KEYS)
        if with_records is True and not has:
            raise DataFormatError(f"{where}: {meta_path(path).name} says the lines carry records, but this line has "
                                  f"no 'instruction'/'response' (keys {sorted(row)})")
        if has and with_records is not False:
            out.append(normalize_row(row, field_map=None, where=where, default_id=str(row["id"]), default_task="selected"))
            continue
        if by_id is None:
            if pool_records is None:
                raise DataFormatError(f"{where}: the selection holds ids only; a pool is needed to resolve them")
            recs = pool_records() if callable(pool_records) else pool_records
            by_id = {str(r["id"]): r for r in recs}
        rid = str(row["id"])
        if rid not in by_id:
            missing.append(f"{rid!r} ({where.rsplit(', ', 1)[-1]})")
            continue
        out.append(by_id[rid])
    if missing:
        raise DataFormatError(f"{path}: {len(missing)} selected id(s) are not in the pool {pool_name}, e.g. "
                              f"{', '.join(missing[:3])}")

    twice = sorted(i for i, n in Counter(str(r["id"]) for r in out).items() if n > 1)
    if twice:
        raise DataFormatError(f"{path}: id(s) selected more than once: {', '.join(map(repr, twice[:5]))} (a selection "
                              "holds each example once)")
    count = (meta or {}).get("count")
    if isinstance(count, int) and count != len(out):
        raise DataFormatError(f"{path}: holds {len(out)} examples, its {meta_path(path).name} says count {count} (the "
                              "file was cut or added to after select wrote it)")
    return out
