"""Issue 23.3: a proxy can be used outside the library. ``export_proxy`` (``python -m iprox_lightning.io.proxy export``,
``python train.py export_proxy``) writes a dense Hugging Face model that plain ``from_pretrained`` loads with the
proxy's logits, recording where it came from; plain ``from_pretrained`` on the proxy directory itself fails with a
message naming ``load_proxy`` and the export; ``load_model`` given a proxy's file names the directory."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from iprox_lightning import LowRankLinear, compress_model, export_proxy, load_model, load_proxy, save_proxy
from iprox_lightning.io.fingerprint import file_identity
from iprox_lightning.models.builtin import builtin_tokenizer
from iprox_lightning.models.tiny import tiny_causal_lm

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1)


def make_proxy(tmp_path, arch="llama", dtype=torch.float32, name="proxy", **kw):
    model = tiny_causal_lm(arch, seed=3, dtype=dtype, **{**TINY, **kw})
    compress_model(model, None, 0.5, method="svd", progress=False)
    return save_proxy(model, builtin_tokenizer(), tmp_path / name, target_model=f"tiny-{arch}")


def tokens():
    return torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                     ("qwen2", {}),  # biases on q/k/v
                                     ("gpt2", {})],  # Conv1D: weights stored [in, out]
                         ids=["llama", "llama-tied", "qwen2-bias", "gpt2-conv1d"])
def test_export_loads_with_plain_from_pretrained_and_gives_the_proxys_logits(tmp_path, arch, kw):
    path = make_proxy(tmp_path, arch, **kw)
    out = export_proxy(path, tmp_path / "dense")
    proxy, _ = load_proxy(path)
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert not any(isinstance(m, LowRankLinear) for m in dense.modules())
    assert dense.dtype == torch.float32
    x = tokens()
    assert torch.allclose(dense(x).logits, proxy(x).logits, atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == builtin_tokenizer().get_vocab()
    assert (out / "model.safetensors").is_file() and not list(out.glob("iprox_proxy*.safetensors"))
    assert "transformers_weights" not in json.loads((out / "config.json").read_text())
    man = json.loads((path / "iprox_proxy.json").read_text())
    if arch == "qwen2":
        assert man["layers"]["model.layers.0.self_attn.q_proj"]["bias"] is True
    rec = json.loads((out / "iprox_export.json").read_text())
    assert rec["proxy"]["path"] == str(path.resolve())
    assert rec["proxy"]["manifest"] == {"file": "iprox_proxy.json", **file_identity(path / "iprox_proxy.json", None)}
    assert rec["proxy"]["weights"] == man["weights"] and rec["proxy"]["target_model"] == f"tiny-{arch}"
    assert rec["layers_densified"] == len(man["layers"]) and rec["dtype"] == "float32"
    assert rec["check"]["max_abs_logit_diff"] <= 1e-5
    loaded, tok = load_model(str(out))  # the library loads it as the plain model it is
    assert torch.allclose(loaded(x).logits, proxy(x).logits, atol=1e-5, rtol=0) and tok is not None


def test_export_dtype(tmp_path):
    path = make_proxy(tmp_path)
    out = export_proxy(path, tmp_path / "bf16", dtype="bf16")
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in dense.parameters()} == {torch.bfloat16}
    assert json.loads((out / "iprox_export.json").read_text())["dtype"] == "bfloat16"
    proxy, _ = load_proxy(path)
    x = tokens()
    assert torch.allclose(dense(x).logits.float(), proxy(x).logits, atol=0.1)
    # a bfloat16 proxy exported as float32: the weights are the exact products, compared in float32
    path16 = make_proxy(tmp_path, dtype=torch.bfloat16, name="proxy16")
    out32 = export_proxy(path16, tmp_path / "f32", dtype="float32")
    rec = json.loads((out32 / "iprox_export.json").read_text())
    assert rec["dtype"] == "float32" and rec["proxy"]["dtype"] == "bfloat16"
    assert rec["check"]["reference_dtype"] == "float32" and rec["check"]["max_abs_logit_diff"] <= 1e-5
    with pytest.raises(ValueError, match="unknown export dtype 'int8'"):
        export_proxy(path, tmp_path / "int8", dtype="int8")


def test_export_refuses_the_proxy_dir_a_non_empty_output_and_a_proxy(tmp_path):
    path = make_proxy(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(ValueError, match="is the proxy directory itself"):
        export_proxy(path, path)
    with pytest.raises(ValueError, match="inside the proxy directory"):
        export_proxy(path, path / "dense")
    with pytest.raises(ValueError, match="contains the proxy directory"):
        export_proxy(path, tmp_path, overwrite=True)
    out = tmp_path / "dense"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"exists and is not empty; pass --overwrite true"):
        export_proxy(path, out)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "data").mkdir()
    with pytest.raises(FileExistsError, match=r"replaces a previous export only.*holds 2 other file\(s\): data/, keep.txt"):
        export_proxy(path, out, overwrite=True)  # issue 57: it deleted every unrelated file without a word
    assert (out / "keep.txt").read_text() == "mine" and (out / "data").is_dir()
    (out / "keep.txt").unlink()
    (out / "data").rmdir()
    export_proxy(path, out)
    export_proxy(path, out, overwrite=True)  # a previous export: replaced
    assert (out / "model.safetensors").is_file()
    other = make_proxy(tmp_path, name="other")
    with pytest.raises(FileExistsError, match="is an IProX proxy directory; refusing to replace a proxy"):
        export_proxy(path, other, overwrite=True)
    assert (other / "iprox_proxy.safetensors").is_file()
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before  # the proxy is never touched
    assert not list(tmp_path.glob(".*export-*")) and not list(tmp_path.glob(".*replaced-*"))  # no leftovers
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_proxy(path, empty) == empty and (empty / "iprox_export.json").is_file()


def test_export_commands(tmp_path, capsys):
    from iprox_lightning.cli import main
    from iprox_lightning.io.proxy import _main

    path = make_proxy(tmp_path)
    _main(["export", str(path), str(tmp_path / "a")])
    assert "exported as a dense Hugging Face model" in capsys.readouterr().out
    with pytest.raises(FileExistsError):
        _main(["export", str(path), str(tmp_path / "a")])
    _main(["export", str(path), str(tmp_path / "a"), "--overwrite", "--dtype", "float16"])
    assert json.loads((tmp_path / "a" / "iprox_export.json").read_text())["dtype"] == "float16"
    main(["export_proxy", "--proxy", str(path), "--output", str(tmp_path / "b")])
    assert "export_proxy: wrote a dense Hugging Face model" in capsys.readouterr().out
    with pytest.raises(FileExistsError):
        main(["export_proxy", "--proxy", str(path), "--output", str(tmp_path / "b")])
    main(["export_proxy", "--proxy", str(path), "--output", str(tmp_path / "b"), "--overwrite", "true",
          "--dtype", "bfloat16"])
    assert json.loads((tmp_path / "b" / "iprox_export.json").read_text())["dtype"] == "bfloat16"
    a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in "ab")
    assert a.dtype == torch.float16 and b.dtype == torch.bfloat16


def test_plain_from_pretrained_on_a_proxy_says_what_to_do(tmp_path):
    from iprox_lightning.io.proxy import FROM_PRETRAINED_NOTE, upgrade_proxy

    path = make_proxy(tmp_path)
    with pytest.raises(ValueError, match=r"IProX proxy.*iprox_lightning\.load_proxy\(.*python -m "
                                         r"iprox_lightning\.io\.proxy export .*train\.py export_proxy"):
        AutoModelForCausalLM.from_pretrained(path)
    # a proxy saved before the note: `upgrade` adds it, nothing else changes
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("transformers_weights")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(path)
    weights = (path / "iprox_proxy.safetensors").read_bytes()
    upgrade_proxy(path)
    assert json.loads((path / "config.json").read_text()) == {**cfg, "transformers_weights": FROM_PRETRAINED_NOTE}
    assert (path / "iprox_proxy.safetensors").read_bytes() == weights
    with pytest.raises(ValueError, match="load_proxy"):
        AutoModelForCausalLM.from_pretrained(path)
    proxy, _ = load_proxy(path)  # the note does not disturb the proxy's own loader
    loaded, _ = load_model(str(path), tokenizer=False)
    x = tokens()
    assert torch.equal(proxy(x).logits, loaded(x).logits)


@pytest.mark.parametrize("name", ["iprox_proxy.safetensors", "iprox_proxy.json"])
def test_load_model_on_a_proxy_file_names_the_directory(tmp_path, name):
    path = make_proxy(tmp_path)
    with pytest.raises(ValueError, match=rf"{name} is a file of the IProX proxy directory {path}: pass the directory "
                                         r"itself .*load_proxy.*io\.proxy export"):
        load_model(str(path / name))
