"""Turning canonical records into token ids with a prompt/response boundary.

Conversation
    A Dolly record becomes one user turn, ``instruction`` followed by ``"\\n\\n" + context`` when
    the context is not empty, and one assistant turn, ``response``. A chat record keeps its
    ``messages``; the trailing assistant turn(s) are the response, everything before the prompt.

Chat template (``prompt_template="chat"``, or ``"auto"`` when the tokenizer has one)
    ``prompt_text`` = the template applied to the prompt turns with ``add_generation_prompt=True``;
    ``full_text`` = the template applied to the whole conversation. ``prompt_text`` must be a prefix
    of ``full_text`` (else a ``ValueError`` names the example and suggests the plain template); the
    response part is the rest (it includes the template's end-of-turn tokens, which the model must
    learn to emit). Both parts are tokenized without adding special tokens (templates carry their
    own BOS), so the boundary is exact and the prompt is tokenized as at generation time. A template
    is a program: a rendering that takes longer than :data:`CHAT_TEMPLATE_SECONDS` (one that loops
    forever) stops with :class:`ChatTemplateTimeout` naming the tokenizer and the example.

Plain template (``prompt_template="plain"``, or ``"auto"`` without a chat template)::

    <bos>### Instruction:
    {instruction}

    ### Input:
    {context}

    ### Response:
    {response}<eos>

    The ``### Input:`` block is left out when the context is empty; ``<bos>`` / ``<eos>`` only when
    the tokenizer defines them. A chat record renders each prompt turn as ``### System:`` /
    ``### Instruction:`` / ``### Response:`` (for system / user / earlier assistant turns), blocks
    separated by a blank line, then ``### Response:\\n`` and the response turns joined by ``"\\n\\n"``.
    The prompt part ends right after ``### Response:\\n``.

Labels (Hugging Face convention, see :mod:`iprox_lightning.engine.batch`) are ``-100`` on every prompt
token and the token id on every response token.

Truncation to ``max_length``
    * ``"prompt_left"`` (default) keeps response tokens where possible: the prompt is cut from the
      left (a leading BOS is kept) down to ``max(max_length - n_response, 1)`` tokens — at least one
      prompt token stays, so the first response token is predicted — then, if still too long, the
      response is cut from the right.
    * ``"right"`` cuts the whole sequence from the right (like ``tokenizer(truncation=True)``); an
      example whose response then starts beyond ``max_length`` loses every response token.

Text that can never be kept is cut before tokenizing: no token spans more than :data:`CHARS_PER_TOKEN_BOUND`
characters, so of each text field only ``max_length × CHARS_PER_TOKEN_BOUND`` characters can reach the kept tokens
— the field's end for a prompt field under ``"prompt_left"`` (instruction, context, prompt turns), its start
otherwise (:func:`bound_record`); the rendered prompt and response texts are then cut the same way
(:func:`bound_rendered`: a conversation of many short turns). A 50 MB record with ``max_length=128`` is tokenized as
8 K characters per field, not 50 MB; the kept tokens are those of the uncut text whenever tokens average at most half
the bound.

An example left with no scored response token (no response token at position ≥ 1) is dropped;
:func:`tokenize_records` returns the dropped ids so callers can count them in the log.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import UserInputError
from ..progress import progress as progress_of

PROMPT_TEMPLATES = ("auto", "chat", "plain")
TRUNCATIONS = ("prompt_left", "right")
_PLAIN_HEADERS = {"system": "### System:", "user": "### Instruction:", "assistant": "### Response:"}


def user_content(instruction: str, context: str = "") -> str:
    """The user turn of a Dolly record: the instruction, then a blank line and the context if any."""
    return f"{instruction}\n\n{context}" if context and context.strip() else instruction


def to_conversation(record: dict) -> tuple[list[dict], list[dict]]:
    """``(prompt_messages, response_messages)`` of a canonical record."""
    if "messages" in record:
        msgs = record["messages"]
        k = len(msgs)
        while k > 0 and msgs[k - 1]["role"] == "assistant":
            k -= 1
        return list(msgs[:k]), list(msgs[k:])
    return (
        [{"role": "user", "content": user_content(record["instruction"], record.get("context") or "")}],
        [{"role": "assistant", "content": record["response"]}],
    )


def render_plain(record: dict) -> tuple[str, str]:
    """``(prompt_text, response_text)`` of the plain template (without BOS / EOS)."""
    prompt, response = to_conversation(record)
    if "messages" in record:
        blocks = [f"{_PLAIN_HEADERS[m['role']]}\n{m['content']}" for m in prompt]
    else:
        blocks = [f"### Instruction:\n{record['instruction']}"]
        if (record.get("context") or "").strip():
            blocks.append(f"### Input:\n{record['context']}")
    return "\n\n".join(blocks) + "\n\n### Response:\n", "\n\n".join(m["content"] for m in response)


CHAT_TEMPLATE_SECONDS = 30.0
"""Time limit of one chat-template rendering (a template is a program: one that loops forever would hang the run)."""


class ChatTemplateTimeout(UserInputError):
    """A tokenizer's chat template did not finish rendering within :data:`CHAT_TEMPLATE_SECONDS`."""


def tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def timeout_message(tokenizer: Any, what: str, seconds: float) -> str:
    return (f"the chat template of tokenizer {tokenizer_name(tokenizer)!r} did not finish rendering {what} within "
            f"{seconds:g} s (a template that never ends?); fix the tokenizer's chat_template or use "
            "prompt_template='plain'")


def call_with_time_limit(fn: Callable[[], Any], seconds: float, message: str) -> Any:
    """``fn()``, stopped after ``seconds`` with :class:`ChatTemplateTimeout` (``message``). In the main thread a
    ``SIGALRM`` timer interrupts ``fn`` itself (an earlier timer is restored); elsewhere ``fn`` runs in a daemon
    thread that is abandoned when it overruns."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        def on_alarm(signum, frame):
            raise ChatTemplateTimeout(message)

        t0 = time.monotonic()
        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        old_timer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_timer:
                signal.setitimer(signal.ITIMER_REAL, max(old_timer - (time.monotonic() - t0), 1e-3))
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller
            result["error"] = e

    worker = threading.Thread(target=run, daemon=True, name="chat-template")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise ChatTemplateTimeout(message)
    if "error" in result:
        raise result["error"]
    return result["value"]


def render_chat(record: dict, tokenizer: Any, time_limit: float | None = None) -> tuple[str, str]:
    """``(prompt_text, response_text)`` with the tokenizer's chat template (see module doc); each rendering stopped
    after ``time_limit`` seconds (``None``: :data:`CHAT_TEMPLATE_SECONDS`; ``0``: no limit) with
    :class:`ChatTemplateTimeout` naming the tokenizer."""
    prompt, response = to_conversation(record)
    rid = record.get("id", "?")
    limit = CHAT_TEMPLATE_SECONDS if time_limit is None else time_limit

    def render(msgs, **kw):
        fn = lambda: tokenizer.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
        return call_with_time_limit(fn, limit, timeout_message(tokenizer, f"example {rid!r}", limit)) if limit else fn()

    try:
        prompt_text = render(prompt, add_generation_prompt=True)
        full_text = render(prompt + response)
    except ChatTemplateTimeout:
        raise
    except Exception as e:
        raise UserInputError(f"example {rid!r}: the tokenizer's chat template failed ({type(e).__name__}: {e}); "
                             f"use prompt_template='plain'") from e
    if not full_text.startswith(prompt_text):
        raise UserInputError(
            f"example {rid!r}: the chat template does not render the prompt (with add_generation_prompt=True) "
            f"as a prefix of the full conversation, so the response boundary is ambiguous; use prompt_template='plain'"
        )
    return prompt_text, full_text[len(prompt_text):]


def resolve_template(tokenizer: Any, prompt_template: str = "auto") -> str:
    """``"chat"`` or ``"plain"`` for ``prompt_template`` in :data:`PROMPT_TEMPLATES`."""
    if prompt_template not in PROMPT_TEMPLATES:
        raise UserInputError(f"prompt_template must be one of {PROMPT_TEMPLATES}, got {prompt_template!r}")
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if prompt_template == "chat" and not has_chat:
        raise UserInputError("prompt_template='chat' but the tokenizer has no chat template; use 'plain' or 'auto'")
    if prompt_template == "auto":
        return "chat" if has_chat else "plain"
    return prompt_template


CHARS_PER_TOKEN_BOUND = 64
"""Characters per token that no real tokenizer exceeds (long whitespace or punctuation runs included); with
``max_length`` it bounds how much of a field's text is rendered and tokenized (:func:`bound_record`)."""


