"""Bounds on the sizes a model's config states (layers, widths, vocabulary, heads, experts), checked on the config's
raw values before anything is built from them.

A config object alone can be costly: transformers' config classes build per-layer lists and checks (measured: a
Llama config of 10^6 layers took 17 s and 66 MB, a Qwen2 one 60 s), and the model the plan builds on the meta device
holds Python objects per module. A ``config.json`` or GGUF with an absurd layer count made ``plan`` grow past 3 GB.
Each size is checked against :data:`SIZE_BOUNDS` first, far above any published model, and a value above it is refused
in one line naming the file and the key."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ..errors import UserInputError

SIZE_BOUNDS: dict[str, tuple[tuple[str, ...], int]] = {
    "layers": (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 1024),
    "hidden size": (("hidden_size", "n_embd", "d_model"), 1 << 17),
    "intermediate size": (("intermediate_size", "n_inner", "ffn_dim", "moe_intermediate_size"), 1 << 20),
    "vocabulary": (("vocab_size",), 1 << 22),
    "attention heads": (("num_attention_heads", "n_head", "num_key_value_heads"), 1 << 12),
    "head size": (("head_dim",), 1 << 14),
    "experts": (("num_experts", "num_local_experts", "n_routed_experts"), 1 << 12),
}
"""``what: (config keys, largest value)``. The largest published decoders have 126 layers (Llama 3.1 405B), a hidden
size of 16,384, a vocabulary of 262,144 (Gemma 3) and a few hundred experts; the bounds leave a wide margin and keep
what the plan and the loader build from a config (one module per layer, one row per token) to a few MB of objects."""


def check_config_sizes(config: Mapping[str, Any] | Any, source: str | os.PathLike) -> None:
    """Refuse ``config`` (a raw config dict, or a transformers config) when one of its sizes, or one of its
    sub-configs' (``text_config``, ...), is not a non-negative integer (or a list of them) or is above its bound in
    :data:`SIZE_BOUNDS`; ``source`` names the file in the error."""
    raw = config if isinstance(config, Mapping) else config.to_dict()
    _check(raw, str(source), "")


def _check(raw: Mapping[str, Any], source: str, at: str) -> None:
    for what, (keys, bound) in SIZE_BOUNDS.items():
        for key in keys:
            value = raw.get(key)
            if value is None:
                continue
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise UserInputError(f"{source}: {at}{key} = {_short(value)} is not a size (a non-negative "
                                         f"integer): damaged or not a model's config")
                if v > bound:
                    raise UserInputError(f"{source}: {at}{key} = {v} {what}, more than any model this package "
                                         f"plans or loads ({bound:,} at most): damaged or not a model's config")
    for key, sub in raw.items():
        if isinstance(sub, Mapping) and not at:  # sub-configs (text_config, vision_config, ...), one level down
            _check(sub, source, f"{key}.")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


GGUF_WEIGHTS_TOLERANCE = 0.1
"""How far a GGUF's tensors may hold fewer or more weights than the model its metadata describes (a share of the
model's parameters): a few small tensors (e.g. rotary frequencies) may be stored or left out; a file missing a layer's
weights, or whose metadata lacks the sizes (so transformers would build its default size), is far outside."""


def gguf_config(path: str | os.PathLike, elements: int):
    """The transformers config of the GGUF ``path`` whose tensors hold ``elements`` weights (what
    :func:`~iprox_lightning.models.loading.check_gguf` returns), refused when those tensors are not the weights of the
    model it describes, before transformers builds that model: its sizes are bounded (:func:`check_config_sizes`), the
    model is built on the meta device (nothing allocated) and its parameter count compared with ``elements``. Before,
    a 1,344-byte GGUF of one 1-element tensor (architecture llama, no sizes) made ``predict`` build a default-size
    Llama (4 GB in 17 s before it was killed). Pass the config on to ``from_pretrained`` (``config=``): the file's
    metadata is then parsed once."""
    p = Path(path)
    raw, _ = PretrainedConfig.get_config_dict(str(p.parent), gguf_file=p.name)
    check_config_sizes(raw, p)
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)  # as AutoConfig.from_pretrained builds it
    config.name_or_path = str(p.parent)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum({id(t): t.numel() for t in model.parameters()}.values())  # tied weights once, as a GGUF stores them
    if abs(elements - params) > GGUF_WEIGHTS_TOLERANCE * params:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        shape = ", ".join(f"{k.replace('_', ' ')} {getattr(text, k)}" for k in
                          ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
                          if getattr(text, k, None) is not None)
        raise UserInputError(
            f"{p}: its tensors hold {elements:,} weights, but the {config.model_type} model its metadata describes "
            f"({shape}) has {params:,} parameters: the tensors do not match the architecture (damaged, cut, or "
            "metadata without the model's sizes, for which transformers would build its default size)")
    return config
