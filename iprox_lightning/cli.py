"""Command line: LightningCLI for the Trainer stages, plain functions for the rest.

    python train.py fit     --config configs/warmup.yaml        # Stage 0: warm-up
    python train.py fit     --config configs/build_proxy.yaml   # Stage 1 (IPSVDCallback) + Stage 2 (alignment)
    python train.py predict --config configs/score.yaml         # influence scores -> Parquet
    python train.py select  --config configs/select.yaml        # top-k subset -> JSONL
    python train.py fit     --config configs/finetune.yaml      # fine-tune the target on the subset
    python train.py test    --config configs/evaluate.yaml      # MMLU / BBH / TyDiQA
    python train.py pipeline                                    # everything, on the built-in data

    python train.py check   --target ... --proxy ...           # proxy check: retention on a random sample
    python train.py report  --config configs/report.yaml        # retention / SA / 1-NND / FLOPs table + plots
    python train.py layer_extraction | influence_scorer | random_scores   # the paper's baselines

``fit/validate/test/predict`` go to LightningCLI (any LightningModule / LightningDataModule by
``class_path``); ``select``, ``pipeline``, ``report`` and ``check`` are plain functions parsed by
jsonargparse (``--config`` and ``--print_config`` work for them too).
"""
from __future__ import annotations

import sys
from typing import Callable

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class IProXCLI(LightningCLI):
    """LightningCLI with the project's defaults (re-runs may reuse a log dir)."""


def run_lightning(args: list[str] | None = None, *, run: bool = True) -> IProXCLI:
    """Run LightningCLI on ``args`` (``None``: the command line).

    When ``args`` are given (the pipeline, tests) the process's own command line is hidden from
    LightningCLI while it runs: it would otherwise warn that both were given, although only
    ``args`` are parsed.
    """
    from .console import quiet_lightning_tips

    quiet_lightning_tips()
    saved = sys.argv
    if args is not None:
        sys.argv = sys.argv[:1]
    try:
        return IProXCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,
            args=args,
            run=run,
        )
    finally:
        sys.argv = saved


def _extra_commands() -> dict[str, Callable]:
    """The plain-function subcommands (imported lazily: ``fit``/``predict`` runs don't need them)."""
    from .baselines.commands import influence_scorer, layer_extraction, random_scores
    from .pipeline import pipeline
    from .report import check, report
    from .select import select

    return {"select": select, "pipeline": pipeline, "report": report, "check": check,
            "layer_extraction": layer_extraction, "influence_scorer": influence_scorer, "random_scores": random_scores}


def main(args: list[str] | None = None):
    argv = list(sys.argv[1:] if args is None else args)
    extra = _extra_commands()
    if argv and argv[0] in extra:
        from jsonargparse import CLI

        return CLI(extra[argv[0]], args=argv[1:], as_positional=False)
    return run_lightning(None if args is None else argv)


if __name__ == "__main__":  # pragma: no cover
    main()
