"""MMLU: k-shot (default 5) multiple-choice accuracy from the next-token log-likelihood of the
answer letters, following open-instruct / LESS (``eval/mmlu/run_eval.py``).

Prompt of a question of subject ``s`` (``s`` with ``_`` -> space)::

    The following are multiple choice questions (with answers) about  <s>.\\n\\n
    <dev question 1>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: <letter>\\n\\n      (x k, dev split)
    <question>\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:

(the double space after "about" is open-instruct's). With ``chat_template`` the whole text is the
user turn and the assistant turn starts with ``"The answer is:"``. While a prompt is longer than
``max_prompt_tokens`` the number of shots is reduced (open-instruct); a prompt still too long at
0 shots is cut from the left.

Prediction: ``argmax_{c in A..D} log p(c | prompt)`` where ``c`` is the token the letter becomes
after ``"Answer:"`` — ``" A"`` for byte-level BPE / SentencePiece vocabularies; for tokenizers
that emit the space separately, the shared space token is appended to the prompt first (see
:func:`~iprox_lightning.evaluation.common.continuation_tokens`). Accuracy is reported per subject,
macro-averaged over subjects (``mmlu/acc``) and over all questions (``mmlu/acc_micro``, what
open-instruct prints as "average accuracy"). Each prediction also records ``letter_mass``, the
next-token probability of the four letters together: near 1 when the letter tokens are the ones
the model expects after "Answer:" (a quick check of the tokenization).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..data.eval_readers import MMLU_CHOICES, MMLUQuestion, read_mmlu, read_mmlu_csv, sample_per_group
from ..errors import UserInputError
from .common import chat_prompt, continuation_tokens, encode_prompts, next_token_logprobs, resolve_chat_template
from .metrics import PerTaskAccuracy
from .suite import SuiteData, left_truncate

log = logging.getLogger(__name__)
NAME = "mmlu"


@dataclass
class MMLUConfig:
    """MMLU options. ``path`` defaults to ``<data_dir>/mmlu``; ``max_per_subject`` caps the test
    questions per subject (a seeded sample); ``chat_template=None`` means "if the tokenizer has one"."""

    path: Optional[str] = None
    subjects: Optional[list[str]] = None
    max_per_subject: Optional[int] = None
    shots: int = 5
    chat_template: Optional[bool] = False
    max_prompt_tokens: int = 2048
    split: str = "test"
    seed: int = 42


def format_subject(subject: str) -> str:
    return "".join(" " + part for part in subject.split("_"))


def format_question(q: MMLUQuestion, include_answer: bool) -> str:
    text = q.question
    for letter, choice in zip(MMLU_CHOICES, q.choices):
        text += f"\n{letter}. {choice}"
    text += "\nAnswer:"
    if include_answer:
        text += f" {q.answer_letter}\n\n"
    return text


def mmlu_prompt(subject: str, shots: Sequence[MMLUQuestion], question: MMLUQuestion) -> str:
    """The plain k-shot prompt (``k = len(shots)``), ending in ``"Answer:"``."""
    head = f"The following are multiple choice questions (with answers) about {format_subject(subject)}.\n\n"
    return head + "".join(format_question(s, True) for s in shots) + format_question(question, False)


def answer_anchor(chat: bool) -> str:
    return "The answer is:" if chat else "Answer:"


def _prompt_text(tokenizer, subject, shots, q, chat: bool) -> str:
    text = mmlu_prompt(subject, shots, q)
    return chat_prompt(tokenizer, text, answer_anchor(True)) if chat else text


def build(cfg: MMLUConfig, tokenizer: Any, data_dir: Optional[str]) -> SuiteData:
    """Read, sample, format and tokenize the MMLU questions."""
    root = Path(cfg.path) if cfg.path else Path(data_dir or ".") / "mmlu"
    chat = resolve_chat_template(tokenizer, cfg.chat_template)
    prefix_ids, letter_ids = continuation_tokens(tokenizer, answer_anchor(chat), [" " + c for c in MMLU_CHOICES])
    questions = read_mmlu(root, cfg.subjects, split=cfg.split)
    records: list[dict[str, Any]] = []
    n_fewer_shots = n_truncated = 0
    for subject, qs in questions.items():
        qs = sample_per_group(qs, cfg.max_per_subject, cfg.seed, subject)
        dev = read_mmlu_csv(root / "dev" / f"{subject}_dev.csv", subject, "dev")[: cfg.shots] if cfg.shots > 0 else []
        if len(dev) < cfg.shots:
            raise UserInputError(f"{root / 'dev' / f'{subject}_dev.csv'}: {len(dev)} rows, fewer than shots={cfg.shots}")
        texts = [_prompt_text(tokenizer, subject, dev, q, chat) for q in qs]
        ids_all = encode_prompts(tokenizer, texts, chat)
        for q, ids in zip(qs, ids_all):
            k = len(dev)
            while len(ids) + len(prefix_ids) > cfg.max_prompt_tokens and k > 0:
                k -= 1
                ids = encode_prompts(tokenizer, [_prompt_text(tokenizer, subject, dev[:k], q, chat)], chat)[0]
            n_fewer_shots += k < len(dev)
            ids, cut = left_truncate(ids + prefix_ids, cfg.max_prompt_tokens)
            n_truncated += cut
            records.append({"id": q.id, "task": subject, "input_ids": ids, "answer": q.answer, "shots": k})
    if n_fewer_shots or n_truncated:
        log.info(
            "MMLU: %d prompt(s) used fewer than %d shots and %d were cut from the left to fit max_prompt_tokens=%d",
            n_fewer_shots, cfg.shots, n_truncated, cfg.max_prompt_tokens,
        )
    return SuiteData(
        suite=NAME,
        records=records,
        tasks=list(questions),
        constants={"choice_ids": list(letter_ids)},
        info={"chat_template": chat, "n_fewer_shots": n_fewer_shots, "n_truncated": n_truncated,
              "shared_prefix_ids": prefix_ids, "choice_ids": letter_ids, "n_questions": len(records)},
    )


def make_metrics(tasks: Sequence[str]) -> dict[str, PerTaskAccuracy]:
    return {"acc": PerTaskAccuracy(tasks)}


@torch.no_grad()
def choice_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, choice_ids: Sequence[int]) -> torch.Tensor:
    """``log p(choice token | prompt)`` for each choice: ``[B, len(choice_ids)]`` (full-vocab log-softmax)."""
    lp = next_token_logprobs(model, input_ids, attention_mask)
    return lp[:, torch.as_tensor(list(choice_ids), device=lp.device)]


def evaluate_batch(model: nn.Module, tokenizer: Any, batch: dict[str, Any], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Score one batch: update ``metrics["acc"]`` and return one prediction record per question."""
    clp = choice_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["choice_ids"])
    pred = clp.argmax(dim=-1)
    answer = batch["answer"].to(pred.device)
    metrics["acc"].update(pred, answer, batch["task"])
    probs = torch.softmax(clp, dim=-1).tolist()
    mass = clp.exp().sum(dim=-1).tolist()  # share of the next-token distribution on the four letters
    return [
        {
            "id": batch["id"][i],
            "task": batch["task"][i],
            "prediction": MMLU_CHOICES[int(pred[i])],
            "answer": MMLU_CHOICES[int(answer[i])],
            "correct": bool(pred[i] == answer[i]),
            "choice_probs": [round(p, 6) for p in probs[i]],
            "letter_mass": round(mass[i], 6),
            "shots": int(batch["shots"][i]),
        }
        for i in range(len(batch["id"]))
    ]
