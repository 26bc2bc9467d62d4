"""Every command-line option has help text: the options of every class a shipped config names (through
``class_path``) and of every plain-function command; ``python train.py --help`` lists every command."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from iprox_lightning.cli import usage
from iprox_lightning.commands import COMMANDS, TRAINER_COMMANDS, command

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def configured_classes() -> list[str]:
    found = set()
    for path in CONFIGS.rglob("*.yaml"):
        found.update(re.findall(r"class_path:\s*(iprox_lightning[\w.]+)", path.read_text()))
    return sorted(found)


def options_without_help(parser: ArgumentParser, prefix: str = "") -> list[str]:
    skip = {"help", "config", "print_config"}
    return sorted(a.dest[len(prefix):] for a in parser._actions
                  if a.dest.startswith(prefix) and a.dest[len(prefix):] not in skip and not a.dest.endswith(".help")
                  and not (a.help or "").strip())


def test_the_configs_name_the_stage_classes():
    classes = configured_classes()
    for name in ("modules.WarmupModule", "modules.ProxyAlignModule", "modules.FinetuneModule",
                 "callbacks.IPSVDCallback", "data.SFTDataModule", "scoring.InfluenceWriter"):
        assert f"iprox_lightning.{name}" in classes


@pytest.mark.parametrize("class_path", configured_classes())
def test_every_option_of_a_configured_class_has_help(class_path):
    module, _, name = class_path.rpartition(".")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(importlib.import_module(module), name), "x", fail_untyped=False)
    assert len([a for a in parser._actions if a.dest.startswith("x.")]) > 1
    assert options_without_help(parser, "x.") == []


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_of_a_command_has_help(name):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(command(name), fail_untyped=False)
    assert options_without_help(parser) == []


def test_top_level_help_lists_every_command_with_one_line():
    text = usage()
    for name in [*TRAINER_COMMANDS, *COMMANDS]:
        line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
        description = line.strip()[len(name):].strip()
        assert len(description.split()) >= 4, line  # a sentence, not a bare word
    assert text.count("\n  ") == len(TRAINER_COMMANDS) + len(COMMANDS)


LIGHTNING_MODULES = {
    "WarmupModule": "iprox_lightning.modules.WarmupModule",
    "FinetuneModule": "iprox_lightning.modules.FinetuneModule",
    "ProxyAlignModule": "iprox_lightning.modules.ProxyAlignModule",
    "InfluenceScoringModule": "iprox_lightning.scoring.InfluenceScoringModule",
    "EvaluationModule": "iprox_lightning.evaluation.EvaluationModule",
}


def class_options(class_path: str) -> set[str]:
    """The options jsonargparse makes of a class's signature (``**kwargs`` followed to the parent class)."""
    module, _, name = class_path.rpartition(".")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(getattr(importlib.import_module(module), name), "x", fail_untyped=False)
    return {a.dest[2:] for a in parser._actions if a.dest.startswith("x.") and not a.dest.endswith(".help")}


@pytest.mark.parametrize("name", LIGHTNING_MODULES)
def test_model_help_lists_that_modules_options_and_no_torch_layers(name, capsys):
    """``python train.py fit --model.help <Name>``: the module's own options, not the hundreds of ``nn.Module``
    subclasses jsonargparse would list for its ``Union[str, nn.Module]`` model argument."""
    from iprox_lightning.cli import main

    with pytest.raises(SystemExit) as e:
        main(["fit", "--model.help", name])
    assert e.value.code == 0
    text = capsys.readouterr().out
    options = class_options(LIGHTNING_MODULES[name])
    assert f"Help for --model.help=iprox_lightning.{name}" in text
    listed = set(re.findall(r"^  --model\.(\w+)[ \n]", text, flags=re.M))
    assert listed == options  # every option of this module, none of another
    assert "known subclasses" not in text and "torch.nn." not in text and "torch.ao." not in text
    assert len(text.splitlines()) < 30 + 6 * len(options)  # one module's options, a few lines each


HEAVY = ("torch", "lightning", "transformers", "datasets", "pyarrow", "scipy", "matplotlib")
"""Modules whose import takes seconds: ``--help`` of the top level and of every IProX command loads none of them."""

_HELP_PROBE = """
import sys
from iprox_lightning.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("LOADED", sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))
"""


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in COMMANDS if name != "export_proxy"])
def test_help_loads_no_heavy_module(argv):
    """``train.py --help`` and ``train.py <command> --help`` answer in well under a second: torch, Lightning,
    transformers & co. stay unimported (measured: 12 s before, on the shared 2-core machine; 0.2 CPU-s now).
    ``export_proxy`` is left out: jsonargparse looks its name up on the package root, where ``export_proxy`` is the
    public function (which imports torch; 1.6 CPU-s). The Trainer commands (``fit``, ``predict``, ...) are
    LightningCLI's help and import Lightning."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HELP_PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("LOADED")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    assert line[-1] == "LOADED []", (argv, line[-1])
    assert "usage:" in out.stdout
