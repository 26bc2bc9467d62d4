"""Top-k data selection from an influence score table.

``select(scores_path, k=0.05, ...)`` reads the table written by ``InfluenceWriter`` (or
``ScoreTable.save``), ranks examples by score (higher = more useful; ties broken by id so the
result is deterministic), optionally de-duplicates and writes the subset as JSONL in the Dolly
schema with the ids kept — the file ``SFTDataModule(selected=..., train_split="selected")`` reads.

* ``k``: an ``int`` count, or a ``float`` fraction in ``(0, 1]`` of the ranked examples
  (paper: 5%); the count is ``round(k · n)``, at least 1.
* ``rule`` / ``task``: how the score columns become one ranking (:mod:`iprox_lightning.selection.rules`):
  ``pooled`` (default: the score against the pooled validation gradient), ``mean`` / ``max`` over the parts of
  one target task (``max`` is LESS's max over subtasks), ``balanced`` (task-balanced round-robin).
* Examples flagged ``zero_grad`` (no response token, no gradient) are never selected.
* ``dedup=True``: one row per id (highest score kept); with ``pool`` also one example per
  identical text (instruction, context, response after whitespace normalisation).
* ``pool``: the candidate pool the records are copied from — any source ``SFTDataModule`` reads
  (``builtin``, a JSONL/JSON/Parquet file, a directory, a HF dataset id, a list of these; in Python
  also a ``datasets.Dataset`` or a list of record dicts). Default: ``builtin`` when every scored id is
  a built-in id. Without a pool the output holds ``{"id", "score"}`` rows only (and says so). The pool must be
  the one that was scored (records digest in the score table's ``settings.json``; ``allow_pool_mismatch=True``
  overrides); ``builtin`` is read at the size that was scored.
* ``exclude_categories`` / ``within_shortest``: restrictions of the candidates, each re-ranking among what is left
  (:mod:`iprox_lightning.selection.candidates`: :class:`~.candidates.ExcludeCategories`,
  :class:`~.candidates.WithinShortest`).
* Refused: an empty selection, an id twice, an ``output`` that is the score table, a pool file or inside a pool
  directory.

A ``<output>.meta.json`` next to the output records the settings, the selected ids with scores and
the selection's explanation (:mod:`iprox_lightning.selection.summary`: share per category vs the pool,
per validation task, lengths, top/bottom examples), which ``select`` also prints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..errors import OutputExistsError, OutputIsDirectoryError, UserInputError
from .candidates import Candidates, ExcludeCategories, WithinShortest
from .topk import topk_count


def _table_fingerprint(settings: dict) -> str | None:
    """Digest of the fingerprint recorded next to a merged score table (``None`` for other tables)."""
    from ..io.fingerprint import digest  # lazy: --help

    fp = settings.get("fingerprint")
    return digest(fp) if fp else None


def _default_pool(ids: Sequence[str]):
    from ..data.synthetic import builtin_family  # lazy: --help

    try:
        for i in ids:
            builtin_family(i)
    except ValueError:
        return None
    return "builtin" if ids else None


def _check_selection(chosen: list, src: Path, ranked: int, scored: int, flags: list, bad: list) -> None:
    """Refuse an empty selection and one holding an id twice."""
    if not chosen:
        raise UserInputError(f"{src}: nothing to select: {ranked} example(s) left to rank of {scored} scored "
                             f"({int(sum(bool(z) for z in flags))} without gradient, {len(bad)} non-finite skipped)")
    ids = [i for _, i in chosen]
    if len(set(ids)) != len(ids):
        dup = next(i for j, i in enumerate(ids) if i in ids[:j])
        raise UserInputError(f"{src}: the selection would hold id {dup!r} twice; select with dedup=True")


def _check_output(out: Path, src: Path, pool) -> None:
    """Refuse an output that is a directory, the score table being read, a pool file, or inside a pool directory
    (where the next read of the pool would take the selection for pool data)."""
    if out.is_dir():
        raise OutputIsDirectoryError(f"output {out} is a directory; name a file, e.g. {out / 'selected.jsonl'}")
    from ..io.output_guard import same_file  # lazy: --help

    if out.resolve() == Path(src).resolve() or same_file(out, src):
        raise UserInputError(f"output {out} is the score table being read; choose another output file")
    from ..data.pool import check_output_is_not_input  # lazy: --help

    check_output_is_not_input(out, pool, "output")


def _suggested_output(out: Path, src: Path) -> Path:
    """A selection file named after the score table: ``<out dir>/<scoring dir name>.jsonl`` for ``.../<name>/scores.parquet``,
    else ``<out dir>/<table stem>.jsonl``."""
    src = Path(src)
    name = src.parent.name if src.name == "scores.parquet" else src.stem
    return out.with_name(f"{name}.jsonl")


def _check_not_another_selectors(out: Path, src: Path) -> None:
    """Refuse to replace a selection file that another score table produced (its ``.meta.json`` names it) or whose
    origin is unknown (no meta): each selector keeps its own file unless ``overwrite`` is set."""
    if not out.exists():
        return
    meta = out.with_name(out.name + ".meta.json")
    prev = None
    if meta.is_file():
        from ..io.jsonfile import read_json  # lazy: --help

        try:
            prev = read_json(meta, what="selection meta").get("scores")
        except (UserInputError, OSError):  # damaged: its origin is unknown (refused below unless overwrite)
            prev = None
    if prev is not None and Path(prev).resolve() == Path(src).resolve():
        return  # the same selector again (e.g. another k): its own file
    suggestion = _suggested_output(out, src)
    if suggestion.resolve() == out.resolve():
        suggestion = out.with_name(f"{out.stem}.{Path(src).parent.name or 'new'}.jsonl")
    origin = f"the selection from {prev}" if prev is not None else "a file of unknown origin (no .meta.json)"
    raise OutputExistsError(
        f"output {out} already holds {origin}, not from {src}: not overwritten. Pass --output {suggestion} "
        "(a file of its own), or --overwrite true to replace it")


def _read_scored_pool(src: Path, settings: dict, pool, builtin_size: int | None, allow_mismatch: bool):
    """``(pool descriptions, builtin size, pool records, pool check)`` of ``pool`` (``None``: no pool), checked to be
    the pool the table ``src`` scored (its records digest, in its ``settings``) unless ``allow_mismatch``."""
    from ..data.pool import describe, read_pool  # lazy: --help
    from ..io.scores import check_scored_pool, scored_pool  # lazy: --help

    pools = [] if pool is None else [describe(pool)]
    scored = scored_pool(settings)  # how the scored pool was read, and its records digest
    size = builtin_size or scored.get("builtin_size") or 2000
    pool_records = read_pool(pool, scored.get("field_map"), builtin_size=size) if pool is not None else []
    pool_check = check_scored_pool(src, scored, pool_records, pools[0] if pools else None,
                                   allow_mismatch=allow_mismatch) if pools else "no pool"
    return pools, size, pool_records, pool_check


def select(
    scores_path: str,
    *,
    k: int | float = 0.05,
    rule: str = "pooled",
    task: str | None = None,
    dedup: bool = True,
    pool: str | list[str] | None = None,
    output: str,
    quiet: bool = False,
    skip_flagged: bool = False,
    allow_pool_mismatch: bool = False,
    builtin_size: int | None = None,
    overwrite: bool = False,
    within_shortest: float | None = None,
    exclude_categories: Sequence[str] | None = None,
) -> str:
    """Write the top-``k`` examples of ``scores_path`` to ``output`` (JSONL), print what was selected and
    return the output path.

    Args:
        scores_path: score table (Parquet) written by the scoring stage, or its directory.
        k: an int count, or a float fraction in (0, 1] of the ranked examples (paper: 0.05).
        rule: how the table's columns become one ranking (:mod:`iprox_lightning.selection.rules`): ``pooled``
            (the pooled ``score``), ``mean`` / ``max`` (mean / LESS max over the parts of ``task``, or over every
            task column when no task is given), ``balanced`` (task-balanced round-robin over standardised task
            scores).
        task: the target task to select for (its columns ``score/<task>`` and ``score/<task>.<part>``; rules
            ``mean``, ``max``, ``balanced``).
        dedup: one row per id and, with a pool, one example per identical text.
        pool: the candidate pool to copy records from (any source SFTDataModule reads; default
            ``builtin`` when all ids are built-in ids, else ids and scores only).
        output: the JSONL file to write (``<output>.meta.json`` goes next to it).
        quiet: do not print the explanation.
        skip_flagged: leave out rows flagged ``nonfinite`` (NaN/inf gradient) or holding a NaN/inf score,
            and report how many; without it such rows stop the selection with an error naming them.
        allow_pool_mismatch: select even when ``pool`` is not the pool that was scored (its records digest
            differs from the one in the score table's ``settings.json``); by default that is an error, as the
            ids would copy records that did not earn the scores.
        builtin_size: size of the ``builtin`` pool (default: the size that was scored, from the score table's
            settings; else 2000).
        overwrite: replace ``output`` even when another score table's selection is there (its ``.meta.json`` names
            the table it came from) or a file of unknown origin; by default only the same table's selection is
            replaced, so one selector never silently overwrites another's file.
        within_shortest: rank only among the ``within_shortest · k`` examples with the shortest responses (the
            table's ``n_tokens``; every example tied with the last of them too), e.g. ``2``: the top ``k`` of the
            ``2k`` shortest. The held-out form of short-answer tasks (MMLU, BBH direct answers) rewards short
            responses; this keeps that and lets the scores choose among them. ``None`` (default): every example.
        exclude_categories: leave out the candidates whose pool record's ``category`` matches one of these
            shell-style patterns (``xquad_*``) before ranking (the rule then ranks, and ``within_shortest`` shortlists,
            among the rest; the balanced rule standardises among them), e.g. the source an evaluation set was drawn
            from; needs ``pool``. The meta records the patterns and how many were left out.
    """
    restrictions = ([ExcludeCategories(exclude_categories)] if exclude_categories else []) + \
        ([WithinShortest(within_shortest)] if within_shortest is not None else [])
    from ..io.scores import read_scored  # lazy: --help

    src, table, settings = read_scored(scores_path)  # the table and its settings, read once
    cands = Candidates.rank(src, table, rule, task, dedup=dedup, skip_flagged=skip_flagged)
    ids, flags, bad = cands.ids, cands.flags, cands.bad
    if pool is None:
        pool = _default_pool(ids)
    pools, size, pool_records, pool_check = _read_scored_pool(src, settings, pool, builtin_size, allow_pool_mismatch)
    records = {r["id"]: r for r in pool_records}
    cands.in_pool(records, pools)
    for r in restrictions:
        if not r.needs_count:
            cands.restrict(r)
    n = len(cands.rows)
    count = topk_count(k, n)
    for r in restrictions:
        if r.needs_count:
            cands.restrict(r, count)
    chosen = cands.rows[:count]
    _check_selection(chosen, src, n, len(ids), flags, bad)

    out = Path(output)
    _check_output(out, src, pool)
    if not overwrite:
        _check_not_another_selectors(out, src)
    elif out.is_symlink() or (out.exists() and not out.with_name(out.name + ".meta.json").is_file()):
        what = ("a symbolic link" if out.is_symlink() else
                "a file of unknown origin (no .meta.json: not a selection this package wrote)")
        raise OutputExistsError(f"output {out} is {what}: not replaced, even with --overwrite true. Choose another "
                                "output, or delete it by hand if it is yours to drop")
    meta = {
        "scores": str(src), "scores_fingerprint": _table_fingerprint(settings), "k": k, "count": len(chosen), "ranked": n,
        "column": cands.column, "rule": rule, "task": task, "dedup": dedup, "pool": pools,
        "pool_check": pool_check, **({"builtin_size": size} if pool == "builtin" else {}),
        **{key: cands.applied[key] for key in ("shortlist", "excluded") if key in cands.applied},
        "skipped": {"zero_grad": int(sum(bool(z) for z in flags)), "nonfinite": len(bad)},
        "selected": [{"id": i, "score": s} for s, i in chosen],
    }
    _write_selection(out, chosen, table, (pool_records, records) if pools else None, meta, bad, quiet)
    return str(out)


def _write_selection(out: Path, chosen: list[tuple[float, str]], table, pool: tuple[list[dict], dict] | None,
                     meta: dict, bad: list, quiet: bool) -> None:
    """Write the chosen ``(score, id)`` rows (with their pool records and the explanation of what was picked, when
    a pool was read: ``pool`` = its records and the same by id) and ``meta`` to ``out``, then print what was written
    unless ``quiet``."""
    from ..io.selection import write_selection  # lazy: --help

    pool_records, records = pool if pool is not None else (None, None)
    if pool_records is not None:
        from .summary import explain_selection  # lazy: --help

        table_rows = {str(r["id"]): r for r in table.to_pylist()}
        label = meta["column"] if "(" not in meta["column"] else f"{meta['rule']} value"  # e.g. score/mmlu, max value
        meta["explanation"] = explain_selection([i for _, i in chosen], pool_records, table_rows,
                                                ranked_by=(label, {i: s for s, i in chosen}))
    write_selection(out, [(i, s) for s, i in chosen], records, meta)
    if bad and not quiet:
        print(f"select: skipped {len(bad)} row(s) flagged 'nonfinite' (NaN/inf), e.g. {sorted({i for i, _ in bad})[:3]}")
    if not quiet:
        what = ("records (Dolly schema, ids kept)" if pool_records is not None
                else "{id, score} rows (no pool given: pass --pool to copy the records)")
        print(f"select: wrote {len(chosen)} of {meta['ranked']} ranked examples ({meta['column']}, k={meta['k']}) as "
              f"{what} to {out} (+ {out.name}.meta.json)")
        left = table.num_rows - meta["ranked"]
        if left > 0:  # why the ranked count is not the table's
            zero, nonfinite = meta["skipped"]["zero_grad"], meta["skipped"]["nonfinite"]
            parts = [f"{zero} without a gradient (no response token)" if zero else "",
                     f"{nonfinite} non-finite" if nonfinite else "",
                     f"{left - zero - nonfinite} repeated ids/texts (dedup) or outside the restrictions"
                     if left - zero - nonfinite else ""]
            print(f"select: {left} of the table's {table.num_rows} rows not ranked: " + ", ".join(x for x in parts if x))
        if pool_records is not None:
            from .summary import format_selection  # lazy: --help

            print(format_selection(meta["explanation"]))
