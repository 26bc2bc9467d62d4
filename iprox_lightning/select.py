"""Top-k data selection from an influence score table.

``select(scores_path, k=0.05, ...)`` reads the table written by ``InfluenceWriter`` (or
``ScoreTable.save``), ranks examples by score (higher = more useful; ties broken by id so the
result is deterministic), optionally de-duplicates and writes the subset as JSONL in the Dolly
schema with the ids kept — the file ``SFTDataModule(selected=..., train_split="selected")`` reads.

* ``k``: an ``int`` count, or a ``float`` fraction in ``(0, 1]`` of the ranked examples
  (paper: 5%); the count is ``round(k · n)``, at least 1.
* ``per_task=True`` ranks by LESS's aggregate ``max_T score_T(z)`` (column ``score_max``) instead
  of the score against the pooled validation gradient (``score``).
* Examples flagged ``zero_grad`` (no response token, no gradient) are never selected.
* ``dedup=True``: one row per id (highest score kept); with ``pool`` also one example per
  identical text (instruction, context, response after whitespace normalisation).
* ``pool``: the candidate pool the records are copied from — any source ``SFTDataModule`` reads
  (``builtin``, a JSONL/JSON/Parquet file, a directory, a HF dataset id, a list of these; in Python
  also a ``datasets.Dataset`` or a list of record dicts). Default: ``builtin`` when every scored id is
  a built-in id. Without a pool the output holds ``{"id", "score"}`` rows only (and says so).

A ``<output>.meta.json`` next to the output records the settings, the selected ids with scores and
the selection's explanation (:mod:`iprox_lightning.selection_summary`: share per category vs the pool,
per validation task, lengths, top/bottom examples), which ``select`` also prints.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence

TEXT_FIELDS = ("instruction", "context", "response")


def _read_scores(path: str):
    from .io.scores import read_table

    return read_table(path)


def _table_fingerprint(src: Path) -> str | None:
    """Digest of the fingerprint recorded next to a merged score table (``None`` for other tables)."""
    from .io.fingerprint import digest
    from .io.scores import read_settings

    fp = read_settings(src.parent).get("fingerprint") if src.name == "scores.parquet" else None
    return digest(fp) if fp else None


def _default_pool(ids: Sequence[str]):
    from .data.synthetic import builtin_family

    try:
        for i in ids:
            builtin_family(i)
    except ValueError:
        return None
    return "builtin" if ids else None


def _norm_text(rec: dict) -> tuple:
    return tuple(" ".join(str(rec.get(f) or "").split()) for f in TEXT_FIELDS)


def select(
    scores_path: str,
    *,
    k: int | float = 0.05,
    per_task: bool = False,
    dedup: bool = True,
    pool: str | list[str] | None = None,
    output: str,
    quiet: bool = False,
    skip_flagged: bool = False,
) -> str:
    """Write the top-``k`` examples of ``scores_path`` to ``output`` (JSONL), print what was selected and
    return the output path.

    Args:
        scores_path: score table (Parquet) written by the scoring stage, or its directory.
        k: an int count, or a float fraction in (0, 1] of the ranked examples (paper: 0.05).
        per_task: rank by LESS's max over validation tasks (``score_max``) instead of ``score``.
        dedup: one row per id and, with a pool, one example per identical text.
        pool: the candidate pool to copy records from (any source SFTDataModule reads; default
            ``builtin`` when all ids are built-in ids, else ids and scores only).
        output: the JSONL file to write (``<output>.meta.json`` goes next to it).
        quiet: do not print the explanation.
        skip_flagged: leave out rows flagged ``nonfinite`` (NaN/inf gradient) or holding a NaN/inf score,
            and report how many; without it such rows stop the selection with an error naming them.
    """
    src, table = _read_scores(scores_path)
    col = "score_max" if per_task else "score"
    if col not in table.column_names:
        raise ValueError(f"{src}: column {col!r} missing (per_task={per_task}); columns: {table.column_names}")
    ids = [str(i) for i in table.column("id").to_pylist()]
    scores = [float(s) for s in table.column(col).to_pylist()]
    flags = table.column("zero_grad").to_pylist() if "zero_grad" in table.column_names else [False] * len(ids)
    nonfin = table.column("nonfinite").to_pylist() if "nonfinite" in table.column_names else [False] * len(ids)
    bad = [(i, s) for s, i, nf in zip(scores, ids, nonfin) if nf or not math.isfinite(s)]
    if bad and not skip_flagged:
        raise ValueError(
            f"{src}: {len(bad)} row(s) have a non-finite {col!r} or are flagged 'nonfinite' (NaN/inf gradient), "
            f"e.g. {', '.join(f'{i!r} -> {s}' for i, s in bad[:3])}; fix the scoring (e.g. float32 instead of "
            "float16) or pass skip_flagged=True (CLI: --skip_flagged true) to leave them out")
    bad_ids = {i for i, _ in bad}
    rows = [(s, i) for s, i, z in zip(scores, ids, flags) if not z and i not in bad_ids]
    from .io.scores import topk_order

    rows = [rows[j] for j in topk_order([r[0] for r in rows], [r[1] for r in rows])]  # score desc, then id
    if dedup:
        seen: set[str] = set()
        rows = [r for r in rows if not (r[1] in seen or seen.add(r[1]))]
    elif len(set(ids)) != len(ids):
        raise ValueError(f"{src}: duplicate ids in the score table and dedup=False")

    from .data.pool import describe, read_pool

    if pool is None:
        pool = _default_pool(ids)
    pools = [] if pool is None else [describe(pool)]
    pool_records = read_pool(pool) if pool is not None else []
    records = {r["id"]: r for r in pool_records}
    if pools:
        missing = [i for _, i in rows if i not in records]
        if missing:
            raise ValueError(f"{len(missing)} scored id(s) not found in pool {pools}, e.g. {missing[:5]}")
        if dedup:
            seen_text: set[tuple] = set()
            kept = []
            for r in rows:
                key = _norm_text(records[r[1]])
                if key not in seen_text:
                    seen_text.add(key)
                    kept.append(r)
            rows = kept

    n = len(rows)
    from .io.scores import topk_count

    chosen = rows[:topk_count(k, n)]

    out = Path(output)
    meta = {
        "scores": str(src), "scores_fingerprint": _table_fingerprint(src), "k": k, "count": len(chosen), "ranked": n,
        "column": col, "per_task": per_task, "dedup": dedup, "pool": pools,
        "skipped": {"zero_grad": int(sum(bool(z) for z in flags)), "nonfinite": len(bad)},
        "selected": [{"id": i, "score": s} for s, i in chosen],
    }
    if pools:
        from .selection_summary import explain_selection, format_selection

        table_rows = {str(r["id"]): r for r in table.to_pylist()}
        meta["explanation"] = explain_selection([i for _, i in chosen], pool_records, table_rows)
    from .io.selection import write_selection

    write_selection(out, [(i, s) for s, i in chosen], records if pools else None, meta)
    if bad and not quiet:
        print(f"select: skipped {len(bad)} row(s) flagged 'nonfinite' (NaN/inf), e.g. {sorted(bad_ids)[:3]}")
    if not quiet:
        what = "records (Dolly schema, ids kept)" if pools else "{id, score} rows (no pool given: pass --pool to copy the records)"
        print(f"select: wrote {len(chosen)} of {n} ranked examples ({col}, k={k}) as {what} to {out}"
              f" (+ {out.name}.meta.json)")
        if pools:
            print(format_selection(meta["explanation"]))
    return str(out)
