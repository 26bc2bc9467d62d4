"""The candidates of a selection: a score table's rows ranked by a rule, restricted step by step.

:class:`Candidates` ranks the table's rows by a rule (:mod:`.rules`), leaving out the rows flagged ``zero_grad`` or
non-finite, and checks them against the pool. A :class:`Restriction` narrows them; every restriction re-ranks among
what is left (a per-task rule standardises among the remaining candidates, not among all of them) and, with a pool and
``dedup``, keeps one example per text again. The two restrictions:

* :class:`ExcludeCategories` — leave out the candidates whose pool ``category`` matches a shell pattern (e.g. an
  evaluation set's own source); applied before ``k`` is counted (a fraction ``k`` is of what is left);
* :class:`WithinShortest` — rank only among the ``m · count`` candidates with the shortest responses (the table's
  ``n_tokens``; ties at the cut kept); applied once the selection's count is known.

A new restriction: a subclass with ``meta_key`` (where the selection's meta records it), ``needs_count`` and
:meth:`Restriction.keep` (the ids it keeps and what the meta says of it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from ..errors import UserInputError
from .rules import rule_columns, rule_order
from .topk import shortest_cut

TEXT_FIELDS = ("instruction", "context", "response")


def norm_text(rec: dict) -> tuple:
    """A record's text, whitespace-normalised: two records with the same are one example (``dedup``)."""
    return tuple(" ".join(str(rec.get(f) or "").split()) for f in TEXT_FIELDS)


def one_per_text(rows: list, records: dict) -> list:
    """``rows`` with only the first (best) of the rows whose records have the same text (:func:`norm_text`)."""
    seen_text: set[tuple] = set()
    kept = []
    for r in rows:
        key = norm_text(records[r[1]])
        if key not in seen_text:
            seen_text.add(key)
            kept.append(r)
    return kept


@dataclass
class Candidates:
    """The ranked ``(value, id)`` rows of a score table (best first, ties by id) that a selection may pick from.

    ``column``: the ranked column's label; ``ids`` / ``flags``: every row of the table and its ``zero_grad`` flag;
    ``bad``: the ``(id, score)`` rows left out as non-finite; ``records``: the pool's records by id (``None``: no
    pool read); ``applied``: each restriction's meta, by its ``meta_key``."""

    src: Path
    table: object
    rule: str
    task: str | None
    dedup: bool
    skip_flagged: bool
    column: str
    ids: list[str]
    flags: list
    bad: list
    rows: list
    records: dict | None = None
    applied: dict = field(default_factory=dict)

    @classmethod
    def rank(cls, src: Path, table, rule: str, task: str | None, *, dedup: bool, skip_flagged: bool) -> "Candidates":
        """Every row of ``table`` ranked by ``rule``; rows flagged ``nonfinite`` or holding a non-finite value are an
        error unless ``skip_flagged`` (then left out and counted)."""
        column, ids, flags, bad, rows = _ranked_rows(src, table, rule, task, dedup=dedup, skip_flagged=skip_flagged)
        return cls(src, table, rule, task, dedup, skip_flagged, column, ids, flags, bad, rows)

    def in_pool(self, records: dict[str, dict], pools) -> None:
        """Check every candidate against the pool read (``pools``: its descriptions; none: nothing to check) and,
        with ``dedup``, keep one per identical text."""
        if not pools:
            return
        missing = [i for _, i in self.rows if i not in records]
        if missing:
            raise UserInputError(f"{len(missing)} scored id(s) not found in pool {pools}, e.g. {missing[:5]}")
        self.records = records
        if self.dedup:
            self.rows = one_per_text(self.rows, records)

    def restrict(self, restriction: "Restriction", count: int | None = None) -> None:
        """Narrow to the ids ``restriction`` keeps, re-ranked among themselves; its meta goes to ``applied``."""
        keep, meta = restriction.keep(self, count)
        self.rows = _ranked_rows(self.src, self.table, self.rule, self.task, dedup=self.dedup,
                                 skip_flagged=self.skip_flagged, candidates=keep)[4]
        if self.records is not None and self.dedup:
            self.rows = one_per_text(self.rows, self.records)
        meta["candidates"] = len(self.rows)  # its place in the meta kept
        self.applied[restriction.meta_key] = meta


class Restriction:
    """Narrows :class:`Candidates` (see the module docstring)."""

    meta_key: ClassVar[str]
    needs_count: ClassVar[bool] = False  # True: applied once the selection's count is known

    def keep(self, candidates: Candidates, count: int | None) -> tuple[set[str], dict]:
        """The ids to keep among ``candidates.rows`` and what the selection's meta says of this restriction (its
        ``"candidates"`` entry is filled in with the count left after the re-ranking)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ExcludeCategories(Restriction):
    """Leave out the candidates whose pool record's ``category`` matches one of ``patterns`` (``fnmatch``)."""

    patterns: Sequence[str]
    meta_key: ClassVar[str] = "excluded"

    def __post_init__(self):
        if isinstance(self.patterns, str) or not all(isinstance(p, str) and p for p in self.patterns):
            raise UserInputError(f"exclude_categories must be a list of category patterns, got {self.patterns!r}")

    def keep(self, candidates, count):
        if candidates.records is None:
            raise UserInputError("exclude_categories reads each candidate's category from the pool: pass pool")
        rows, records = candidates.rows, candidates.records
        cats = {i: str(records[i].get("category", "")) for _, i in rows}
        present = sorted(set(cats.values()))
        idle = [p for p in self.patterns if not any(fnmatchcase(c, p) for c in present)]
        if idle:  # a misspelt or foreign pattern would exclude nothing and select as if it were not given
            shown = ", ".join(repr(c) for c in present[:10]) + (f" and {len(present) - 10} more" if len(present) > 10
                                                                  else "")
            raise UserInputError(f"exclude_categories {idle} match(es) no category of the {len(rows)} ranked candidates "
                                 f"(their categories: {shown}); patterns are case-sensitive fnmatch patterns")
        keep = [i for _, i in rows if not any(fnmatchcase(cats[i], p) for p in self.patterns)]
        if not keep:
            raise UserInputError(f"exclude_categories {list(self.patterns)} leaves no candidate of the {len(rows)} ranked")
        return set(keep), {"categories": list(self.patterns), "count": len(rows) - len(keep), "candidates": None}


