"""The commands of ``python train.py <command>``, one module each (``iprox_lightning/commands/<command>.py``).

* ``fit`` / ``validate`` / ``test`` / ``predict`` — LightningCLI (:mod:`.lightning`), driven by the
  stage configs in ``configs/``;
* every other command is a plain function of the same name in its module, parsed by jsonargparse
  (``--config``, ``--print_config`` and ``--help`` work for each). The off-the-shelf proxy baseline
  needs no command: point ``configs/score.yaml`` at any causal LM.

A new command: add ``commands/<name>.py`` whose first docstring line says what it does and which
defines ``<name>(...)``, then add the name to :data:`COMMANDS`. A command that is its wing's own public function
(``select``) is named in :data:`COMMAND_HOMES` instead of a module here.
"""
from __future__ import annotations

import ast
from importlib import import_module
from importlib.util import find_spec
from typing import Callable

TRAINER_COMMANDS = {
    "fit": "Train a LightningModule: warm-up, build the proxy (IPSVD + alignment), fine-tune",
    "validate": "Run one validation epoch of a LightningModule",
    "test": "Evaluate a model on MMLU, BBH and TyDiQA (configs/evaluate.yaml)",
    "predict": "Score the pool with a model: influence scores to Parquet (configs/score.yaml)",
}
"""The LightningCLI subcommands (:mod:`.lightning`) and what they do in this project."""

COMMANDS = ("sample_pool", "select", "pipeline", "plan", "report", "check", "layer_extraction", "regression_scorer", "random_scores",
            "rds_scores", "export_proxy", "build_store", "query", "cache")
"""The plain-function commands, in the order ``train.py --help`` lists them."""

COMMAND_HOMES = {"select": "..selection.select"}
"""Commands whose module lives in a wing (relative to this package); the others are ``commands/<name>.py``."""


def _module(name: str):
    return import_module(COMMAND_HOMES.get(name, f".{name}"), __name__)


def command(name: str) -> Callable:
    """The function of command ``name`` (imported on demand: a ``fit`` run needs none of them)."""
    if name not in COMMANDS:
        raise KeyError(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
    return getattr(_module(name), name)


def summary(name: str) -> str:
    """One line saying what command ``name`` does (the first line of its module's docstring), read from the module's
    source without importing it: ``train.py --help`` lists every command without loading torch or Lightning."""
    spec = find_spec(COMMAND_HOMES.get(name, f".{name}"), __name__)
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.strip().splitlines()[0].rstrip(".")
