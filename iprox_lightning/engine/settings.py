"""Settings declared once.

A stage's settings are the fields of one frozen config dataclass (:class:`~iprox_lightning.compression.apply.CompressionConfig`,
:class:`~iprox_lightning.alignment.module.AlignConfig`, :class:`~iprox_lightning.scoring.influence.ScoringConfig`):
names, types, defaults, checks and documentation live there and nowhere else. A callable that takes them -- a Lightning
class's ``__init__`` (``IPSVDCallback``, ``ProxyAlignModule``, ``InfluenceScoringModule``) or a function API
(``compress_model``) -- declares only its own arguments plus one parameter for the config, and is decorated with
:func:`takes_settings`. The decorator

* gives the callable the dataclass's fields as keyword arguments in its signature (``__signature__``: what
  jsonargparse / ``LightningCLI``, ``help()`` and editors read), so a YAML file or a command line sets them with the
  same flat keys as before (``init_args: {sparsity: 0.5}``, ``--model.init_args.lr 1e-4``);
* appends the dataclass's documentation of each field to the callable's docstring (the CLI's ``--help``);
* at call time builds the config from those keywords (or takes one given whole, ``compression=CompressionConfig(...)``,
  not both) and calls the callable with it.

So a new setting is one dataclass field: every class, function and CLI that takes the config has it.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from typing import Any, Callable, Mapping, Optional, TypeVar

from ..errors import UserInputError

F = TypeVar("F", bound=Callable)
_P = inspect.Parameter


def field_docs(config_cls: type) -> dict[str, str]:
    """``{field: its text}`` from the ``Args:`` section of the dataclass's docstring (Google style, as written)."""
    doc = inspect.getdoc(config_cls) or ""
    args = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    out: dict[str, str] = {}
    name = None
    for line in args.splitlines():
        m = re.match(r"^    (\w+):\s*(.*)$", line)
        if m:
            name = m.group(1)
            out[name] = m.group(2)
        elif name and line.startswith("        "):
            out[name] += " " + line.strip()
        elif line.strip() and not line.startswith(" "):
            break  # the next section
    return out


def with_field_docs(doc: str | None, config_cls: type, names: list[str]) -> str:
    """``doc`` with each field's documentation appended to its ``Args:`` section (added when missing), so the
    docstring readers (``help()``, jsonargparse's ``--help``) describe every setting where they look."""
    docs = field_docs(config_cls)
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in lines:
        lines += ["", "Args:"]
    start = lines.index("Args:") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].strip() and not lines[i].startswith(" ")), len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    extra = [f"    {n}: {docs[n]}" for n in names if n in docs]
    return "\n".join(lines[:end] + extra + lines[end:]) + "\n"


def _field_parameters(config_cls: type, positional: tuple[str, ...], names: list[str]) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(config_cls)
    params = []
    for f in dataclasses.fields(config_cls):
        if f.name not in names:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else _P.empty)  # type: ignore[misc]
        kind = _P.POSITIONAL_OR_KEYWORD if f.name in positional else _P.KEYWORD_ONLY
        params.append(_P(f.name, kind, default=default, annotation=_cli_type(hints[f.name])))
    return params


def _cli_type(tp: Any) -> Any:
    """A field's type as a caller writes it: ``tuple[str, ...]`` (how a frozen config keeps a list) is a list."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]  # type: ignore[valid-type]
    if origin is typing.Union:
        return typing.Union[tuple(_cli_type(a) for a in args)]
    return tp


def takes_settings(config_cls: type, param: str, *, positional: tuple[str, ...] = (),
                   fields: tuple[str, ...] | None = None) -> Callable[[F], F]:
    """Decorate ``fn(..., <param>=None, ...)``: its settings are ``config_cls``'s fields (module docstring).

    Args:
        config_cls: the frozen config dataclass.
        param: the name of ``fn``'s parameter that receives the built config (keyword, default ``None``).
        positional: fields that may also be passed by position, right after ``fn``'s own positional parameters
            (``compress_model(model, loader, 0.5)``).
        fields: the fields ``fn`` takes as keywords (default: every one); the others keep their defaults unless the
            config is given whole (a gradient store takes the metric's fields, not the scoring loop's).
    """
    all_names = [f.name for f in dataclasses.fields(config_cls) if f.init]
    if fields is not None and set(fields) - set(all_names):
        raise TypeError(f"takes_settings: {sorted(set(fields) - set(all_names))} are not {config_cls.__name__} fields")
    names = [n for n in all_names if fields is None or n in fields]

    def decorate(fn: F) -> F:
        sig = inspect.signature(fn)
        try:  # the own parameters' types resolved in fn's module (the wrapper lives here, where they are not names)
            hints = typing.get_type_hints(fn)
        except Exception:  # noqa: BLE001 - a name only imported for type checking: keep the text
            hints = {}
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
        if param not in sig.parameters:
            raise TypeError(f"{fn.__qualname__} has no parameter {param!r} for its {config_cls.__name__}")
        clash = set(all_names) & set(sig.parameters)
        if clash:
            raise TypeError(f"{fn.__qualname__} declares {sorted(clash)} itself: they are {config_cls.__name__} fields")
        if any(p.kind in (_P.POSITIONAL_ONLY, _P.VAR_POSITIONAL, _P.VAR_KEYWORD) for p in own):
            raise TypeError(f"{fn.__qualname__}: takes_settings needs named parameters only")
        taken = _field_parameters(config_cls, positional, names)
        head = [p for p in own if p.kind == _P.POSITIONAL_OR_KEYWORD and p.name != param]
        tail = [p for p in own if p.kind == _P.KEYWORD_ONLY and p.name != param]
        pos_fields = [p for p in taken if p.kind == _P.POSITIONAL_OR_KEYWORD]
        public = sig.replace(parameters=[*head, *pos_fields, *(p for p in taken if p.kind == _P.KEYWORD_ONLY), *tail],
                             return_annotation=hints.get("return", sig.return_annotation))
        # ``param`` itself is a Python-only way in (the whole config object): not in the public signature, so the
        # CLI offers one spelling of each setting
        with_config = public.replace(parameters=[*public.parameters.values(),
                                                 _P(param, _P.KEYWORD_ONLY, default=None,
                                                    annotation=Optional[config_cls])])
        owner = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = with_config.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"{owner}: {e}") from None
            given = dict(bound.arguments)
            flat = {n: given.pop(n) for n in names if n in given}
            config = given.get(param)
            if config is not None:
                if flat:
                    raise UserInputError(f"{owner}: give the settings either as {param}={config_cls.__name__}(...) or "
                                         f"as keywords ({', '.join(sorted(flat))}), not both")
                if isinstance(config, Mapping):
                    config = config_cls(**config)
                elif not isinstance(config, config_cls):
                    raise TypeError(f"{owner}: {param} must be a {config_cls.__name__}, got {type(config).__name__}")
            else:
                try:
                    config = config_cls(**flat)
                except ValueError as e:  # the same class (a user error stays one), named by its owner
                    raise type(e)(f"{owner}: {e}") from None
            given[param] = config
            return fn(**given)

        wrapper.__signature__ = public  # type: ignore[attr-defined]
        del wrapper.__wrapped__  # inspect.signature must read __signature__, not follow fn
        wrapper.__doc__ = with_field_docs(fn.__doc__, config_cls, names)
        return wrapper  # type: ignore[return-value]

    return decorate
