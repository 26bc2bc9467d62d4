"""Every shipped YAML is validated against the code's signatures (as litgpt's config-hub test does)."""
from pathlib import Path

import pytest
import yaml

from iprox_lightning.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SUBCOMMAND = {
    "warmup": "fit",
    "build_proxy": "fit",
    "score": "predict",
    "select": "select",
    "finetune": "fit",
    "evaluate": "test",
    "report": "report",
}
# overlays: (base config, subcommand) they apply to; plain-function commands stand alone
OVERLAYS = {
    "ablations/svd_init": ("build_proxy", "fit"),
    "ablations/random_init": ("build_proxy", "fit"),
    "ablations/no_alignment": ("build_proxy", "fit"),
    "ablations/no_kl": ("build_proxy", "fit"),
    "baselines/off_the_shelf": ("score", "predict"),
    "baselines/kfac": ("score", "predict"),
    "baselines/layer_extraction": (None, "layer_extraction"),
    "baselines/regression_scorer": (None, "regression_scorer"),
    "baselines/random": (None, "random_scores"),
}


def test_every_config_is_registered():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(SUBCOMMAND)
    found = {f"{p.parent.name}/{p.stem}" for d in ("ablations", "baselines") for p in (CONFIGS / d).glob("*.yaml")}
    assert found == set(OVERLAYS)
    assert {p.stem for p in (CONFIGS / "builtin").glob("*.yaml")} <= set(SUBCOMMAND)


def _print_config(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args + ["--print_config"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None), out
    return yaml.safe_load(out)


@pytest.mark.parametrize("stage", sorted(SUBCOMMAND))
def test_config_validates_against_code(stage, capsys):
    args = [SUBCOMMAND[stage], "--config", str(CONFIGS / f"{stage}.yaml")]
    cfg = _print_config(args, capsys)
    if stage == "select":
        assert cfg["k"] == 0.05
        return
    if stage == "report":
        assert cfg["topk_fraction"] == 0.05
        return
    # every class_path resolves to a class whose signature accepted the init_args
    assert cfg["model"]["class_path"].startswith("iprox_lightning.")
    assert cfg["data"]["class_path"].startswith("iprox_lightning.")
    overlay = CONFIGS / "builtin" / f"{stage}.yaml"
    if overlay.exists():
        merged = _print_config(args + ["--config", str(overlay)], capsys)
        assert merged["model"]["class_path"] == cfg["model"]["class_path"]


def test_paper_defaults_in_configs(capsys):
    warm = _print_config(["fit", "--config", str(CONFIGS / "warmup.yaml")], capsys)
    assert warm["model"]["init_args"]["lr"] == 1e-5 and warm["model"]["init_args"]["weight_decay"] == 0.01
    assert warm["model"]["init_args"]["freeze_embeddings"] is True
    assert warm["data"]["init_args"]["warmup_fraction"] == 0.05 and warm["trainer"]["max_epochs"] == 1
    proxy = _print_config(["fit", "--config", str(CONFIGS / "build_proxy.yaml")], capsys)
    assert proxy["model"]["init_args"]["kl_weight"] == 0.1 and proxy["data"]["init_args"]["batch_size"] == 4
    assert proxy["data"]["init_args"]["construction_fraction"] == 0.01
    assert proxy["data"]["init_args"]["probe_fraction"] == 0.1
    ft = _print_config(["fit", "--config", str(CONFIGS / "finetune.yaml")], capsys)
    assert ft["trainer"]["max_epochs"] == 4 and ft["model"]["init_args"]["lr"] == 1e-5


def test_bad_key_is_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  class_path: iprox_lightning.modules.WarmupModule\n  init_args:\n    lrr: 0.1\n")
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(CONFIGS / "warmup.yaml"), "--config", str(bad), "--print_config"])
    assert e.value.code == 2
    assert "lrr" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_ablation_and_baseline_configs_validate(name, capsys):
    base, sub = OVERLAYS[name]
    args = [sub] + (["--config", str(CONFIGS / f"{base}.yaml")] if base else []) + ["--config", str(CONFIGS / f"{name}.yaml")]
    cfg = _print_config(args, capsys)
    if name == "ablations/svd_init":
        assert cfg["trainer"]["callbacks"][0]["init_args"]["method"] == "svd"
    if name == "ablations/no_alignment":
        assert cfg["model"]["init_args"]["align"] is False
    if name == "ablations/no_kl":
        assert cfg["model"]["init_args"]["kl_weight"] == 0.0
    if name == "baselines/kfac":
        assert cfg["model"]["init_args"]["method"] == "kfac"
    if name == "baselines/layer_extraction":
        assert cfg["sparsity"] == 0.3


