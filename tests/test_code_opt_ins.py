"""Issue 61 (Deliver 3): code only when asked on the command line. ``trust_remote_code: true`` and
``weights_only: false`` are checked on the *resolved* configuration (every config file, group file, nested group file
and option merged, before any class is built), and allowed only when the command line sets that very key to that
value, in any spelling the parser takes, or ``IPROX_ALLOW_CODE`` allows it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from iprox_lightning.cli import main
from iprox_lightning.errors import UserInputError

ROOT = Path(__file__).resolve().parents[1]
SCORE = str(ROOT / "configs" / "score.yaml")
MODEL_GROUP = ("class_path: iprox_lightning.scoring.InfluenceScoringModule\n"
               "init_args:\n  trust_remote_code: {value}\n")


class Built(Exception):
    """Raised instead of building the classes: the opt-in check let the configuration through."""


@pytest.fixture
def no_build(monkeypatch):
    """Stop a Lightning command right after the opt-in check (nothing is built, loaded or run)."""
    from iprox_lightning.commands.lightning import IProXCLI

    monkeypatch.delenv("IPROX_ALLOW_CODE", raising=False)

    def stop(self):
        raise Built

    monkeypatch.setattr(IProXCLI, "instantiate_classes", stop)


def _refused(match: str):
    return pytest.raises(UserInputError, match=match)


def test_a_group_file_named_inside_a_config_cannot_opt_in(tmp_path, no_build):
    """Issue 61: a config naming a group file (``model: m.yaml``) whose trust_remote_code is true ran the model
    directory's Python; the argv scan read only the files on the command line. The error names the group file."""
    (tmp_path / "groups").mkdir()
    group = tmp_path / "groups" / "m.yaml"
    group.write_text(MODEL_GROUP.format(value="true"))
    outer = tmp_path / "outer.yaml"
    outer.write_text("model: groups/m.yaml\n")
    with _refused(rf"^{group}: model.init_args.trust_remote_code: true would run code .* a config file cannot opt in"):
        main(["predict", "--config", SCORE, "--config", str(outer)])
    # nested one level deeper: a group file inside a group file's directory, named by a config named by a config
    deeper = tmp_path / "deeper.yaml"
    deeper.write_text(f"model: {group}\ndata:\n  init_args:\n    trust_remote_code: false\n")
    with _refused(rf"^{group}: model.init_args.trust_remote_code"):
        main(["predict", "--config", SCORE, "--config", str(deeper)])
    # the same file with false, or the user's own opt-in on the command line: built
    with pytest.raises(Built):
        main(["predict", "--config", SCORE, "--config", str(outer), "--model.init_args.trust_remote_code", "true"])
    group.write_text(MODEL_GROUP.format(value="false"))
    with pytest.raises(Built):
        main(["predict", "--config", SCORE, "--config", str(outer)])


@pytest.mark.parametrize("flag", [["--data.init_args.trust_remote_code", "false"],
                                  ["--data.init_args.trust_remote_code", "true"],
                                  ["--data.trust_remote_code=true"],
                                  ["--model.init_args.trust_remote_code", "false"],
                                  ["--weights_only", "false"]])
def test_another_key_or_value_on_the_command_line_does_not_exempt_a_config(tmp_path, no_build, flag):
    """Issue 61: ``--data.init_args.trust_remote_code false`` exempted the config's
    ``model.init_args.trust_remote_code: true`` (the scan matched the key's name, not its group or its value). Only
    that very key set to true on the command line counts (a false given before the config is overridden by it)."""
    cfg = tmp_path / "shared.yaml"
    cfg.write_text("model:\n  init_args:\n    trust_remote_code: true\n")
    with _refused(rf"^{cfg}: model.init_args.trust_remote_code: true would run code"):
        main(["predict", "--config", SCORE, *flag, "--config", str(cfg)])


