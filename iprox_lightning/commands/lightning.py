"""The Trainer commands ``fit``, ``validate``, ``test`` and ``predict``: LightningCLI over any LightningModule / LightningDataModule.

The stage configs in ``configs/`` pick the module and data module by ``class_path``
(``--model.help ProxyAlignModule`` lists one module's options). A ``class_path`` may only name the packages of
:data:`ALLOWED_IMPORTS` (others via ``$IPROX_ALLOW_IMPORTS``): anything else is refused before it is imported.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI

from ..errors import UserInputError


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
    from jsonargparse import set_parsing_settings

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
    as they raised them (:func:`construction_error`)."""

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except Exception as e:
            cause = construction_error(e)
            if cause is e:
                raise
            raise cause from None

    def _instantiate_trainer(self, config, callbacks):
        from ..console import add_console_callbacks

        config = add_console_callbacks(config)
        config["callbacks"] = list(config["callbacks"]) + [StopOnSigterm()]
        return super()._instantiate_trainer(config, callbacks)


class StopOnSigterm(Callback):
    """SIGTERM ends a predict run (scoring, a store build) after the batch in hand, as Lightning's fit and validation
    loops already do (in predict Lightning's handler only records it, so the run went on to its end): the shards
    written so far are kept, and the same command resumes from them. ``train.py`` then says so in one line."""

    def on_predict_batch_end(self, trainer, *args, **kwargs) -> None:
        if getattr(trainer, "received_sigterm", False):
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException()


ALLOWED_IMPORTS = ("iprox_lightning", "lightning", "pytorch_lightning", "torch.optim", "torchmetrics")
"""The packages a config's ``class_path`` (or any import path given as a value) may name on the command line."""
IMPORTS_ENV = "IPROX_ALLOW_IMPORTS"
"""Extra packages a ``class_path`` may name, comma-separated (``*``: any); e.g. ``IPROX_ALLOW_IMPORTS=my_project``."""


def allowed_imports() -> list[str] | None:
    """:data:`ALLOWED_IMPORTS` plus the packages named in ``$IPROX_ALLOW_IMPORTS`` (``None``: any import allowed)."""
    import os

    extra = [e.strip() for e in os.environ.get(IMPORTS_ENV, "").split(",") if e.strip()]
    return None if "*" in extra else list(ALLOWED_IMPORTS) + extra


MOVED_MODULES = {  # 0.1.0 module -> its home in the wings (0.2)
    "modules.causal_lm": "training.causal_lm", "modules.warmup": "training.warmup",
    "modules.finetune": "training.finetune", "modules.proxy_align": "alignment.module",
    "modules.proxy_fsdp": "alignment.fsdp", "callbacks.ipsvd": "compression.callback",
    "callbacks.keep_best": "alignment.keep_best", "callbacks.ranking_fidelity": "alignment.fidelity",
    "compress": "compression.apply", "compression_config": "compression.config", "compression_plan": "compression.plan",
    "ipsvd": "compression.ipsvd", "rank": "compression.ranks", "probes": "compression.probes",
    "influence_weights": "compression.influence_weights", "alignment": "alignment.losses",
    "task_alignment": "alignment.task", "select": "selection.select", "selection_rules": "selection.rules",
    "selection_summary": "selection.summary", "selection_effect": "evaluation.effect",
    "tracking": "engine.tracking", "batch": "engine.batch", "lowrank": "engine.lowrank",
    "target_layers": "engine.target_layers", "analysis.score_table": "io.scores",
}


def moved_path(path: str) -> str | None:
    """The 0.2 import path of a class or function given by its 0.1.0 module path (``iprox_lightning.modules.proxy_align
    .ProxyAlignModule`` -> ``iprox_lightning.alignment.module.ProxyAlignModule``); ``None`` for any other path. The
    faces ``iprox_lightning.modules.X`` / ``iprox_lightning.callbacks.X`` keep working as they are."""
    parts = path.split(".")
    if parts[0] != "iprox_lightning" or len(parts) < 3:
        return None
    for n in (3, 2):  # the longest 0.1.0 module first; the last part is the class or function
        old = ".".join(parts[1:n])
        if len(parts) > n and old in MOVED_MODULES and not (old == "alignment" and parts[2] in _ALIGNMENT_WING):
            return ".".join(["iprox_lightning", MOVED_MODULES[old], *parts[n:]])
    return None


_ALIGNMENT_WING = {"losses", "module", "fsdp", "keep_best", "fidelity", "task"}  # iprox_lightning.alignment.<these>: 0.2