def test_build_proxy_documents_the_task_alignment_keys_with_their_defaults(tmp_path, capsys):
    """Issue 22's keys are in build_proxy.yaml as comments (off by default): each commented value is the code's
    default, and set (uncommented, to other values) they reach ProxyAlignModule / SFTDataModule."""
    import inspect
    import re

    from iprox_lightning.data import SFTDataModule
    from iprox_lightning.modules import ProxyAlignModule

    text = (CONFIGS / "build_proxy.yaml").read_text()
    keys = {"model": ("val_grad_weight", "val_examples_per_task", "val_grad_chunk", "score_weight", "score_loss",
                      "score_refresh_every", "task_reduction"), "data": ("val_train_fraction", "mix_val_train", "align_examples")}
    other = {"val_grad_weight": 0.5, "val_examples_per_task": 3, "val_grad_chunk": None, "score_weight": 0.25,
             "score_loss": "listwise",
             "score_refresh_every": 5, "task_reduction": "max", "val_train_fraction": 0.5, "mix_val_train": 2,
             "align_examples": 40}
    for part, cls in (("model", ProxyAlignModule), ("data", SFTDataModule)):
        defaults = inspect.signature(cls.__init__).parameters
        for k in keys[part]:
            m = re.search(rf"^\s*# {k}: (\S+)\s", text, re.M)
            assert m, f"{k} is not documented in build_proxy.yaml"
            assert yaml.safe_load(m.group(1)) == defaults[k].default, k
    overlay = tmp_path / "task.yaml"
    overlay.write_text(yaml.safe_dump({part: {"init_args": {k: other[k] for k in ks}} for part, ks in keys.items()}))
    cfg = _print_config(["fit", "--config", str(CONFIGS / "build_proxy.yaml"), "--config", str(overlay)], capsys)
    for part, ks in keys.items():
        assert {k: cfg[part]["init_args"][k] for k in ks} == {k: other[k] for k in ks}
    plain = _print_config(["fit", "--config", str(CONFIGS / "build_proxy.yaml")], capsys)
    assert plain["model"]["init_args"]["val_grad_weight"] == 0.0 and plain["data"]["init_args"]["val_train_fraction"] == 0.0


@pytest.mark.parametrize("old, new", [
    ("iprox_lightning.modules.proxy_align.ProxyAlignModule", "iprox_lightning.alignment.module.ProxyAlignModule"),
    ("iprox_lightning.modules.ProxyAlignModule", None),  # the face keeps working
])
def test_a_0_1_class_path_names_its_new_home(old, new, tmp_path, capsys):
    """Issue 53: users' configs keep their ``iprox_lightning.modules.X`` / ``callbacks.X`` class_paths; a 0.1.0 module
    path (``modules.proxy_align.ProxyAlignModule``) fails with a message naming where the class lives now."""
    overlay = tmp_path / "old.yaml"
    overlay.write_text(f"model:\n  class_path: {old}\n")
    args = ["fit", "--config", str(CONFIGS / "build_proxy.yaml"), "--config", str(overlay)]
    if new is None:
        assert _print_config(args, capsys)["model"]["class_path"] == old
        return
    with pytest.raises(SystemExit) as e:
        main(args + ["--print_config"])
    err = capsys.readouterr().err
    assert e.value.code != 0 and f"the class now lives at '{new}'" in err
