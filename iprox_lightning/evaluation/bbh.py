"""BIG-Bench Hard: 3-shot chain-of-thought exact match, following open-instruct / LESS
(``eval/bbh/run_eval.py``).

Prompt: ``<cot-prompts/<task>.txt without its canary header, stripped>\\n\\nQ: <input>\\nA:``
(with ``chat_template``: the text up to the question is the user turn and the assistant turn
starts with ``"A:"``). Greedy generation (``max_new_tokens`` cap, stops at a blank line ``"\\n\\n"``
or EOS); the answer is the text after ``"So the answer is "`` up to the next period (else the
generation up to its first blank line); exact match after lower-casing and removing punctuation
(:func:`~iprox_lightning.evaluation.metrics.bbh_exact_match`). Reported per task and averaged over
tasks (``bbh/em``, open-instruct's ``average_exact_match``). ``max_per_task`` (LESS: 40) draws a
seeded sample of each task. ``cot=False`` keeps only the question and final answer of each
exemplar (open-instruct's ``--no_cot``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from ..data.eval_readers import bbh_dropped_tasks, read_bbh, sample_per_group
from .common import chat_prompt, encode_prompts, greedy_generate, resolve_chat_template
from .metrics import ExactMatch, bbh_exact_match, extract_bbh_answer
from .suite import SuiteData, left_truncate

log = logging.getLogger(__name__)
NAME = "bbh"
STOP = ("\n\n",)


@dataclass
class BBHConfig:
    """BBH options.

    Args:
        path: the BBH folder (``<task>.json`` + ``cot-prompts/<task>.txt``; default ``<data_dir>/bbh``).
        tasks: the tasks to evaluate (default: every task of the folder).
        allow_partial: evaluate the complete tasks of a partial folder (a task file without its CoT prompt,
            or a prompt without its task file) instead of stopping; the skipped tasks are printed and recorded
            in the metrics file (``suites.bbh.skipped_tasks``). Off by default: a partial folder is an error
            listing the missing files.
        max_per_task: a seeded sample of at most this many questions per task (LESS: 40).
        max_new_tokens: generation cap per question.
        cot: keep the exemplars' chain of thought (``False``: question and final answer only).
        chat_template: wrap prompts in the tokenizer's chat template (``None``: when it has one).
        max_prompt_tokens: cut over-long prompts from the left to this many tokens.
        seed: sampling seed of ``max_per_task``.
    """

    path: Optional[str] = None
    tasks: Optional[list[str]] = None
    allow_partial: bool = False
    max_per_task: Optional[int] = 40
    max_new_tokens: int = 512
    cot: bool = True
    chat_template: Optional[bool] = False
    max_prompt_tokens: Optional[int] = None
    seed: int = 42


def strip_cot(prompt: str) -> str:
    """Replace each exemplar's reasoning by its final answer (open-instruct ``--no_cot``)."""
    fields = []
    for part in prompt.split("\n\n"):
        if part.startswith("Q:"):
            if "So the answer is" not in part or "\nA:" not in part:
                raise ValueError(f"BBH exemplar without '\\nA:' / 'So the answer is': {part[:80]!r}")
            answer = part.split("So the answer is")[-1].strip()
            question = part.split("\nA:")[0].strip()
            fields.append(question + "\nA: " + answer)
        else:
            fields.append(part)
    return "\n\n".join(fields)


def bbh_prompt(cot_prompt: str, question: str) -> str:
    """The user part of a BBH prompt (without the trailing ``"\\nA:"``)."""
    return cot_prompt.strip() + "\n\nQ: " + question


def build(cfg: BBHConfig, tokenizer: Any, data_dir: Optional[str]) -> SuiteData:
    root = Path(cfg.path) if cfg.path else Path(data_dir or ".") / "bbh"
    chat = resolve_chat_template(tokenizer, cfg.chat_template)
    # read_bbh logs the skipped tasks (one warning); the metrics file records them
    skipped_tasks = bbh_dropped_tasks(root) if cfg.allow_partial and cfg.tasks is None else []
    data = read_bbh(root, cfg.tasks, allow_partial=cfg.allow_partial)
    records: list[dict[str, Any]] = []
    n_truncated = 0
    for task, (cot, examples) in data.items():
        few_shot = cot if cfg.cot else strip_cot(cot)
        examples = sample_per_group(examples, cfg.max_per_task, cfg.seed, task)
        texts = [
            chat_prompt(tokenizer, bbh_prompt(few_shot, ex.input), "A:") if chat else bbh_prompt(few_shot, ex.input) + "\nA:"
            for ex in examples
        ]
        for ex, ids in zip(examples, encode_prompts(tokenizer, texts, chat)):
            ids, cut = left_truncate(ids, cfg.max_prompt_tokens)
            n_truncated += cut
            records.append({"id": ex.id, "task": task, "input_ids": ids, "target": ex.target})
    if n_truncated:
        log.info("BBH: %d prompt(s) cut from the left to max_prompt_tokens=%s", n_truncated, cfg.max_prompt_tokens)
    return SuiteData(
        suite=NAME,
        records=records,
        tasks=list(data),
        constants={"max_new_tokens": cfg.max_new_tokens, "stop": list(STOP)},
        info={"chat_template": chat, "n_truncated": n_truncated, "n_questions": len(records), "cot": cfg.cot,
              "skipped_tasks": skipped_tasks},
    )


def make_metrics(tasks: Sequence[str]) -> dict[str, ExactMatch]:
    return {"em": ExactMatch(tasks, normalization="bbh")}


def evaluate_batch(model: nn.Module, tokenizer: Any, batch: dict[str, Any], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Generate, extract the answers, update ``metrics["em"]``; one prediction record per question."""
    outputs, _ = greedy_generate(
        model, tokenizer, batch["input_ids"], batch["attention_mask"], batch["max_new_tokens"], batch["stop"]
    )
    preds = [extract_bbh_answer(o) for o in outputs]
    metrics["em"].update(preds, batch["target"], batch["task"])
    return [
        {"id": batch["id"][i], "task": batch["task"][i], "output": o, "prediction": p,
         "target": batch["target"][i], "correct": bbh_exact_match(p, batch["target"][i]) == 100.0}
        for i, (o, p) in enumerate(zip(outputs, preds))
    ]
