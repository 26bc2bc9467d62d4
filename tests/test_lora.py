"""LoRA through peft (issue 66): the warm-up / fine-tune modules' ``lora`` option, adapters per epoch, the merged dense
model, adapter directories loaded with their base, their fingerprints, layers matched by full path, ``plan``."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from iprox_lightning.engine.target_layers import find_target_linears
from iprox_lightning.errors import InputNotFoundError, UserInputError
from iprox_lightning.models.builtin import builtin_model, builtin_tokenizer
from iprox_lightning.models.loading import load_adapter, load_model
from iprox_lightning.models.lora import LoraSettings, add_adapters
from iprox_lightning.modules import FinetuneModule, WarmupModule
from test_alignment_module import make_batch  # the tests' shared SFT batch

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread

LORA = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
VOCAB = 90  # token ids below the built-in model's vocabulary (95)


def _base_dir(path: Path, seed: int = 0) -> Path:
    """The built-in demo model (randomly initialised, ``seed``) and its tokenizer saved as a model directory."""
    torch.manual_seed(seed)
    model = builtin_model()
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(path)
    builtin_tokenizer().save_pretrained(path)
    return path


def _fit(module, epochs: int = 2, n: int = 3):
    tr = L.Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False)
    tr.fit(module, DataLoader([make_batch(i, V=VOCAB) for i in range(n)], batch_size=None))
    return tr


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A LoRA warm-up of the built-in model saved from a directory: (base dir, save_dir, trainer)."""
    root = tmp_path_factory.mktemp("lora")
    base = _base_dir(root / "base")
    module = WarmupModule(model=str(base), lr=1e-2, warmup_ratio=0.0, save_dir=str(root / "warm"), lora=LORA)
    tr = _fit(module)
    return base, root / "warm", tr


