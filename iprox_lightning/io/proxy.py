"""The proxy directory: the only reader and writer of a saved IProX proxy.

Layout (:data:`MANIFEST_VERSION` 2)::

    config.json (+ generation_config.json)   # the target architecture (a plain Hugging Face config)
    tokenizer files
    iprox_proxy.safetensors                   # every weight, the LowRankLinear factors ``<layer>.A`` / ``.B`` included
    iprox_proxy.json                          # manifest: format_version, target model, settings, per-layer ranks,
                                              # parameter counts, fingerprint of the weights file (and, for
                                              # ``drop_blocks``, "block_drop": removed blocks + their importance)
    README.md                                 # how to load it

A proxy loads as a proxy or not at all:

* :func:`load_proxy` rebuilds the architecture from ``config.json``, replaces each manifest layer by a
  ``LowRankLinear`` of the recorded rank, checks the weights file's tensor names and shapes against that
  model **before** loading (missing / unexpected tensors, a rank that disagrees with the factors, a layer
  the config does not have: each a :class:`ProxyFormatError` naming the file, tensor and shapes), then
  loads strictly. The weights file must also be the one saved with the manifest (its size and SHA-256, recorded
  in ``"weights"``) and hold every floating tensor in the manifest's ``dtype``: a replaced, cut-short or converted
  file is a :class:`ProxyFormatError` naming the file and the expected vs found digest / dtype.
  Nothing is unpickled; ``trust_remote_code`` is never used.
* Plain ``AutoModelForCausalLM.from_pretrained(proxy_dir)`` fails loudly: the weights are not in a file
  transformers reads (``model.safetensors``), so it cannot return a model with randomly initialised
  projections; ``config.json``'s ``transformers_weights`` (:data:`FROM_PRETRAINED_NOTE`) makes transformers' error
  say to use :func:`load_proxy` or :func:`export_proxy`. (Writing dense ``A·B`` products instead would load, but as
  a *different* model: the gradients of a dense layer are not the proxy's factor gradients; :func:`export_proxy`
  writes such a model, for other tools, to another directory.)
* :func:`check_not_a_bare_proxy` lets the generic loader refuse a directory whose weights hold factor
  tensors but whose manifest is missing.

Version 1 directories (weights in ``model.safetensors``, written by ``save_pretrained`` or the first
``save_proxy``) load through the same checked path (:func:`load_proxy`: missing / unexpected tensors are a
:class:`ProxyFormatError`), with a warning: transformers *does* read ``model.safetensors``, so plain
``from_pretrained`` on such a directory returns random projections. :func:`upgrade_proxy` (``python -m
iprox_lightning.io.proxy upgrade <dir>``) re-saves it as version 2 in place, after which plain
``from_pretrained`` fails loudly.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from ..engine.lowrank import LowRankLinear
from ..engine.target_layers import (
    count_parameters, is_compressed, linear_shape, linear_weight, lowrank_layers, set_submodule,
)
from ..errors import InputNotFoundError, OutputExistsError, UserInputError
from .atomic import atomic_path, write_text_atomic
from .fingerprint import file_identity, sort_safetensors_metadata
from .jsonfile import Fields, read_json, read_safetensors_header, write_json
from .ownership import make_owned_dir

log = logging.getLogger(__name__)

PROXY_MANIFEST = "iprox_proxy.json"
PROXY_WEIGHTS = "iprox_proxy.safetensors"
LEGACY_WEIGHTS = "model.safetensors"  # format_version 1
MANIFEST_VERSION = 2
_FACTOR = re.compile(r"\.(A|B)$")

README = """# IProX proxy

This directory is an IProX proxy (low-rank factors `A`, `B` replace the attention/MLP projections).
Load it with

```python
import iprox_lightning as ipx
proxy, tok = ipx.load_proxy("{path}")      # or ipx.load_model("{path}")
```

