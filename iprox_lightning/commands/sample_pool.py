"""Write a stratified random sample of a pool (each source in proportion to its size), to score a large pool in part."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import OutputExistsError, OutputIsDirectoryError, UserInputError


def sample_pool(pool: str, n: int, output: str, by: str = "source", seed: int = 0, overwrite: bool = False) -> str:
    """Draw ``n`` records of ``pool`` without replacement, each stratum (value of the field ``by``) getting its share
    ``n·|stratum|/|pool|`` (largest remainder; :func:`~iprox_lightning.data.splits.stratified_sample`), and write them
    to ``output`` as JSON Lines: the rows as they are in the pool, every field kept, with their ids (and categories)
    filled in as the pool reader names them, so the sample's records are the pool's.

    Args:
        pool: the pool (a JSONL / JSON / Parquet file, a directory of them, a Hugging Face dataset id).
        n: the sample size (at most the pool's size).
        output: the JSONL file to write. An existing file holding another sample is not replaced unless
            ``overwrite`` is set; the same sample again is left as it is.
        by: the field whose values are the strata (every row must have it), e.g. ``source`` or ``category``.
        seed: seed of the draw within each stratum.
        overwrite: replace ``output`` even when it holds something else.
    """
    from ..data.sources import iter_rows, write_records_jsonl  # lazy: --help
    from ..data.splits import stratified_sample  # lazy: --help
    from ..io.records import DataFormatError, json_id, normalize_row  # lazy: --help

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UserInputError(f"--n must be >= 1, got {n}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserInputError(f"--seed must be an integer >= 0, got {seed}")
    out = Path(output)
    if out.is_dir():
        raise OutputIsDirectoryError(f"--output {out} is a directory; name a file, e.g. {out / 'pool_sample.jsonl'}")
    if out.suffix != ".jsonl":
        raise UserInputError(f"--output {out}: the sample is written as JSON Lines; name a .jsonl file")
    src = Path(str(pool))
    if src.exists() and (out.resolve() == src.resolve() or (src.is_dir() and out.resolve().is_relative_to(src.resolve()))):
        raise UserInputError(f"--output {out} would {'replace' if src.is_file() else 'go inside'} the pool {pool}; "
                         "choose another output file")
    from ..io.output_guard import check_output_not_input  # lazy: --help

    check_output_not_input(out, {"pool": str(pool)}, "--output")  # by identity: a hard link of the pool too
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
    if n > len(rows):
        raise UserInputError(f"--n {n} is more than the {len(rows)} records of {pool}")
    sample = stratified_sample(rows, n, seed, by=by)
    same = False
    if out.exists() or out.is_symlink():
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
    if not same:
        write_records_jsonl(sample, out)
    counts = Counter(str(r[by]) for r in sample)
    print(f"sample_pool: {n} of {len(rows):,} records of {pool}, stratified by {by!r} (seed {seed}): "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
          + f" -> {out}" + (" (already there, unchanged)" if same else ""))
    return str(out)
