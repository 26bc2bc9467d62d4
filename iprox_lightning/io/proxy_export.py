"""Dense export of a proxy: a plain Hugging Face model that ``AutoModelForCausalLM.from_pretrained`` loads.

Every ``LowRankLinear`` of a loaded proxy becomes the layer the architecture has there (``nn.Linear``, or GPT-2's
``Conv1D`` with the transposed weight) holding ``W = A @ B`` (the product is taken in float64, then cast to the
export's dtype) and the layer's bias; every other weight is copied. The dense model is built from the proxy's
``config.json`` and loaded **strictly**, so the saved ``model.safetensors`` holds exactly the tensors
``from_pretrained`` expects. Before the export is moved into place it is loaded back with ``from_pretrained`` (no
missing / unexpected / mismatched tensor) and its logits are compared with the proxy's on a fixed token sequence.

The export gives the proxy's *outputs* to any Hugging Face tool. It is not the proxy for scoring: the gradients of a
dense ``W`` are not the factor gradients the proxy's influence scores use (score the proxy directory for those).
``iprox_export.json`` in the export records the proxy it came from (path, SHA-256 of its manifest, the manifest's
weights digest, target model, ranks) and the load-back check.

The entry point is :func:`iprox_lightning.io.proxy.export_proxy` (it loads the proxy through the checked
:func:`~iprox_lightning.io.proxy.load_proxy`); this module does the conversion and the writing.
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from ..engine.target_layers import conv1d_class, count_parameters, lowrank_layers
from ..errors import OutputExistsError, UserInputError
from .atomic import named_os_errors, write_text_atomic
from .fingerprint import file_identity
from .jsonfile import read_json, write_json
from .output_guard import check_output_not_input, same_file
from .ownership import check_owned, mark

log = logging.getLogger(__name__)

EXPORT_RECORD = "iprox_export.json"
EXPORT_VERSION = 1
EXPORT_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
"""The ``dtype`` names an export accepts (default: the proxy's own dtype)."""
CHECK_TOKENS = 16
"""Length of the token sequence on which the export's logits are compared with the proxy's."""

README = """# Dense export of an IProX proxy

Every low-rank projection `A·B` of the proxy `{proxy}` is one dense weight here, so any Hugging Face tool loads it:

```python
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained("{out}")
```

It computes the proxy's outputs (logits checked against the proxy on export; `{record}` records the proxy, its
manifest digest and the check). It is *not* the proxy for influence scoring: the gradients of a dense weight are
not the proxy's factor gradients; score with the proxy directory (`iprox_lightning.load_proxy`) for those.
"""


def resolve_export_dtype(dtype: str | torch.dtype | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in EXPORT_DTYPES.values():
            raise UserInputError(f"export dtype {dtype} is not a floating dtype; use one of {sorted(EXPORT_DTYPES)}")
        return dtype
    try:
        return EXPORT_DTYPES[str(dtype).lower().replace("torch.", "")]
    except KeyError:
        raise UserInputError(f"unknown export dtype {dtype!r}; use one of {sorted(EXPORT_DTYPES)}") from None


def check_export_target(proxy_dir: str | Path, output: str | Path, *, overwrite: bool = False) -> None:
    """Refuse an output that is the proxy directory, lies inside it or contains it (by device and inode), is a
    file or a symbolic link, or is a non-empty directory (unless ``overwrite``, and then only a previous export:
    marked by the package as a ``proxy export`` (:mod:`.ownership`) and holding nothing but an export's files)."""
    src = Path(proxy_dir).expanduser().resolve()
    out = Path(output).expanduser().absolute()
    if same_file(out, src) or out.resolve() == src:
        raise UserInputError(f"export: the output {output} is the proxy directory itself; write the dense model to "
                             "another directory (the proxy stays as it is)")
    check_output_not_input(out, {"proxy": src}, "export: the output", replaced_whole=True)
    if out.is_symlink():
        raise OutputExistsError(f"export: the output {output} is a symbolic link; name a directory itself (the "
                                "export replaces the output, and deletes nothing through a link)")
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"export: the output {output} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"export: the output {output} exists and is not empty; pass --overwrite true "
                                "(overwrite=True) to replace its contents, or choose another directory")
    if out.is_dir() and overwrite and not (out / "iprox_proxy.json").exists():  # a proxy: refused below, by name
        foreign = sorted(f.name + ("/" if f.is_dir() else "") for f in out.iterdir() if not _export_file(f))
        if foreign:
            raise OutputExistsError(
                f"export: --overwrite replaces a previous export only, and {output} also holds {len(foreign)} other "
                f"file(s): {', '.join(foreign[:8])}{' ...' if len(foreign) > 8 else ''}; move them or choose another "
                "directory")
        check_owned(out, "proxy export", option="export_proxy --overwrite true",
                    what="a previous export is replaced only when the package marked it as one")


_EXPORT_FILES = ("config.json", "generation_config.json", "README.md", EXPORT_RECORD, "chat_template.jinja",
                 "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.json", "tokenizer.model",
                 ".iprox-dir.json")  # the last: the package's marker (io/ownership.py)


def _export_file(path: Path) -> bool:
    """Whether ``path`` is a file an export writes (the dense model, its config and tokenizer, the record)."""
    n = path.name
    return path.is_file() and (n in _EXPORT_FILES or n.startswith(("model", "tokenizer")) and
                               n.endswith((".safetensors", ".json", ".model")))


def _reference_modules(config: Any) -> dict[str, type]:
    """``{module name: class}`` of the architecture ``config`` describes (built on the meta device: no memory)."""
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    return {n: m for n, m in ref.named_modules()}


def dense_state_dict(proxy: nn.Module, dtype: torch.dtype, reference: Mapping[str, nn.Module]) -> dict[str, torch.Tensor]:
    """The state dict of the dense model: each ``LowRankLinear`` ``<name>`` as ``<name>.weight = A @ B`` (in the
    layout of the ``reference`` module at ``<name>``: ``[out, in]`` for ``nn.Linear``, ``[in, out]`` for
    ``Conv1D``) and ``<name>.bias`` (zeros when the architecture has a bias the proxy layer lacks); every other
    tensor copied; all cast to ``dtype``."""
    low = lowrank_layers(proxy)
    out: dict[str, torch.Tensor] = {}
    for key, t in proxy.state_dict().items():
        layer = key.rpartition(".")[0]
        if layer not in low:
            out[key] = t.detach().to(dtype).clone() if t.is_floating_point() else t.detach().clone()
    for name, m in low.items():
        ref = reference.get(name)
        if ref is None:
            raise ValueError(f"export: layer {name!r} of the proxy does not exist in the architecture of its config.json")
        w = (m.A.detach().to(torch.float64) @ m.B.detach().to(torch.float64))
        conv = conv1d_class() is not None and isinstance(ref, conv1d_class())
        out[f"{name}.weight"] = (w.t() if conv else w).to(dtype).contiguous()
        ref_bias = getattr(ref, "bias", None) is not None
        if m.bias is not None and not ref_bias:
            raise ValueError(f"export: layer {name!r} has a bias in the proxy but the {type(ref).__name__} of its "
                             "architecture has none; the dense model could not hold it")
        if ref_bias:
            out[f"{name}.bias"] = (m.bias.detach().to(dtype).clone() if m.bias is not None
                                   else torch.zeros(m.out_features, dtype=dtype))
    return out


def dense_model(proxy: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A dense copy of ``proxy`` (:func:`dense_state_dict`) built from its config and loaded strictly."""
    config = copy.deepcopy(proxy.config)
    if hasattr(config, "transformers_weights"):  # the proxy dir's note for plain from_pretrained: not for the export
        delattr(config, "transformers_weights")
    state = dense_state_dict(proxy, dtype, _reference_modules(config))
    attn = getattr(config, "_attn_implementation", None) or "eager"
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    missing, unexpected = dense.load_state_dict(state, strict=False)
    tied = {k for k in missing if _tied_to_present(dense, k, state)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"export: the dense state does not match the architecture: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    if getattr(proxy, "generation_config", None) is not None:
        dense.generation_config = copy.deepcopy(proxy.generation_config)
    return dense.eval()


def _tied_to_present(model: nn.Module, key: str, state: Mapping[str, Any]) -> bool:
    sd = model.state_dict()
    return any(k in state and k != key and sd[k].data_ptr() == sd[key].data_ptr() for k in sd)


def _check_tokens(config: Any) -> torch.Tensor:
    vocab = int(getattr(config, "vocab_size", 0) or 0) or CHECK_TOKENS
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, CHECK_TOKENS), generator=gen)


@torch.no_grad()
def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids.to(next(model.parameters()).device)).logits.float().cpu()


def write_export(proxy: nn.Module, tokenizer: Any, proxy_dir: str | Path, output: str | Path,
                 manifest: Mapping[str, Any], *, dtype: str | torch.dtype | None = None,
                 overwrite: bool = False) -> Path:
    """Write the dense export of ``proxy`` (loaded from ``proxy_dir``, whose manifest is ``manifest``) to
    ``output``: built in a temporary directory beside it, loaded back with ``from_pretrained`` and compared with
    the proxy, then moved into place (replacing ``output``'s contents only when ``overwrite``). Returns ``output``."""
    proxy_dir, output = Path(proxy_dir), Path(output)
    check_export_target(proxy_dir, output, overwrite=overwrite)
    first = next(proxy.parameters())
    out_dtype = resolve_export_dtype(dtype, first.dtype)
    layers = lowrank_layers(proxy)
    if not layers:
        raise ValueError(f"export: {proxy_dir} loaded without any LowRankLinear layer; nothing to export")
    if (proxy_dir / "generation_config.json").is_file():
        try:
            proxy.generation_config = GenerationConfig.from_pretrained(proxy_dir)
        except Exception as e:  # an invalid generation config must not stop the export
            log.warning("export: could not read %s: %s", proxy_dir / "generation_config.json", e)
    dense = dense_model(proxy, out_dtype)
    params = {"proxy": count_parameters(proxy), "export": count_parameters(dense)}

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.export-", dir=output.parent))
    try:
        mark(tmp, "proxy export")  # the marker keeps the folder's identity through the move into place
        with named_os_errors(output):  # safetensors' own error on a full disk: an OSError naming the output
            dense.save_pretrained(tmp)
            del dense
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        saved_config = read_json(tmp / "config.json", what="the export's config")
        if "transformers_weights" in saved_config:  # older transformers keep it on save: the export must not
            saved_config.pop("transformers_weights")
            write_json(tmp / "config.json", saved_config, sort_keys=True, newline=True)
        check = _check_round_trip(proxy, tmp, out_dtype, output)
        record = _export_record(proxy_dir, manifest, layers, out_dtype, params, tokenizer is not None, check)
        write_json(tmp / EXPORT_RECORD, record, newline=True)
        write_text_atomic(tmp / "README.md", README.format(proxy=proxy_dir, out=output, record=EXPORT_RECORD))
        _move_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s -> %s (%d layers densified, %s)", proxy_dir, output, len(layers), record["dtype"])
    return output


def _check_round_trip(proxy: nn.Module, tmp: Path, out_dtype: torch.dtype, output: Path) -> dict:
    """Load the dense model saved in ``tmp`` back the way a user will and compare its logits with the proxy's (at
    the export's precision when it is float32/64: then they must agree to 1e-4 relative; else only be finite);
    the check's record. Raises, saying nothing was written to ``output``, when they do not."""
    first = next(proxy.parameters())
    again, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=out_dtype, attn_implementation="eager",
                                                       output_loading_info=True)
    bad = {k: list(v)[:5] for k, v in info.items() if v}
    if bad:
        raise ValueError(f"export: from_pretrained of the dense model reports {bad}; nothing was written to {output}")
    ids = _check_tokens(again.config)
    strict = out_dtype in (torch.float32, torch.float64)
    ref_dtype = out_dtype if strict and out_dtype != first.dtype else first.dtype
    if ref_dtype != first.dtype:
        proxy = proxy.to(ref_dtype)  # exact upcast of the proxy: compare in the export's precision
    ref = _logits(proxy, ids)
    got = _logits(again, ids)
    del again
    diff = float((got - ref).abs().max())
    tol = 1e-4 * (1.0 + float(ref.abs().max()))
    if not torch.isfinite(got).all() or (strict and not diff <= tol):
        raise ValueError(f"export: the dense model's logits differ from the proxy's by up to {diff:.3g} "
                         f"(tolerance {tol:.3g}); nothing was written to {output}")
    return {"tokens": int(ids.shape[1]), "reference_dtype": str(ref_dtype).replace("torch.", ""),
            "max_abs_logit_diff": diff, "tolerance": tol if strict else None}


def _export_record(proxy_dir: Path, manifest: Mapping[str, Any], layers: Mapping[str, Any], out_dtype: torch.dtype,
                   params: dict, has_tokenizer: bool, check: dict) -> dict:
    """The export's record (``EXPORT_RECORD``): the proxy it came from (path, manifest identity, weights, ranks),
    its dtype, parameter counts and the round-trip check."""
    try:  # the installed package's version, without importing the package's root (io sits below it)
        __version__ = version("iprox_lightning")
    except PackageNotFoundError:
        __version__ = "unknown"

    man_file = proxy_dir / "iprox_proxy.json"
    return {
        "format_version": EXPORT_VERSION,
        "what": "dense export of an IProX proxy: each LowRankLinear replaced by one layer with weight A @ B",
        "proxy": {
            "path": str(proxy_dir.resolve()),
            "manifest": {"file": man_file.name, **file_identity(man_file, hash_limit=None)},
            "weights": manifest.get("weights"),
            "format_version": manifest.get("format_version", 1),
            "target_model": manifest.get("target_model"),
            "dtype": manifest.get("dtype"),
            "ranks": {name: m.rank for name, m in layers.items()},
            **({"block_drop": manifest["block_drop"]} if "block_drop" in manifest else {}),
        },
        "dtype": str(out_dtype).replace("torch.", ""),
        "layers_densified": len(layers),
        "params": params,
        "tokenizer": has_tokenizer,
        "check": check,
        "iprox_lightning": __version__,
    }


def _move_into_place(tmp: Path, output: Path) -> None:
    """``tmp`` becomes ``output``; a previous ``output`` (empty, or replaced by ``overwrite``) is removed only
    after the new one is in place."""
    old = None
    if output.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{output.name}.replaced-", dir=output.parent))
        os.replace(output, old / output.name)
    try:
        os.replace(tmp, output)
    except BaseException:
        if old is not None:
            os.replace(old / output.name, output)
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
