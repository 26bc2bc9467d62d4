"""Load a causal LM + tokenizer from a hub id, a local directory, a ``.gguf`` file, a saved IProX
proxy directory, or ``"builtin"`` (the offline demo model).

* GGUF files are dequantized to float by transformers (needs ``gguf``); the float model is cached
  as safetensors (``save_pretrained``) the first time, so the next load takes seconds. The cache
  lives in ``$IPROX_CACHE`` (default ``~/.cache/iprox_lightning``) under a key made of the file's
  name, size and a hash of its first and last MiB; it is written to a temporary directory and
  renamed atomically, so an interrupted first load never leaves a broken cache.
  A file that is not GGUF or is cut short stops with a ``ValueError`` naming it (:func:`check_gguf`).
* ``trust_remote_code`` is off unless the caller asks for it.
* A directory holding ``adapter_config.json`` is a peft adapter: its base model (``base_model_name_or_path``) loads
  through these same loaders and the adapters are merged into it (:mod:`.lora`); its weights are read from
  ``adapter_model.safetensors`` only.
* A directory holding ``iprox_proxy.json`` is an IProX proxy and goes through
  :func:`iprox_lightning.io.proxy.load_proxy`; a path to its manifest or weights file is refused with an error
  naming the directory, ``load_proxy`` and the dense export.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mmap
import os
import struct
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import InputNotFoundError, UserInputError
from ..io.atomic import atomic_path
from ..io.fingerprint import is_adapter_dir
from ..io.jsonfile import Fields, read_json, read_safetensors_header
from ..io.ownership import mark
from ..io.proxy import PROXY_MANIFEST, PROXY_WEIGHTS, check_not_a_bare_proxy, is_proxy_dir, load_proxy
from ..progress import progress
from .hub import check_model_source
from .lora import adapter_base, attach_saved_adapter, check_adapter_dir, merge

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "32": torch.float32, "32-true": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "bf16-true": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "16-true": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise UserInputError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def cache_root() -> Path:
    return Path(os.environ.get("IPROX_CACHE", Path.home() / ".cache" / "iprox_lightning"))


def _gguf_cache_key(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > (1 << 20):
            f.seek(max(size - (1 << 20), 0))
            h.update(f.read(1 << 20))
    return f"{path.stem}-{h.hexdigest()[:16]}"


def gguf_cache_dir(path: str | os.PathLike) -> Path:
    """Where the float safetensors copy of a GGUF file is (or will be) cached."""
    return cache_root() / "gguf" / _gguf_cache_key(Path(path))


def check_gguf(path: str | os.PathLike) -> int:
    """Refuse a GGUF file that cannot be read whole (truncated download, not GGUF) with a ``ValueError`` naming the
    file, before transformers fails deep inside its reader. Reads the header and tensor table only (memory-mapped);
    skipped when the ``gguf`` package is missing (transformers then says it needs it). Its metadata's sizes (layers,
    widths, heads, vocabulary) are bounded (:mod:`.bounds`). Returns the elements of its tensors."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise UserInputError(f"{p}: not a GGUF file (starts with {magic!r}, not b'GGUF'; {size} bytes)")
    _check_gguf_counts(p, size)
    try:
        return _scan_gguf(p, size)
    except _GGUFDamaged as e:
        raise UserInputError(f"{p}: not a readable GGUF file, truncated or damaged ({size} bytes; {e})") from None


GGUF_ARRAY_ENTRIES_PER_VOCAB = 8
"""Array entries (of every key-value array together) a GGUF may hold per row of its token embedding: a tokenizer's
tokens, scores and token types (one each per token) and merges (fewer than tokens) take about 4. The GGUF readers
keep over 1 KB of Python and numpy objects per entry, so a small file of many short strings (a 10 MB file, 700,000 of
them) took 1.3 GB before any check; beyond this bound (plus :data:`GGUF_ARRAY_ENTRIES_SLACK`) the file is refused."""
GGUF_ARRAY_ENTRIES_SLACK = 1 << 16
"""Array entries a GGUF may hold beyond :data:`GGUF_ARRAY_ENTRIES_PER_VOCAB` per vocabulary row (about 80 MB of
reader objects), for key-values other than the tokenizer's."""
_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GGUFDamaged(Exception):
    pass


