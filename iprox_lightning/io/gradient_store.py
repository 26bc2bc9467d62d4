"""The gradient store: the only reader and writer of a store directory (projected per-example gradients of a pool).

Layout::

    store.json                                # schema_version, fingerprint, settings, layout, pool provenance, state
    projection.safetensors                    # the seeded projections, "<key>|out" / "<key>|in" (identity: absent)
    kfac-<digest>.safetensors                 # the metric's fitted factors (K-FAC / EK-FAC), if any (io/factors.py)
    shards/rank000-<run>-00000.safetensors    # per-rank shards, written atomically (temp file + os.replace)
    shards/corrupt/...                        # unreadable shards moved aside on resume (their ids built again)
    .store.lock                               # held (flock) by the build writing here: a second build is refused
    cache/validation/<fingerprint>.safetensors  # a query's projected validation gradients (+ .json), for re-queries

A shard holds ``vectors [n, D]`` (``float32`` / ``float16`` / ``bfloat16``, the store's ``dtype``), ``n_tokens [n]``
(int64), ``zero_grad [n]`` and ``nonfinite [n]`` (bool); its metadata holds ``ids`` and ``tasks`` (JSON lists).
Safetensors only: nothing is ever unpickled.

``store.json``'s **fingerprint** records what produced the vectors: the model's identity, the settings (projection
size and seed, metric and its options, tracked layers, dtypes, tokenization) and the digest of the tokenized pool.
A build into a directory whose fingerprint differs raises :class:`~.fingerprint.FingerprintMismatch` naming every
field that differs; a query refuses a store whose model (or, when given, pool) is not the one it names. A killed
build continues where it stopped: the ids of the readable shards are skipped (exactly once: the reader keeps the first
occurrence of an id, in shard name order).

``store.json`` also records the store's size once the build is complete: ``bytes`` (the shard files together) and
``bytes_per_example`` (``bytes / rows``), and its **contents** (:func:`contents_manifest`): every shard with its rows
and SHA-256, and the SHA-256 of the projection and factor files. A query reads a store only after
:func:`verify_contents` found exactly those files, unchanged: a shard deleted, added (another store's) or replaced, or
projections / factors swapped, is refused naming the file.

**The query cache** (``cache/``, :func:`save_validation_gradients` / :func:`load_validation_gradients`): a query
computes the projected gradients of its validation set — the only model work it does — and keeps them under the
fingerprint of everything they depend on (:func:`validation_cache_fingerprint`: the store's fingerprint, layout and
storage, its projection and factor files, the tokenized validation set, the batch size); a re-query of the same
validation set (another rule, ``--neighbours``, another output directory) reads them instead. Entries are written
atomically (:class:`~.tensor_cache.TensorCache`); a rebuild with ``overwrite`` removes them.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import UserInputError
from .atomic import atomic_path
from .fingerprint import FingerprintMismatch, diff, digest, file_identity, sort_safetensors_metadata
from .jsonfile import Fields, read_json, read_safetensors_header
from .ownership import check_owned
from .scores import write_json_atomic
from .tensor_cache import TensorCache

SCHEMA_VERSION = 1
STORE_FILE = "store.json"
PROJECTION_FILE = "projection.safetensors"
SHARD_DIR = "shards"
CORRUPT_DIR = "corrupt"
LOCK_FILE = ".store.lock"
CACHE_DIR = "cache"
CACHE_FORMAT = 1
STORAGE_DTYPES = ("float32", "float16", "bfloat16")


class StoreFormatError(UserInputError):
    """A store directory or one of its files is missing, malformed or of another version."""


def storage_dtype(name: str):
    if name not in STORAGE_DTYPES:
        raise UserInputError(f"store dtype must be one of {STORAGE_DTYPES}, got {name!r}")
    return getattr(torch, name)


# ----------------------------------------------------------------------------------- store.json
def read_info(store_dir: str | os.PathLike, *, required: bool = True) -> dict:
    """The parsed ``store.json`` (``{}`` when absent and not ``required``)."""
    p = Path(store_dir) / STORE_FILE
    if not p.exists():
        if required:
            raise StoreFormatError(f"{store_dir} is not a gradient store: {p} not found (build one with "
                                   "`python train.py build_store`)")
        return {}

    info = read_json(p, error=StoreFormatError, what="gradient store record")
    if info.get("schema_version") != SCHEMA_VERSION:
        raise StoreFormatError(f"{p}: field 'schema_version' is {info.get('schema_version')!r}, this version reads "
                               f"{SCHEMA_VERSION}")
    check_info_fields(p, info)
    return info


def check_info_fields(p: Path, info: Mapping) -> None:
    """Every field of ``store.json`` a build or query reads has its type and a possible value, and the layout adds up:
    each tracked weight's block (``k_out × k_in`` numbers, ``1 <= k <= `` the weight's side) starts where the previous
    one ended, and the blocks fill ``dim``. Refused naming the file and field (an edited or foreign record)."""
    f = Fields(p, StoreFormatError)
    fp = f.get(info, "fingerprint", "object")
    f.get(fp, "settings", "object", at="fingerprint")
    f.get(fp, "model", "object|null", at="fingerprint", default=None)
    f.get(fp, "pool", "object|null", at="fingerprint", default=None)
    dim = f.get(info, "dim", "int", minimum=1)
    f.get(info, "dtype", "str", choices=STORAGE_DTYPES)
    f.get(info, "rows", "int", minimum=0, default=None)
    f.get(info, "complete", "bool", default=None)
    tok = f.get(info, "tokenization", "object", default=None)
    if tok is not None:
        f.get(tok, "max_length", "int", at="tokenization", minimum=2, default=None)
        f.get(tok, "batch_size", "int", at="tokenization", minimum=1, default=None)
    factors = f.get(info, "factors", "str|null", default=None)
    if factors is not None and (Path(factors).name != factors or factors in ("", ".", "..")):
        raise f.fail("factors", f"is {factors!r}: a file name inside the store, not a path")
    layout = f.get(info, "layout", "list")
    offset, keys = 0, set()
    for j, row in enumerate(layout):
        at = f"layout[{j}]"
        f.check(at, row, "object")
        key = f.get(row, "key", "str", at=at)
        if key in keys:
            raise f.fail(f"{at}.key", f"is {key!r} a second time")
        keys.add(key)
        out_f, in_f = f.get(row, "out", "int", at=at, minimum=1), f.get(row, "in", "int", at=at, minimum=1)
        k_out, k_in = f.get(row, "k_out", "int", at=at, minimum=1), f.get(row, "k_in", "int", at=at, minimum=1)
        if k_out > out_f or k_in > in_f:
            raise f.fail(at, f"projects a {out_f} x {in_f} weight to {k_out} x {k_in}: more rows than the weight has")
        if f.get(row, "offset", "int", at=at, minimum=0) != offset:
            raise f.fail(f"{at}.offset", f"is {row['offset']}, but the blocks before it end at {offset}")
        offset += k_out * k_in
    if offset != dim:
        raise f.fail("dim", f"is {dim}, but the layout's blocks hold {offset} numbers")
    contents = f.get(info, "contents", "object", default=None)
    if contents is not None:
        for name, rec in f.get(contents, "shards", "object", at="contents").items():
            at = f"contents.shards.{name}"
            f.check(at, rec, "object")
            f.get(rec, "rows", "int", at=at, minimum=0)
            f.get(rec, "sha256", "str", at=at)
        for name, sha in f.get(contents, "files", "object", at="contents", default={}).items():
            f.check(f"contents.files.{name}", sha, "str")


def write_info(store_dir: str | os.PathLike, info: Mapping) -> Path:
    return write_json_atomic(Path(store_dir) / STORE_FILE, {**info, "schema_version": SCHEMA_VERSION})


def check_store_fingerprint(store_dir: str | os.PathLike, fingerprint: Mapping, *, hint: str) -> None:
    """Refuse to continue a build in ``store_dir`` unless its recorded fingerprint equals ``fingerprint`` (nothing
    to check in an empty directory)."""
    out = Path(store_dir)
    n = len(shard_files(out))
    info = read_info(out, required=False)
    if not n and not info:
        return
    old = info.get("fingerprint")
    if old is None:
        raise FingerprintMismatch(f"{out} holds {n} store shard(s) but no {STORE_FILE} fingerprint, so it cannot be "
                                  f"told what produced them; {hint}")
    lines = diff(old, dict(fingerprint))
    if lines:
        raise FingerprintMismatch(f"{out} holds a gradient store built from different inputs; refusing to continue or "
                                  f"reuse it. What differs (store -> now):\n  " + "\n  ".join(lines) + f"\n{hint}")


def clear_store(store_dir: str | os.PathLike) -> None:
    """Remove a store's shards, settings, projections and factors (a build then starts fresh); only from a directory
    the package marked as a gradient store (:mod:`.ownership`), else
    :class:`~iprox_lightning.errors.OutputExistsError`."""
    out = Path(store_dir)
    if (any(os.path.lexists(out / n) for n in (SHARD_DIR, CACHE_DIR, STORE_FILE, PROJECTION_FILE))
            or any(out.glob("*kfac-*.safetensors"))):
        check_owned(out, "gradient store", option="overwrite", what="the store would be cleared")
    shutil.rmtree(out / SHARD_DIR, ignore_errors=True)
    shutil.rmtree(out / CACHE_DIR, ignore_errors=True)
    for name in (STORE_FILE, PROJECTION_FILE):
        (out / name).unlink(missing_ok=True)
    for f in out.glob("*kfac-*.safetensors"):  # saved factors (io/factors.py names them <method>-<digest>)
        f.unlink()


# ----------------------------------------------------------------------------------- tensors files
def save_tensors(path: str | os.PathLike, tensors: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` as safetensors, atomically (temp file + ``os.replace``)."""
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().clone().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata) if metadata else None)
        sort_safetensors_metadata(tmp)  # the same tensors and metadata: the same bytes
    return Path(path)


