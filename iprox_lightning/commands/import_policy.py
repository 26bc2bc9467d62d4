"""What a command line may import and opt in to, checked before anything is imported: the ``class_path`` policy
(:func:`restricted_imports`) and the code-running settings a config file may not set (:func:`check_config_opt_ins`).

Kept apart from :mod:`.lightning` so that every command's parsing (and ``--help``) runs without torch or Lightning.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..errors import UserInputError


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