def _scan_gguf(p: Path, size: int) -> None:
    """Walk the GGUF's key-values and tensor table as stored, without a reader: every declared string length and
    array count is checked against the bytes left in the file before anything is read for it, the array entries are
    bounded by the vocabulary (:data:`GGUF_ARRAY_ENTRIES_PER_VOCAB`), and the tensors must end inside the file. Each
    failure is a :class:`UserInputError` naming the file, the key or tensor, and the byte offset."""
    with open(p, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 24
        _, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)

        def need(n: int, what: str) -> None:
            if n < 0 or pos + n > size:
                raise _GGUFDamaged(f"{what} at byte {pos} needs {n} bytes, {max(size - pos, 0)} are left")

        def u32() -> int:
            nonlocal pos
            need(4, "a 4-byte field")
            pos += 4
            return struct.unpack_from("<I", mm, pos - 4)[0]

        def u64(what: str = "an 8-byte field") -> int:
            nonlocal pos
            need(8, what)
            pos += 8
            return struct.unpack_from("<Q", mm, pos - 8)[0]

        def string(what: str) -> str:
            nonlocal pos
            n = u64(f"the length of {what}")
            need(n, f"{what} ({n} bytes)")
            pos += n
            return bytes(mm[pos - n:pos]).decode("utf-8", "replace")

        entries = 0

        def value(vtype: int, key: str, depth: int = 0) -> int | None:
            nonlocal pos, entries
            if vtype in _GGUF_SCALARS:
                need(_GGUF_SCALARS[vtype], f"the value of {key!r}")
                pos += _GGUF_SCALARS[vtype]
                fmt = _GGUF_INTS.get(vtype)
                return struct.unpack_from(fmt, mm, pos - _GGUF_SCALARS[vtype])[0] if fmt else None
            if vtype == _GGUF_STRING:
                string(f"the string value of {key!r}")
                return None
            if vtype != _GGUF_ARRAY or depth > 1:
                raise _GGUFDamaged(f"key {key!r} has value type {vtype}, not a GGUF type")
            itype, count = u32(), u64(f"the length of array {key!r}")
            least = _GGUF_SCALARS.get(itype, 8 if itype == _GGUF_STRING else 12)
            need(count * least, f"array {key!r} of {count} entries")  # before a single entry is read
            entries += count
            if itype in _GGUF_SCALARS:
                pos += count * least
            else:
                for _ in range(count):
                    value(itype, key, depth + 1)
            return None

        alignment = 32
        sizes: dict[str, int] = {}
        for _ in range(n_kv):
            key = string("a key")
            got = value(u32(), key)
            if key == "general.alignment" and got:
                alignment = got
            if got is not None and _is_size_key(key):
                sizes[key] = got
        tensors = []
        for _ in range(n_tensors):
            name = string("a tensor name")
            n_dims = u32()
            if n_dims > 8:
                raise _GGUFDamaged(f"tensor {name!r} has {n_dims} dimensions")
            dims = [u64(f"a dimension of tensor {name!r}") for _ in range(n_dims)]
            tensors.append((name, dims, u32(), u64(f"the offset of tensor {name!r}")))
        data_start = -(-pos // alignment) * alignment
    _check_gguf_sizes(p, sizes)
    elements = sum(math.prod(d) for _, d, _, _ in tensors)
    vocab = next((d[-1] for name, d, _, _ in tensors if name == "token_embd.weight" and d), None)
    budget = GGUF_ARRAY_ENTRIES_PER_VOCAB * (vocab or 0) + GGUF_ARRAY_ENTRIES_SLACK
    if entries > budget:
        raise UserInputError(f"{p}: its key-value arrays hold {entries} entries, more than a model with "
                             f"{vocab if vocab is not None else 'no'} token-embedding rows has ({budget} at most; a "
                             "GGUF reader keeps over 1 KB per entry): damaged or not a model file")
    try:
        import gguf  # lazy: a cached plan loads no gguf (0.7 s to import)
    except ImportError:
        return elements
    end = data_start
    for name, dims, ttype, offset in tensors:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise UserInputError(f"{p}: tensor {name!r} has GGML type {ttype}, which this gguf package does not know "
                                 f"(damaged, or a newer quantization than gguf {getattr(gguf, '__version__', '')})") \
                from None
        n = 1
        for d in dims:
            n *= d
        end = max(end, data_start + offset + n // block * type_size)
    if end > size:
        raise UserInputError(f"{p}: not a readable GGUF file, truncated or damaged ({size} bytes; its tensors end at "
                             f"byte {end})")
    return elements


_GGUF_INTS = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}  # integer value types -> struct format
_GGUF_SIZE_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
                   "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
                   "attention.head_count_kv": "num_key_value_heads", "vocab_size": "vocab_size",
                   "attention.key_length": "head_dim", "expert_count": "num_experts"}