def _cut(text: Any, max_chars: int, keep_end: bool) -> Any:
    if not isinstance(text, str) or len(text) <= max_chars:
        return text
    return text[len(text) - max_chars:] if keep_end else text[:max_chars]


def bound_record(record: dict, max_chars: int, truncation: str = "prompt_left") -> dict:
    """``record`` with each text field cut to ``max_chars`` characters on the side :func:`truncate` drops: prompt
    fields (``instruction``, ``context``, prompt turns of ``messages``) keep their end under ``"prompt_left"``, their
    start under ``"right"``; response fields keep their start. The same dict when nothing is longer."""
    keep_end = truncation == "prompt_left"
    if "messages" in record:
        prompt, response = to_conversation(record)
        if all(len(m["content"]) <= max_chars for m in record["messages"]):
            return record
        msgs = [{**m, "content": _cut(m["content"], max_chars, keep_end)} for m in prompt]
        msgs += [{**m, "content": _cut(m["content"], max_chars, False)} for m in response]
        return {**record, "messages": msgs}
    fields = {"instruction": keep_end, "context": keep_end, "response": False}
    if all(not isinstance(record.get(f), str) or len(record[f]) <= max_chars for f in fields):
        return record
    return {**record, **{f: _cut(record[f], max_chars, end) for f, end in fields.items() if f in record}}


def bound_rendered(prompt_text: str, response_text: str, max_chars: int, truncation: str = "prompt_left",
                   bos_text: str | None = None) -> tuple[str, str]:
    """The rendered ``(prompt_text, response_text)`` cut to ``max_chars`` characters each on the side :func:`truncate`
    drops (the prompt's end is kept under ``"prompt_left"``, its start under ``"right"``; the response's start), a
    leading ``bos_text`` (a chat template's BOS, which truncation keeps) kept in front. What :func:`bound_record`
    cannot bound, many short turns of one conversation (50,000 turns of 100 characters peaked at 2.1 GB), is bounded
    here, before tokenizing."""
    if len(prompt_text) > max_chars:
        if truncation != "prompt_left":
            prompt_text = prompt_text[:max_chars]
        elif bos_text and prompt_text.startswith(bos_text):
            prompt_text = bos_text + prompt_text[len(prompt_text) - max_chars:]
        else:
            prompt_text = prompt_text[len(prompt_text) - max_chars:]
    return prompt_text, response_text[:max_chars]


