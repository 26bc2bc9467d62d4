"""What a command line may import and opt in to, checked before anything is imported: the ``class_path`` policy
(:func:`restricted_imports`) and the code-running settings a config file may not set, checked on the resolved
configuration (:func:`check_code_opt_ins`).

Kept apart from :mod:`.lightning` so that every command's parsing (and ``--help``) runs without torch or Lightning.
"""
from __future__ import annotations

import os
import re
import sys
from argparse import Namespace
from contextlib import contextmanager
from pathlib import Path

import yaml
from jsonargparse import ArgumentParser, _common, _typehints, _util, set_parsing_settings

from ..errors import UserInputError


ALLOWED_IMPORTS = ("iprox_lightning", "lightning", "pytorch_lightning", "torch.optim", "torchmetrics")
"""The packages a config's ``class_path`` (or any import path given as a value) may name on the command line."""
IMPORTS_ENV = "IPROX_ALLOW_IMPORTS"
"""Extra packages a ``class_path`` may name, comma-separated (``*``: any); e.g. ``IPROX_ALLOW_IMPORTS=my_project``."""


def allowed_imports() -> list[str] | None:
    """:data:`ALLOWED_IMPORTS` plus the packages named in ``$IPROX_ALLOW_IMPORTS`` (``None``: any import allowed)."""
    extra = [e.strip() for e in os.environ.get(IMPORTS_ENV, "").split(",") if e.strip()]
    bad = [e for e in extra if e != "*" and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", e)]
    if bad:
        raise UserInputError(f"{IMPORTS_ENV}={os.environ[IMPORTS_ENV]!r}: {', '.join(map(repr, bad))} is not a "
                             "package name; name packages by their import path, comma-separated (my_project,other."
                             "pkg), or '*' for any")
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
_ALL = {"1", "true", "yes", "*"}
_GROUP_KEYS = {"init_args", "dict_kwargs"}  # spelled or not on the command line: ``--model.trust_remote_code``


def allowed_code() -> set[str]:
    """The :data:`CODE_OPT_INS` keys ``$IPROX_ALLOW_CODE`` allows (every key for ``1`` / ``true`` / ``yes`` / ``*``);
    a name that is none of these is refused, naming the variable."""
    given = [k.strip() for k in os.environ.get(CODE_ENV, "").split(",") if k.strip()]
    if any(k.lower() in _ALL for k in given):
        return set(CODE_OPT_INS)
    unknown = [k for k in given if k not in CODE_OPT_INS]
    if unknown:
        raise UserInputError(f"{CODE_ENV}={os.environ[CODE_ENV]!r}: {', '.join(map(repr, unknown))} is not a code "
                             f"opt-in; name {' or '.join(CODE_OPT_INS)} (comma-separated), or 1 for both")
    return set(given)


def _runs_code(key: str, v) -> bool:
    """``v`` is the value of ``key`` that runs code, read as the parser reads it (``"yes"``, ``"True"``: true)."""
    if isinstance(v, str):
        v = _yaml_value(v)
    if isinstance(v, bool):
        return v is CODE_OPT_INS[key]
    return isinstance(v, int) and bool(v) is CODE_OPT_INS[key]  # 1 / 0 in a free-form (dict) setting


def _yaml_value(text: str):
    """A command-line value as jsonargparse reads it (YAML: ``true``, ``True``, ``yes``, ``on`` are true)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _normal(parts) -> tuple[str, ...]:
    """A dotted key without the ``init_args`` / ``dict_kwargs`` levels the command line may leave out."""
    return tuple(str(p) for p in parts if p not in _GROUP_KEYS)


def _abbreviated(parts: list[str]) -> str | None:
    """The :data:`CODE_OPT_INS` key a top-level option abbreviates (argparse takes ``--weights_on`` for
    ``--weights_only``; nested keys are never abbreviated)."""
    hits = [k for k in CODE_OPT_INS if len(parts) == 1 and parts[0] and k.startswith(parts[0])]
    return hits[0] if len(hits) == 1 else None


def command_line_opt_ins(argv: list[str]) -> dict[tuple[str, ...], object]:
    """The :data:`CODE_OPT_INS` keys the command line itself sets, by dotted path without ``init_args`` (the last
    value given wins, as in the parser): ``--k v``, ``--k=v``, and a group or config given inline as YAML / JSON
    (``--model '{"init_args": {...}}'``). A group or config given as a file is not the command line."""
    found: dict[tuple[str, ...], object] = {}

    def inline(node, prefix: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                key = _normal(prefix + (str(k),))
                if k in CODE_OPT_INS:
                    found[key] = v
                inline(v, key)

    for i, a in enumerate(argv):
        if a == "-c" or a.startswith("--"):
            name, given, value = a.partition("=")
            value = value if given else None
            if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            if value is None:
                continue
            parts = name.lstrip("-").split(".")
            prefix = () if parts in (["c"], ["config"]) else _normal(parts)
            key = parts[-1] if parts[-1] in CODE_OPT_INS else _abbreviated(parts)
            if key is not None and prefix:
                found[prefix[:-1] + (key,)] = value
            loaded = _yaml_value(value)
            if isinstance(loaded, dict):
                inline(loaded, prefix)
    return found


def _opt_ins_set(node, path: tuple[str, ...] = (), source=None):
    """``(dotted path, key, source)`` for every :data:`CODE_OPT_INS` key of a resolved config (jsonargparse
    ``Namespace``, dicts, lists) set to its code-running value; ``source``: the group file it was read from, if any."""
    if isinstance(node, Namespace):
        node = vars(node)
    if isinstance(node, dict):
        source = node.get("__path__") or source
        for k, v in node.items():
            if k == "__path__" or (k == "config" and not path):  # the config files themselves
                continue
            if k in CODE_OPT_INS and _runs_code(k, v):
                yield path + (str(k),), k, source
            yield from _opt_ins_set(v, path + (str(k),), source)
    elif isinstance(node, (list, tuple)):
        for j, v in enumerate(node):
            yield from _opt_ins_set(v, path + (str(j),), source)


def check_code_opt_ins(config, argv: list[str]) -> None:
    """Refuse a resolved configuration (what the parser built from every config file, group file and option, before
    any class is built) that sets a :data:`CODE_OPT_INS` key to its code-running value, unless the command line
    ``argv`` sets that very key to that value itself or :data:`CODE_ENV` allows the key. The error names the key and
    the file it came from. A same-named key of another group on the command line (``--data.init_args.
    trust_remote_code``) does not count, nor a value that does not run code."""
    allowed = allowed_code()
    given = None
    for path, key, source in _opt_ins_set(config):
        if key in allowed:
            continue
        if given is None:
            given = command_line_opt_ins(argv)
        said = given.get(_normal(path), _MISSING)
        if said is not _MISSING and _runs_code(key, said):
            continue
        dotted, value = ".".join(path), str(CODE_OPT_INS[key]).lower()
        files = config.get("config") if isinstance(config, Namespace) else None
        where = _source_file(source, [f for f in files or [] if f is not None], path, key)
        raise UserInputError(
            f"{where}: {dotted}: {value} would run code the model or checkpoint files bring; a config file cannot opt "
            f"in to that. Opt in yourself on the command line (--{dotted} {value}) or with {CODE_ENV}={key}")


_MISSING = object()


def _source_file(source, configs: list, path: tuple[str, ...], key: str) -> str:
    """The file that set ``path``: its group file, else the last config file setting it, else every config file."""
    def name(p) -> str:
        return str(getattr(p, "absolute", p))

    if source is not None:
        return name(source)
    for cfg in reversed(configs):
        try:
            data = yaml.safe_load(Path(name(cfg)).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if any(_normal(p) == _normal(path) for p, _, _ in _opt_ins_set(data)):
            return name(cfg)
    return ("a config file or checkpoint (" + ", ".join(name(c) for c in configs) + ")" if configs
            else "a config file or checkpoint")


def opt_in_checking_parser():
    """A jsonargparse ``ArgumentParser`` class whose ``parse_args`` checks the resolved configuration with
    :func:`check_code_opt_ins` before the caller builds or runs anything (the ``parser_class`` of a command's CLI)."""

    class OptInCheckingParser(ArgumentParser):
        def parse_args(self, args=None, *rest, **kwargs):
            cfg = super().parse_args(args, *rest, **kwargs)
            check_code_opt_ins(cfg, list(sys.argv[1:] if args is None else args))
            return cfg

    return OptInCheckingParser
