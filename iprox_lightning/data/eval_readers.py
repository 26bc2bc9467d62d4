"""Readers for the evaluation suites in their public formats (MMLU, BBH, TyDiQA GoldP).

Layouts (as in the LESS / open-instruct evaluation data):

* **MMLU** — ``<root>/dev/<subject>_dev.csv`` (5 few-shot exemplars per subject) and
  ``<root>/test/<subject>_test.csv``; CSV without header, columns
  ``question, A, B, C, D, answer`` with the answer a letter ``A``–``D``.
* **BBH** — ``<root>/<task>.json`` = ``{"examples": [{"input": str, "target": str}, ...]}`` and
  ``<root>/cot-prompts/<task>.txt``: a canary line, a ``-----`` line, then the 3-shot
  chain-of-thought prompt (task description + three ``Q: ... A: ... So the answer is X.`` blocks).
* **TyDiQA GoldP** — the one-shot exemplar file ``tydiqa-one-shot.json`` =
  ``{language: [{"id", "lang", "context", "question", "answers": [{"text", "answer_start"}]}]}``
  and the SQuAD-format dev file ``tydiqa-goldp-v1.1-dev.json`` =
  ``{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers"}]}]}]}`` whose
  language is the prefix of each question id (``"english-123-0"`` -> ``"english"``).

Every reader validates its input and raises :class:`EvalDataError` (a ``ValueError``) naming the
file, the row / JSON path and the field at fault.
"""
from __future__ import annotations

import csv
import json
import logging
import os
import random
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any, Sequence

from ..errors import InputNotFoundError, UserInputError
from ..io.records import read_utf8

MMLU_CHOICES = ("A", "B", "C", "D")


class EvalDataError(UserInputError):
    """Malformed evaluation data; the message names the file, the row / JSON path and the field."""


# --------------------------------------------------------------------------------------- MMLU
@dataclass(frozen=True)
class MMLUQuestion:
    """One MMLU question: ``answer`` is the index (0–3) of the correct choice."""

    id: str
    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: int

    @property
    def answer_letter(self) -> str:
        return MMLU_CHOICES[self.answer]


def read_mmlu_csv(path: str | os.PathLike, subject: str | None = None, split: str | None = None) -> list[MMLUQuestion]:
    """Read one MMLU CSV (no header; ``question, A, B, C, D, answer-letter``).

    ``subject`` / ``split`` default to what the file name says (``<subject>_<split>.csv``).
    Ids are ``mmlu/<subject>/<split>/<row>`` with ``row`` the 0-based CSV record index.
    """
    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"MMLU file not found: {path}")
    stem = path.stem
    if subject is None or split is None:
        name_subject, _, name_split = stem.rpartition("_")
        subject = subject or name_subject or stem
        split = split or name_split or "test"
    out: list[MMLUQuestion] = []

    with StringIO(read_utf8(path, error=EvalDataError), newline="") as f:
        for row_idx, row in enumerate(csv.reader(f)):
            where = f"{path}, row {row_idx + 1}"
            if len(row) != 6:
                raise EvalDataError(
                    f"{where}: expected 6 columns (question, A, B, C, D, answer), got {len(row)}"
                )
            question, *choices, answer = row
            if not question.strip():
                raise EvalDataError(f"{where}: field 'question' (column 1) is empty")
            answer = answer.strip()
            if answer not in MMLU_CHOICES:
                raise EvalDataError(
                    f"{where}: field 'answer' (column 6) must be one of {list(MMLU_CHOICES)}, got {answer!r}"
                )
            out.append(
                MMLUQuestion(
                    id=f"mmlu/{subject}/{split}/{row_idx}",
                    subject=subject,
                    question=question,
                    choices=tuple(choices),  # type: ignore[arg-type]
                    answer=MMLU_CHOICES.index(answer),
                )
            )
    if not out:
        raise EvalDataError(f"{path}: no rows")
    return out