"""GGUF metadata sizes (``<arch>.<key>``) -> the config key transformers maps each to."""


def _is_size_key(key: str) -> bool:
    """Whether ``key`` is an ``<arch>.<size>`` key of :data:`_GGUF_SIZE_KEYS`."""
    return key.partition(".")[2] in _GGUF_SIZE_KEYS


def _check_gguf_sizes(p: Path, sizes: dict[str, int]) -> None:
    """The GGUF's layer count, widths, heads and vocabulary bounded (:mod:`.bounds`) before any reader or config is
    built from them."""
    from .bounds import check_config_sizes  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    for key, v in sizes.items():
        check_config_sizes({_GGUF_SIZE_KEYS[key.partition(".")[2]]: v}, f"{p}: metadata {key}")


def _check_gguf_counts(p: Path, size: int) -> None:
    """The header's tensor and key-value counts, bounded by the file's size before any reader allocates for them
    (a tensor entry takes at least 32 bytes, a key-value at least 13), and at least one tensor: a GGUF without
    tensors is no model (transformers would build a default-size model from it)."""
    with open(p, "rb") as f:
        head = f.read(24)
    if len(head) < 24:
        raise UserInputError(f"{p}: truncated GGUF header ({size} bytes)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version < 2:
        raise UserInputError(f"{p}: GGUF version {version} is not supported (2 or newer)")
    if n_tensors == 0:
        raise UserInputError(f"{p}: the GGUF file holds no tensors: it is not a model's weights")
    if n_tensors * 32 + n_kv * 13 > size:
        raise UserInputError(f"{p}: the GGUF header counts {n_tensors} tensors and {n_kv} key-values, more than its "
                             f"{size} bytes can hold (damaged or not a model file)")


def check_model_config(model: str) -> None:
    """Check the sizes of ``model``'s config (a ``.gguf`` file, a model directory or a hub id) on its raw values
    (:mod:`.bounds`), before a config object is built from them (the plan's
    :func:`~iprox_lightning.analysis.memory.load_config`)."""
    from .bounds import check_config_sizes  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    p = Path(model)
    if p.suffix == ".gguf":
        if not p.is_file():
            return  # the caller says it is missing
        check_gguf(p)  # header, counts and metadata sizes bounded before a reader parses them
        return
    if p.is_dir():
        cfg = p / "config.json"
        if cfg.is_file():
            check_config_sizes(read_json(cfg, what="the model's architecture"), cfg)
        return
    from transformers import PretrainedConfig  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)  # a hub id only: the cached plan of a file or directory loads no transformers

    try:
        raw, _ = PretrainedConfig.get_config_dict(model)
    except (OSError, ValueError):
        return  # not reachable or not a model: the caller's own reading says so
    check_config_sizes(raw, f"{model} (config.json)")


def _finish_tokenizer(tok):
    if tok is not None and tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token  # documented: padding reuses EOS when a model has no pad token
    if tok is not None:
        tok.padding_side = "right"
    return tok


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False):
    """The tokenizer for ``name_or_path`` (same resolution rules as :func:`load_model`)."""
    from transformers import AutoTokenizer  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    if name_or_path == "builtin":
        from .builtin import builtin_tokenizer  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

        return builtin_tokenizer()
    p = Path(name_or_path)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise InputNotFoundError(f"GGUF file not found: {p}")
        cached = gguf_cache_dir(p)
        if (cached / "tokenizer_config.json").exists():
            return _finish_tokenizer(AutoTokenizer.from_pretrained(cached))
        check_gguf(p)
        return _finish_tokenizer(AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name))
    if is_adapter_dir(p) and not (p / "tokenizer_config.json").is_file():
        return load_tokenizer(adapter_base(p), trust_remote_code=trust_remote_code)  # a peft adapter: its base's

    check_model_source(str(name_or_path), "tokenizer")
    return _finish_tokenizer(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code))


