import pytest
import torch

from iprox_lightning.models.loading import gguf_cache_dir, load_model, resolve_dtype
from iprox_lightning.engine.target_layers import find_target_linears, linear_shape, linear_weight
from iprox_lightning.models.tiny import tiny_causal_lm

ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "mistral", "phi3", "gpt2"]
# expected targeted leaf names per block
EXPECTED = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "mistral": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_build_and_targets(arch):
    model = tiny_causal_lm(arch, num_layers=2)
    targets = find_target_linears(model)
    leaves = {n.rsplit(".", 1)[-1] for n in targets}
    assert leaves == EXPECTED[arch]
    per_block = 4 if arch == "gpt2" else len(EXPECTED[arch])  # gpt2: c_attn, attn.c_proj, c_fc, mlp.c_proj
    assert len(targets) == 2 * per_block
    assert not any("embed" in n or "lm_head" in n or "wte" in n for n in targets)
    ids = torch.randint(3, 128, (2, 9))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.logits.shape == (2, 9, 128)
    assert torch.isfinite(out.logits).all()
    for m in targets.values():
        o, i = linear_shape(m)
        assert linear_weight(m).shape == (o, i)


def test_gpt2_conv1d_weight_is_transposed():
    model = tiny_causal_lm("gpt2", hidden_size=32, intermediate_size=64)
    fc = model.transformer.h[0].mlp.c_fc  # Conv1D(nf=64, nx=32): weight [32, 64]
    assert tuple(fc.weight.shape) == (32, 64)
    assert linear_shape(fc) == (64, 32)
    x = torch.randn(3, 32)
    torch.testing.assert_close(fc(x), x @ linear_weight(fc).t() + fc.bias)


def test_target_patterns_and_errors():
    model = tiny_causal_lm("llama")
    only_q = find_target_linears(model, patterns=["q_proj"])
    assert list(only_q) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    with pytest.raises(ValueError, match="no targeted linear layer found"):
        find_target_linears(model, patterns=["nonexistent"])


def test_shared_module_is_refused():
    model = tiny_causal_lm("llama")
    model.model.layers[1].self_attn.q_proj = model.model.layers[0].self_attn.q_proj
    with pytest.raises(ValueError, match="shared between"):
        find_target_linears(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_save_and_load_directory_roundtrip(tmp_path, arch):
    model = tiny_causal_lm(arch, seed=3)
    model.save_pretrained(tmp_path / arch)
    loaded, tok = load_model(str(tmp_path / arch), tokenizer=False)
    assert tok is None
    sd, sd2 = model.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    assert loaded.config._attn_implementation == "eager"
    assert not loaded.training


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf model"):
        load_model(str(f))
    assert resolve_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


def test_module_passthrough():
    m = tiny_causal_lm("llama")
    assert load_model(m) == (m, None)


@pytest.mark.slow
def test_gguf_load_cache_roundtrip_and_answer(smollm_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("IPROX_CACHE", str(tmp_path / "cache"))
    cache = gguf_cache_dir(smollm_gguf)
    assert not cache.exists()
    m1, tok1 = load_model(str(smollm_gguf))
    assert (cache / "model.safetensors").exists() and (cache / "config.json").exists()
    assert not list(cache.parent.glob("*.tmp-*"))  # atomic write left no temp dir
    m2, tok2 = load_model(str(smollm_gguf))
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert tok1.get_vocab() == tok2.get_vocab() and tok2.chat_template == tok1.chat_template
    enc = tok2.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    out = m2.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok2.decode(out[0, enc["input_ids"].shape[1]:])
    assert "Paris" in answer
