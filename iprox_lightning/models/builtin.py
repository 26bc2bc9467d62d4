"""The built-in demo model: a character-level tokenizer and a tiny Llama, both built offline, so the whole
IProX pipeline runs anywhere in a few minutes on a CPU (``load_model("builtin")``). The demo's data are in
:mod:`iprox_lightning.data.synthetic`.

Tokenizer
    :func:`builtin_tokenizer` is character level (one token per character of
    :data:`BUILTIN_ALPHABET`, ``<unk>`` for anything else) with special tokens ``<pad>`` = 0,
    ``<s>`` = 1, ``</s>`` = 2 (the :func:`~iprox_lightning.models.tiny.tiny_causal_lm` defaults),
    ``<unk>`` = 3 and the chat-role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``. Its
    chat template (:data:`BUILTIN_CHAT_TEMPLATE`) renders a conversation as::

        <s><|user|>\\n{content}</s>\\n<|assistant|>\\n{content}</s>\\n

    so the chat-template code path of the SFT pipeline is exercised by the demo.
"""
from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from .tiny import tiny_causal_lm

BUILTIN_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
BUILTIN_ALPHABET: str = string.ascii_lowercase + string.ascii_uppercase + string.digits + " \n.,:;?!'\"+-*/=()[]<>_#%&|"
"""The characters of the built-in tokenizer's vocabulary, in id order after the special tokens."""

BUILTIN_CHAT_TEMPLATE: str = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def builtin_tokenizer():
    """The built-in character-level tokenizer (a ``transformers.PreTrainedTokenizerFast``).

    Deterministic: the vocabulary is :data:`BUILTIN_SPECIAL_TOKENS` (ids 0..6) followed by the
    characters of :data:`BUILTIN_ALPHABET`. Encoding with ``add_special_tokens=True`` prepends
    ``<s>``; decoding concatenates characters. Padding is on the right.
    """
    vocab = {tok: i for i, tok in enumerate(BUILTIN_SPECIAL_TOKENS)}
    for ch in BUILTIN_ALPHABET:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=list(BUILTIN_SPECIAL_TOKENS[4:]),
        padding_side="right",
        model_max_length=512,
    )
    tok.chat_template = BUILTIN_CHAT_TEMPLATE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    return tok


def builtin_model(seed: int = 0, **overrides):
    """A tiny randomly initialised Llama (``LlamaForCausalLM``) sized for the built-in demo.

    Defaults: vocabulary of :func:`builtin_tokenizer` (95 tokens), hidden size 64, MLP size 128,
    2 layers, 4 attention heads, 2 KV heads, untied embeddings, eager attention (double backward
    works), ~86k parameters. ``overrides`` go to :func:`~iprox_lightning.models.tiny.tiny_causal_lm`.
    """
    kwargs = dict(
        vocab_size=len(BUILTIN_SPECIAL_TOKENS) + len(BUILTIN_ALPHABET),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=512,
    )
    kwargs.update(overrides)
    return tiny_causal_lm("llama", seed=seed, **kwargs)
