"""Model-side primitives shared by the suites: left padding, next-token log-probabilities, greedy
generation with stop strings, and chat-template prompt formatting.

Evaluation batches are **left padded** (prompts end at the last column), so the next-token
distribution of every row is read at position ``-1`` and generation continues every row from the
same column. Position ids are derived from the attention mask
(``position_ids = cumsum(mask) - 1``), so a left-padded row gets exactly the logits it would get
unpadded.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn
from transformers import GenerationConfig, StoppingCriteriaList

from ..data import formatting


def pad_token_id(tokenizer: Any) -> int:
    """The id used for padding: ``pad_token_id``, else ``eos_token_id``, else 0 (masked anyway)."""
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            return v
    return 0


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(input_ids [B, T], attention_mask [B, T])`` (long tensors)."""
    if not seqs:
        raise ValueError("left_pad: empty batch")
    if any(len(s) == 0 for s in seqs):
        raise ValueError("left_pad: a prompt has no tokens")
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, T - len(s):] = 1
    return ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@torch.no_grad()
def next_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``log p(· | prompt)`` of the token following each left-padded prompt: float32 ``[B, V]``."""
    if not bool((attention_mask[:, -1] == 1).all()):
        raise ValueError("next_token_logprobs expects LEFT-padded prompts (attention_mask[:, -1] must be 1)")
    kwargs: dict[str, Any] = dict(input_ids=input_ids, attention_mask=attention_mask)
    if _accepts(model, "position_ids"):
        kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    sig = inspect.signature(model.forward).parameters
    if "logits_to_keep" in sig:
        kwargs["logits_to_keep"] = 1
    if "use_cache" in sig:
        kwargs["use_cache"] = False
    out = model(**kwargs)
    logits = out.logits if hasattr(out, "logits") else out
    return torch.log_softmax(logits[:, -1, :].float(), dim=-1)


class _StopOnStrings:
    """Per-row stopping criterion: a row stops once its generated text contains a stop string."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], prompt_len: int, window: int = 16):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop_strings if s]
        self.prompt_len = prompt_len
        self.window = window

    def __call__(self, input_ids: torch.LongTensor, scores: Any = None, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if not self.stop:
            return done
        new = input_ids[:, self.prompt_len:]
        tail = new[:, -self.window:].tolist()
        for i, row in enumerate(tail):
            text = self.tokenizer.decode(row, skip_special_tokens=True)
            done[i] = any(s in text for s in self.stop)
        return done


def eos_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (deduplicated)."""
    ids: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        for v in src if isinstance(src, (list, tuple)) else [src]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def truncate_at_stop(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` up to (excluding) the earliest occurrence of any stop string."""
    cut = len(text)
    for s in stop_strings:
        if s:
            j = text.find(s)
            if j != -1:
                cut = min(cut, j)
    return text[:cut]


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    tokenizer: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    stop_strings: Sequence[str] = (),
) -> tuple[list[str], list[list[int]]]:
    """Greedy decoding (``do_sample=False``) of left-padded prompts with Hugging Face ``generate``.

    A row stops at an EOS token, at ``max_new_tokens`` or once its text contains a stop string.
    Returns ``(texts, token_ids)``: the decoded continuation of each row cut before its first stop
    string (special tokens skipped), and its generated ids up to (excluding) the first EOS.
    """
    if not hasattr(model, "generate"):
        raise TypeError(f"{type(model).__name__} has no .generate(); pass a Hugging Face causal LM")
    if not bool((attention_mask[:, -1] == 1).all()):
        raise ValueError("greedy_generate expects LEFT-padded prompts (attention_mask[:, -1] must be 1)")
    eos = eos_token_ids(model, tokenizer)
    cfg = GenerationConfig(
        max_new_tokens=int(max_new_tokens),
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_token_id(tokenizer),
        eos_token_id=eos or None,
    )
    prompt_len = input_ids.shape[1]
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=cfg,
        stopping_criteria=StoppingCriteriaList([_StopOnStrings(tokenizer, stop_strings, prompt_len)]),
    )
    texts, ids_out = [], []
    for row in out[:, prompt_len:].tolist():
        for j, t in enumerate(row):
            if t in eos:
                row = row[:j]
                break
        text = truncate_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop_strings)
        texts.append(text)
        ids_out.append(row)
    return texts, ids_out


