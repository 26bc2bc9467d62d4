"""A pipeline run's settings as one object (:class:`PipelineSettings`, the ``pipeline`` command's arguments) and the
checks that refuse a bad one before any stage runs."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import StrategyRegistry

from ..data.sources import is_hub_dataset, parse_hub_id
from ..engine.precision import check_precision
from ..errors import PROXY_VALIDATIONS, OutputNotDirectoryError, UserInputError, check_choice
from ..models.hub import check_dataset_source, check_model_source
from ..scoring.config import ScoringConfig
from ..selection.rules import RULES


@dataclass(frozen=True)
class PipelineSettings:
    """The arguments of one ``python train.py pipeline`` run, as :func:`iprox_lightning.commands.pipeline.pipeline`
    received them (its signature declares their defaults, its docstring what each means)."""

    workdir: str
    target: str
    pool: Any
    validation: Any
    sparsity: float
    select_fraction: float
    select_rule: str
    method: str
    proxy_validation: str
    config_dir: str | None
    demo_overlays: bool | None
    accelerator: str
    devices: int
    num_nodes: int | None
    strategy: str | None
    precision: str | None
    finetune: bool
    force: bool
    seed: int
    data_args: dict[str, Any] | None
    align_epochs: int | None
    num_threads: int | None
    eval_per_task: int | None
    lora: dict[str, Any] | None
    plan: str | dict[str, Any] | None
    device_memory: str | None

    @property
    def demo(self) -> bool:
        """Whether the stages get the ``configs/builtin/`` demo overlays (default: on the built-in pool)."""
        return (self.pool == "builtin") if self.demo_overlays is None else self.demo_overlays

    @property
    def sources(self) -> dict[str, Any]:
        return {"target": self.target, "pool": self.pool, "validation": self.validation}


def check_arguments(wd: Path, sparsity: float, select_fraction: float, method: str, select_rule: str = "balanced",
                    eval_per_task: int | None = None, proxy_validation: str = "target") -> None:
    """Refuse at once the arguments a late stage would refuse (after warm-up and proxy building ran)."""
    if wd.exists() and not wd.is_dir():
        raise OutputNotDirectoryError(f"workdir {wd} is a file, not a directory")
    if isinstance(sparsity, bool) or not 0.0 <= sparsity < 1.0:
        raise UserInputError(f"sparsity must be in [0, 1), got {sparsity}")
    if isinstance(select_fraction, bool) or not 0.0 < select_fraction <= 1.0:
        raise UserInputError(f"select_fraction must be a fraction in (0, 1], got {select_fraction}")
    if select_rule not in RULES:
        raise UserInputError(f"select_rule: unknown selection rule {select_rule!r}; rules: {', '.join(RULES)}")
    check_choice("proxy_validation", proxy_validation, PROXY_VALIDATIONS)
    if eval_per_task is not None and (isinstance(eval_per_task, bool) or eval_per_task < 1):
        raise UserInputError(f"eval_per_task must be >= 1 or null (every validation example), got {eval_per_task}")
    try:
        config = ScoringConfig(method=method)
    except ValueError as e:
        raise UserInputError(f"method: {e}") from None
    if getattr(config.metric_class(), "needs_optimizer_state", False):
        raise UserInputError(f"method: {method} scores a LoRA checkpoint's adapter gradients with its Adam moments, "
                             "which the pipeline's dense target and proxy do not have: run LESS with configs/less/ "
                             "(docs/GUIDE.md, 'LoRA: adapter gradients and LESS')")


def trainer_hardware(accelerator: str, devices: int, num_nodes: int | None, strategy: str | None,
                     precision: str | None) -> dict[str, Any]:
    """The Trainer settings every stage's overlay gets: ``accelerator`` and ``devices`` always, ``num_nodes``,
    ``strategy`` and ``precision`` when given (else the stage configs' own); a bad value is refused before any stage
    runs."""

    for name, value in (("devices", devices), ("num_nodes", num_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UserInputError(f"{name} must be a positive integer, got {value!r}")
    strategies = ["auto", *sorted(StrategyRegistry.available_strategies())]
    if strategy is not None and strategy not in strategies and "." not in str(strategy):
        raise UserInputError(f"strategy: unknown strategy {strategy!r}; give one of {', '.join(strategies)} or a "
                             "strategy class path (e.g. lightning.pytorch.strategies.ModelParallelStrategy)")
    check_precision(precision, "pipeline")  # the precisions every stage supports (engine/precision.py)
    check_strategy_hardware(strategy, accelerator, devices)
    out: dict[str, Any] = {"accelerator": accelerator, "devices": devices}
    if num_nodes is not None:
        out["num_nodes"] = num_nodes
    if strategy is not None:
        out["strategy"] = {"class_path": strategy} if "." in strategy else strategy
    if precision is not None:
        out["precision"] = str(precision)
    return out


GPU_STRATEGIES = ("fsdp", "deepspeed")
"""Strategies (their names and class paths contain these) that run on CUDA devices only."""


def check_strategy_hardware(strategy: str | None, accelerator: str, devices: int) -> None:
    """Refuse before any stage a strategy the machine cannot run: FSDP or DeepSpeed without a CUDA device (or with
    ``--accelerator cpu``), more ``--devices`` than the CUDA devices there are, DeepSpeed without its package
    (before: Lightning's error inside the first stage, or inside a stage's own process)."""

    kind = next((k for k in GPU_STRATEGIES if strategy is not None and k in str(strategy).lower()), None)
    if kind is None:
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise UserInputError(f"strategy {strategy!r} runs on CUDA devices only, and this machine has none: use "
                             "--strategy ddp (or leave --strategy out) on CPUs")
    if str(accelerator).lower() == "cpu":
        raise UserInputError(f"strategy {strategy!r} runs on CUDA devices only, and the accelerator is cpu (the "
                             "default): pass --accelerator gpu, or --strategy ddp to run on CPUs")
    if isinstance(devices, int) and devices > gpus:
        raise UserInputError(f"strategy {strategy!r} with --devices {devices}: this machine has {gpus} CUDA "
                             f"device(s); pass --devices {gpus} or fewer")
    if kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise UserInputError(f"strategy {strategy!r} needs the deepspeed package, which is not installed "
                             "(pip install deepspeed), or use --strategy fsdp / ddp")



def check_sources(target: str, pool, validation) -> None:
    """Refuse at once a hub id that is neither cached nor reachable (before: the warm-up started, then a traceback)."""

    if isinstance(target, str):
        check_model_source(target, "target model")
    for what, src in (("pool", pool), ("validation", validation)):
        for s in ([src] if isinstance(src, str) else list(src or []) if isinstance(src, (list, tuple)) else []):
            if isinstance(s, str) and s != "builtin" and not s.startswith("eval:") and is_hub_dataset(s):
                check_dataset_source(parse_hub_id(s)[0], f"{what} {s!r}: data set")


