"""TyDiQA GoldP: 1-shot exact match and F1 with the gold passage, per language and macro-averaged,
following open-instruct / LESS (``eval/tydiqa/run_eval.py``).

Prompt of a question in language ``l`` (templates below, ``P``/``Q``/``A`` the passage / question /
answer labels of ``l``)::

    <instruction_l>\\n\\n
    P <demo context>\\nQ <demo question>\\nA <demo answer>\\n\\n        (x shots, from tydiqa-one-shot.json)
    P <context>\\nQ <question>\\nA

Contexts are cut to ``max_context_tokens`` tokens (LESS: 512). With ``chat_template`` (LESS uses
it for TyDiQA; ``None`` = when the tokenizer has one) everything before ``A`` is the user turn and
the assistant turn starts with ``A``. Greedy generation of at most ``max_new_tokens`` (50) tokens,
stopped at the first newline, stripped; SQuAD EM and F1 against all gold answers
(:mod:`~iprox_lightning.evaluation.metrics`), per language and averaged over languages
(``tydiqa/em``, ``tydiqa/f1``).

The evaluation set is ``eval_file`` — the public SQuAD-format ``tydiqa-goldp-v1.1-dev.json``
(default ``<path>/tydiqa-goldp-v1.1-dev.json``) or, as a tiny smoke set, a file in the one-shot
layout. A demonstration is never the question itself: when the only exemplar of a language *is*
the question (evaluating on ``tydiqa-one-shot.json``), that question gets fewer shots; each
prediction records its ``shots``.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from torch import nn

from ..data.eval_readers import EvalDataError, TyDiQAExample, read_tydiqa_goldp, read_tydiqa_one_shot, sample_per_group
from ..errors import InputNotFoundError
from .common import chat_prompt, encode_prompts, greedy_generate, resolve_chat_template, truncate_text_tokens
from .inputs import resolve_in
from .metrics import ExactMatch, SquadF1, squad_exact_match, squad_f1
from .suite import SuiteData

log = logging.getLogger(__name__)
NAME = "tydiqa"
STOP = ("\n",)
GOLDP_DEV = "tydiqa-goldp-v1.1-dev.json"
ONE_SHOT = "tydiqa-one-shot.json"

# (instruction, passage label, question label, answer label) — open-instruct's templates
TEMPLATES: dict[str, tuple[str, str, str, str]] = {
    "english": ("Answer the following question based on the information in the given passage.", "Passage:", "Question:", "Answer:"),
    "arabic": ("أجب على السؤال التالي بناءً على المعلومات في المقطع المعطى.", "المقطع:", "السؤال:", "الإجابة:"),
    "bengali": ("প্রদত্ত অধ্যায়ের তথ্যের উপর ভিত্তি করে নিম্নলিখিত প্রশ্নের উত্তর দিন।", "অধ্যায়:", "প্রশ্ন:", "উত্তর:"),
    "finnish": ("Vastaa seuraavaan kysymykseen annetun kappaleen tiedon perusteella.", "Kappale:", "Kysymys:", "Vastaus:"),
    "indonesian": ("Jawab pertanyaan berikut berdasarkan informasi di bagian yang diberikan.", "Bagian:", "Pertanyaan:", "Jawaban:"),
    "korean": ("주어진 문단의 정보에 기반하여 다음 질문에 답하십시오.", "문단:", "질문:", "답변:"),
    "russian": ("Ответьте на следующий вопрос на основе информации в данном отрывке.", "Отрывок:", "Вопрос:", "Ответ:"),
    "swahili": ("Jibu swali lifuatalo kulingana na habari kwenye kifungu kilichotolewa.", "Kifungu:", "Swali:", "Jibu:"),
    "telugu": ("ఇచ్చిన పేరాలోని సమాచారం ఆధారంగా కింది ప్రశ్నకు సమాధానం ఇవ్వండి.", "పేరా:", "ప్రశ్న:", "సమాధానం:"),
}


@dataclass
class TyDiQAConfig:
    """TyDiQA options. ``path`` defaults to ``<data_dir>/tydiqa``; ``eval_file`` defaults to
    ``<path>/tydiqa-goldp-v1.1-dev.json``; ``shots_file`` to ``<path>/tydiqa-one-shot.json``."""

    path: Optional[str] = None
    eval_file: Optional[str] = None
    shots_file: Optional[str] = None
    languages: Optional[list[str]] = None
    shots: int = 1
    max_per_lang: Optional[int] = 200
    max_context_tokens: Optional[int] = 512
    max_new_tokens: int = 50
    chat_template: Optional[bool] = None
    seed: int = 42


def read_eval_file(path: str | Path) -> list[TyDiQAExample]:
    """A SQuAD-format GoldP file or a file in the one-shot layout (told apart by a top-level ``"data"``)."""
    path = Path(path)
    if not path.is_file():
        hint = (
            f" ({GOLDP_DEV} is not shipped; download it from the TyDiQA release, or set "
            f"tydiqa.eval_file to {ONE_SHOT} for a 9-question smoke test)" if path.name == GOLDP_DEV else ""
        )
        raise InputNotFoundError(f"TyDiQA evaluation file not found: {path}{hint}")
    with open(path, encoding="utf-8") as f:
        try:
            head = json.load(f)
        except json.JSONDecodeError as e:
            raise EvalDataError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if isinstance(head, dict) and "data" in head:
        return read_tydiqa_goldp(path)
    return [ex for exs in read_tydiqa_one_shot(path).values() for ex in exs]


def _is_goldp(path: Path) -> bool:
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return head.startswith("{") and '"data"' in head[:200]


def tydiqa_prompt(example: TyDiQAExample, demos: Sequence[TyDiQAExample]) -> tuple[str, str]:
    """``(user_text, answer_label)``: the prompt up to (excluding) the answer label."""
    if example.lang not in TEMPLATES:
        raise EvalDataError(f"TyDiQA question {example.id!r}: no prompt template for language {example.lang!r}; known: {sorted(TEMPLATES)}")
    instruction, p, q, a = TEMPLATES[example.lang]
    text = instruction + "\n\n"
    if demos:
        text += "\n\n".join(f"{p} {d.context}\n{q} {d.question}\n{a} {d.answers[0]}" for d in demos) + "\n\n"
    text += f"{p} {example.context}\n{q} {example.question}\n"
    return text, a


def build(cfg: TyDiQAConfig, tokenizer: Any, data_dir: Optional[str]) -> SuiteData:
    root = Path(cfg.path) if cfg.path else Path(data_dir or ".") / "tydiqa"
    chat = resolve_chat_template(tokenizer, cfg.chat_template)

    eval_path = resolve_in(root, cfg.eval_file, GOLDP_DEV)
    examples = read_eval_file(eval_path)
    smoke = eval_path.name == ONE_SHOT or not _is_goldp(eval_path)
    langs = sorted({ex.lang for ex in examples})
    if cfg.languages is not None:
        unknown = [l for l in cfg.languages if l not in langs]
        if unknown:
            raise EvalDataError(f"{eval_path}: no questions in language(s) {unknown}; present: {langs}")
        langs = list(cfg.languages)
    missing = [l for l in langs if l not in TEMPLATES]
    if missing:
        raise EvalDataError(f"{eval_path}: no prompt template for language(s) {missing}; known: {sorted(TEMPLATES)}")
    demo_pool: dict[str, list[TyDiQAExample]] = {}
    if cfg.shots > 0:
        shots_path = resolve_in(root, cfg.shots_file, ONE_SHOT)
        demo_pool = read_tydiqa_one_shot(shots_path)
        lacking = [l for l in langs if l not in demo_pool]
        if lacking:
            raise EvalDataError(f"{shots_path}: no exemplar for language(s) {lacking}")

    def cut(ex: TyDiQAExample) -> TyDiQAExample:
        ctx, _ = truncate_text_tokens(tokenizer, ex.context, cfg.max_context_tokens)
        return ex if ctx == ex.context else TyDiQAExample(ex.id, ex.lang, ctx, ex.question, ex.answers, ex.answer_starts)

    records: list[dict[str, Any]] = []
    n_fewer_shots = 0
    for lang in langs:
        chosen = sample_per_group([e for e in examples if e.lang == lang], cfg.max_per_lang, cfg.seed, lang)
        demos_all = [cut(d) for d in demo_pool.get(lang, [])]
        texts, shots_used = [], []
        for ex in chosen:
            demos = [d for d in demos_all if d.id != ex.id][: cfg.shots]
            n_fewer_shots += len(demos) < cfg.shots
            user, a = tydiqa_prompt(cut(ex), demos)
            texts.append(chat_prompt(tokenizer, user, a) if chat else user + a)
            shots_used.append(len(demos))
        for ex, ids, k in zip(chosen, encode_prompts(tokenizer, texts, chat), shots_used):
            records.append({"id": ex.id, "task": lang, "input_ids": ids, "answers": list(ex.answers), "shots": k})
    if n_fewer_shots:
        log.info("TyDiQA: %d question(s) had fewer than %d demonstration(s) (a question is never its own demo)",
                    n_fewer_shots, cfg.shots)
    return SuiteData(
        suite=NAME,
        records=records,
        tasks=langs,
        constants={"max_new_tokens": cfg.max_new_tokens, "stop": list(STOP)},
        info={"chat_template": chat, "eval_file": str(eval_path), "n_fewer_shots": n_fewer_shots, "n_questions": len(records),
              "eval_set": (f"SMOKE SET: the {len(records)} one-shot exemplars ({eval_path.name}), not TyDiQA GoldP dev"
                           if smoke else "TyDiQA GoldP dev")},
    )


def make_metrics(tasks: Sequence[str]) -> dict[str, Any]:
    return {"em": ExactMatch(tasks, normalization="squad"), "f1": SquadF1(tasks)}


def evaluate_batch(model: nn.Module, tokenizer: Any, batch: dict[str, Any], metrics: dict[str, Any]) -> list[dict[str, Any]]:
    outputs, _ = greedy_generate(
        model, tokenizer, batch["input_ids"], batch["attention_mask"], batch["max_new_tokens"], batch["stop"]
    )
    preds = [o.strip() for o in outputs]
    metrics["em"].update(preds, batch["answers"], batch["task"])
    metrics["f1"].update(preds, batch["answers"], batch["task"])
    return [
        {"id": batch["id"][i], "task": batch["task"][i], "prediction": p, "answers": batch["answers"][i],
         "em": squad_exact_match(p, batch["answers"][i]), "f1": squad_f1(p, batch["answers"][i]),
         "shots": int(batch["shots"][i])}
        for i, p in enumerate(preds)
    ]