`AutoModelForCausalLM.from_pretrained` cannot load it (the factors are not transformers weights), on
purpose: it would silently return random projections. `iprox_proxy.json` records the ranks and settings.
For other tools, export a dense Hugging Face model (same logits): `python -m iprox_lightning.io.proxy export {path} OUT`.
"""


class ProxyFormatError(UserInputError):
    """A proxy directory that cannot be loaded as the proxy it claims to be."""


def weights_file(path: str | Path) -> Path | None:
    p = Path(path)
    for name in (PROXY_WEIGHTS, LEGACY_WEIGHTS):
        if (p / name).is_file():
            return p / name
    return None


def tensor_shapes(file: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from a safetensors header (no tensor is read)."""
    with safe_open(str(file), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def tensor_dtypes(file: str | Path) -> dict[str, str]:
    """``{name: dtype}`` from a safetensors header, as torch dtype names (``"float32"``); unknown codes as written."""
    with safe_open(str(file), framework="pt") as f:
        return {k: _ST_DTYPES.get(f.get_slice(k).get_dtype(), f.get_slice(k).get_dtype()) for k in f.keys()}


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
MANIFEST_DTYPES = ("float32", "float16", "bfloat16", "float64")
"""The floating dtypes a proxy's weights may be stored in (the manifest's ``dtype``)."""


def _metadata(file: Path) -> dict:
    with safe_open(str(file), framework="pt") as f:
        return dict(f.metadata() or {})


def is_proxy_dir(path: str | Path) -> bool:
    """True for a directory holding a proxy manifest or proxy weights."""
    p = Path(path)
    return p.is_dir() and ((p / PROXY_MANIFEST).is_file() or (p / PROXY_WEIGHTS).is_file())


def check_not_a_bare_proxy(path: str | Path) -> None:
    """Raise :class:`ProxyFormatError` when ``path`` holds proxy weights (factor tensors ``<layer>.A`` /
    ``.B``, or the proxy weights file) but no ``iprox_proxy.json``: transformers would load such a
    directory with randomly initialised projections."""
    p = Path(path)
    if not p.is_dir() or (p / PROXY_MANIFEST).is_file():
        return
    if (p / PROXY_WEIGHTS).is_file():
        raise ProxyFormatError(f"{p}: holds {PROXY_WEIGHTS} but no {PROXY_MANIFEST}: it is an IProX proxy without "
                               "its manifest (ranks, settings) and cannot be loaded; copy the manifest back or "
                               "rebuild the proxy")
    files = sorted(p.glob("*.safetensors"))
    for f in files:
        try:
            names = tensor_shapes(f)
            meta = _metadata(f)
        except Exception:  # not a readable safetensors file: leave the error to transformers
            continue
        factors = sorted(n for n in names if _FACTOR.search(n))
        if factors or "iprox_proxy" in meta:
            raise ProxyFormatError(
                f"{f}: holds {len(factors)} low-rank factor tensor(s) (e.g. {factors[:2]}) but {p} has no "
                f"{PROXY_MANIFEST}: loading it as a plain model would give randomly initialised projections; "
                "copy the manifest back or rebuild the proxy")


# ----------------------------------------------------------------------------------------------- save
def build_manifest(model: nn.Module, report: Any = None, **extra: Any) -> dict:
    """The ``iprox_proxy.json`` content: per-layer shapes/ranks read from ``model`` plus the compression
    settings and parameter counts of ``report`` (a ``CompressionReport`` — any fields of its ``to_dict()`` —
    or a dict) and any ``extra`` keys."""
    layers = {}
    for name, m in lowrank_layers(model).items():
        layers[name] = {"rank": m.rank, "in_features": m.in_features, "out_features": m.out_features,
                        "bias": m.bias is not None}
    info: dict[str, Any] = {}
    if hasattr(report, "to_dict"):  # a CompressionReport
        d = report.to_dict()
        layer_info = {lr["name"]: lr for lr in d.pop("layers", [])}
        for name, entry in layers.items():
            if name in layer_info:
                entry.update({k: layer_info[name][k] for k in ("mode", "objective", "objective_dense", "time_s")
                              if k in layer_info[name]})
        info.update(d)
    elif report is not None:
        info.update(dict(report))
    info.update(extra)
    for k in ("format_version", "layers", "dtype", "params_after", "weights"):  # always recomputed here
        info.pop(k, None)
    target = info.pop("target_model", None) or getattr(getattr(model, "config", None), "_name_or_path", None) or None
    first = next(model.parameters(), None)
    return {
        "format_version": MANIFEST_VERSION,
        "target_model": target,
        **info,
        "dtype": str(first.dtype).replace("torch.", "") if first is not None else None,
        "params_after": count_parameters(model),
        "layers": layers,
    }


def save_proxy(model: nn.Module, tokenizer: Any, path: str | Path, manifest: Any = None, **extra: Any) -> Path:
    """Write a proxy directory (module docstring). ``manifest`` is the ``CompressionReport`` (or a dict) of
    the compression; ``extra`` keys (e.g. ``target_model="HuggingFaceTB/SmolLM2-135M-Instruct"``) are added
    to the manifest."""
    path = Path(path)
    if not is_compressed(model):
        raise ValueError("save_proxy: the model holds no LowRankLinear layer (compress it first)")
    make_owned_dir(path, "proxy")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("save_proxy needs a Hugging Face model with a .config")
    config.save_pretrained(path)
    add_from_pretrained_note(path)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(path)
        except Exception as e:  # an invalid generation config must not lose the proxy
            log.warning("could not save generation config: %s", e)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    (path / LEGACY_WEIGHTS).unlink(missing_ok=True)  # never leave a file transformers would load

    with atomic_path(path / PROXY_WEIGHTS) as tmp:
        save_model(model, str(tmp), metadata={"format": "pt", "iprox_proxy": str(MANIFEST_VERSION)})
        sort_safetensors_metadata(tmp)  # a re-built identical proxy has the same weights digest
    man = build_manifest(model, manifest, **extra)
    man["weights"] = {"file": PROXY_WEIGHTS, **file_identity(path / PROXY_WEIGHTS, hash_limit=None)}

    write_json(path / PROXY_MANIFEST, man, default=float, newline=True)
    write_text_atomic(path / "README.md", README.format(path=path))
    return path


# ----------------------------------------------------------------------------------------------- load
def read_manifest(path: str | Path) -> dict:
    """The ``iprox_proxy.json`` of a proxy directory (validated: a JSON object with ``layers``)."""
    man_file = Path(path) / PROXY_MANIFEST
    if not man_file.is_file():
        raise InputNotFoundError(f"{man_file} not found: {path} is not an IProX proxy directory")

    manifest = read_json(man_file, error=ProxyFormatError, what="proxy manifest")
    f = Fields(man_file, ProxyFormatError)
    if not isinstance(manifest.get("layers"), dict):
        raise ProxyFormatError(f"{man_file}: malformed manifest (no 'layers' object)")
    dtype = manifest.get("dtype")
    if dtype is not None and dtype not in MANIFEST_DTYPES:
        raise ProxyFormatError(f"{man_file}: 'dtype' is {dtype!r}; a proxy's weights are one of {list(MANIFEST_DTYPES)}")
    version = manifest.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ProxyFormatError(f"{man_file}: 'format_version' is {version!r}, not an integer")
    if version > MANIFEST_VERSION:
        raise ProxyFormatError(f"{man_file}: format_version {manifest['format_version']} is newer than this "
                               f"iprox_lightning reads ({MANIFEST_VERSION})")
    f.get(manifest, "format_version", "int", minimum=1, default=None)
    for name, spec in manifest["layers"].items():
        if not isinstance(spec, dict):
            raise ProxyFormatError(f"{man_file}: layer {name!r} is {spec!r}, not an object with rank / in_features / "
                                   "out_features")
        f.get(spec, "bias", "bool", at=f"layers.{name}", default=None)
    weights = f.get(manifest, "weights", "object|null", default=None)
    if weights is not None:
        f.get(weights, "size", "int|null", at="weights", minimum=0, default=None)
        sha = f.get(weights, "sha256", "str|null", at="weights", default=None)
        if sha is not None and not re.fullmatch(r"[0-9a-f]{16,64}", sha):
            raise f.fail("weights.sha256", f"is {sha!r}, not a hex SHA-256 digest")
    bd = f.get(manifest, "block_drop", "object|null", default=None)
    if bd is not None:
        f.get(bd, "num_blocks_before", "int", at="block_drop", minimum=1)
        for j, b in enumerate(f.get(bd, "dropped", "list", at="block_drop")):
            f.check(f"block_drop.dropped[{j}]", b, "int", minimum=0)
    return manifest


def read_config(path: str | Path) -> Any:
    """The transformers config of a proxy directory's ``config.json``, or a :class:`ProxyFormatError` naming the file
    (cut short, not JSON, no ``model_type``, a field of the wrong type) instead of transformers' own error."""
    from transformers import AutoConfig  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise InputNotFoundError(f"{cfg_file} not found (the proxy's architecture)")
    Fields(cfg_file, ProxyFormatError).get(read_json(cfg_file, error=ProxyFormatError, what="the proxy's architecture"),
                                           "model_type", "str")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers' validation: a field of the wrong type or value, an unknown model_type
        first = (str(e).strip().splitlines() or [""])[0]
        raise ProxyFormatError(f"{cfg_file}: not a config transformers can build ({type(e).__name__}: {first})") \
            from None


def _check_tensors(model: nn.Module, weights: Path, man_file: Path, layers: Mapping[str, dict]) -> None:
    """Compare the weights file's header with the model built from config + manifest, before loading."""
    read_safetensors_header(weights, error=ProxyFormatError)  # sizes against the file, naming it
    try:
        have = tensor_shapes(weights)
        have_dtypes = tensor_dtypes(weights)
    except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
        raise ProxyFormatError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {e}); "
                               f"{weights.stat().st_size} bytes") from None
    state = model.state_dict()
    want = {k: tuple(v.shape) for k, v in state.items()}
    # tied weights (e.g. lm_head tied to the embeddings) are saved once
    tied = {k for k in want if k not in have and _is_tied(model, k, have)}
    for name, spec in layers.items():
        r = int(spec["rank"])
        for fac, shape in ((f"{name}.A", (spec["out_features"], r)), (f"{name}.B", (r, spec["in_features"]))):
            if fac in have and have[fac] != tuple(shape):
                raise ProxyFormatError(
                    f"{man_file}: layer {name!r} has rank {r} in the manifest, but {weights.name} holds {fac} with "
                    f"shape {list(have[fac])} (expected {list(shape)}): the manifest and the weights disagree")
    missing = sorted(k for k in want if k not in have and k not in tied)
    unexpected = sorted(k for k in have if k not in want)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s) {missing[:5]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensor(s) {unexpected[:5]}")
        raise ProxyFormatError(f"{weights}: does not match the proxy described by {man_file.name} and config.json: "
                               + "; ".join(parts) + " — refusing to load with randomly initialised or ignored weights")
    for k, shape in want.items():
        if k in have and have[k] != shape:
            raise ProxyFormatError(f"{weights}: tensor {k} has shape {list(have[k])}, the model built from config.json "
                                   f"expects {list(shape)}")
    wrong = sorted(k for k in have if state[k].is_floating_point() and have_dtypes[k] != _dtype_name(state[k].dtype))
    if wrong:
        k = wrong[0]
        raise ProxyFormatError(f"{weights}: {len(wrong)} tensor(s) stored as another dtype than the {man_file.name} "
                               f"records ({_dtype_name(state[k].dtype)}), e.g. {k}: {have_dtypes[k]} — refusing to "
                               "convert them silently")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_weights_digest(weights: Path, manifest: Mapping[str, Any], man_file: Path) -> None:
    """The weights file is the one saved with the manifest: its size and SHA-256 (as recorded in ``"weights"``;
    older manifests of large files recorded size and mtime: size only)."""
    rec = manifest.get("weights")
    if not isinstance(rec, Mapping):
        return
    size = weights.stat().st_size
    if rec.get("size") is not None and int(rec["size"]) != size:
        raise ProxyFormatError(f"{weights}: {size} bytes, but {man_file.name} records {rec['size']} bytes for the "
                               "proxy's weights: the file was replaced or cut short after the proxy was saved")
    want = rec.get("sha256")
    if want:
        found = file_identity(weights, hash_limit=None)["sha256"]
        if found[:len(want)] != want[:len(found)]:
            raise ProxyFormatError(f"{weights}: sha256 {found} differs from {want} recorded in {man_file.name}: the "
                                   "weights are not the ones saved with this manifest (re-save the proxy, or restore "
                                   "the file)")


def _is_tied(model: nn.Module, key: str, have: Mapping[str, Any]) -> bool:
    sd = model.state_dict(keep_vars=True)  # the parameters themselves: tied ones are one object (also on "meta")
    t = sd[key]
    return any(k in have and sd[k] is t for k in sd if k != key)


def _check_block_drop(config: Any, manifest: Mapping[str, Any], man_file: Path) -> None:
    """A proxy compressed with ``drop_blocks`` (manifest ``"block_drop"``: the original indices of the removed
    blocks) must have a ``config.json`` with that many fewer decoder blocks."""
    bd = manifest.get("block_drop")
    if bd is None:
        return
    if not isinstance(bd, Mapping) or not isinstance(bd.get("dropped"), list) or "num_blocks_before" not in bd:
        raise ProxyFormatError(f"{man_file}: malformed 'block_drop' (needs 'dropped' and 'num_blocks_before')")
    want = int(bd["num_blocks_before"]) - len(bd["dropped"])
    have = getattr(config, "num_hidden_layers", None)
    if have != want:
        raise ProxyFormatError(f"{man_file}: blocks {bd['dropped']} of {bd['num_blocks_before']} were dropped, so the "
                               f"proxy has {want} decoder blocks, but config.json says num_hidden_layers={have}")


def _swap_in_factor_layers(model: nn.Module, layers: dict, man_file: Path) -> None:
    """Replace each manifest layer of ``model`` by a ``LowRankLinear`` of the recorded rank (shapes checked)."""
    for name, spec in layers.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ProxyFormatError(f"{man_file}: layer {name!r} does not exist in the {type(model).__name__} built "
                                   "from config.json") from None
        out_f, in_f = linear_shape(old)
        if (out_f, in_f) != (spec["out_features"], spec["in_features"]):
            raise ProxyFormatError(f"{man_file}: layer {name!r} is {out_f}x{in_f} in the model but "
                                   f"{spec['out_features']}x{spec['in_features']} in the manifest")
        w = linear_weight(old)
        new = LowRankLinear(in_f, out_f, int(spec["rank"]), bias=bool(spec.get("bias", False)), dtype=w.dtype)
        set_submodule(model, name, new)


def load_proxy(path: str | Path, *, attn_implementation: str = "eager", dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> tuple[nn.Module, Any]:
    """Rebuild a proxy saved by :func:`save_proxy`: the architecture from ``config.json``, the
    ``LowRankLinear`` layers of the recorded ranks, the weights file checked against them, then loaded
    strictly. Returns ``(model in eval mode, tokenizer or None when the directory holds none)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)
    from transformers.initialization import no_init_weights  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    path = Path(path)
    man_file = path / PROXY_MANIFEST
    if not man_file.is_file():
        check_not_a_bare_proxy(path)
    manifest = read_manifest(path)
    layers = manifest["layers"]
    weights = weights_file(path)
    if weights is None:
        raise InputNotFoundError(f"{path / PROXY_WEIGHTS} not found (proxy weights)")
    for name, spec in layers.items():
        miss = [k for k in ("rank", "in_features", "out_features") if k not in spec]
        if miss:
            raise ProxyFormatError(f"{man_file}: layer {name!r} lacks field(s) {miss}")
        bad = {k: spec[k] for k in ("rank", "in_features", "out_features")
               if isinstance(spec[k], bool) or not isinstance(spec[k], int) or spec[k] < 1}
        if bad:
            raise ProxyFormatError(f"{man_file}: layer {name!r}: {bad} must be positive integers")
    config = read_config(path)
    _check_block_drop(config, manifest, man_file)
    build_dtype = getattr(torch, str(manifest.get("dtype") or "float32"))  # one of MANIFEST_DTYPES (read_manifest)

    def build(on_meta: bool) -> nn.Module:
        # every tensor is overwritten by the strict load below: skip the random initialisation (a second of CPU per
        # 100M parameters, the dense model's and the factors')
        with no_init_weights(), (torch.device("meta") if on_meta else contextlib.nullcontext()):
            m = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=build_dtype)
            _swap_in_factor_layers(m, layers, man_file)
        m.tie_weights()  # tied input/output embeddings (skipped with the initialisation)
        return m

    # first without memory: config.json's sizes (vocab_size, hidden_size, ...) are checked against the weights file's
    # header before a model of that size is allocated (a vocab_size of 1e12 asked for 64 TB)
    _check_tensors(build(on_meta=True), weights, man_file, layers)
    model = build(on_meta=False)
    _check_tensors(model, weights, man_file, layers)
    if weights.name == PROXY_WEIGHTS:
        _check_weights_digest(weights, manifest, man_file)
    missing, unexpected = load_model(model, str(weights), strict=True)
    if missing or unexpected:  # strict=True raises already; defensive
        raise ProxyFormatError(f"{weights}: missing {missing}, unexpected {unexpected}")
    if weights.name == LEGACY_WEIGHTS:
        log.warning("%s", legacy_message(path))
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    tok = None
    if (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(path)
    return model.eval(), tok


def legacy_message(path: str | Path) -> str:
    return (f"{path}: a version-1 proxy directory (weights in {LEGACY_WEIGHTS}). It loaded through the checked "
            f"proxy loader, but plain AutoModelForCausalLM.from_pretrained on it would return randomly initialised "
            f"projections; re-save it as version 2 with `python -m iprox_lightning.io.proxy upgrade {path}`")


def upgrade_proxy(path: str | Path) -> Path:
    """Re-save a version-1 proxy directory as version 2, in place: the weights are loaded through
    :func:`load_proxy` (checked against config + manifest), written to ``iprox_proxy.safetensors`` with the
    manifest updated (format_version, weights fingerprint; the recorded settings kept), verified to load back
    identically, and only then ``model.safetensors`` is removed (so plain ``from_pretrained`` fails instead of
    returning random projections). A version-2 directory is left as it is, except that its ``config.json``
    gets the :data:`FROM_PRETRAINED_NOTE` if it lacks it. Returns ``path``."""
    path = Path(path)
    weights = weights_file(path)
    if weights is None or weights.name != LEGACY_WEIGHTS or (path / PROXY_WEIGHTS).is_file():
        if (path / PROXY_WEIGHTS).is_file() and (path / LEGACY_WEIGHTS).is_file():
            raise ProxyFormatError(f"{path}: holds both {PROXY_WEIGHTS} and {LEGACY_WEIGHTS}; remove the one that "
                                   "is not the proxy's weights")
        read_manifest(path)  # a readable version-2 proxy, or a clear error
        add_from_pretrained_note(path)  # directories saved before the note existed
        return path
    manifest = read_manifest(path)
    model, tok = load_proxy(path)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    extra = {k: v for k, v in manifest.items() if k not in ("format_version", "layers", "dtype", "params_after", "weights")}
    legacy = path / LEGACY_WEIGHTS
    moved = legacy.with_name(LEGACY_WEIGHTS + ".v1-upgrading")
    old_manifest = (path / PROXY_MANIFEST).read_text()
    legacy.rename(moved)  # kept until the new file is verified; transformers does not read this name
    try:
        save_proxy(model, tok, path, manifest=None, **extra)
        again, _ = load_proxy(path)
        after = again.state_dict()
        if set(after) != set(before) or any(not torch.equal(after[k], before[k]) for k in before):
            raise ProxyFormatError(f"{path}: the re-saved weights do not load back identically; {LEGACY_WEIGHTS} kept")
    except Exception:
        (path / PROXY_WEIGHTS).unlink(missing_ok=True)
        write_text_atomic(path / PROXY_MANIFEST, old_manifest)
        moved.rename(legacy)
        raise
    moved.unlink()
    log.info("%s: upgraded to proxy format_version %d", path, MANIFEST_VERSION)
    return path


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m iprox_lightning.io.proxy",
                                 description="IProX proxy directories: upgrade a version-1 directory in place, or export a proxy as a dense Hugging Face model.",
                                 epilog="--debug (anywhere) shows the traceback of an error otherwise reported in one line.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("upgrade", help="re-save version-1 proxy directories (model.safetensors) as version 2")
    up.add_argument("paths", nargs="+", help="proxy directories")
    ex = sub.add_parser("export", help="write a dense Hugging Face model (each A·B as one weight) that plain "
                                       "AutoModelForCausalLM.from_pretrained loads")
    ex.add_argument("proxy", help="the proxy directory")
    ex.add_argument("output", help="the directory to write (must not exist or be empty, unless --overwrite true)")
    ex.add_argument("--dtype", default=None, help="dtype of the exported weights (default: the proxy's)")
    ex.add_argument("--overwrite", nargs="?", const="true", default="false", choices=["true", "false"],
                    help="replace the contents of a non-empty output directory")
    args = ap.parse_args(argv)
    if args.cmd == "export":
        out = export_proxy(args.proxy, args.output, dtype=args.dtype, overwrite=args.overwrite == "true")
        print(f"{args.proxy}: exported as a dense Hugging Face model to {out} "
              f"(AutoModelForCausalLM.from_pretrained loads it; provenance in {out}/iprox_export.json)")
        return
    for p in args.paths:
        upgrade_proxy(p)
        print(f"{p}: proxy format_version {MANIFEST_VERSION} ({PROXY_WEIGHTS}); plain from_pretrained now refuses it")


FROM_PRETRAINED_NOTE = (
    "not a transformers checkpoint: this directory is an IProX proxy, whose low-rank factors (iprox_proxy.safetensors) "
    "are not weights transformers can load. Load it with iprox_lightning.load_proxy(<this directory>) (or "
    "iprox_lightning.load_model), or write a dense Hugging Face model that from_pretrained loads: "
    "`python -m iprox_lightning.io.proxy export <this directory> <output directory>` "
    "(or `python train.py export_proxy --proxy <this directory> --output <output directory>`)")
"""Written as ``transformers_weights`` into a proxy's ``config.json``. transformers (>= 4.53) reads that key as the
name of the weights file and, as it is not a ``*.safetensors`` name, raises a ``ValueError`` that quotes it: plain
``from_pretrained(proxy_dir)`` then says what to do instead of "no file named model.safetensors". ``load_proxy``
ignores it; ``save_pretrained`` drops it (transformers never writes the key back)."""


def add_from_pretrained_note(path: str | Path) -> None:
    """Put :data:`FROM_PRETRAINED_NOTE` into ``path/config.json`` (``transformers_weights``), if not already there."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return

    cfg = read_json(cfg_file, error=ProxyFormatError, what="the proxy's architecture")
    if cfg.get("transformers_weights") == FROM_PRETRAINED_NOTE:
        return
    cfg["transformers_weights"] = FROM_PRETRAINED_NOTE

    write_json(cfg_file, cfg, sort_keys=True, newline=True)


def export_proxy(path: str | Path, output: str | Path, *, dtype: str | torch.dtype | None = None,
                 overwrite: bool = False) -> Path:
    """Write the proxy at ``path`` as a dense Hugging Face model to ``output`` (:mod:`.proxy_export`): each
    ``LowRankLinear`` as one layer with weight ``A @ B``, saved with ``save_pretrained`` (safetensors) plus the
    tokenizer and ``iprox_export.json`` (the proxy's path, manifest and weights digests). The proxy is loaded through
    :func:`load_proxy` (all its checks); the export is loaded back with ``from_pretrained`` and its logits compared
    with the proxy's before it is moved into place. ``dtype``: of the exported weights (default: the proxy's).
    Refuses ``output`` == ``path`` (or inside / around it), an existing proxy directory, and a non-empty directory
    unless ``overwrite``. Returns ``output``."""
    from .proxy_export import check_export_target, write_export  # lazy: a cached plan loads no transformers (test_plan_memory)

    path, output = Path(path), Path(output)
    check_export_target(path, output, overwrite=overwrite)
    if is_proxy_dir(output):
        raise OutputExistsError(f"export: the output {output} is an IProX proxy directory; refusing to replace a proxy "
                                "with an export (choose another directory)")
    manifest = read_manifest(path)
    model, tok = load_proxy(path)
    return write_export(model, tok, path, output, manifest, dtype=dtype, overwrite=overwrite)


if __name__ == "__main__":  # pragma: no cover
    from ..errors import run_command_line

    run_command_line(_main)