@pytest.mark.parametrize("flag", [["--model.init_args.trust_remote_code", "true"],
                                  ["--model.init_args.trust_remote_code=true"],
                                  ["--model.init_args.trust_remote_code", "True"],
                                  ["--model.init_args.trust_remote_code=TRUE"],
                                  ["--model.init_args.trust_remote_code", "yes"],
                                  ["--model.init_args.trust_remote_code=on"],
                                  ["--model.trust_remote_code", "Yes"],
                                  ["--model", '{"init_args": {"trust_remote_code": true}}'],
                                  ["--model.init_args", "{trust_remote_code: yes}"]])
def test_every_command_line_spelling_of_the_opt_in_is_the_users_act(tmp_path, no_build, flag):
    """Each spelling the parser reads as true, with ``=`` or a separate value, ``init_args`` written or left out, or
    the group given inline on the command line, opts in; the configuration is then built."""
    cfg = tmp_path / "shared.yaml"
    cfg.write_text("model:\n  init_args:\n    trust_remote_code: 'yes'\n")
    with pytest.raises(Built):
        main(["predict", "--config", SCORE, "--config", str(cfg), *flag])
    with pytest.raises(Built):  # the flag alone, without the config
        main(["predict", "--config", SCORE, *flag])


@pytest.mark.parametrize("flag,allowed", [(["--weights_only", "false"], True), (["--weights_only=False"], True),
                                          (["--weights_only", "no"], True), (["--weights_on", "off"], True),
                                          (["--weights_only", "true"], False), ([], False)])
def test_weights_only_false_from_a_config_needs_the_command_line(tmp_path, no_build, flag, allowed):
    """``weights_only: false`` (a checkpoint's pickles run on load) from a config file is refused unless the command
    line says so itself, argparse's abbreviation of the option included."""
    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("ckpt_path: null\nweights_only: 'False'\n")
    if allowed:
        with pytest.raises(Built):
            main(["predict", "--config", SCORE, "--config", str(cfg), *flag])
    else:  # a true given before the config is overridden by the config's false
        with _refused(rf"^{cfg}: weights_only: false would run code"):
            main(["predict", "--config", SCORE, *flag, "--config", str(cfg)])


def test_the_environment_allows_a_key_and_an_unknown_name_is_one_error(tmp_path, no_build, monkeypatch):
    """``IPROX_ALLOW_CODE`` names the keys it allows (or 1 / * for both); a name that is no opt-in is refused."""
    cfg = tmp_path / "shared.yaml"
    cfg.write_text("weights_only: false\nmodel:\n  init_args:\n    trust_remote_code: true\n")
    monkeypatch.setenv("IPROX_ALLOW_CODE", "weights_only")
    with _refused("model.init_args.trust_remote_code: true would run code"):
        main(["predict", "--config", SCORE, "--config", str(cfg)])
    monkeypatch.setenv("IPROX_ALLOW_CODE", "weights_only,trust_remote_code")
    with pytest.raises(Built):
        main(["predict", "--config", SCORE, "--config", str(cfg)])
    monkeypatch.setenv("IPROX_ALLOW_CODE", "1")
    with pytest.raises(Built):
        main(["predict", "--config", SCORE, "--config", str(cfg)])
    monkeypatch.setenv("IPROX_ALLOW_CODE", "trust_remote_cod")
    with _refused(r"^IPROX_ALLOW_CODE='trust_remote_cod': 'trust_remote_cod' is not a code opt-in"):
        main(["predict", "--config", SCORE, "--config", str(cfg)])


@pytest.mark.parametrize("value", ["my-project", "a b", "pkg.*", "x;y"])
def test_an_invalid_allow_imports_value_is_one_error_line(value, tmp_path):
    """Issue 61: an ``IPROX_ALLOW_IMPORTS`` entry that is not a package name (``my-project``) ended in jsonargparse's
    ValueError traceback; it is one ``error:`` line naming the variable."""
    import os

    env = {**os.environ, "IPROX_ALLOW_IMPORTS": value, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "select", "--k", "2"], capture_output=True,
                       text=True, env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: IPROX_ALLOW_IMPORTS={value!r}: ") and "not a package name" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
