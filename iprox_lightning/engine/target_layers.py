"""Which layers IProX compresses, tracks and scores, and the helpers that count, find and swap them.

By default: the attention and MLP projections inside the decoder blocks (``q/k/v/o``,
``gate/up/down``, fused ``qkv_proj``/``gate_up_proj``, GPT-2 ``c_attn/c_proj/c_fc``), never the
embeddings or the LM head. GPT-2-style ``Conv1D`` layers are included (their weight is ``[in, out]``).
"""
from __future__ import annotations

import re
import sys
from typing import Iterable

import torch
from torch import nn

from .lowrank import LowRankLinear



def conv1d_class() -> type | None:
    """transformers' GPT-2-style ``Conv1D`` class, or ``None`` while ``transformers.pytorch_utils`` is not imported:
    no ``Conv1D`` layer can exist before its class does, and the engine then loads without transformers (``train.py
    plan`` reads its numbers from a cache without it)."""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)

# leaf-name patterns of attention / MLP projections across Llama, Qwen, Gemma, Mistral, Phi, GPT-2, ...
DEFAULT_TARGET_PATTERNS = (
    r"q_proj", r"k_proj", r"v_proj", r"o_proj", r"qkv_proj", r"query_key_value", r"dense",
    r"gate_proj", r"up_proj", r"down_proj", r"gate_up_proj", r"fc1", r"fc2", r"w1", r"w2", r"w3",
    r"c_attn", r"c_proj", r"c_fc", r"out_proj", r"dense_h_to_4h", r"dense_4h_to_h", r"wq", r"wk", r"wv", r"wo",
)
# a peft model's LoRA adapters (``...q_proj.lora_A.default``): what a model holding them tracks when no patterns are
# given (its base is frozen; its adapted projections are peft layers, not linear ones)
ADAPTER_TARGET_PATTERNS = (r"lora_[AB]\.[^.]+",)
# never touched, whatever the patterns say
EXCLUDED_PATTERNS = (r"embed", r"lm_head", r"wte", r"wpe", r"score", r"classifier")
# a module path must contain a decoder block index ("layers.3.", "h.3.", "blocks.3.")
BLOCK_RE = re.compile(r"(^|\.)(layers|h|blocks|block|decoder_layers)\.\d+\.")


def is_linear_like(module: nn.Module) -> bool:
    conv = conv1d_class()
    return isinstance(module, (nn.Linear, LowRankLinear)) or (conv is not None and isinstance(module, conv))


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The weight of a linear-like layer as ``[out, in]`` (``Conv1D`` stores ``[in, out]``)."""
    conv = conv1d_class()
    if conv is not None and isinstance(module, conv):
        return module.weight.t()
    return module.weight


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a linear-like layer."""
    if isinstance(module, LowRankLinear):
        return module.out_features, module.in_features
    w = linear_weight(module)
    return int(w.shape[0]), int(w.shape[1])


def find_target_linears(
    model: nn.Module,
    patterns: Iterable[str] | None = None,
    *,
    include_lowrank: bool = True,
) -> dict[str, nn.Module]:
    """Map ``module path -> module`` for the targeted linear layers of a causal LM, in model order.

    ``patterns`` are regexes (default ``DEFAULT_TARGET_PATTERNS``), each matched whole against the module's path and
    against every dotted tail of it (:func:`path_tails`): a leaf name (``q_proj``) matches as it always did, and a
    longer path names the layers inside a wrapper, e.g. PEFT's adapters ``lora_[AB]\\.default`` or
    ``q_proj\\.lora_A\\.default`` (in a PEFT model the leaf of ``...q_proj.lora_A.default`` is ``default``);
    only modules inside a numbered decoder block are returned; embeddings / LM head never are.
    Without ``patterns`` a model holding LoRA adapters (peft) tracks its adapters (:data:`ADAPTER_TARGET_PATTERNS`,
    :func:`default_patterns`), any other the projections (:data:`DEFAULT_TARGET_PATTERNS`).
    Raises ``ValueError`` when nothing matches (so a wrong pattern never silently tracks nothing).
    """
    patterns = list(patterns or default_patterns(model))
    pats = [re.compile(rf"^(?:{p})$") for p in patterns]
    excl = [re.compile(p) for p in EXCLUDED_PATTERNS]
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not name or not is_linear_like(module):
            continue
        if isinstance(module, LowRankLinear) and not include_lowrank:
            continue
        if any(e.search(name) for e in excl):
            continue
        if not BLOCK_RE.search(name + "."):
            continue
        tails = path_tails(name)
        if any(p.match(t) for p in pats for t in tails):
            found[name] = module
    if not found:
        raise ValueError(
            f"no targeted linear layer found in {type(model).__name__} with patterns "
            f"{patterns}"
        )
    _refuse_shared(model, found)
    return found


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds LoRA adapter layers (peft's ``lora_A`` / ``lora_B``, any adapter name)."""
    return any(".lora_A." in f"{n}." for n, _ in model.named_modules())


def default_patterns(model: nn.Module) -> tuple[str, ...]:
    """The tracked layers when none are named: a peft model's adapters (:data:`ADAPTER_TARGET_PATTERNS`: the
    gradients LESS scores, over the adapter weights alone), else the projections (:data:`DEFAULT_TARGET_PATTERNS`)."""
    return ADAPTER_TARGET_PATTERNS if has_adapters(model) else DEFAULT_TARGET_PATTERNS


def path_tails(name: str) -> list[str]:
    """The dotted tails of a module path, shortest first: ``a.b.c`` -> ``["c", "b.c", "a.b.c"]`` (the leaf name
    first, the whole path last)."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts) - 1, -1, -1)]


def _refuse_shared(model: nn.Module, found: dict[str, nn.Module]) -> None:
    """Per-module hooks break on a module reachable under two names: refuse it explicitly."""
    seen: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if module in found.values():
            if id(module) in seen and seen[id(module)] != name:
                raise ValueError(
                    f"targeted layer is shared between {seen[id(module)]!r} and {name!r}; "
                    "per-layer statistics would mix both uses — untie it or exclude it"
                )
            seen[id(module)] = name


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of distinct parameters of ``model`` (tied tensors counted once), embeddings and LM
    head included."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the dotted path ``name`` of ``model`` (replacing what is there)."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def lowrank_layers(model: nn.Module) -> dict:
    """``{name: LowRankLinear}`` of a model (empty for an uncompressed one)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}


def is_compressed(model: nn.Module) -> bool:
    """True when the model already holds ``LowRankLinear`` layers (e.g. a resumed proxy)."""
    return bool(lowrank_layers(model))
