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
