"""Decoder blocks of a causal LM: find them, score them, keep the most important, cut the rest (block surgery).

Shared by Stage 1's ``drop_blocks`` (:func:`iprox_lightning.compression.apply.compress`) and the Layer Extraction baseline
(:mod:`iprox_lightning.baselines.layer_extraction`, ShortGPT), which both rank blocks by

    I_LE(i) = 1 − E_x[ h_iᵀ h_{i+1} / (‖h_i‖ ‖h_{i+1}‖) ]

(``h_i`` / ``h_{i+1}`` the hidden states entering / leaving block ``i``, averaged over every real token) and
remove the least important ones: :func:`remove_blocks` cuts ``config.num_hidden_layers`` and the per-layer config
lists (``layer_types``, ...) to match and renumbers every ``layer_idx`` so KV caching keeps working.
"""
from __future__ import annotations

import copy
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from ..progress import progress as progress_of
from .batch import check_batch
from .model_modes import eval_mode

# config attributes holding one entry per decoder layer
PER_LAYER_CONFIG_KEYS = ("layer_types", "no_rope_layers", "sliding_window_layers", "attention_chunk_sizes")
# config attributes holding a list of layer *indices*
LAYER_INDEX_CONFIG_KEYS = ("mlp_only_layers",)
BLOCK_LIST_PATHS = ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers", "transformer.blocks")


def decoder_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, ModuleList)`` of the decoder blocks of a HF causal LM."""
    n_layers = getattr(model.config, "num_hidden_layers", None)
    for path in BLOCK_LIST_PATHS:
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(mod, nn.ModuleList):
            return path, mod
    # fallback: the longest ModuleList whose length is num_hidden_layers
    cands = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if not cands:
        raise ValueError(f"cannot find the decoder blocks of {type(model).__name__} (tried {BLOCK_LIST_PATHS})")
    return cands[0]


def _hidden_in(args, kwargs) -> torch.Tensor:
    h = kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]
    return h[0] if isinstance(h, tuple) else h


def _hidden_out(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@torch.no_grad()
def block_importance(
    model: nn.Module,
    batches: Iterable[Mapping],
    *,
    max_batches: int | None = None,
    progress: bool = True,
) -> torch.Tensor:
    """``I_LE [L]`` (float64): 1 − mean cosine between each block's input and output hidden states.

    The mean is over all real tokens (``attention_mask == 1``) of all ``batches``.
    """
    _, blocks = decoder_blocks(model)
    L = len(blocks)
    cos_sum = torch.zeros(L, dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    state: dict[str, torch.Tensor] = {}
    handles = []

    def make_hooks(i: int):
        def pre(module, args, kwargs):
            state[f"in{i}"] = _hidden_in(args, kwargs)

        def post(module, args, kwargs, output):
            h_in = state.pop(f"in{i}")
            h_out = _hidden_out(output)
            cos = torch.nn.functional.cosine_similarity(h_in.double(), h_out.double(), dim=-1, eps=1e-12)  # [B, T]
            cos_sum[i] += (cos * state["mask"]).sum().cpu()

        return pre, post

    for i, blk in enumerate(blocks):
        pre, post = make_hooks(i)
        handles.append(blk.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(blk.register_forward_hook(post, with_kwargs=True))
    dev = next(model.parameters()).device

    bar = progress_of(total=max_batches, desc="block importance", unit="batch", enabled=progress)
    try:
        with eval_mode(model):
            for b, batch in enumerate(batches):
                if max_batches is not None and b >= max_batches:
                    break
                check_batch(batch)
                mask = batch["attention_mask"].to(dev)
                state["mask"] = mask.double()
                count += mask.sum().double().cpu()
                model(input_ids=batch["input_ids"].to(dev), attention_mask=mask, use_cache=False)
                if bar is not None:
                    bar.update(1)
    finally:
        for h in handles:
            h.remove()
        if bar is not None:
            bar.close()
    if count == 0:
        raise ValueError("block_importance got no token (empty batches?)")
    return 1.0 - cos_sum / count


def most_important_blocks(importance: torch.Tensor | Sequence[float], n_keep: int) -> list[int]:
    """Indices (ascending) of the ``n_keep`` most important blocks; among equal importances the earlier block
    is kept. (:func:`~iprox_lightning.baselines.layer_extraction.blocks_to_keep` at a sparsity; ``compress(drop_blocks=d)`` keeps ``L − d``.)"""
    imp = torch.as_tensor(importance, dtype=torch.float64)
    L = imp.numel()
    if not 1 <= n_keep <= L:
        raise ValueError(f"keep between 1 and {L} blocks, got {n_keep}")
    order = sorted(range(L), key=lambda i: (-float(imp[i]), i))
    return sorted(order[:n_keep])


def remove_blocks(model: nn.Module, keep: Sequence[int], *, inplace: bool = False) -> nn.Module:
    """The model with only the decoder blocks ``keep`` (in their original order).

    Fixes ``config.num_hidden_layers``, per-layer config lists (``PER_LAYER_CONFIG_KEYS``), lists of
    layer indices (``LAYER_INDEX_CONFIG_KEYS``) and renumbers every ``layer_idx`` attribute inside
    the kept blocks. Without ``inplace`` the input model is left untouched (deep copy).
    """
    path, blocks = decoder_blocks(model)
    L = len(blocks)
    keep = sorted(set(int(i) for i in keep))
    if not keep:
        raise ValueError("keep at least one decoder block")
    bad = [i for i in keep if not 0 <= i < L]
    if bad:
        raise ValueError(f"block indices {bad} out of range for a model with {L} blocks")
    if not inplace:
        model = copy.deepcopy(model)
        path, blocks = decoder_blocks(model)
    new_blocks = nn.ModuleList([blocks[i] for i in keep])
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, new_blocks)
    for new_idx, blk in enumerate(new_blocks):
        for m in blk.modules():
            if hasattr(m, "layer_idx") and isinstance(getattr(m, "layer_idx"), int):
                m.layer_idx = new_idx
    cfg = model.config
    for key in PER_LAYER_CONFIG_KEYS:
        val = getattr(cfg, key, None)
        if isinstance(val, (list, tuple)):
            if len(val) != L:
                raise ValueError(f"config.{key} has {len(val)} entries but the model has {L} blocks")
            setattr(cfg, key, type(val)(val[i] for i in keep))
    for key in LAYER_INDEX_CONFIG_KEYS:
        val = getattr(cfg, key, None)
        if isinstance(val, (list, tuple)):
            setattr(cfg, key, [keep.index(i) for i in val if i in keep])
    cfg.num_hidden_layers = len(keep)
    if hasattr(cfg, "max_window_layers") and isinstance(cfg.max_window_layers, int):
        # Qwen2: layers with index >= max_window_layers use sliding attention (layer_types already cut)
        cfg.max_window_layers = sum(1 for i in keep if i < cfg.max_window_layers)
    return model
