"""Layer Extraction baseline (ShortGPT, Men et al. 2024): drop the least important decoder blocks.

Block importance (paper Appendix A.1)::

    I_LE(i) = 1 − E_x[ h_iᵀ h_{i+1} / (‖h_i‖ ‖h_{i+1}‖) ]

with ``h_i`` / ``h_{i+1}`` the hidden states entering / leaving block ``i`` (attention + MLP). The
expectation runs over every real (non-padding) token of a small sample of the training pool (1 %
in the paper), each token weighted equally. Blocks that barely change the representation have
low importance. At sparsity ``ρ`` the ``round((1 − ρ) · L)`` most important blocks are kept (at
least one), in their original order, giving a smaller *dense* model: the other blocks are removed,
``config.num_hidden_layers`` and the per-layer config lists (``layer_types``, ...) are cut to
match, and every ``layer_idx`` attribute is renumbered so KV caching keeps working. The result is
an ordinary HF model (``save_pretrained`` / ``from_pretrained``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..engine.blocks import (
    BLOCK_LIST_PATHS, LAYER_INDEX_CONFIG_KEYS, PER_LAYER_CONFIG_KEYS, block_importance, decoder_blocks,
    most_important_blocks, remove_blocks,
)
from ..errors import UserInputError
from ..io.jsonfile import write_json
from ..io.ownership import make_owned_dir
from ..models.loading import load_model

log = logging.getLogger(__name__)

def blocks_to_keep(importance: torch.Tensor | Sequence[float], sparsity: float) -> list[int]:
    """Indices (ascending) of the ``max(1, round((1 − ρ) · L))`` most important blocks."""
    if not 0 <= sparsity < 1:
        raise UserInputError(f"sparsity must be in [0, 1), got {sparsity}")
    L = torch.as_tensor(importance).numel()
    return most_important_blocks(importance, max(1, int(round((1 - sparsity) * L))))


def layer_extraction_proxy(
    model: nn.Module,
    batches: Iterable[Mapping],
    *,
    sparsity: float = 0.3,
    max_batches: int | None = None,
    progress: bool = True,
) -> tuple[nn.Module, dict]:
    """Score the blocks on ``batches``, keep the top ``(1 − ρ)`` share: ``(proxy, info)``.

    ``info`` = ``{"importance": [...], "kept_blocks": [...], "removed_blocks": [...], "sparsity": ρ,
    "num_layers_before": L, "num_layers_after": L'}``.
    """
    imp = block_importance(model, batches, max_batches=max_batches, progress=progress)
    keep = blocks_to_keep(imp, sparsity)
    proxy = remove_blocks(model, keep)
    L = imp.numel()
    info = {
        "method": "layer_extraction",
        "importance": [float(x) for x in imp],
        "kept_blocks": keep,
        "removed_blocks": [i for i in range(L) if i not in keep],
        "sparsity": float(sparsity),
        "num_layers_before": L,
        "num_layers_after": len(keep),
    }
    log.info("layer extraction: kept %d/%d blocks %s", len(keep), L, keep)
    return proxy, info


def save_layer_extraction(proxy: nn.Module, info: Mapping, output_dir: str | os.PathLike, tokenizer=None) -> Path:
    """``save_pretrained`` the proxy (safetensors) + ``layer_extraction.json`` (+ tokenizer) into ``output_dir``."""
    out = Path(output_dir)
    make_owned_dir(out, "model")
    proxy.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    write_json(out / "layer_extraction.json", dict(info))
    return out


def run_layer_extraction(
    model: str,
    output_dir: str,
    batches: Iterable[Mapping],
    *,
    sparsity: float = 0.3,
    max_batches: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
) -> dict:
    """Config-friendly entry point: load ``model`` (hub id / dir / .gguf via ``load_model``), extract, save.

    ``batches`` is the (e.g. 1 %) sample of the pool in the project's batch format.
    """
    m, tok = load_model(model, dtype=dtype)
    m.to(device)
    proxy, info = layer_extraction_proxy(m, batches, sparsity=sparsity, max_batches=max_batches)
    info["source_model"] = model
    save_layer_extraction(proxy, info, output_dir, tokenizer=tok)
    return info