def test_lora_warmup_saves_adapters_every_epoch_and_the_merged_model(warmed):
    base, warm, tr = warmed
    adapters = warm / "adapters"
    assert sorted(p.name for p in adapters.iterdir()) == ["epoch_1", "epoch_2", "final"]
    for d in adapters.iterdir():
        assert (d / "adapter_model.safetensors").is_file() and (d / "adapter_config.json").is_file()
        assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))
        assert Path(json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"]) == base.resolve()
    e1, e2, final = (load_file(adapters / n / "adapter_model.safetensors") for n in ("epoch_1", "epoch_2", "final"))
    assert sorted(e1) == sorted(final) and len(e1) == 2 * 2 * 2  # A and B of q_proj and v_proj in 2 blocks
    assert any(not torch.equal(e1[k], e2[k]) for k in e1)  # the second epoch trained them further
    assert all(torch.equal(e2[k], final[k]) for k in e2)  # fit ended at the end of epoch 2
    # only the adapters trained: the optimiser holds them alone
    opt = [p for g in tr.optimizers[0].param_groups for p in g["params"]]
    # r (in + out) for q_proj (64 -> 64) and v_proj (64 -> 32: 2 key-value heads of 16) in 2 blocks
    assert sum(p.numel() for p in opt) == 2 * 4 * ((64 + 64) + (64 + 32))

    # the merged dense model: W + (alpha / r) B A on the adapted layers, the others the base's bit for bit
    merged, _ = load_model(str(warm), tokenizer=False)
    before, _ = load_model(str(base), tokenizer=False)
    sd, sd0 = merged.state_dict(), before.state_dict()
    assert not any("lora" in k for k in sd)
    scale = LORA["alpha"] / LORA["r"]
    for k in sd0:
        if k.endswith(("q_proj.weight", "v_proj.weight")):
            prefix = "base_model.model." + k[: -len(".weight")]
            A, B = final[prefix + ".lora_A.weight"], final[prefix + ".lora_B.weight"]
            # float32 sum of the same terms in another order: 1e-6 of weights of size ~0.1
            torch.testing.assert_close(sd[k], sd0[k] + scale * B @ A, rtol=0, atol=1e-6)
            assert not torch.equal(sd[k], sd0[k]), k
        else:
            assert torch.equal(sd[k], sd0[k]), k


def test_merged_logits_equal_base_plus_adapter_logits(warmed):
    _, warm, _ = warmed
    merged, tok = load_model(str(warm))
    adapted, _ = load_adapter(warm / "adapters" / "final", merged=False, tokenizer=False)
    from peft import PeftModel

    assert isinstance(adapted, PeftModel) and tok is not None
    via_loader, tok2 = load_model(str(warm / "adapters" / "final"))  # the peft loader: base + adapters, merged
    assert not isinstance(via_loader, PeftModel) and tok2 is not None
    b = make_batch(7, V=VOCAB)
    with torch.no_grad():
        want = adapted(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = merged(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got2 = via_loader(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    # x (W + s B A) vs x W + s (x A) B in float32: the 1e-5 (measured ~2e-7)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got2, want, rtol=0, atol=1e-5)


def test_lora_finetune_starts_from_the_merged_model(warmed, tmp_path):
    _, warm, _ = warmed
    module = FinetuneModule(model=str(warm), lr=1e-2, warmup_ratio=0.0, save_dir=str(tmp_path / "ft"),
                            lora={**LORA, "target_modules": ["o_proj"]})
    _fit(module, epochs=1, n=2)
    assert sorted(p.name for p in (tmp_path / "ft" / "adapters").iterdir()) == ["epoch_1", "final"]
    cfg = json.loads((tmp_path / "ft" / "adapters" / "final" / "adapter_config.json").read_text())
    assert Path(cfg["base_model_name_or_path"]) == warm.resolve() and cfg["target_modules"] == ["o_proj"]
    ft, _ = load_model(str(tmp_path / "ft"), tokenizer=False)
    w, _ = load_model(str(warm), tokenizer=False)
    changed = [k for k, v in ft.state_dict().items() if not torch.equal(v, w.state_dict()[k])]
    assert changed and all(k.endswith("o_proj.weight") for k in changed)


def test_adapter_fingerprint_includes_its_base(warmed, tmp_path):
    """A changed base never reuses an old result: the adapter's files are the same, its identity is not."""
    import shutil

    from iprox_lightning.io.fingerprint import digest, model_identity, source_identity

    _, warm, _ = warmed
    base = _base_dir(tmp_path / "base", seed=0)
    adapter = tmp_path / "adapter"
    shutil.copytree(warm / "adapters" / "final", adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    before = source_identity(str(adapter))
    assert before["base"] == source_identity(str(base))
    _base_dir(base, seed=1)  # the base's weights change, the adapter's files do not
    after = source_identity(str(adapter))
    assert before["files"] == after["files"] and digest(before) != digest(after)
    assert digest(model_identity(str(adapter))) == digest(after)
    # a base named relative to the adapter directory resolves there
    cfg["base_model_name_or_path"] = "../base"
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    assert source_identity(str(adapter))["base"] == source_identity(str(adapter / "../base"))


def test_adapter_loading_refuses_pickles_and_a_missing_base(warmed, tmp_path):
    import shutil

    _, warm, _ = warmed
    adapter = tmp_path / "adapter"
    shutil.copytree(warm / "adapters" / "final", adapter)
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(InputNotFoundError, match="adapter_model.bin is a pickle, which is never loaded"):
        load_model(str(adapter))
    (adapter / "adapter_model.bin").rename(adapter / "adapter_model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    del cfg["base_model_name_or_path"]
    (adapter / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserInputError, match="base_model_name_or_path"):
        load_model(str(adapter))


@pytest.mark.parametrize("bad, message", [
    ({"r": 0}, "lora.r must be a positive integer"),
    ({"alpha": -1}, "lora.alpha must be a positive number"),
    ({"dropout": 1.0}, r"lora.dropout must be in \[0, 1\)"),
    ({"target_modules": []}, "lora.target_modules must be a non-empty list"),
    ({"rank": 8}, r"lora: unknown key\(s\) \['rank'\]"),
])
def test_bad_lora_settings_are_refused_naming_the_field(bad, message):
    with pytest.raises(UserInputError, match=message):
        WarmupModule(model="builtin", lora=bad)


def test_lora_on_missing_layers_is_a_user_error():
    with pytest.raises(UserInputError, match="lora.target_modules"):
        add_adapters(builtin_model(), LoraSettings(target_modules=("no_such_proj",)))


# ------------------------------------------------------------------------------------------------- target layers
def _leaf_only(model, patterns):
    """Brute force of the old rule: the leaf name matched whole, inside a numbered block, not excluded."""
    import re

    from iprox_lightning.engine.target_layers import BLOCK_RE, EXCLUDED_PATTERNS, is_linear_like

    return [n for n, m in model.named_modules() if n and is_linear_like(m) and BLOCK_RE.search(n + ".")
            and not any(re.search(e, n) for e in EXCLUDED_PATTERNS)
            and any(re.fullmatch(p, n.rsplit(".", 1)[-1]) for p in patterns)]


@pytest.mark.parametrize("patterns", [None, ["q_proj"], ["q_proj", "down_proj"], [r".*_proj"], [r"(gate|up)_proj"]])
def test_leaf_name_patterns_find_what_they_always_did(patterns):
    from iprox_lightning.engine.target_layers import DEFAULT_TARGET_PATTERNS

    model = builtin_model()
    assert list(find_target_linears(model, patterns)) == _leaf_only(model, patterns or DEFAULT_TARGET_PATTERNS)


def test_full_path_patterns_track_peft_adapter_layers():
    model = add_adapters(builtin_model(), LoraSettings(**{**LORA, "target_modules": ("q_proj", "v_proj")}))
    found = find_target_linears(model, [r"lora_[AB]\.default"])
    want = [n for n, _ in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert list(found) == want and len(want) == 2 * 2 * 2  # A and B of q_proj and v_proj in 2 blocks
    assert all(type(m) is torch.nn.Linear for m in found.values())
    only_q = find_target_linears(model, [r"q_proj\.lora_A\.default"])
    assert list(only_q) == [n for n in want if n.endswith("q_proj.lora_A.default")]
    full = find_target_linears(model, [r"base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_B\.default"])
    assert list(full) == ["base_model.model.model.layers.1.self_attn.v_proj.lora_B.default"]
    # a leaf name still finds the un-adapted projections of a peft model (its wrapped ones are not linear layers)
    assert list(find_target_linears(model, ["k_proj"])) == [n for n, _ in model.named_modules()
                                                             if n.endswith("self_attn.k_proj")]


# ------------------------------------------------------------------------------------------------- plan
def test_plan_fits_an_8b_lora_warm_up_on_one_80gb_device():
    """``plan --model llama-3.1-8b --lora ... --precision bf16-true`` at T 512, batch 8: the warm-up row counts the
    frozen base weights in bfloat16, the adapters' weights, gradients and AdamW moments, and fits one 80 GB device
    (full fine-tuning does not)."""
    from iprox_lightning.cli import main

    lora = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    args = ["plan", "--model", "llama-3.1-8b", "--max_length", "512", "--precision", "bf16-true"]
    rows = {r["stage"]: r for r in main(args + ["--lora", json.dumps(lora)])}
    full = {r["stage"]: r for r in main(args)}
    # brute force: r (in + out) of q (4096 -> 4096), k and v (4096 -> 1024), o (4096 -> 4096), 32 blocks
    n_lora = 32 * 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096))
    warm, ft = rows["warm-up"], rows["fine-tune"]
    assert warm["parts"]["weights"] == (8_030_261_248 + n_lora) * 2
    assert warm["parts"]["adamw"] == 2 * n_lora * 2
    assert warm["parts"]["gradients"] == 2 * n_lora * 2  # the gradients and AdamW's foreach temporary on cuda
    assert warm["parts"]["activations"] == full["warm-up"]["parts"]["activations"]
    assert warm["parts"]["lm_head"] == full["warm-up"]["parts"]["lm_head"]
    assert warm["peak"] <= 80e9 < full["warm-up"]["peak"]
    assert ft["parts"] == warm["parts"]


def test_plan_lora_default_targets_are_peft_s_and_fsdp_is_refused():
    from iprox_lightning.analysis import memory as M

    assert M.with_lora_targets({"r": 8}, "llama-3.1-8b")["target_modules"] == ["q_proj", "v_proj"]
    with pytest.raises(UserInputError, match="strategy ddp"):
        M.RunSettings(strategy="fsdp", devices=2, lora={"r": 8, "target_modules": ["q_proj"]})


# ------------------------------------------------------------------------------------------------- pipeline --lora
DEMO_LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


def test_pipeline_lora_runs_end_to_end_on_the_demo(tmp_path):
    """``pipeline --lora``: LoRA warm-up -> merged target -> proxy -> scoring -> selection -> LoRA fine-tunes ->
    evaluation, on a small built-in pool through the command line."""
    from iprox_lightning.cli import main

    wd = tmp_path / "p"
    args = ["pipeline", "--workdir", str(wd), "--data_args", json.dumps({"builtin_size": 160}),
            "--select_rule", "pooled", "--eval_per_task", "20", "--align_epochs", "1"]
    summary = main(args + ["--lora", json.dumps(DEMO_LORA)])
    stages = set(summary["seconds_per_stage"])
    assert {"warmup", "build_proxy", "score:target", "score:proxy", "select", "finetune:proxy", "finetune:target",
            "finetune:random", "evaluate"} <= stages
    assert summary["lora"] == {**DEMO_LORA, "dropout": 0.0}
    warm = wd / "warmup" / "model"
    # the demo's warm-up runs 3 epochs, its fine-tunes 4 (configs/builtin/warmup.yaml, configs/finetune.yaml)
    assert sorted(p.name for p in (warm / "adapters").iterdir()) == ["epoch_1", "epoch_2", "epoch_3", "final"]
    for who in ("proxy", "target", "random"):
        ft = wd / "finetune" / who / "model"
        assert sorted(p.name for p in (ft / "adapters").iterdir()) == [f"epoch_{i}" for i in (1, 2, 3, 4)] + ["final"]
        cfg = json.loads((ft / "adapters" / "final" / "adapter_config.json").read_text())
        assert Path(cfg["base_model_name_or_path"]) == warm.resolve()
        sel = wd / "selected" / f"{who}.jsonl"
        assert len([l for l in sel.read_text().splitlines() if l.strip()]) == round(0.05 * 160)
    assert json.loads((warm / "adapters" / "final" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "builtin"
    # the target the proxy was built from and scored is the merged model: its logits are the base's plus the adapters'
    merged, _ = load_model(str(warm), tokenizer=False)
    adapted, _ = load_adapter(warm / "adapters" / "final", merged=False, tokenizer=False)
    b = make_batch(3, V=VOCAB)
    with torch.no_grad():
        want = adapted(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        got = merged(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the tolerance (merge vs adapter path)
    base, _ = load_model("builtin", tokenizer=False)
    assert not torch.allclose(merged(input_ids=b["input_ids"]).logits, base(input_ids=b["input_ids"]).logits)
    # a changed LoRA setting never reuses the LoRA warm-up
    from iprox_lightning.io.fingerprint import FingerprintMismatch

    with pytest.raises(FingerprintMismatch) as e:
        main(args + ["--lora", json.dumps({**DEMO_LORA, "r": 8})])
    assert str(e.value).startswith("stage warmup: ") and "overlay.model.init_args.lora.r: 4 -> 8" in str(e.value)


def test_lora_without_peft_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(UserInputError, match=r"pip install 'iprox_lightning\[peft\]'"):
        WarmupModule(model="builtin", lora=LORA)
