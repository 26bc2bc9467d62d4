"""Layer Extraction (ShortGPT): importance vs brute force, the cut model equals the original with blocks skipped."""
import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from iprox_lightning.baselines.layer_extraction import (
    block_importance,
    blocks_to_keep,
    decoder_blocks,
    layer_extraction_proxy,
    remove_blocks,
    save_layer_extraction,
)
from iprox_lightning.models.tiny import tiny_causal_lm, tiny_config


def _model(arch):
    if arch == "gemma3":  # mixed sliding / full layers with a window shorter than the sequence
        cfg = tiny_config("gemma3", num_layers=4)
        cfg.sliding_window = 4
        cfg.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    return tiny_causal_lm(arch, num_layers=4)


def _batches(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(2):
        ids = torch.randint(3, 128, (3, 11), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 6:] = 0
        mask[2, 9:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.clone(), "id": [f"{b}-{i}" for i in range(3)]})
    return out


def _brute_importance(model, batches):
    """Hidden states via output_hidden_states (block inputs); the last block's output with the final norm removed."""
    import copy

    bare = copy.deepcopy(model)
    bare.model.norm = nn.Identity()
    L = model.config.num_hidden_layers
    sums, count = torch.zeros(L, dtype=torch.float64), 0.0
    with torch.no_grad():
        for b in batches:
            hs = bare(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True).hidden_states
            m = b["attention_mask"].bool()
            for i in range(L):
                x, y = hs[i][m].double(), hs[i + 1][m].double()
                sums[i] += ((x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1))).sum()
            count += m.sum().item()
    return 1 - sums / count


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_block_importance_vs_brute_force(arch):
    model = _model(arch)
    batches = _batches()
    imp = block_importance(model, batches, progress=False)
    torch.testing.assert_close(imp, _brute_importance(model, batches), rtol=1e-6, atol=1e-9)
    assert imp.shape == (4,) and torch.all(imp > 0)


def test_blocks_to_keep():
    imp = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.2, 0.8, 0.05, 0.7, 0.6, 0.4])
    assert blocks_to_keep(imp, 0.3) == [0, 2, 3, 5, 7, 8, 9]  # 7 most important, original order
    assert blocks_to_keep(imp, 0.0) == list(range(10))
    assert blocks_to_keep(imp, 0.99) == [2]
    assert blocks_to_keep([1.0, 1.0, 1.0, 1.0], 0.5) == [0, 1]  # ties: earlier blocks
    with pytest.raises(ValueError):
        blocks_to_keep(imp, 1.0)


def _skip_hooks(model, skip):
    """Make the original model skip blocks: each skipped block returns its input hidden states."""
    _, blocks = decoder_blocks(model)
    handles = []
    for i in skip:
        def hook(mod, args, kwargs, out):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h
        handles.append(blocks[i].register_forward_hook(hook, with_kwargs=True))
    return handles


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("keep", [[0, 2], [1, 3], [3]])
def test_cut_model_equals_original_with_blocks_skipped(arch, keep):
    model = _model(arch)
    cut = remove_blocks(model, keep)
    assert model.config.num_hidden_layers == 4 and len(decoder_blocks(model)[1]) == 4  # original untouched
    assert cut.config.num_hidden_layers == len(keep) and len(decoder_blocks(cut)[1]) == len(keep)
    if getattr(model.config, "layer_types", None):
        assert cut.config.layer_types == [model.config.layer_types[i] for i in keep]
    assert [b.self_attn.layer_idx for b in decoder_blocks(cut)[1]] == list(range(len(keep)))
    b = _batches(1)[0]
    handles = _skip_hooks(model, [i for i in range(4) if i not in keep])
    try:
        ref = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    finally:
        for h in handles:
            h.remove()
    out = cut(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    full = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert (full - out).abs().max() > 1e-3  # removing blocks does change the model


def test_layer_extraction_proxy_saves_and_reloads(tmp_path):
    model = _model("gemma3")
    proxy, info = layer_extraction_proxy(model, _batches(), sparsity=0.5, progress=False)
    imp = torch.tensor(info["importance"])
    assert info["kept_blocks"] == sorted(torch.topk(imp, 2).indices.tolist())
    assert info["num_layers_after"] == 2 and len(info["removed_blocks"]) == 2
    out_dir = save_layer_extraction(proxy, info, tmp_path / "le")
    assert json.loads((out_dir / "layer_extraction.json").read_text())["kept_blocks"] == info["kept_blocks"]
    assert any(p.suffix == ".safetensors" for p in out_dir.iterdir())
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    assert reloaded.config.num_hidden_layers == 2
    b = _batches(2)[0]
    torch.testing.assert_close(
        reloaded(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
        proxy(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
    )
    # generation with a KV cache works on the renumbered layers and matches the no-cache greedy path
    x = b["input_ids"][:1, :5]
    g1 = proxy.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, use_cache=True)
    g2 = proxy.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(g1, g2)


def test_remove_blocks_errors():
    model = _model("llama")
    with pytest.raises(ValueError, match="out of range"):
        remove_blocks(model, [0, 7])
    with pytest.raises(ValueError, match="at least one"):
        remove_blocks(model, [])