@dataclass(frozen=True)
class WithinShortest(Restriction):
    """Rank only among the ``ceil(multiple · count)`` candidates with the fewest response tokens (ties kept)."""

    multiple: float
    meta_key: ClassVar[str] = "shortlist"
    needs_count: ClassVar[bool] = True

    def __post_init__(self):
        m = self.multiple
        if isinstance(m, bool) or not isinstance(m, (int, float)) or m < 1:
            raise UserInputError(f"within_shortest must be a number >= 1 (a multiple of k), got {m!r}")

    def keep(self, candidates, count):
        short, cut = _shortest(candidates.src, candidates.table, [i for _, i in candidates.rows],
                               int(np.ceil(self.multiple * count)))
        return short, {"within_shortest": self.multiple, "candidates": None, "max_response_tokens": cut}


def _ranked_rows(src: Path, table, rule: str, task: str | None, *, dedup: bool, skip_flagged: bool,
                 candidates: set[str] | None = None):
    """``(column label, ids, zero_grad flags, bad rows, ranked rows)`` of a score table under ``rule``: the ranked rows
    are ``(value, id)`` best first (ties by id), without the rows flagged ``zero_grad`` or non-finite (``bad``:
    ``(id, score)``, an error unless ``skip_flagged``) and, with ``dedup``, one per id; with ``candidates``, the rule
    ranks those ids only (its standardisation and round-robin among them)."""
    used = rule_columns(rule, table.column_names, task)
    col = used[0] if len(used) == 1 else f"{rule}({', '.join(used)})"
    ids = [str(i) for i in table.column("id").to_pylist()]
    values = {c: np.asarray([np.nan if v is None else float(v) for v in table.column(c).to_pylist()], np.float64)
              for c in used}
    flags = table.column("zero_grad").to_pylist() if "zero_grad" in table.column_names else [False] * len(ids)
    nonfin = table.column("nonfinite").to_pylist() if "nonfinite" in table.column_names else [False] * len(ids)
    finite = np.all([np.isfinite(v) for v in values.values()], axis=0) if ids else np.ones(0, bool)
    bad = [(i, float(values[used[0]][j])) for j, (i, nf) in enumerate(zip(ids, nonfin)) if nf or not finite[j]]
    if bad and not skip_flagged:
        raise UserInputError(
            f"{src}: {len(bad)} row(s) have a non-finite {col!r} or are flagged 'nonfinite' (NaN/inf gradient), "
            f"e.g. {', '.join(f'{i!r} -> {s}' for i, s in bad[:3])}; fix the scoring (e.g. float32 instead of "
            "float16) or pass skip_flagged=True (CLI: --skip_flagged true) to leave them out")
    bad_ids = {i for i, _ in bad}
    keep = np.asarray([not z and i not in bad_ids and (candidates is None or i in candidates)
                       for i, z in zip(ids, flags)], bool)
    kept_ids = [i for i, m in zip(ids, keep) if m]
    order, value = rule_order(rule, kept_ids, {c: v[keep] for c, v in values.items()}, task)
    rows = [(float(value[j]), kept_ids[j]) for j in order]  # best first (ties by id)
    if dedup:
        seen: set[str] = set()
        rows = [r for r in rows if not (r[1] in seen or seen.add(r[1]))]
    elif len(set(ids)) != len(ids):
        raise UserInputError(f"{src}: duplicate ids in the score table and dedup=False")
    return col, ids, flags, bad, rows


def _shortest(src: Path, table, ranked: list[str], count: int) -> tuple[set[str], float]:
    """The ``count`` ids of ``ranked`` with the fewest response tokens (the table's ``n_tokens``), every id tied with
    the last of them too, and that last length."""
    if "n_tokens" not in table.column_names:
        raise UserInputError(f"{src}: within_shortest needs the score table's 'n_tokens' column (the response tokens "
                             "each example was scored on; written by the scoring, store-query and RDS+ stages)")
    n_tok = dict(zip((str(i) for i in table.column("id").to_pylist()), table.column("n_tokens").to_pylist()))
    missing = [i for i in ranked if n_tok.get(i) is None]
    if missing:
        raise UserInputError(f"{src}: 'n_tokens' is missing for {len(missing)} row(s), e.g. {missing[:3]}")
    if not ranked:
        return set(), 0.0

    cut = shortest_cut([float(n_tok[i]) for i in ranked], count)
    return {i for i in ranked if float(n_tok[i]) <= cut}, cut