def list_mmlu_subjects(root: str | os.PathLike, split: str = "test") -> list[str]:
    """Sorted subject names that have a ``<root>/<split>/<subject>_<split>.csv`` file."""
    d = Path(root) / split
    if not d.is_dir():
        raise InputNotFoundError(f"MMLU {split} directory not found: {d}")
    suffix = f"_{split}.csv"
    subjects = sorted(p.name[: -len(suffix)] for p in d.iterdir() if p.name.endswith(suffix))
    if not subjects:
        raise EvalDataError(f"{d}: no '*{suffix}' files")
    return subjects


def read_mmlu(
    root: str | os.PathLike,
    subjects: Sequence[str] | None = None,
    split: str = "test",
) -> dict[str, list[MMLUQuestion]]:
    """``{subject: questions}`` from ``<root>/<split>/<subject>_<split>.csv`` (all subjects by default)."""
    root = Path(root)
    available = list_mmlu_subjects(root, split)
    if subjects is None:
        subjects = available
    unknown = [s for s in subjects if s not in available]
    if unknown:
        raise EvalDataError(f"{root / split}: unknown MMLU subject(s) {unknown}; available: {available}")
    return {s: read_mmlu_csv(root / split / f"{s}_{split}.csv", s, split) for s in subjects}


# ---------------------------------------------------------------------------------------- BBH
@dataclass(frozen=True)
class BBHExample:
    id: str
    task: str
    input: str
    target: str


def read_bbh_task(path: str | os.PathLike, task: str | None = None) -> list[BBHExample]:
    """Read ``<task>.json`` = ``{"examples": [{"input", "target"}]}``; ids ``bbh/<task>/<index>``."""
    path = Path(path)
    task = task or path.stem
    data = _load_json(path)
    if not isinstance(data, dict) or "examples" not in data:
        raise EvalDataError(f"{path}: expected a JSON object with an 'examples' list")
    examples = data["examples"]
    if not isinstance(examples, list) or not examples:
        raise EvalDataError(f"{path}: field 'examples' must be a non-empty list")
    out = []
    for i, ex in enumerate(examples):
        where = f"{path}, examples[{i}]"
        if not isinstance(ex, dict):
            raise EvalDataError(f"{where}: expected an object with 'input' and 'target'")
        for key in ("input", "target"):
            if key not in ex:
                raise EvalDataError(f"{where}: missing field {key!r}")
            if not isinstance(ex[key], str) or not ex[key].strip():
                raise EvalDataError(f"{where}: field {key!r} must be a non-empty string, got {ex[key]!r}")
        out.append(BBHExample(id=f"bbh/{task}/{i}", task=task, input=ex["input"], target=ex["target"]))
    return out


def read_bbh_cot_prompt(path: str | os.PathLike) -> str:
    """The 3-shot CoT prompt of ``cot-prompts/<task>.txt`` without its canary header.

    Like open-instruct, drops the first two lines (the canary GUID and ``-----``) when present and
    returns the rest verbatim.
    """
    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"BBH CoT prompt not found: {path}")

    lines = read_utf8(path, error=EvalDataError).splitlines(keepends=True)
    if len(lines) >= 2 and "canary" in lines[0].lower() and lines[1].strip().startswith("---"):
        lines = lines[2:]
    text = "".join(lines)
    if "So the answer is" not in text:
        raise EvalDataError(f"{path}: a CoT prompt must contain 'So the answer is' (the answer cue)")
    return text


def list_bbh_tasks(root: str | os.PathLike, *, allow_partial: bool = False) -> list[str]:
    """Sorted task names having both ``<root>/<task>.json`` and ``<root>/cot-prompts/<task>.txt``.

    A partial directory — a CoT prompt without its task file, or a task file (a JSON object with
    ``examples``) without its CoT prompt — is an :class:`EvalDataError` listing the missing pieces;
    ``allow_partial=True`` uses the complete tasks only and logs the dropped ones
    (``bbh_dropped_tasks(root)`` lists them)."""
    root = Path(root)
    if not root.is_dir():
        raise InputNotFoundError(f"BBH directory not found: {root}")
    tasks, missing = _bbh_inventory(root)
    if missing:
        if not allow_partial:
            raise EvalDataError(
                f"{root}: partial BBH directory, {len(missing)} task(s) incomplete: " + "; ".join(missing[:10])
                + (f"; ... and {len(missing) - 10} more" if len(missing) > 10 else "")
                + " (restore the files, or pass allow_partial=True to use the complete tasks only)")

        logging.getLogger(__name__).warning("%s: partial BBH directory, dropped %d task(s): %s", root, len(missing),
                                            "; ".join(missing))
    if not tasks:
        raise EvalDataError(f"{root}: no '<task>.json' with a matching 'cot-prompts/<task>.txt'")
    return tasks


