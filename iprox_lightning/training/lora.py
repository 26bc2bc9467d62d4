"""LoRA in the warm-up and fine-tune modules (``lora: {r, alpha, dropout, target_modules}`` of
:class:`~iprox_lightning.training.causal_lm.CausalLMModule`): the adapters put on the loaded model, saved at the end
of every epoch and of ``fit`` (``<save_dir>/adapters/epoch_<n>``, ``<save_dir>/adapters/final``: peft's format,
safetensors, each loadable on its own with its base; beside them the optimiser's Adam moments,
``optimizer_state.safetensors``: :mod:`iprox_lightning.io.optimizer_state`, what LESS's training gradients read), and
merged into the dense model ``save_dir`` receives (what Stage 1 reads). The peft calls themselves are :mod:`iprox_lightning.models.lora`'s."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ..errors import UserInputError
from ..io.optimizer_state import OPTIMIZER_STATE, adam_state_of, save_adam_state
from ..io.ownership import make_owned_dir
from ..models.lora import LoraSettings, add_adapters, is_adapted, merge, save_adapter

ADAPTERS_DIR = "adapters"
"""The folder of ``save_dir`` the adapters are saved in, one directory per epoch and ``final``."""


def with_adapters(model: nn.Module, settings: LoraSettings, source: Any, mesh: Any = None) -> nn.Module:
    """``model`` with fresh LoRA adapters (peft; base weights frozen). ``source``: what the model was loaded from (the
    adapters' recorded base: a path made absolute, a hub id or ``builtin``; a module given from Python records none).
    Refused under FSDP2 (``ModelParallelStrategy``): its sharded merge and save are not built."""
    if mesh is not None:
        raise UserInputError("lora: LoRA under ModelParallelStrategy (FSDP2) is not supported; use strategy ddp "
                             "(the frozen base and small adapters need no sharding of optimiser state)")
    return add_adapters(model, settings, base=str(source) if isinstance(source, (str, Path)) else None)


def adapter_dir(save_dir: str | Path, name: str) -> Path:
    return Path(save_dir) / ADAPTERS_DIR / name


def save_epoch_adapter(module, name: str) -> Path | None:
    """The adapters of ``module.model`` into ``<save_dir>/adapters/<name>`` on rank 0 (all ranks call it), with the
    optimiser's Adam moments when it has taken a step (:func:`~iprox_lightning.io.optimizer_state.save_adam_state`)."""
    path = adapter_dir(module.hparams.save_dir, name)
    trainer = module._trainer
    if trainer is None or trainer.is_global_zero:
        make_owned_dir(module.hparams.save_dir, "model")  # created (and marked) before the first adapter goes in
        save_adapter(module.model, path)
        optimizers = trainer.optimizers if trainer is not None else []
        if optimizers and any(optimizers[0].state.values()):
            state = adam_state_of(dict(module.model.named_parameters()), optimizers[0])
            lrs = module.__dict__.get("_step_lrs")
            if lrs:  # the mean learning rate of the epoch's steps (LESS's weight); "final": its last epoch's
                module.__dict__["_epoch_lr"] = sum(lrs) / len(lrs)
            state.lr = module.__dict__.get("_epoch_lr", state.lr)
            save_adam_state(path / OPTIMIZER_STATE, state)
    module.__dict__["_step_lrs"] = []  # the next epoch's steps
    if trainer is not None:
        trainer.strategy.barrier("save_adapter")
    return path


def note_step_lr(module, optimizer) -> None:
    """Record the learning rate of the optimiser step about to be taken (its first group's), for the epoch's mean."""
    module.__dict__.setdefault("_step_lrs", []).append(float(optimizer.param_groups[0]["lr"]))


def save_final_and_merge(module) -> None:
    """The final adapters saved (``adapters/final``), then ``module.model`` replaced by the merged dense model."""
    if not is_adapted(module.model):
        return
    save_epoch_adapter(module, "final")
    module.model = merge(module.model)