@dataclass(frozen=True)
class LoadRequest:
    """What :func:`load_model` was asked for, as each registered loader reads it: ``name`` as given, ``path`` (with
    ``gguf_file`` joined), the torch ``dtype`` (``None``: as saved), transformers' ``kwargs`` (``trust_remote_code``,
    ``attn_implementation``), ``use_cache`` (the GGUF float cache), ``tokenizer`` (load one too) and
    ``merge_adapters`` (a peft adapter directory merged into a dense model, or kept as the peft model)."""

    name: str
    path: Path
    dtype: torch.dtype | None
    kwargs: dict
    attn_implementation: str | None
    trust_remote_code: bool
    use_cache: bool
    tokenizer: bool
    merge_adapters: bool = True


LOADERS: dict[str, tuple[Callable[[LoadRequest], bool], Callable[[LoadRequest], tuple]]] = {}
"""The model families / adapters :func:`load_model` loads, by name, in the order they are tried: the first whose
``matches(request)`` is true returns ``(model, tokenizer)`` (``dense``, last, takes any hub id or directory)."""


def register_loader(name: str, matches: Callable[[LoadRequest], bool], *, before: str | None = None):
    """Register ``load(request) -> (model, tokenizer or None)`` (the decorated function) as the loader ``name`` of
    the sources ``matches(request)`` accepts, tried before the loader ``before`` (default: before ``dense``, the
    catch-all). A new family or adapter (a PEFT adapter directory, say) is one such function."""

    def decorate(load: Callable[[LoadRequest], tuple]) -> Callable[[LoadRequest], tuple]:
        if name in LOADERS:
            raise TypeError(f"model loader name {name!r} is taken")
        at = before if before is not None else ("dense" if "dense" in LOADERS else None)
        items = list(LOADERS.items())
        i = next((j for j, (n, _) in enumerate(items) if n == at), len(items))
        items.insert(i, (name, (matches, load)))
        LOADERS.clear()
        LOADERS.update(items)
        return load

    return decorate


