"""Validation sets for scoring, built from the paper's evaluation suites (LESS convention).

LESS / IProX score the pool against a few examples per target task:

* ``mmlu``   — the dev ("5-shot") questions of each subject: prompt = question + lettered choices +
  ``"Answer:"``, response = the answer letter;
* ``bbh``    — the chain-of-thought exemplars of ``cot-prompts/<task>.txt`` (3 per task): prompt =
  the ``Q:`` text, response = the ``A:`` chain of thought ending in "So the answer is …";
  ``bbh-direct`` — the same exemplars with the final answer alone as the response (the form of a direct-answer
  evaluation; category ``bbh`` all the same, so the task's columns do not change);
* ``tydiqa`` — the one-shot exemplars (one per language) of ``tydiqa-one-shot.json``: prompt = the
  passage + question, response = the gold answer.

Each record follows the Dolly schema with ``category`` = the suite name, so per-task scores are
per suite (``mmlu``, ``bbh``, ``tydiqa``). ``SFTDataModule(validation="eval:<dir>")`` uses this,
``"eval:<dir>:mmlu,bbh"`` restricts the suites.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ..errors import InputNotFoundError, UserInputError
from .eval_readers import list_bbh_tasks, read_bbh_cot_prompt, read_mmlu, read_tydiqa_one_shot

SUITES = ("mmlu", "bbh", "tydiqa")
FORMS = {"bbh-direct": "bbh"}  # another form of a suite's validation examples -> that suite (see the module doc)
SUITE_NAMES = (*SUITES, *FORMS)  # what an eval:<dir>:<suites> source may name
LETTERS = "ABCD"
_Q_SPLIT = re.compile(r"(?:^|\n\n)Q: ")


def mmlu_validation_records(root: str | Path, per_subject: int | None = None) -> list[dict]:
    root = Path(root)
    out = []
    for subject, qs in read_mmlu(root, split="dev").items():
        for q in qs[: per_subject or len(qs)]:
            choices = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(q.choices))
            out.append({
                "id": f"val-mmlu-{q.id}",
                "instruction": f"{q.question.strip()}\n{choices}\nAnswer:",
                "context": "",
                "response": LETTERS[q.answer],
                "category": "mmlu",
                "subtask": subject,
            })
    return out


def split_cot_prompt(text: str, where: str) -> list[tuple[str, str]]:
    """``[(question, chain_of_thought_answer), ...]`` from a BBH ``cot-prompts/<task>.txt`` file."""
    parts = _Q_SPLIT.split(text)[1:]  # drop the header / task description
    pairs = []
    for i, part in enumerate(parts):
        if "\nA: " not in part:
            raise UserInputError(f"{where}: exemplar {i + 1} has no 'A: ' answer")
        q, a = part.split("\nA: ", 1)
        pairs.append((q.strip(), a.strip()))
    if not pairs:
        raise UserInputError(f"{where}: no 'Q: ' exemplar found")
    return pairs


def direct_answer(chain_of_thought: str, where: str) -> str:
    """The final answer of a BBH exemplar's chain of thought: the text after its last ``"So the answer is"``,
    without the closing period (``"... So the answer is (A)."`` -> ``"(A)"``)."""
    if "So the answer is" not in chain_of_thought:
        raise UserInputError(f"{where}: exemplar answer has no 'So the answer is' cue: {chain_of_thought[:80]!r}")
    answer = chain_of_thought.rsplit("So the answer is", 1)[1].strip()
    answer = answer[:-1].rstrip() if answer.endswith(".") else answer
    if not answer:
        raise UserInputError(f"{where}: empty answer after 'So the answer is' in {chain_of_thought[-80:]!r}")
    return answer


def bbh_validation_records(root: str | Path, per_task: int | None = None, form: str = "cot") -> list[dict]:
    """BBH's exemplars as validation records; ``form``: ``cot`` (the chain of thought is the response) or
    ``direct`` (the final answer alone, ids ``val-bbh-direct-…``)."""
    if form not in ("cot", "direct"):
        raise UserInputError(f"BBH validation form {form!r}: choose 'cot' or 'direct'")
    root = Path(root)
    out = []
    for task in list_bbh_tasks(root):
        path = root / "cot-prompts" / f"{task}.txt"
        pairs = split_cot_prompt(read_bbh_cot_prompt(path), str(path))
        for j, (q, a) in enumerate(pairs[: per_task or len(pairs)]):
            out.append({
                "id": f"val-bbh-{task}-{j}" if form == "cot" else f"val-bbh-direct-{task}-{j}",
                "instruction": q,
                "context": "",
                "response": a if form == "cot" else direct_answer(a, f"{path} exemplar {j + 1}"),
                "category": "bbh",
                "subtask": task,
            })
    return out


def tydiqa_validation_records(root: str | Path, per_language: int | None = None) -> list[dict]:
    data = read_tydiqa_one_shot(Path(root) / "tydiqa-one-shot.json")
    out = []
    for lang, exs in data.items():
        for ex in exs[: per_language or len(exs)]:
            out.append({
                "id": f"val-tydiqa-{ex.id}",
                "instruction": "Answer the following question based on the information in the given passage.",
                "context": f"Passage: {ex.context.strip()}\nQuestion: {ex.question.strip()}",
                "response": ex.answers[0],
                "category": "tydiqa",
                "subtask": lang,
            })
    return out


def eval_validation_records(eval_dir: str | Path, suites: Sequence[str] = SUITES, per_subtask: int | None = None) -> list[dict]:
    """Validation records for the given suites from ``eval_dir`` (holding ``mmlu/``, ``bbh/``, ``tydiqa/``)."""
    eval_dir = Path(eval_dir)
    if not eval_dir.is_dir():
        raise InputNotFoundError(f"evaluation data directory not found: {eval_dir}")
    readers = {"mmlu": mmlu_validation_records, "bbh": bbh_validation_records, "tydiqa": tydiqa_validation_records,
               "bbh-direct": lambda root, n: bbh_validation_records(root, n, form="direct")}
    out = []
    for s in suites:
        if s not in readers:
            raise UserInputError(f"unknown suite {s!r}; choose from {SUITE_NAMES}")
        out.extend(readers[s](eval_dir / FORMS.get(s, s), per_subtask))
    return out


def parse_eval_source(src: str) -> tuple[str, tuple[str, ...]] | None:
    """``"eval:<dir>[:suite,suite]"`` -> ``(dir, suites)``; ``None`` for any other source string."""
    if not src.startswith("eval:"):
        return None
    rest = src[len("eval:"):]
    head, sep, tail = rest.rpartition(":")
    if sep and tail and all(t in SUITE_NAMES for t in tail.split(",")):
        return head, tuple(tail.split(","))
    if sep and tail and head and "/" not in tail and "\\" not in tail and not Path(rest).exists():
        unknown = [t for t in tail.split(",") if t not in SUITE_NAMES]
        raise UserInputError(f"{src!r}: unknown suite name(s) {unknown} after the directory {head!r}; choose from "
                             f"{list(SUITE_NAMES)} (comma-separated, e.g. 'eval:{head}:mmlu,bbh')")
    return rest, SUITES
