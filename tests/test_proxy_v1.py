"""Issue 12: version-1 proxy directories (weights in ``model.safetensors`` next to ``iprox_proxy.json``) load only
through the checked proxy loader (missing / unexpected tensors are an error naming them), warn that plain
``from_pretrained`` would return random projections, and ``upgrade`` re-saves them as version 2 (after which plain
``from_pretrained`` refuses the directory)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from iprox_lightning.models.tiny import tiny_causal_lm

sys.path.insert(0, str(Path(__file__).parent))
from test_scoring_influence import TINY  # noqa: E402


@pytest.fixture
def v1_dir(tmp_path):
    """What a version-1 save looked like: every weight in model.safetensors, manifest format_version 1."""
    from iprox_lightning import compress_model, save_proxy

    model = tiny_causal_lm("llama", seed=3, **TINY)
    compress_model(model, None, 0.5, method="svd", progress=False)
    path = save_proxy(model, None, tmp_path / "proxy", target_model="tiny", sparsity=0.5)
    save_file(load_file(path / "iprox_proxy.safetensors"), path / "model.safetensors", metadata={"format": "pt"})
    (path / "iprox_proxy.safetensors").unlink()
    man = json.loads((path / "iprox_proxy.json").read_text())
    man["format_version"] = 1
    man.pop("weights")
    (path / "iprox_proxy.json").write_text(json.dumps(man))
    return path, model.eval()


def test_v1_loads_through_the_checked_loader_with_a_warning(v1_dir, caplog):
    from iprox_lightning import load_model

    path, model = v1_dir
    x = torch.randint(3, 64, (2, 7))
    with caplog.at_level(logging.WARNING, logger="iprox_lightning.io.proxy"):
        loaded, _ = load_model(str(path), tokenizer=False)
    assert torch.equal(loaded(x).logits, model(x).logits)
    (rec,) = [r for r in caplog.records if r.name == "iprox_lightning.io.proxy"]
    assert rec.getMessage() == (
        f"{path}: a version-1 proxy directory (weights in model.safetensors). It loaded through the checked proxy "
        "loader, but plain AutoModelForCausalLM.from_pretrained on it would return randomly initialised projections; "
        f"re-save it as version 2 with `python -m iprox_lightning.io.proxy upgrade {path}`")


@pytest.mark.parametrize("edit, message", [
    ("drop", r"model.safetensors: does not match the proxy described by iprox_proxy.json and config.json: 1 missing "
             r"tensor\(s\) \['model.layers.0.self_attn.q_proj.A'\] — refusing to load"),
    ("extra", r"model.safetensors: does not match the proxy described by iprox_proxy.json and config.json: 1 "
              r"unexpected tensor\(s\) \['model.layers.0.self_attn.q_proj.weight'\] — refusing to load"),
])
def test_v1_with_missing_or_unexpected_tensors_is_an_error(v1_dir, edit, message):
    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import ProxyFormatError

    path, _ = v1_dir
    t = load_file(path / "model.safetensors")
    if edit == "drop":
        t.pop("model.layers.0.self_attn.q_proj.A")
    else:  # a dense weight next to the factors (a half-converted checkpoint)
        t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 32)
    save_file(t, path / "model.safetensors")
    with pytest.raises(ProxyFormatError, match=message):
        load_model(str(path), tokenizer=False)


def test_upgrade_resaves_v1_as_v2_and_plain_transformers_then_refuses(v1_dir, capsys, caplog):
    from transformers import AutoModelForCausalLM

    from iprox_lightning import load_model
    from iprox_lightning.io.proxy import _main

    path, model = v1_dir
    _main(["upgrade", str(path)])
    assert capsys.readouterr().out == (f"{path}: proxy format_version 2 (iprox_proxy.safetensors); plain from_pretrained "
                                       "now refuses it\n")
    assert sorted(p.name for p in path.glob("*.safetensors*")) == ["iprox_proxy.safetensors"]
    man = json.loads((path / "iprox_proxy.json").read_text())
    assert man["format_version"] == 2 and man["weights"]["file"] == "iprox_proxy.safetensors"
    assert man["target_model"] == "tiny" and man["sparsity"] == 0.5  # the recorded settings are kept
    caplog.clear()
    loaded, _ = load_model(str(path), tokenizer=False)
    assert not [r for r in caplog.records if "version-1" in r.getMessage()]
    x = torch.randint(3, 64, (2, 7))
    assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(ValueError, match=r"IProX proxy.*load_proxy.*export"):
        AutoModelForCausalLM.from_pretrained(path)
    _main(["upgrade", str(path)])  # a version-2 directory is left as it is
    assert json.loads((path / "iprox_proxy.json").read_text()) == man


def test_upgrade_refuses_a_broken_v1_and_leaves_it_untouched(v1_dir):
    from iprox_lightning.io.proxy import ProxyFormatError, upgrade_proxy

    path, _ = v1_dir
    t = load_file(path / "model.safetensors")
    t.pop("model.layers.0.self_attn.q_proj.A")
    save_file(t, path / "model.safetensors")
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    with pytest.raises(ProxyFormatError, match="1 missing tensor"):
        upgrade_proxy(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