def load_model(
    name_or_path: str | nn.Module,
    *,
    gguf_file: str | None = None,
    dtype: str | torch.dtype | None = torch.float32,
    attn_implementation: str | None = "eager",
    trust_remote_code: bool = False,
    use_cache: bool = True,
    tokenizer: bool = True,
    merge_adapters: bool = True,
):
    """Return ``(model, tokenizer)`` for a hub id, local dir, ``.gguf`` path, proxy dir or ``"builtin"``: the first
    registered loader that takes the source (:data:`LOADERS`, :func:`register_loader`).

    A peft adapter directory loads with its base, merged into a dense model (``merge_adapters``), or as the peft model
    (``merge_adapters=False``: what gradient scoring reads, the adapters' gradients; :func:`load_adapter`).

    ``attn_implementation`` defaults to ``"eager"`` because the alignment stage needs a double
    backward through attention (fused SDPA kernels have none); pass ``"sdpa"`` for fast scoring.
    ``use_cache=False`` skips the GGUF safetensors cache. The model is returned in eval mode.
    """
    if isinstance(name_or_path, nn.Module):
        return name_or_path, None
    name = str(name_or_path)
    kwargs = dict(trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    p = Path(name)
    if gguf_file is not None:
        p = p / gguf_file
    request = LoadRequest(name, p, resolve_dtype(dtype), kwargs, attn_implementation, trust_remote_code, use_cache,
                          tokenizer, merge_adapters)
    load = next(load for matches, load in LOADERS.values() if matches(request))
    return load(request)


@register_loader("builtin", lambda r: r.name == "builtin")
def _load_builtin(r: LoadRequest):
    """The demo's tiny Llama and its tokenizer (:mod:`.builtin`)."""
    from .builtin import builtin_model, builtin_tokenizer  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    model = builtin_model()
    if r.dtype is not None:
        model = model.to(r.dtype)
    return model.eval(), (builtin_tokenizer() if r.tokenizer else None)


def _is_proxy_dir(r: LoadRequest) -> bool:
    if not r.path.is_dir():
        return False
    check_not_a_bare_proxy(r.path)  # factor tensors without a manifest: never load them as a plain model
    return is_proxy_dir(r.path)


@register_loader("proxy", _is_proxy_dir)
def _load_proxy_dir(r: LoadRequest):
    """A saved IProX proxy directory (:func:`iprox_lightning.io.proxy.load_proxy`)."""
    # the attention kernel asked for, as for any other model (a proxy is scored beside its target)
    model, tok = load_proxy(r.path, **({"attn_implementation": r.attn_implementation} if r.attn_implementation else {}))
    if r.dtype is not None:
        model = model.to(r.dtype)
    return model.eval(), _finish_tokenizer(tok)


@register_loader("gguf", lambda r: r.path.suffix == ".gguf")
def _load_gguf_file(r: LoadRequest):
    """A ``.gguf`` file, dequantized once and cached (:func:`_load_gguf`)."""
    return _load_gguf(r.path, r.dtype, r.kwargs, use_cache=r.use_cache, tokenizer=r.tokenizer)


@register_loader("peft", lambda r: is_adapter_dir(r.path))
def _load_peft_adapter(r: LoadRequest):
    """A peft adapter directory with its base model (``adapter_config.json`` names it; loaded by these same loaders),
    merged into a dense model unless asked not to (:func:`load_adapter`)."""
    return load_adapter(r.path, merged=r.merge_adapters, dtype=r.dtype, attn_implementation=r.attn_implementation,
                        trust_remote_code=r.trust_remote_code, use_cache=r.use_cache, tokenizer=r.tokenizer)


def load_adapter(path: str | os.PathLike, *, merged: bool = True, dtype: str | torch.dtype | None = torch.float32,
                 attn_implementation: str | None = "eager", trust_remote_code: bool = False, use_cache: bool = True,
                 tokenizer: bool = True):
    """``(model, tokenizer)`` of a peft adapter directory: its base (``base_model_name_or_path``) loaded by
    :func:`load_model` (the same loaders: builtin, a directory, a ``.gguf``, a hub id; ``trust_remote_code`` only when
    asked), the adapters put on it from ``adapter_model.safetensors`` (:mod:`.lora`; a pickle is refused), merged into
    a dense model (``merged``) or the peft model; eval mode either way. The tokenizer is the adapter directory's when it
    holds one, else the base's."""
    p = Path(path)
    base = check_adapter_dir(p)
    own_tok = tokenizer and (p / "tokenizer_config.json").is_file()
    model, tok = load_model(base, dtype=dtype, attn_implementation=attn_implementation,
                            trust_remote_code=trust_remote_code, use_cache=use_cache,
                            tokenizer=tokenizer and not own_tok)
    if own_tok:
        tok = load_tokenizer(str(p), trust_remote_code=trust_remote_code)
    adapted = attach_saved_adapter(model, p)
    if dtype is not None:
        adapted = adapted.to(resolve_dtype(dtype))
    return (merge(adapted) if merged else adapted).eval(), tok


@register_loader("dense", lambda r: True)
def _load_dense(r: LoadRequest):
    """A Hugging Face causal LM from a hub id or a local directory (``AutoModelForCausalLM``); a proxy's own file or
    any other file is refused naming what to pass instead."""
    from transformers import AutoModelForCausalLM  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    from ..console import transformers_bars_off  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    p, name = r.path, r.name
    if p.is_file() and p.parent.is_dir() and is_proxy_file(p):
        raise UserInputError(f"{p} is a file of the IProX proxy directory {p.parent}: pass the directory itself "
                             f"(load_model / iprox_lightning.load_proxy load it as a proxy), or export a dense Hugging Face "
                             f"model with `python -m iprox_lightning.io.proxy export {p.parent} <output directory>`")
    if p.exists() and not p.is_dir():
        raise UserInputError(f"{p} is a file but not a .gguf model; pass a model directory, a hub id or a .gguf file")

    check_model_source(name, "model")
    if p.is_dir():
        check_model_dir(p)
    # a local directory loads in a moment: no "Loading weights" bar (a download keeps its bars)
    with transformers_bars_off() if p.is_dir() else nullcontext():
        model = AutoModelForCausalLM.from_pretrained(name, dtype=r.dtype, **r.kwargs)
    tok = load_tokenizer(name, trust_remote_code=r.trust_remote_code) if r.tokenizer else None
    return model.eval(), tok


def check_model_dir(path: Path) -> None:
    """A local model directory's ``config.json`` (UTF-8 JSON object with a ``model_type``) and every ``*.safetensors``
    header (sizes and offsets inside the file) are read before transformers is: each fault is one
    :class:`UserInputError` naming the file and field, instead of transformers' ``OSError`` or the safetensors
    library's error without a file name."""
    cfg = path / "config.json"
    if cfg.is_file():
        raw = read_json(cfg, what="the model's architecture")
        Fields(cfg).get(raw, "model_type", "str")
        from .bounds import check_config_sizes  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

        check_config_sizes(raw, cfg)  # layers, widths, vocabulary bounded before transformers builds from them
    for f in sorted(path.glob("*.safetensors")):
        read_safetensors_header(f)


def _load_gguf(p: Path, torch_dtype, kwargs: dict, *, use_cache: bool, tokenizer: bool):
    """``(model, tokenizer)`` of a ``.gguf`` file: its cached float copy when there is one (and ``use_cache``), else
    dequantized by transformers (then cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    from ..console import transformers_bars_off  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    if not p.is_file():
        raise InputNotFoundError(f"GGUF file not found: {p}")
    cached = gguf_cache_dir(p)
    if use_cache and (cached / "config.json").exists():
        log.info("loading cached float copy of %s from %s", p, cached)
        check_model_dir(cached)
        with transformers_bars_off():
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch_dtype, **kwargs)
        tok = load_tokenizer(str(p)) if tokenizer else None
        return model.eval(), tok
    from .bounds import gguf_config  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    # its tensors are the model its metadata describes, checked before that model is built (the config, read once here,
    # is the one transformers would read)
    config = gguf_config(p, check_gguf(p))
    log.info("dequantizing GGUF %s (first load; cached afterwards)", p)
    with _dequantizing_progress(p.name):
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, config=config, dtype=torch_dtype,
                                                     **kwargs)
    _drop_gguf_marker(model)
    tok = _finish_tokenizer(AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name))
    if use_cache:
        _write_cache(model, tok, cached)
    return model.eval(), (tok if tokenizer else None)


@contextlib.contextmanager
def _dequantizing_progress(name: str):
    """transformers' de-quantisation loop (its own ``tqdm.auto`` bar, which its progress-bar switch does not turn off)
    shown as the package's progress (:func:`iprox_lightning.progress.progress`): the bar on a terminal, a line a
    minute in a log, never the bar's ``\r`` noise in a piped log."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    real = gguf_utils.tqdm
    gguf_utils.tqdm = lambda it, *a, **k: progress(it, desc=f"de-quantizing {name}", unit="tensor")
    try:
        yield
    finally:
        gguf_utils.tqdm = real


def _drop_gguf_marker(model) -> None:
    """transformers marks GGUF-loaded models as "quantized" although their weights are already
    dequantized floats; drop the marker so the model saves and trains like any float model."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for obj in (model, model.config):
        if hasattr(obj, "quantization_config"):
            try:
                delattr(obj, "quantization_config")
            except AttributeError:
                pass
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass


def _write_cache(model, tok, target: Path) -> None:
    try:
        with atomic_path(target, directory=True) as tmp:
            mark(tmp, "gguf copy")  # the marker keeps the folder's identity through the rename
            model.save_pretrained(tmp, safe_serialization=True)
            if tok is not None:
                tok.save_pretrained(tmp)
    except OSError:
        if target.is_dir() and any(target.iterdir()):  # another process won the race: its copy is kept
            return
        raise
    log.info("cached float model at %s", target)


def is_proxy_file(path: str | os.PathLike) -> bool:
    """True for the manifest or weights file of a proxy directory (a path that should have been the directory)."""
    p = Path(path)
    return p.name in (PROXY_MANIFEST, PROXY_WEIGHTS) and (p.parent / PROXY_MANIFEST).is_file()
