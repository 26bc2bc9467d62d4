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
}


def test_every_config_is_registered():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(SUBCOMMAND)
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
