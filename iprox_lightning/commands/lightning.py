"""The Trainer commands ``fit``, ``validate``, ``test`` and ``predict``: LightningCLI over any LightningModule / LightningDataModule.

The stage configs in ``configs/`` pick the module and data module by ``class_path``
(``--model.help ProxyAlignModule`` lists one module's options). A ``class_path`` may only name the packages of
:data:`ALLOWED_IMPORTS` (others via ``$IPROX_ALLOW_IMPORTS``): anything else is refused before it is imported.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..console import add_console_callbacks, quiet_lightning_tips
from ..errors import UserInputError
from .import_policy import (ALLOWED_IMPORTS, CODE_ENV, CODE_OPT_INS, IMPORTS_ENV, MOVED_MODULES,  # noqa: F401
                            allowed_imports, check_code_opt_ins, moved_path, restricted_imports)


def is_torch_module_base(cls: type) -> bool:
    """``torch.nn.Module`` itself (not its subclasses, so not ``LightningModule``)."""
    return cls is torch.nn.Module


def hide_torch_module_subclasses() -> None:
    """Our modules take their model as ``Union[str, nn.Module]``: a name or path on the command line, an already
    built ``nn.Module`` only from Python. jsonargparse treats a class-typed option as "any subclass, by class path"
    and lists every importable ``nn.Module`` subclass (hundreds of ``torch.nn`` / ``torch.ao`` layers) in the help
    of that option, which buries a module's own options under ``--model.help <Name>``. Declared a type without
    subclasses on the command line, ``nn.Module`` keeps accepting its Python objects and the help lists only the
    module's options. (Process-wide jsonargparse setting; idempotent.)"""
    set_parsing_settings(subclasses_disabled=[is_torch_module_base])


def raised_in_jsonargparse(error: BaseException) -> bool:
    """Whether ``error`` was raised by jsonargparse's own code (the innermost frame of its traceback)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "jsonargparse" in Path(tb.tb_frame.f_code.co_filename).parts


def construction_error(error: BaseException) -> BaseException:
    """The error a class raised while jsonargparse built it: jsonargparse re-raises it as the ``__cause__`` of its
    own "Does not validate against any of the Union subtypes" ``ValueError`` (the model and data options are
    ``Union[<base class>, None]``); unwrap those layers, keep everything else."""
    while error.__cause__ is not None and raised_in_jsonargparse(error):
        error = error.__cause__
    return error


class IProXCLI(LightningCLI):
    """LightningCLI with the project's console defaults (one tqdm progress-bar style and a model summary without
    unknown FLOPs, :func:`iprox_lightning.console.add_console_callbacks`), and the errors of the classes it builds
    as they raised them (:func:`construction_error`). The resolved configuration's code opt-ins
    (``trust_remote_code``, ``weights_only``) are checked before any class is built (:func:`check_code_opt_ins`)."""

    def parse_arguments(self, parser, args) -> None:
        self._argv = list(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def before_instantiate_classes(self) -> None:
        """The check sees the configuration as it will be built: config files, group files, options and a
        ``ckpt_path``'s hyper-parameters merged."""
        argv, config = self._argv, self.config
        if self.subcommand is not None:
            config = config[self.subcommand]
            argv = argv[argv.index(self.subcommand) + 1:] if self.subcommand in argv else argv
        check_code_opt_ins(config, argv)

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as e:
            cause = construction_error(e)
            if cause is e:
                raise
            raise cause from None
        check_manual_optimization(self.model, self.trainer)

    def _instantiate_trainer(self, config, callbacks):
        config = add_console_callbacks(config)
        config["callbacks"] = list(config["callbacks"]) + [StopOnSigterm()]
        try:
            return super()._instantiate_trainer(config, callbacks)
        except (ValueError, MisconfigurationException) as e:  # the Trainer's settings and this machine disagree
            if isinstance(e, UserInputError):
                raise
            raise UserInputError(f"trainer: {e}") from e


def check_manual_optimization(model, trainer) -> None:
    """A module that steps its optimiser itself (``micro_batch_size``: one step per batch over its micro-batches) takes
    neither of the Trainer's step options: refused here in one line naming both, not by Lightning inside ``fit``."""
    if model is None or trainer is None or getattr(model, "automatic_optimization", True):
        return
    taken = {k: v for k, v, unset in (("accumulate_grad_batches", trainer.accumulate_grad_batches, (1,)),
                                      ("gradient_clip_val", trainer.gradient_clip_val, (None, 0))) if v not in unset}
    if taken:
        given = ", ".join(f"trainer.{k}={v}" for k, v in taken.items())
        raise UserInputError(f"{given} cannot be combined with model.micro_batch_size (the module then makes one "
                             "optimiser step per batch over its micro-batches): raise data.batch_size for a larger "
                             "effective batch, or drop micro_batch_size")


class StopOnSigterm(Callback):
    """SIGTERM ends a predict run (scoring, a store build) after the batch in hand, as Lightning's fit and validation
    loops already do (in predict Lightning's handler only records it, so the run went on to its end): the shards
    written so far are kept, and the same command resumes from them. ``train.py`` then says so in one line."""

    def on_predict_batch_end(self, trainer, *args, **kwargs) -> None:
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException()


def run_lightning(args: list[str] | None = None, *, run: bool = True) -> IProXCLI:
    """Run LightningCLI on ``args`` (``None``: the command line).

    When ``args`` are given (the pipeline, tests) the process's own command line is hidden from
    LightningCLI while it runs: it would otherwise warn that both were given, although only
    ``args`` are parsed. Re-runs may reuse a log dir (the saved config is overwritten).
    """
    quiet_lightning_tips()
    hide_torch_module_subclasses()
    saved = sys.argv
    if args is not None:
        sys.argv = sys.argv[:1]
    try:
        with restricted_imports():
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