def load_tensors(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tensors, metadata)`` of a safetensors file; a missing or unreadable one raises naming it."""
    p = Path(path)
    if not p.exists():
        raise StoreFormatError(f"{p} not found")

    read_safetensors_header(p, error=StoreFormatError)
    try:
        with safe_open(str(p), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises several types for a damaged file
        raise StoreFormatError(f"{p}: cannot read safetensors file ({type(e).__name__}: {e})") from None


def save_projections(store_dir: str | os.PathLike, projections: Mapping[str, tuple[Any, Any]]) -> Path:
    """``{key: (P_out or None, P_in or None)}`` -> ``projection.safetensors`` (identities are not written)."""
    t = {}
    for key, (p_out, p_in) in projections.items():
        if p_out is not None:
            t[f"{key}|out"] = p_out
        if p_in is not None:
            t[f"{key}|in"] = p_in
    return save_tensors(Path(store_dir) / PROJECTION_FILE, t, {"keys": json.dumps(list(projections))})


def load_projections(store_dir: str | os.PathLike) -> dict[str, tuple[Any, Any]]:
    """``{key: (P_out or None, P_in or None)}`` as saved by :func:`save_projections`."""
    t, meta = load_tensors(Path(store_dir) / PROJECTION_FILE)
    try:
        keys = json.loads(meta["keys"])
    except (KeyError, json.JSONDecodeError):
        raise StoreFormatError(f"{Path(store_dir) / PROJECTION_FILE}: metadata field 'keys' is missing or malformed") \
            from None
    return {k: (t.get(f"{k}|out"), t.get(f"{k}|in")) for k in keys}


# ----------------------------------------------------------------------------------- shards
def shard_files(store_dir: str | os.PathLike) -> list[str]:
    """Complete shard files in name order (temp files and moved-aside ones ignored)."""
    return sorted(glob.glob(os.path.join(str(store_dir), SHARD_DIR, "rank*.safetensors")))


def shard_name(rank: int, run: str, seq: int) -> str:
    return f"rank{rank:03d}-{run}-{seq:05d}.safetensors"


def write_shard(store_dir: str | os.PathLike, name: str, *, ids: Sequence[str], tasks: Sequence[Any], vectors,
                n_tokens, zero_grad, nonfinite) -> Path:
    """One shard of ``len(ids)`` rows (``vectors`` already in the store's dtype)."""
    n = len(ids)
    if vectors.shape[0] != n:
        raise ValueError(f"shard {name}: {vectors.shape[0]} vectors for {n} ids")
    return save_tensors(Path(store_dir) / SHARD_DIR / name, {
        "vectors": vectors, "n_tokens": torch.as_tensor(n_tokens, dtype=torch.int64).reshape(n),
        "zero_grad": torch.as_tensor(zero_grad, dtype=torch.bool).reshape(n),
        "nonfinite": torch.as_tensor(nonfinite, dtype=torch.bool).reshape(n)},
        {"ids": json.dumps([str(i) for i in ids]), "tasks": json.dumps([None if t is None else str(t) for t in tasks])})


def _read_shard(path: str, vectors: bool = True) -> dict:
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        ids, tasks = json.loads(meta["ids"]), json.loads(meta["tasks"])
        out = {"ids": ids, "tasks": tasks}
        for k in (("vectors",) if vectors else ()) + ("n_tokens", "zero_grad", "nonfinite"):
            out[k] = f.get_tensor(k)
    if len(ids) != len(tasks) or len(out["n_tokens"]) != len(ids) or (vectors and out["vectors"].shape[0] != len(ids)):
        raise ValueError("row counts of ids, tasks and tensors differ")
    return out


def _quarantine(path: str, error: Exception) -> dict:
    src = Path(path)
    dest = src.parent / CORRUPT_DIR / src.name
    dest.parent.mkdir(exist_ok=True)
    shutil.move(str(src), dest)
    msg = str(error).splitlines()[0][:200] if str(error) else ""
    logging.getLogger(__name__).warning("store shard %s is unreadable (%s: %s): moved to %s; its examples will be "
                                        "built again", src, type(error).__name__, msg, dest)
    return {"shard": str(src), "moved_to": str(dest), "error": f"{type(error).__name__}: {msg}",
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def repair_shards(store_dir: str | os.PathLike) -> list[dict]:
    """Move unreadable shards (truncated by a crash) to ``shards/corrupt/``; returns what was moved."""
    repairs = []
    for f in shard_files(store_dir):
        try:
            _read_shard(f, vectors=False)
        except Exception as e:
            repairs.append(_quarantine(f, e))
    return repairs


def done_ids(store_dir: str | os.PathLike) -> set[str]:
    """Ids already in the readable shards (what a resumed build skips)."""
    out: set[str] = set()
    for f in shard_files(store_dir):
        try:
            out.update(_read_shard(f, vectors=False)["ids"])
        except Exception:  # repaired by repair_shards at the start of a build
            continue
    return out


def iter_shards(store_dir: str | os.PathLike, *, vectors: bool = True) -> Iterator[dict]:
    """The store's rows shard by shard, each id once (first occurrence in shard name order): dicts with ``ids``,
    ``tasks``, ``vectors`` (as stored), ``n_tokens``, ``zero_grad``, ``nonfinite``. An unreadable shard raises
    naming it."""
    seen: set[str] = set()
    for f in shard_files(store_dir):
        try:
            s = _read_shard(f, vectors)
        except Exception as e:
            raise StoreFormatError(f"store shard {f} is unreadable ({type(e).__name__}: {e}); resume the build "
                                   "(it moves the shard aside and builds its examples again)") from None
        keep = [j for j, i in enumerate(s["ids"]) if i not in seen]
        seen.update(s["ids"])
        if len(keep) < len(s["ids"]):
            idx = torch.tensor(keep, dtype=torch.long)
            s = {k: ([v[j] for j in keep] if isinstance(v, list) else v[idx]) for k, v in s.items()}
        if s["ids"]:
            yield s


def _sha256(path: str | os.PathLike) -> str:
    return file_identity(path, hash_limit=None)["sha256"]


def _side_files(store_dir: str | os.PathLike, info: Mapping) -> list[str]:
    """The store's files besides its shards that a query reads: the projections and the fitted factors."""
    names = [PROJECTION_FILE] if (Path(store_dir) / PROJECTION_FILE).exists() else []
    return names + ([info["factors"]] if info.get("factors") else [])


def contents_manifest(store_dir: str | os.PathLike, info: Mapping) -> dict:
    """``{"shards": {name: {"rows", "sha256"}}, "files": {name: sha256}}`` of a finished store (what
    :func:`verify_contents` checks before a query)."""
    shards = {}
    for f in shard_files(store_dir):
        shards[Path(f).name] = {"rows": len(_read_shard(f, vectors=False)["ids"]), "sha256": _sha256(f)}
    return {"shards": shards, "files": {n: _sha256(Path(store_dir) / n) for n in _side_files(store_dir, info)}}


def verify_contents(store_dir: str | os.PathLike, info: Mapping) -> None:
    """Refuse a store whose files are not the ones its build recorded (``store.json``'s ``contents``): a shard missing,
    added or changed, a projection or factor file changed, or rows that do not add up to ``rows``."""
    where = Path(store_dir) / STORE_FILE
    rec = info.get("contents")
    if not isinstance(rec, Mapping) or not isinstance(rec.get("shards"), Mapping):
        raise StoreFormatError(f"{where}: no 'contents' record (a store built before it was kept): run the same "
                               "build_store command again (it reuses the shards and records them)")
    have = {Path(f).name: f for f in shard_files(store_dir)}
    want = rec["shards"]
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise StoreFormatError(
            f"{Path(store_dir) / SHARD_DIR}: the shards are not the ones the build recorded in {where}"
            + (f"; missing: {', '.join(missing[:5])}" if missing else "")
            + (f"; not from this build: {', '.join(extra[:5])}" if extra else "")
            + "; rebuild the store (build_store --overwrite true) or restore the files")
    for name, f in have.items():
        if _sha256(f) != want[name].get("sha256"):
            raise StoreFormatError(f"{f}: changed since the build recorded it in {where} (SHA-256 differs); rebuild "
                                   "the store or restore the file")
    rows = sum(s["rows"] for s in want.values())  # integers >= 0 (read_info)
    if rows != info.get("rows"):
        raise StoreFormatError(f"{where}: the shards hold {rows} rows, 'rows' says {info.get('rows')}")
    files = rec.get("files", {})
    for name in sorted(set(files) | set(_side_files(store_dir, info))):
        path = Path(store_dir) / name
        if name not in files or not path.exists() or _sha256(path) != files[name]:
            raise StoreFormatError(f"{path}: not the file the build recorded in {where} (missing or changed); rebuild "
                                   "the store or restore the file")
    check_layout_against_files(store_dir, info)


def check_layout_against_files(store_dir: str | os.PathLike, info: Mapping) -> None:
    """``store.json``'s layout, ``dim``, ``dtype`` and shard rows agree with the files (their headers only: nothing is
    read): each projection ``[k, side]`` as the layout says (identity where absent), each shard's ``vectors`` ``[rows,
    dim]`` in ``dtype``. Refused naming ``store.json``'s field and the file (an edited record)."""
    where = Path(store_dir) / STORE_FILE
    proj = Path(store_dir) / PROJECTION_FILE
    shapes: dict[str, list[int]] = {}
    if proj.exists():
        with safe_open(str(proj), framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    for j, row in enumerate(info["layout"]):
        for side, k, n in (("out", row["k_out"], row["out"]), ("in", row["k_in"], row["in"])):
            have = shapes.get(f"{row['key']}|{side}", [n, n])  # absent: identity
            if have != [k, n]:
                raise StoreFormatError(f"{where}: field 'layout[{j}]' ({row['key']}) says a {k} x {n} '{side}' "
                                       f"projection, {proj.name} holds {have[0]} x {have[1]}")
    shards = info.get("contents", {}).get("shards", {})
    for f in shard_files(store_dir):
        with safe_open(f, framework="pt") as st:
            v = st.get_slice("vectors")
            shape, dtype = list(v.get_shape()), v.get_dtype()
        want_rows = shards.get(Path(f).name, {}).get("rows")
        if len(shape) != 2 or shape[1] != info["dim"] or (want_rows is not None and shape[0] != want_rows):
            raise StoreFormatError(f"{where}: fields 'dim' ({info['dim']}) / 'contents.shards' rows ({want_rows}) "
                                   f"disagree with {f}: vectors {shape}")
        want = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[info["dtype"]]
        if dtype != want:
            raise StoreFormatError(f"{where}: field 'dtype' is {info['dtype']!r}, but {f} stores {dtype} vectors")


def store_size(store_dir: str | os.PathLike, rows: int) -> dict:
    """``{"bytes": the shard files' sizes summed, "bytes_per_example": bytes / rows}`` (what ``store.json`` records)."""
    total = sum(os.path.getsize(f) for f in shard_files(store_dir))
    return {"bytes": total, "bytes_per_example": total / rows if rows else None}


# ----------------------------------------------------------------------------------- the query cache
def validation_cache(store_dir: str | os.PathLike) -> TensorCache:
    return TensorCache(Path(store_dir) / CACHE_DIR, kind="store cache")


def validation_cache_fingerprint(store_dir: str | os.PathLike, info: Mapping, validation: Any, **settings: Any) -> str:
    """What a query's projected validation gradients depend on: the store (its fingerprint: model, projection size
    and seed, metric and options, layers, dtypes, pool; its layout and storage; the identity of its projection and
    factor files), the tokenized validation set (``validation``: its
    :func:`~.fingerprint.loader_digest`, so the examples, tasks, tokenizer, template and ``max_length``) and the
    query's own ``settings`` (batch size, subtasks)."""
    out = Path(store_dir)
    files = {name: file_identity(out / name) for name in (PROJECTION_FILE, info.get("factors")) if name
             and (out / name).is_file()}
    return digest({"format": CACHE_FORMAT, "store": info["fingerprint"], "dtype": info["dtype"], "dim": info["dim"],
                   "layout": info["layout"], "files": files, "validation": validation, **settings})


def save_validation_gradients(store_dir: str | os.PathLike, fp: str, *, task_names: Sequence[str], sums, counts,
                              seconds: float, vectors=None, ids: Sequence[str] | None = None,
                              tasks: Sequence[Any] | None = None) -> Path:
    """Keep a query's validation gradients under ``fp``: ``sums [K, D]`` (per task, float64, as the scores use them)
    and, when given, the per-example ``vectors [n, D]`` with their ``ids`` and ``tasks`` (what ``neighbours`` needs)."""
    tensors = {"sums": sums}
    meta = {"format": CACHE_FORMAT, "task_names": list(task_names), "val_counts": [int(c) for c in counts],
            "seconds": seconds, "vectors": vectors is not None}
    if vectors is not None:
        if ids is None or tasks is None or len(ids) != vectors.shape[0] or len(tasks) != len(ids):
            raise ValueError("save_validation_gradients: vectors need one id and one task each")
        tensors["vectors"] = vectors
        meta.update(ids=[str(i) for i in ids], tasks=[None if t is None else str(t) for t in tasks])
    return validation_cache(store_dir).save("validation", fp, tensors, meta)


def load_validation_gradients(store_dir: str | os.PathLike, fp: str, *, vectors: bool = False) -> dict | None:
    """The entry :func:`save_validation_gradients` wrote under ``fp`` (``None``: none, or — ``vectors`` — one
    without the per-example vectors): ``{"task_names", "sums", "counts", "seconds", "path"}`` (+ ``"vectors"``,
    ``"ids"``, ``"tasks"``)."""
    cache = validation_cache(store_dir)
    entry = cache.load("validation", fp)
    if entry is None:
        return None
    t, meta = entry
    if meta.get("format") != CACHE_FORMAT or "sums" not in t or (vectors and "vectors" not in t):
        return None
    out = {"task_names": list(meta["task_names"]), "sums": t["sums"], "counts": np.asarray(meta["val_counts"], np.int64),
           "seconds": meta.get("seconds"), "path": str(cache.path("validation", fp))}
    if "vectors" in t:
        out.update(vectors=t["vectors"], ids=list(meta["ids"]), tasks=list(meta["tasks"]))
    return out