def _bbh_inventory(root: Path) -> tuple[list[str], list[str]]:
    """``(complete tasks, descriptions of the incomplete ones)`` of a BBH directory."""
    prompts = root / "cot-prompts"
    jsons = {p.stem: p for p in root.glob("*.json")}
    txts = {p.stem for p in prompts.glob("*.txt")} if prompts.is_dir() else set()
    tasks = sorted(t for t in jsons if t in txts)
    missing = [f"{t}: {root.name}/{t}.json missing" for t in sorted(txts - set(jsons))]
    for t in sorted(set(jsons) - txts):
        try:
            is_task = isinstance(d := json.loads(jsons[t].read_bytes()), dict) and "examples" in d
        except (ValueError, OSError):
            is_task = False
        if is_task:  # not a metadata file such as bbh-three-shot.json
            missing.append(f"{t}: cot-prompts/{t}.txt missing")
    return tasks, sorted(missing)


def bbh_dropped_tasks(root: str | os.PathLike) -> list[str]:
    """The incomplete tasks of a BBH directory (what ``allow_partial=True`` drops)."""
    return _bbh_inventory(Path(root))[1]


def read_bbh(
    root: str | os.PathLike, tasks: Sequence[str] | None = None, *, allow_partial: bool = False
) -> dict[str, tuple[str, list[BBHExample]]]:
    """``{task: (cot_prompt, examples)}`` for the given tasks (by default all tasks; a partial directory
    is an error unless ``allow_partial`` or the tasks are named explicitly)."""
    root = Path(root)
    available = list_bbh_tasks(root, allow_partial=allow_partial or tasks is not None)
    if tasks is None:
        tasks = available
    unknown = [t for t in tasks if t not in available]
    if unknown:
        raise EvalDataError(f"{root}: unknown BBH task(s) {unknown}; available: {available}")
    return {
        t: (read_bbh_cot_prompt(root / "cot-prompts" / f"{t}.txt"), read_bbh_task(root / f"{t}.json", t))
        for t in tasks
    }


# ------------------------------------------------------------------------------------- TyDiQA
@dataclass(frozen=True)
class TyDiQAExample:
    """A GoldP question: the gold passage ``context`` contains the answer; ``answers`` are its texts."""

    id: str
    lang: str
    context: str
    question: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...] = field(default=())


