"""LoRA through ``peft``: the settings, adapters put on a model, saved, read back with their base model, and merged.

* :class:`LoraSettings` — ``{r, alpha, dropout, target_modules}``, the ``lora`` option of the warm-up and fine-tune
  modules and of ``pipeline --lora``; checked field by field (a bad value is a
  :class:`~iprox_lightning.errors.UserInputError` naming it). ``target_modules`` as peft reads it: a list of module
  names (a module matches when its path is the name or ends with ``.<name>``) or one regex over the whole path;
  ``None``: peft's default for the architecture (``q_proj``, ``v_proj`` for Llama, Qwen, Gemma).
* :func:`add_adapters` — ``peft.get_peft_model``: the base weights frozen, only the adapters train.
* :func:`save_adapter` — an adapter directory in peft's format (``adapter_config.json`` +
  ``adapter_model.safetensors``, never a pickle), its ``base_model_name_or_path`` the base as it was loaded (a local
  base by its absolute path), so the directory loads on its own.
* :func:`merge` — ``merge_and_unload``: the dense model, ``W + (alpha / r) · B A`` in every adapted layer (what
  Stage 1 reads).
* :func:`check_adapter_dir`, :func:`attach_saved_adapter` — an adapter directory read (its weights from
  ``adapter_model.safetensors`` only) onto its base model, which
  :func:`~iprox_lightning.models.loading.load_adapter` loads through the package's own loaders (``trust_remote_code``
  only when asked); :func:`~iprox_lightning.models.loading.load_model` loads such a directory merged (the ``peft``
  loader).
* :func:`shared_base_key`, :func:`adapter_weights`, :func:`read_adapter_weights`, :func:`use_adapter_weights` —
  several adapter directories over one base scored with that base loaded once (the scoring module's
  ``checkpoints``): each directory's adapter tensors held, put in place in turn.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
from safetensors.torch import load_file
from torch import nn

from ..engine.target_layers import has_adapters
from ..errors import InputNotFoundError, UserInputError
from ..io.atomic import named_os_errors
from ..io.fingerprint import ADAPTER_CONFIG, adapter_base  # noqa: F401  (the base an adapter names: one reader)
from ..io.fingerprint import is_adapter_dir, sort_safetensors_metadata, source_identity
from ..io.jsonfile import read_json, read_safetensors_header
from ..io.ownership import make_owned_dir

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft's ``LoraConfig``).

    Args:
        r: the adapters' rank.
        alpha: the scale numerator: an adapter adds ``(alpha / r) · B A`` to its layer's weight.
        dropout: dropout on the adapters' input while training.
        target_modules: the adapted layers: module names (``["q_proj", "v_proj"]``; a module matches when its path is
            the name or ends with ``.<name>``) or one regex over the whole module path; ``None``: peft's default for
            the architecture.
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[Union[tuple[str, ...], str]] = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise UserInputError(f"lora.r must be a positive integer, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise UserInputError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserInputError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        t = self.target_modules
        if isinstance(t, (list, tuple)):
            if not t or not all(isinstance(x, str) and x for x in t):
                raise UserInputError(f"lora.target_modules must be a non-empty list of module names, got {t!r}")
            object.__setattr__(self, "target_modules", tuple(t))
        elif t is not None and not (isinstance(t, str) and t):
            raise UserInputError(f"lora.target_modules must be a list of module names, a regex or null, got {t!r}")

    @classmethod
    def of(cls, value: Union[None, "LoraSettings", Mapping[str, Any]]) -> Optional["LoraSettings"]:
        """``None`` (no LoRA: full fine-tuning), or the settings of a mapping ``{r, alpha, dropout, target_modules}``
        (an unknown key is refused naming the known ones)."""
        if value is None or isinstance(value, LoraSettings):
            return value
        require_peft()
        if not isinstance(value, Mapping):
            raise UserInputError(f"lora must be a mapping {{r, alpha, dropout, target_modules}} or null, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise UserInputError(f"lora: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(value))

    def to_dict(self) -> dict:
        d = asdict(self)
        if isinstance(d["target_modules"], tuple):
            d["target_modules"] = list(d["target_modules"])
        return d

    def resolved_targets(self, model_type: str) -> Union[list[str], str]:
        """``target_modules``, or peft's default for ``model_type`` (refused when peft has none)."""
        if self.target_modules is not None:
            return list(self.target_modules) if isinstance(self.target_modules, tuple) else self.target_modules
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS  # lazy: optional extra peft

        if model_type not in DEFAULTS:
            raise UserInputError(f"lora.target_modules: peft has no default for the architecture {model_type!r}; "
                                 "name the layers, e.g. [q_proj, v_proj]")
        return list(DEFAULTS[model_type])

    def peft_config(self, model_type: str):
        from peft import LoraConfig  # lazy: optional extra peft

        return LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=float(self.dropout), bias="none",
                          target_modules=self.resolved_targets(model_type), task_type="CAUSAL_LM")


