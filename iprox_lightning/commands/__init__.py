"""The commands of ``python train.py <command>``, one module each (``iprox_lightning/commands/<command>.py``).

* ``fit`` / ``validate`` / ``test`` / ``predict`` — LightningCLI (:mod:`.lightning`), driven by the
  stage configs in ``configs/``;
* every other command is a plain function of the same name in its module, parsed by jsonargparse
  (``--config``, ``--print_config`` and ``--help`` work for each). The off-the-shelf proxy baseline
  needs no command: point ``configs/score.yaml`` at any causal LM.

A new command: add ``commands/<name>.py`` whose first docstring line says what it does and which
defines ``<name>(...)``, then add the name to :data:`COMMANDS`.
"""
from __future__ import annotations

from importlib import import_module
from typing import Callable

TRAINER_COMMANDS = {
    "fit": "Train a LightningModule: warm-up, build the proxy (IPSVD + alignment), fine-tune",
    "validate": "Run one validation epoch of a LightningModule",
    "test": "Evaluate a model on MMLU, BBH and TyDiQA (configs/evaluate.yaml)",
    "predict": "Score the pool with a model: influence scores to Parquet (configs/score.yaml)",
}
"""The LightningCLI subcommands (:mod:`.lightning`) and what they do in this project."""

COMMANDS = ("sample_pool", "select", "pipeline", "plan", "report", "check", "layer_extraction", "regression_scorer", "random_scores",
            "rds_scores", "export_proxy", "build_store", "query")
"""The plain-function commands, in the order ``train.py --help`` lists them."""


def command(name: str) -> Callable:
    """The function of command ``name`` (imported on demand: a ``fit`` run needs none of them)."""
    if name not in COMMANDS:
        raise KeyError(f"unknown command {name!r}; commands: {', '.join(COMMANDS)}")
    return getattr(import_module(f"{__name__}.{name}"), name)


def summary(name: str) -> str:
    """One line saying what command ``name`` does (the first line of its module's docstring)."""
    return (import_module(f"{__name__}.{name}").__doc__ or "").strip().splitlines()[0].rstrip(".")