def _parse_answers(answers: Any, where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if not isinstance(answers, list) or not answers:
        raise EvalDataError(f"{where}: field 'answers' must be a non-empty list of {{'text', 'answer_start'}}")
    texts, starts = [], []
    for j, a in enumerate(answers):
        if not isinstance(a, dict) or "text" not in a:
            raise EvalDataError(f"{where}: answers[{j}] must be an object with a 'text' field")
        if not isinstance(a["text"], str) or not a["text"].strip():
            raise EvalDataError(f"{where}: answers[{j}].text must be a non-empty string, got {a['text']!r}")
        start = a.get("answer_start", -1)
        if not isinstance(start, int):
            raise EvalDataError(f"{where}: answers[{j}].answer_start must be an integer, got {start!r}")
        texts.append(a["text"])
        starts.append(start)
    return tuple(texts), tuple(starts)


def _check_str(obj: dict, key: str, where: str) -> str:
    if key not in obj:
        raise EvalDataError(f"{where}: missing field {key!r}")
    if not isinstance(obj[key], str) or not obj[key].strip():
        raise EvalDataError(f"{where}: field {key!r} must be a non-empty string, got {obj[key]!r}")
    return obj[key]


def read_tydiqa_one_shot(path: str | os.PathLike) -> dict[str, list[TyDiQAExample]]:
    """Read ``tydiqa-one-shot.json`` = ``{language: [exemplar, ...]}`` (the LESS layout)."""
    path = Path(path)
    data = _load_json(path)
    if not isinstance(data, dict) or not data:
        raise EvalDataError(f"{path}: expected a non-empty JSON object mapping language -> list of exemplars")
    out: dict[str, list[TyDiQAExample]] = {}
    for lang, items in data.items():
        if not isinstance(items, list) or not items:
            raise EvalDataError(f"{path}, [{lang!r}]: expected a non-empty list of exemplars")
        out[lang] = []
        for i, ex in enumerate(items):
            where = f"{path}, [{lang!r}][{i}]"
            if not isinstance(ex, dict):
                raise EvalDataError(f"{where}: expected an object")
            ex_id = _check_str(ex, "id", where)
            ex_lang = ex.get("lang", lang)
            if ex_lang != lang:
                raise EvalDataError(f"{where}: field 'lang' is {ex_lang!r} but the exemplar is listed under {lang!r}")
            texts, starts = _parse_answers(ex.get("answers"), where)
            out[lang].append(
                TyDiQAExample(
                    id=ex_id,
                    lang=lang,
                    context=_check_str(ex, "context", where),
                    question=_check_str(ex, "question", where),
                    answers=texts,
                    answer_starts=starts,
                )
            )
    return out


def read_tydiqa_goldp(path: str | os.PathLike) -> list[TyDiQAExample]:
    """Read a SQuAD-format TyDiQA GoldP file (e.g. ``tydiqa-goldp-v1.1-dev.json``).

    Each question's language is the prefix of its id before the first ``-`` (open-instruct's rule).
    """
    path = Path(path)
    data = _load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise EvalDataError(f"{path}: expected a SQuAD-format object with a 'data' list")
    out: list[TyDiQAExample] = []
    for a, article in enumerate(data["data"]):
        where_a = f"{path}, data[{a}]"
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise EvalDataError(f"{where_a}: missing field 'paragraphs' (a list)")
        for p, para in enumerate(article["paragraphs"]):
            where_p = f"{where_a}.paragraphs[{p}]"
            if not isinstance(para, dict):
                raise EvalDataError(f"{where_p}: expected an object with 'context' and 'qas'")
            context = _check_str(para, "context", where_p)
            if not isinstance(para.get("qas"), list):
                raise EvalDataError(f"{where_p}: missing field 'qas' (a list)")
            for q, qa in enumerate(para["qas"]):
                where = f"{where_p}.qas[{q}]"
                if not isinstance(qa, dict):
                    raise EvalDataError(f"{where}: expected an object")
                qid = _check_str(qa, "id", where)
                lang = qid.split("-")[0]
                if not lang:
                    raise EvalDataError(f"{where}: field 'id' ({qid!r}) must start with the language ('english-...')")
                texts, starts = _parse_answers(qa.get("answers"), where)
                out.append(
                    TyDiQAExample(
                        id=qid,
                        lang=lang,
                        context=context,
                        question=_check_str(qa, "question", where),
                        answers=texts,
                        answer_starts=starts,
                    )
                )
    if not out:
        raise EvalDataError(f"{path}: no questions")
    seen: set[str] = set()
    for ex in out:
        if ex.id in seen:
            raise EvalDataError(f"{path}: duplicate question id {ex.id!r}")
        seen.add(ex.id)
    return out


# -------------------------------------------------------------------------------------- utils
def sample_per_group(items: Sequence[Any], n: int | None, seed: int, group: str) -> list[Any]:
    """At most ``n`` items drawn without replacement, reproducibly from ``(seed, group)``, kept in
    their original order. ``n=None`` keeps everything."""
    if n is None or n >= len(items):
        return list(items)
    if n < 0:
        raise UserInputError(f"cap must be >= 0, got {n}")
    rng = random.Random(f"{seed}:{group}")
    keep = sorted(rng.sample(range(len(items)), n))
    return [items[i] for i in keep]


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise InputNotFoundError(f"file not found: {path}")

    try:
        return json.loads(read_utf8(path, error=EvalDataError))
    except json.JSONDecodeError as e:
        raise EvalDataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None