def require_peft() -> None:
    """Refuse LoRA, naming the extra to install, where ``peft`` is not installed."""
    if importlib.util.find_spec("peft") is None:
        raise UserInputError("lora: LoRA needs the peft package, which is not installed: "
                             "pip install 'iprox_lightning[peft]'")


def matches_target(settings: LoraSettings, model_type: str, module_path: str) -> bool:
    """Whether peft puts an adapter on the module at ``module_path`` (peft's own rule), for the plan's counts."""
    from peft.tuners.tuners_utils import check_target_module_exists  # lazy: optional extra peft

    return bool(check_target_module_exists(settings.peft_config(model_type), module_path))


@contextlib.contextmanager
def _peft_quiet():
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` (a ``FutureWarning`` on every wrap with
    transformers 5): not the user's to act on, so not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def add_adapters(model: nn.Module, settings: LoraSettings, base: Optional[str] = None) -> nn.Module:
    """``model`` wrapped by ``peft.get_peft_model`` with fresh adapters (base weights frozen). ``base``: the source
    the model was loaded from (recorded as ``base_model_name_or_path``; a local path made absolute)."""
    from peft import get_peft_model  # lazy: optional extra peft

    model_type = getattr(getattr(model, "config", None), "model_type", "")
    cfg = settings.peft_config(model_type)
    try:
        with _peft_quiet():
            adapted = get_peft_model(model, cfg)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise UserInputError(f"lora.target_modules: {str(e).splitlines()[0]}") from None
    if base is not None:  # peft records the model's name_or_path (empty for a model built in code): the source's
        adapted.peft_config["default"].base_model_name_or_path = base_reference(base)
    return adapted


def base_reference(source: str) -> str:
    """How an adapter names its base: a local path absolute (the adapter loads from any working directory), a hub id
    or ``builtin`` as given."""
    p = Path(source)
    return str(p.resolve()) if p.exists() else str(source)


def is_adapted(model: nn.Module) -> bool:
    try:
        from peft import PeftModel  # lazy: optional extra peft
    except ImportError:  # pragma: no cover - peft not installed: nothing is adapted
        return False
    return isinstance(model, PeftModel)


def scores_adapters(model: Any) -> bool:
    """Whether gradient scoring of ``model`` (a source string or a loaded module) runs over LoRA adapter gradients: a
    peft adapter directory (loaded with its base, unmerged: ``load_model(..., merge_adapters=False)``) or a peft
    model. Its tracked layers are then the adapters (``engine.target_layers.default_patterns``), and the scoring
    settings record ``gradients: adapters`` (:data:`ADAPTER_GRADIENTS`), so no result over the merged dense model's
    gradients is reused for them."""
    if isinstance(model, (str, Path)):
        return is_adapter_dir(model)

    return has_adapters(model) if isinstance(model, nn.Module) else False


ADAPTER_GRADIENTS = {"gradients": "adapters"}
"""What the settings of a scoring run, store or check over a peft model's adapter gradients record (nothing for any
other model: their fingerprints are as before)."""


def save_adapter(model: nn.Module, path: Union[str, Path]) -> Path:
    """The adapters of the peft ``model`` into the directory ``path`` (peft's format, safetensors), marked as the
    package's; a full disk is an ``OSError`` naming it."""
    path = Path(path)
    make_owned_dir(path, "model")
    with named_os_errors(path), _peft_quiet():
        # save_embedding_layers=False: the base's embeddings are never trained or resized here, so peft's "auto" check
        # (which looks the base's config.json up on the hub, warning where it cannot: "builtin", offline) is not run
        model.save_pretrained(path, safe_serialization=True, save_embedding_layers=False)
    sort_safetensors_metadata(path / ADAPTER_WEIGHTS)  # the same adapters, the same bytes
    return path


def merge(model: nn.Module) -> nn.Module:
    """The dense model of a peft ``model`` (``merge_and_unload``: each adapted weight ``W + (alpha / r) · B A``, the
    adapter modules gone). The peft model's base is merged in place."""
    with _peft_quiet():
        return model.merge_and_unload()


def check_adapter_dir(path: Union[str, Path]) -> str:
    """Check an adapter directory before anything loads it: ``adapter_model.safetensors`` there (a pickled
    ``adapter_model.bin`` is refused) with a sound header, a base named; returns the base
    (:func:`adapter_base`)."""
    require_peft()
    p = Path(path)
    weights = p / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = " (its adapter_model.bin is a pickle, which is never loaded: save it with safe_serialization)" \
            if (p / "adapter_model.bin").exists() else ""
        raise InputNotFoundError(f"{p}: no {ADAPTER_WEIGHTS}{pickled}")

    read_safetensors_header(weights)
    base = adapter_base(p)
    if Path(base).exists() and Path(base).resolve() == p.resolve():
        raise UserInputError(f"{p / ADAPTER_CONFIG}: base_model_name_or_path names the adapter directory itself")
    return base


def attach_saved_adapter(model: nn.Module, path: Union[str, Path]) -> nn.Module:
    """``model`` (the adapter's base, loaded) wrapped by peft with the adapters of the directory ``path`` (read from
    its safetensors file; :func:`check_adapter_dir` first), for inference."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict  # lazy: optional extra peft

    p = Path(path)
    try:
        with _peft_quiet():
            cfg = LoraConfig.from_pretrained(str(p))
    except (TypeError, ValueError) as e:
        raise UserInputError(f"{p / ADAPTER_CONFIG}: not a LoRA adapter config peft reads: {e}") from None
    cfg.inference_mode = True
    # peft renames the recorded base to the loaded model's name (a warning when they differ: "builtin", a relative
    # path); the base was checked and loaded from the record, which the wrapped model keeps
    base, cfg.base_model_name_or_path = cfg.base_model_name_or_path, model.__dict__.get("name_or_path", None) or None
    with _peft_quiet():
        adapted = get_peft_model(model, cfg)
        result = set_peft_model_state_dict(adapted, load_file(str(p / ADAPTER_WEIGHTS)))
    adapted.peft_config["default"].base_model_name_or_path = base
    _check_fit(result, p / ADAPTER_WEIGHTS, f"its base {cfg.base_model_name_or_path}")
    return adapted


def _check_fit(result, weights: Path, against: str) -> None:
    """A ``UserInputError`` naming ``weights`` when peft's ``set_peft_model_state_dict`` ``result`` left adapter tensors
    missing or found unexpected ones (``against``: what they were loaded into)."""
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise UserInputError(f"{weights}: does not fit {against} "
                             f"({len(missing)} adapter tensors missing, e.g. {missing[:2]}; "
                             f"{len(result.unexpected_keys)} unexpected, e.g. {list(result.unexpected_keys)[:2]})")


def shared_base_key(path: Union[str, Path]) -> Optional[str]:
    """What adapter directories must have in common to be scored over one loaded base, their adapter tensors swapped
    (:func:`read_adapter_weights`): the base's identity (its files, as a fingerprint records it:
    :func:`~iprox_lightning.io.fingerprint.source_identity`) and the adapter settings (``adapter_config.json`` but
    the base's name), as a string. ``None`` for anything else: not an adapter directory, or one whose weights hold
    more than LoRA matrices (``modules_to_save``, ...: loaded whole, each with its base)."""
    p = Path(path)
    if not is_adapter_dir(p) or not (p / ADAPTER_WEIGHTS).is_file():
        return None
    names = [k for k in read_safetensors_header(p / ADAPTER_WEIGHTS) if k != "__metadata__"]
    if not names or any("lora_" not in k for k in names):
        return None
    settings = dict(read_json(p / ADAPTER_CONFIG, what="a peft adapter's settings"))
    settings.pop("base_model_name_or_path", None)
    return json.dumps({"base": source_identity(adapter_base(p)), "adapter": settings}, sort_keys=True, default=str)


def adapter_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA adapter tensors of a peft ``model`` in place now, by parameter name (the tensors themselves, no
    copy)."""
    return {n: p.data for n, p in model.named_parameters() if "lora_" in n}


def read_adapter_weights(model: nn.Module, path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """The adapters of the directory ``path`` for the peft ``model`` (loaded from another directory over the same
    base, with the same adapter settings: :func:`shared_base_key`), read through it into new tensors, by name, to be
    put in place by :func:`use_adapter_weights` (the model keeps the ones in place before, whatever fails). The
    values are the ones ``path`` loaded on its own holds (:func:`~iprox_lightning.models.loading.load_adapter`): peft
    makes the adapters float32 over a half-precision base and loads the file's tensors into them, then the model is
    cast to its dtype; here each file tensor takes the same two casts."""
    from peft import set_peft_model_state_dict  # lazy: optional extra peft

    p = Path(path)
    check_adapter_dir(p)
    params = {n: q for n, q in model.named_parameters() if "lora_" in n}
    state = load_file(str(p / ADAPTER_WEIGHTS))
    dtypes = {q.dtype for q in params.values()}
    loaded = torch.float32 if dtypes <= {torch.float16, torch.bfloat16} else None  # (peft's autocast_adapter_dtype)
    if loaded is not None:
        state = {k: t.to(loaded) for k, t in state.items()}
    before = adapter_weights(model)
    try:
        with torch.no_grad():
            for q in params.values():
                q.data = torch.empty_like(q.data)
            with _peft_quiet():
                result = set_peft_model_state_dict(model, state)
        _check_fit(result, p / ADAPTER_WEIGHTS, "the adapters of the base it shares")
        return adapter_weights(model)
    finally:  # the model as it was: the caller puts the new ones in place when it uses them
        use_adapter_weights(model, before)


def use_adapter_weights(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Put the adapter tensors ``weights`` (:func:`adapter_weights`, :func:`read_adapter_weights` of ``model``) in
    place in ``model``: its parameters then hold them (no copy; the modules and their paths stay as they are)."""
    params = dict(model.named_parameters())
    for n, t in weights.items():
        params[n].data = t