@contextmanager
def restricted_imports():
    """While parsing a command line or config, a ``class_path`` outside :func:`allowed_imports` is refused
    *before* its module is imported (importing runs the module's top-level code, whatever the config is later
    checked for): jsonargparse's import-path policy, ``*`` denied and the allowed packages allowed, with an error
    saying how to allow a package. The previous policy is restored afterwards (the settings are process-wide)."""
    allowed = allowed_imports()
    if allowed is None:
        yield
        return
    from jsonargparse import _common, _typehints, _util, set_parsing_settings

    saved = {k: _common.parsing_settings[k] for k in ("import_path_verdicts", "import_paths_enforced")}
    check = _common.check_import_path

    def check_with_hint(path: str) -> None:
        new = moved_path(path)
        if new is not None:
            raise _common.ImportDenied(f"import path {path!r} is a 0.1.0 path: the class now lives at {new!r} "
                                       "(update the class_path in your config)")
        try:
            check(path)
        except _common.ImportDenied:
            raise _common.ImportDenied(
                f"import path {path!r} (a class_path?) is outside the packages the command line may import "
                f"({', '.join(allowed)}); it was not imported, as importing runs the module's code. To allow it, "
                f"set {IMPORTS_ENV}={path.split('.')[0]} (comma-separated packages; '*' allows any)") from None

    set_parsing_settings(import_path_denylist=["*"], import_path_allowlist=allowed)
    patched = [(m, m.check_import_path) for m in (_util, _typehints) if hasattr(m, "check_import_path")]
    for m, _ in patched:
        m.check_import_path = check_with_hint
    try:
        yield
    finally:
        for m, f in patched:
            m.check_import_path = f
        _common.parsing_settings.update(saved)


CODE_OPT_INS = {"trust_remote_code": True, "weights_only": False}
"""Settings that run code a file brings (a model directory's Python; a checkpoint's pickles) and the value that does:
the user's own act on the command line (``--model.init_args.trust_remote_code true``) or ``IPROX_ALLOW_CODE=<key>``
(comma-separated, or ``1`` for both), never a line of a config file someone else wrote."""
CODE_ENV = "IPROX_ALLOW_CODE"


def check_config_opt_ins(argv: list[str]) -> None:
    """Refuse a config file (``--config FILE``, ``-c FILE``, a group given as a file: ``--data FILE``) that sets a :data:`CODE_OPT_INS` key to its code-running value, unless
    the command line sets the same key itself or :data:`CODE_ENV` allows it; the error names the file and the key."""
    import os

    import yaml

    allowed = {k.strip() for k in os.environ.get(CODE_ENV, "").split(",") if k.strip()}
    if allowed & {"1", "true", "yes", "*"}:
        return
    configs, flags = [], []
    for i, a in enumerate(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
        if a in ("--config", "-c") and value is not None:
            configs.append((value, []))
        elif a.startswith(("--config=", "-c=")):
            configs.append((a.split("=", 1)[1], []))
        elif a.startswith("--"):
            flags.append(a[2:].split("=", 1)[0])
            # a group given as a file (``--data d.yaml``, ``--model=m.yaml``) is a config file too
            given = a.split("=", 1)[1] if "=" in a else value
            if given and given.lower().endswith((".yaml", ".yml", ".json")) and Path(given).is_file():
                configs.append((given, a[2:].split("=", 1)[0].split(".")))

    def runs_code(key, v) -> bool:
        """``v`` is the value of ``key`` that runs code, as the parser reads it (``"true"``, ``"yes"``: true)."""
        if isinstance(v, str):
            v = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False,
                 "0": False}.get(v.strip().lower(), v)
        return v is CODE_OPT_INS[key] or (not isinstance(v, bool) and isinstance(v, int) and bool(v) is CODE_OPT_INS[key])

    def found(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in CODE_OPT_INS and runs_code(k, v):
                    yield ".".join(path + [str(k)]), k, CODE_OPT_INS[k]
                yield from found(v, path + [str(k)])
        elif isinstance(node, list):
            for j, v in enumerate(node):
                yield from found(v, path + [str(j)])

    for cfg, prefix in configs:
        try:
            data = yaml.safe_load(Path(cfg).read_text())
        except (OSError, yaml.YAMLError):
            continue  # the parser names an unreadable config itself
        for dotted, key, value in found(data, prefix):
            if key in allowed or any(f == key or f.endswith("." + key) for f in flags):
                continue
            raise UserInputError(
                f"{cfg}: {dotted}: {str(value).lower()} would run code the model or checkpoint files bring; a config "
                f"file cannot opt in to that. Opt in yourself on the command line (--{dotted} {str(value).lower()}) or "
                f"with {CODE_ENV}={key}")


def run_lightning(args: list[str] | None = None, *, run: bool = True) -> IProXCLI:
    """Run LightningCLI on ``args`` (``None``: the command line).

    When ``args`` are given (the pipeline, tests) the process's own command line is hidden from
    LightningCLI while it runs: it would otherwise warn that both were given, although only
    ``args`` are parsed. Re-runs may reuse a log dir (the saved config is overwritten).
    """
    from ..console import quiet_lightning_tips

    quiet_lightning_tips()
    hide_torch_module_subclasses()
    check_config_opt_ins(list(sys.argv[1:] if args is None else args))
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
