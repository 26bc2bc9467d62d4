"""``train.py sample_pool``'s work (:func:`write_pool_sample`): a stratified sample of a pool's rows, written as JSON
Lines with every field kept and the ids (and categories) the pool reader gives them. ``commands/sample_pool.py`` holds
the command's arguments."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import OutputExistsError, UserInputError
from ..io.output_guard import check_output_not_input
from ..io.records import DataFormatError, json_id, normalize_row
from .sources import iter_rows, write_records_jsonl
from .splits import stratified_sample


def write_pool_sample(pool: str, n: int, out: Path, by: str, seed: int, overwrite: bool) -> str:
    """Draw ``n`` rows of ``pool`` stratified by the field ``by`` (seed ``seed``) and write them to ``out`` (left as
    it is when it holds this sample already); print what was drawn and return the path."""
    check_output_not_input(out, {"pool": str(pool)}, "--output")  # by identity: a hard link of the pool too
    rows = _rows_with_ids(pool, by)
    if n > len(rows):
        raise UserInputError(f"--n {n} is more than the {len(rows)} records of {pool}")
    sample = stratified_sample(rows, n, seed, by=by)
    same = _holds_this_sample(out, sample, overwrite)
    if not same:
        write_records_jsonl(sample, out)
    counts = Counter(str(r[by]) for r in sample)
    print(f"sample_pool: {n} of {len(rows):,} records of {pool}, stratified by {by!r} (seed {seed}): "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
          + f" -> {out}" + (" (already there, unchanged)" if same else ""))
    return str(out)


def _rows_with_ids(pool: str, by: str) -> list[dict]:
    """Every row of ``pool`` as it is, with the id and category the pool reader gives it; a row without ``by``, a
    duplicate id or an empty pool is refused."""
    rows, seen, counters = [], {}, {}
    for name, where, row in iter_rows(pool):
        idx = counters.get(name, 0)
        counters[name] = idx + 1
        rec = normalize_row(row, field_map=None, where=where, default_id=f"{name}-{idx:06d}", default_task=name)
        if by not in row:
            raise DataFormatError(f"{where}: no field {by!r} to stratify by (--by {by}); the row's fields: "
                                  f"{sorted(row)}")
        if rec["id"] in seen:
            raise DataFormatError(f"{where}: duplicate id {rec['id']!r} (first seen at {seen[rec['id']]})")
        seen[rec["id"]] = where
        rows.append({**row, "id": json_id(rec["id"]), "category": rec["category"]})
    if not rows:
        raise DataFormatError(f"{pool}: no records")
    return rows


def _holds_this_sample(out: Path, sample: list[dict], overwrite: bool) -> bool:
    """Whether ``out`` holds ``sample`` already; refuses to replace anything else without ``overwrite``, and with it
    anything but a JSONL file of records."""
    if not (out.exists() or out.is_symlink()):
        return False
    try:
        same = [r for _, _, r in iter_rows(out)] == sample
        records = True
    except (DataFormatError, ValueError, OSError):
        same = records = False
    if overwrite and (out.is_symlink() or not records):  # --overwrite replaces a sample (records) only
        what = "a symbolic link" if out.is_symlink() else "not a JSONL file of records"
        raise OutputExistsError(f"--output {out} is {what}: not replaced, even with --overwrite true (the package "
                                "replaces only what it writes). Choose another output, or delete it by hand if it "
                                "is yours to drop")
    if not same and not overwrite:
        raise OutputExistsError(f"--output {out} already exists and holds something else than this sample: not "
                                "overwritten. Pass another --output, or --overwrite true to replace it")
    return same