def truncate(
    prompt_ids: list[int], response_ids: list[int], max_length: int, truncation: str = "prompt_left", bos_id: int | None = None
) -> tuple[list[int], list[int]]:
    """Apply the truncation rule of the module doc; returns the kept ``(prompt_ids, response_ids)``."""
    if max_length < 2:
        raise UserInputError(f"max_length must be >= 2, got {max_length}")
    n_p, n_r = len(prompt_ids), len(response_ids)
    if n_p + n_r <= max_length:
        return prompt_ids, response_ids
    if truncation == "right":
        keep_p = min(n_p, max_length)
        return prompt_ids[:keep_p], response_ids[: max_length - keep_p]
    if truncation != "prompt_left":
        raise UserInputError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    keep_p = min(n_p, max(max_length - n_r, 1))
    if keep_p < n_p:
        if bos_id is not None and keep_p >= 2 and prompt_ids[0] == bos_id:
            prompt_ids = [bos_id] + prompt_ids[n_p - keep_p + 1:]
        else:
            prompt_ids = prompt_ids[n_p - keep_p:]
    return prompt_ids, response_ids[: max_length - keep_p]


@dataclass
class TokenizedExample:
    """One tokenized example: ``input_ids`` (int32 ``[T]``) whose first ``prompt_len`` tokens are prompt."""

    id: str
    task: str
    input_ids: torch.Tensor
    prompt_len: int

    @property
    def labels(self) -> torch.Tensor:
        lab = self.input_ids.long().clone()
        lab[: self.prompt_len] = -100
        return lab

    @property
    def n_scored(self) -> int:
        """Response tokens whose prediction is scored (those at positions >= 1)."""
        return len(self.input_ids) - max(self.prompt_len, 1)


def tokenize_records(
    records: Sequence[dict],
    tokenizer: Any,
    *,
    max_length: int = 512,
    prompt_template: str = "auto",
    truncation: str = "prompt_left",
    chunk_size: int = 1024,
    progress: bool = False,
    desc: str = "tokenizing",
) -> tuple[list[TokenizedExample], list[str]]:
    """Tokenize canonical records; returns ``(examples, dropped_ids)`` (module doc for the rules)."""
    mode = resolve_template(tokenizer, prompt_template)
    if truncation not in TRUNCATIONS:
        raise UserInputError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
    if max_length < 2:
        raise UserInputError(f"max_length must be >= 2, got {max_length}")
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    bos_text = getattr(tokenizer, "bos_token", None) if mode == "chat" else None  # rendered by the template
    examples: list[TokenizedExample] = []
    dropped: list[str] = []

    # every rendering is timed in the main thread (a signal timer costs microseconds); elsewhere the first one only
    in_main = threading.current_thread() is threading.main_thread()
    _limit = lambda j: None if in_main or j == 0 else 0  # noqa: E731
    starts = range(0, len(records), chunk_size)

    starts = progress_of(starts, desc=desc, unit="chunk", total=len(starts), enabled=progress, leave=True)
    for s in starts:
        chunk = [bound_record(r, max_length * CHARS_PER_TOKEN_BOUND, truncation) for r in records[s : s + chunk_size]]
        texts = [render_chat(r, tokenizer, time_limit=_limit(s + j)) if mode == "chat" else render_plain(r)
                 for j, r in enumerate(chunk)]
        texts = [bound_rendered(p, r, max_length * CHARS_PER_TOKEN_BOUND, truncation, bos_text) for p, r in texts]
        enc = dict(add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False, verbose=False)
        enc_p = tokenizer([t[0] for t in texts], **enc)["input_ids"]
        enc_r = tokenizer([t[1] for t in texts], **enc)["input_ids"]
        for r, p_ids, r_ids in zip(chunk, enc_p, enc_r):
            p_ids, r_ids = list(p_ids), list(r_ids)
            if mode == "plain":
                if bos is not None:
                    p_ids = [bos] + p_ids
                if eos is not None:
                    r_ids = r_ids + [eos]
            p_ids, r_ids = truncate(p_ids, r_ids, max_length, truncation, bos)
            ex = TokenizedExample(
                id=r["id"], task=r["category"], input_ids=torch.tensor(p_ids + r_ids, dtype=torch.int32), prompt_len=len(p_ids)
            )
            if len(r_ids) == 0 or ex.n_scored <= 0:
                dropped.append(r["id"])
            else:
                examples.append(ex)
    return examples, dropped