def resolve_chat_template(tokenizer: Any, use: bool | None) -> bool:
    """``use=None`` means: use the chat template when the tokenizer has one."""
    has = getattr(tokenizer, "chat_template", None) is not None
    if use is None:
        return has
    if use and not has:
        raise ValueError(
            f"chat_template=True but the tokenizer {type(tokenizer).__name__} has no chat template; "
            "set chat_template: false (plain prompts) or null (auto)"
        )
    return bool(use)


def chat_prompt(tokenizer: Any, user_text: str, assistant_prefix: str) -> str:
    """open-instruct's chat formatting with the tokenizer's own template: one user turn, the
    generation prompt, then ``assistant_prefix`` (joined with a space unless the template already
    ends in whitespace). A rendering slower than ``CHAT_TEMPLATE_SECONDS`` stops naming the tokenizer."""
    limit = formatting.CHAT_TEMPLATE_SECONDS
    text = formatting.call_with_time_limit(
        lambda: tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                              add_generation_prompt=True),
        limit, formatting.timeout_message(tokenizer, "an evaluation prompt", limit))
    if not isinstance(text, str):
        raise TypeError("apply_chat_template(tokenize=False) did not return a string")
    if not assistant_prefix:
        return text
    return text + assistant_prefix if text[-1:] in ("\n", " ") else text + " " + assistant_prefix


def encode_prompts(tokenizer: Any, texts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of full prompt strings. Plain prompts get the tokenizer's special tokens (BOS);
    chat-formatted prompts already contain them in the template text."""
    if not texts:
        return []
    # verbose=False: prompts longer than the model's window are cut from the left afterwards (max_prompt_tokens,
    # reported per suite), so transformers' "sequence length is longer than the specified maximum" is noise
    enc = tokenizer(list(texts), add_special_tokens=not chat, verbose=False)
    return [list(x) for x in enc["input_ids"]]


def continuation_tokens(tokenizer: Any, context: str, continuations: Sequence[str]) -> tuple[list[int], list[int]]:
    """How each continuation is tokenized *after* ``context``: returns ``(shared_prefix, last_ids)``.

    Tokenizes ``context`` and ``context + c`` for every ``c`` (no special tokens) and takes the
    tokens that ``c`` adds. Those must be: a (possibly empty) prefix shared by all continuations —
    e.g. a bare space token for tokenizers whose letters carry no leading space — followed by one
    distinct token per continuation (e.g. ``" A"`` in byte-level BPE, ``"▁A"`` in SentencePiece).
    The prompt is then extended by the shared prefix and the choice is read from the next-token
    distribution at ``last_ids``. Raises ``ValueError`` otherwise.
    """
    base = tokenizer(context, add_special_tokens=False, verbose=False)["input_ids"]
    adds = []
    for c in continuations:
        full = tokenizer(context + c, add_special_tokens=False, verbose=False)["input_ids"]
        if full[: len(base)] != base:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} merges {context[-12:]!r} with {c!r}: the context's "
                "tokens are not a prefix of the context+continuation tokens"
            )
        adds.append(full[len(base):])
    lengths = {len(a) for a in adds}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"continuations {list(continuations)} tokenize to {adds}: expected the same number (>= 1) of tokens each"
        )
    prefixes = {tuple(a[:-1]) for a in adds}
    if len(prefixes) != 1:
        raise ValueError(f"continuations {list(continuations)} tokenize to {adds}: only their last token may differ")
    last = [a[-1] for a in adds]
    if len(set(last)) != len(last):
        raise ValueError(f"continuations {list(continuations)} share a last token ({adds}); cannot tell them apart")
    return list(prefixes.pop()), last


def truncate_text_tokens(tokenizer: Any, text: str, max_tokens: int | None) -> tuple[str, bool]:
    """``text`` cut to its first ``max_tokens`` tokens (decoded back); ``(text, was_truncated)``."""
    if max_tokens is None:
        return text, False
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True), True
