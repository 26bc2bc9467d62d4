"""Peak memory per device of each IProX stage, before the run (``train.py plan``).

Bytes per device of what each stage holds at its peak, from the model's shapes (a Hugging Face config on the meta
device: no weights, no memory) and the run's settings. ``B`` is the per-device batch, ``T`` the sequence length.

* **Weights** per precision: ``32-true`` and ``bf16-mixed`` keep float32 weights (``bf16-mixed`` runs the matmuls
  under ``torch.autocast``; its bfloat16 copies of the weights a backward needs are saved tensors, counted with the
  activations), ``bf16-true`` keeps bfloat16 weights (and bfloat16 gradients and AdamW states).
* **Gradients and AdamW** (warm-up, fine-tune: every parameter but the frozen input embeddings and LM head; Stage 2:
  the proxy's factors only): one gradient and two AdamW moments per trainable parameter in the weights' dtype; on a
  GPU, ``torch.optim.AdamW`` (foreach) allocates one more full-size temporary during ``step``. DDP keeps its
  gradient buckets (one more gradient copy); FSDP (``ModelParallelStrategy``, FSDP2) divides weights, gradients and
  moments by the number of devices and holds the largest block's gathered weights twice (prefetch).
* **Activations**: the bytes autograd saves for the backward, counted by running the model's own decoder stack with
  one and with two layers under ``FakeTensorMode`` (no memory is allocated) at the run's ``T`` and precision, with
  ``torch.autograd.graph.saved_tensors_hooks`` summing every saved storage that is not a parameter
  (:func:`saved_activation_bytes`): ``outside + L · per_layer`` for ``L`` layers, exact for any Hugging Face
  architecture and attention implementation (eager attention saves its ``[B, H, T, T]`` probabilities). With
  activation checkpointing only each layer's input hidden state is kept, plus one layer's activations; a gradient
  store's checkpointed build also keeps the tracked layers' inputs, which the engine's hooks hold until the backward
  (``tracked_input``, counted on fake tensors the same way). Warm-up / fine-tune with ``micro_batch_size`` hold one
  micro-batch's activations and LM-head rows (checkpointed, the larger of the head's backward and one recomputed
  block, which do not overlap); with FSDP2's CPU offload (``fsdp_cpu_offload``) the sharded weights,
  gradients and AdamW moments are in host memory, and the device holds the root's weights (embeddings, head), two
  gathered blocks and one block's unsharded gradients.
* **LM head**: the warm-up / fine-tune loss computes ``[N, V]`` float32 logits for the ``N`` scored (response) tokens
  (``response_share`` = ``N / (B·T)``), and its backward holds three such tensors (the saved log-softmax, its
  gradient, the logits' gradient) while the gradients of the weights are being allocated and the earlier layers'
  activations are still held: the training stages add weights, moments, gradients, activations and these (an upper
  bound, the measured CPU peaks reach it within 20%); the backward-pairs engine (probes, scoring,
  stores) fuses the head with the cross-entropy in row chunks (no ``[N, V]`` tensor); Stage 2 holds the teacher's
  and the proxy's logits, their softmaxes at temperature τ and the first-order graph over them: six ``[N, V]``.
* **Stage 1** (IPSVD, on every rank, before any sharding): the teacher on the device in the run's weights (bfloat16
  under ``bf16-true``, float32 otherwise: ``bf16-mixed`` keeps float32 master weights), the proxy's factors (the rest
  of the proxy is the teacher's own tensors until it is compressed: no dense copy), the float32 probe columns of one
  probe group of the rank's share of the layers (``num_probe_tokens · Σ (in + out)`` over the group;
  ``probe_group_layers`` layers of the share :func:`~iprox_lightning.compression.schedule.assign_layers` gives the
  rank; one group of every layer by default, on one device), then per layer the float64 work of
  :func:`iprox_lightning.compression.ipsvd.ipsvd_factors` (``H``, ``Δ`` in float64, the Gram matrices ``min(d, N)²`` of
  each side, ``W`` and the whitened ``S`` with two ``[out, in]`` temporaries, the Gram of ``S``), and the global
  allocation's kept decompositions of the rank's layers (:class:`~iprox_lightning.compression.ipsvd.WhitenedSVD`,
  float64 ``(in + out)·dense_rank`` per layer, kept only while they fit in one group's probe bytes:
  :func:`~iprox_lightning.compression.schedule.kept_whitened`).
* **Stage 2** (alignment, :func:`stage_two_parts`): teacher (under FSDP sharded per decoder block) + compressed proxy
  (under FSDP sharded and gathered whole for the step) + the factors' gradients and AdamW moments, the teacher's kept
  ``(h, δ)`` of every aligned layer and token of a pass (``b·T · Σ (in + out)``, ``grad_through_projection``; ``b``
  the build batch or ``align_micro_batch_size``), and the proxy's activations of a pass three times over: its
  forward, the first-order graph ``create_graph=True`` keeps, and the double backward's transients (activation
  checkpointing does not lower this peak: measured); the weight copies ``bf16-mixed`` saves once.
* **Scoring**: the frozen model, activations of one batch, the validation gradients ``V: [K, out, in]`` per tracked
  weight (float32, ``K`` validation tasks; as ``validation_gradients`` holds them: bfloat16, on the host with one
  layer's widened on the device, or one column group's per pass: :func:`validation_gradient_bytes`), the per-layer
  feature transient (``[B, out, in]`` per-example gradients
  where :func:`~iprox_lightning.scoring.features.choose_mode` materialises them, else the ghost ``[B, T, K, out]``);
  K-FAC adds its factors ``in² + out²`` per tracked weight (``kfac_dtype``, float32 by default; with ``kfac_offload``
  one layer's; ``KFAC.memory_parts``), EK-FAC also its float32 scales ``[out, in]``; or, if larger, the fit's
  largest moment (``KFAC.fit_moments``: one ``kfac_partitions`` group's sums beside a pass's activations or one
  float64 eigendecomposition, with the factors made before it).
* **Store build**: the frozen model, one batch's activations, the projections ``k × (in + out)`` per tracked weight,
  the per-example projected vectors ``B × Σ k_out·k_in`` buffered for ``write_every_n_batches`` batches.
* **With the proxy** (:func:`proxy_model`: its factors at the plan's ranks): scoring against the target's validation
  gradients (the preparation with both models, then the pool with the proxy alone: :func:`proxy_scoring_plan`), its
  store build (:func:`proxy_store_plan`) and a store's query (:func:`query_plan`). **LESS** and ``checkpoints``:
  :func:`less_scoring_plan` (the adapters' gradients and Adam moments), :func:`with_checkpoints` (each checkpoint's
  model, or adapters over one shared base, and state held).

Times come from :mod:`.flops` (FLOPs per stage), converted to seconds where a measured throughput of the same model
size on the same device kind is known (``bench/results/speed_*.json``); otherwise the FLOPs are reported as such.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import math
import re
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..compression.ipsvd import whitened_bytes
from ..compression.schedule import assign_layers, kept_whitened, probe_groups, whitened_keep, whitened_room
from ..engine.target_layers import find_target_linears
from ..errors import PROXY_VALIDATIONS, UserInputError
from ..io.jsonfile import Fields, read_json, write_json
from ..models.loading import cache_root
from ..models.lora import LoraSettings, matches_target
from ..scoring.config import VALIDATION_DEFAULTS, ScoringConfig, check_validation_gradients, metric_registry
from ..scoring.features import choose_mode
from ..scoring.metrics import owners_by_size
from .flops import LinearShape, ModelShape, alignment_flops, probe_flops, scoring_flops

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STRATEGIES = ("ddp", "fsdp")
GIB = 1024**3

# Named shapes: the published configs' sizes, built in code (no hub access).
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=8192),
    "gemma-3-270m": dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                         tie_word_embeddings=True, max_position_embeddings=32768, sliding_window=512),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=32768),
}


def weight_bytes(precision: str) -> int:
    """Bytes per weight (and per gradient / AdamW moment) under a Lightning ``precision``."""
    _check_choice("precision", precision, PRECISIONS)
    return 2 if precision == "bf16-true" else 4


def activation_bytes(precision: str) -> int:
    """Bytes per element of the hidden states the matmuls produce (bfloat16 under both bf16 precisions)."""
    _check_choice("precision", precision, PRECISIONS)
    return 4 if precision == "32-true" else 2


def _check_choice(option: str, value: str, choices: Iterable[str]) -> None:
    if value not in tuple(choices):
        raise UserInputError(f"{option} must be one of {', '.join(choices)}, got {value!r}")


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------
def load_config(model: str):
    """The Hugging Face config of ``model``: a named shape (:data:`NAMED_SHAPES`), a ``.gguf`` file, a local model
    directory (a saved proxy directory reads its target's ``config.json``) or a hub id."""
    from transformers import AutoConfig  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    if model in NAMED_SHAPES:
        d = dict(NAMED_SHAPES[model])
        return AutoConfig.for_model(d.pop("model_type"), **d)
    p = Path(model)
    try:
        if p.suffix == ".gguf":
            if not p.is_file():
                raise UserInputError(f"model: no GGUF file {model}")
            return AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise UserInputError(f"model: {model} has no config.json (a Hugging Face model directory is needed)")
            return AutoConfig.from_pretrained(str(p))
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise UserInputError(f"model: cannot read a config for {model!r} (a named shape: "
                             f"{', '.join(NAMED_SHAPES)}; a .gguf file; a model directory; a reachable hub id): "
                             f"{str(e).splitlines()[0]}") from None


def _meta_model(config):
    from transformers import AutoModelForCausalLM  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@dataclass
class ModelSizes:
    """Parameter counts of a causal LM (no duplicates: tied weights once) and its shapes for FLOPs."""

    shape: ModelShape
    params: int  # every parameter
    frozen: int  # input embeddings + LM head (frozen in every stage; tied weights once)
    largest_block: int  # parameters of the largest decoder block (FSDP gathers one at a time)

    @property
    def trainable(self) -> int:
        """Parameters the warm-up / fine-tune trains (everything but the embeddings and the head)."""
        return self.params - self.frozen

    @classmethod
    def from_config(cls, config, *, name: str = "") -> "ModelSizes":
        model = _meta_model(config)
        params = sum(p.numel() for p in model.parameters())
        frozen_ids = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
                      for p in m.parameters()}
        frozen = sum(p.numel() for p in model.parameters() if id(p) in frozen_ids)
        names = set(getattr(model, "_no_split_modules", None) or [])
        blocks = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in names]
        return cls(ModelShape.from_model(model, name=name), params, frozen, max(blocks, default=0))


# --------------------------------------------------------------------------------------------
# activations: what a backward keeps, counted under FakeTensorMode
# --------------------------------------------------------------------------------------------
def with_layers(config, n: int):
    """A copy of the Hugging Face ``config`` with its first ``n`` decoder layers (``layer_types`` cut to match)."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    return cfg


def _saved_bytes(config, batch_size: int, seq_len: int, precision: str, attn_implementation: str,
                 trainable: bool) -> int:
    """Bytes of every non-parameter storage the decoder stack (``model.model``, no LM head) saves for its backward
    on ``batch_size × seq_len`` tokens; the model is built and run on fake tensors (nothing allocated)."""
    from transformers import AutoModelForCausalLM  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
        model.train()
        model.requires_grad_(trainable)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            if st._cdata not in params:
                seen[st._cdata] = st.nbytes()
            return t

        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model.get_decoder()(inputs_embeds=emb, attention_mask=torch.ones(batch_size, seq_len, dtype=torch.long),
                                use_cache=False)
    return sum(seen.values())


def _tracked_input_bytes(config, seq_len: int, precision: str, attn_implementation: str) -> int:
    """Bytes of the distinct inputs of one decoder layer's tracked linears on one sequence (what the backward-pairs
    engine's hooks hold per layer until the backward), counted on fake tensors of a one-layer model."""
    from transformers import AutoModelForCausalLM  # lazy: a cached plan loads no transformers/Lightning (test_plan_memory)

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(with_layers(config, 1), attn_implementation=attn_implementation,
                                                 dtype=dtype)
        seen: dict[int, int] = {}

        def hook(module, args, output):
            st = args[0].untyped_storage()
            seen[st._cdata] = st.nbytes()

        for m in find_target_linears(model).values():
            m.register_forward_hook(hook)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else contextlib.nullcontext()
        with autocast:
            model.get_decoder()(inputs_embeds=model.get_input_embeddings()(ids), use_cache=False,
                                attention_mask=torch.ones(1, seq_len, dtype=torch.long))
    return sum(seen.values())


@dataclass(frozen=True)
class Activations:
    """Saved-activation bytes of the decoder stack: per sequence of ``seq_len`` tokens ``outside`` (rotary tables,
    final norm) and ``per_layer``; per batch ``fixed_outside`` / ``fixed_per_layer`` (what does not grow with the batch:
    under ``bf16-mixed`` the bfloat16 copies of the weights autocast casts); ``layer_input`` = one layer's input
    hidden state of one sequence (what activation checkpointing keeps per layer); ``tracked_input`` = one layer's
    tracked linears' distinct inputs of one sequence (what the engine's hooks hold per layer in a checkpointed store
    build)."""

    outside: int
    per_layer: int
    layer_input: int
    fixed_outside: int = 0
    fixed_per_layer: int = 0
    tracked_input: int = 0

    def total(self, num_layers: int, batch_size: int = 1, *, checkpointing: bool = False,
              hold_tracked: bool = False) -> int:
        """``hold_tracked``: checkpointed under the backward-pairs engine, which holds every tracked input."""
        fixed = self.fixed_outside + num_layers * self.fixed_per_layer
        if checkpointing:
            held = self.layer_input + (self.tracked_input if hold_tracked else 0)
            return fixed + batch_size * (self.outside + num_layers * held + self.per_layer)
        return fixed + batch_size * (self.outside + num_layers * self.per_layer)


def saved_activation_bytes(config, *, seq_len: int, precision: str, attn_implementation: str = "eager",
                           trainable: bool = True) -> Activations:
    """:class:`Activations` of ``config``'s decoder stack: its saved tensors with one and two layers and one and two
    sequences, counted on fake tensors (see the module docstring); the count is affine in layers and sequences."""
    c = {(L, B): _saved_bytes(with_layers(config, L), B, seq_len, precision, attn_implementation, trainable)
         for L in (1, 2) for B in (1, 2)}
    seq_layer = c[2, 2] - c[2, 1] - c[1, 2] + c[1, 1]
    fixed_layer = c[2, 1] - c[1, 1] - seq_layer
    seq_out = c[1, 2] - c[1, 1] - seq_layer
    fixed_out = c[1, 1] - fixed_layer - seq_out - seq_layer
    return Activations(outside=seq_out, per_layer=seq_layer, fixed_outside=fixed_out, fixed_per_layer=fixed_layer,
                       layer_input=seq_len * int(config.hidden_size) * activation_bytes(precision),
                       tracked_input=_tracked_input_bytes(config, seq_len, precision, attn_implementation))


# --------------------------------------------------------------------------------------------
# the plan cache: a model's counts, computed once per architecture, sequence length and precision
# --------------------------------------------------------------------------------------------
PLAN_CACHE_VERSION = 2  # 2: Activations.tracked_input


def _config_key(model: str) -> dict | None:
    """What names ``model``'s config without reading it through transformers: a named shape's fields, a model
    directory's ``config.json`` digest, a ``.gguf`` file's path, size and time; ``None`` for a hub id."""
    if model in NAMED_SHAPES:
        return {"named": model, **NAMED_SHAPES[model]}
    p = Path(model)
    if p.suffix == ".gguf" and p.is_file():
        st = p.stat()
        return {"gguf": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if p.is_dir() and (p / "config.json").is_file():
        return {"config.json": hashlib.sha256((p / "config.json").read_bytes()).hexdigest()}
    return None


def _sizes_from_dict(d: Mapping[str, Any]) -> ModelSizes:
    sh = dict(d["shape"])
    shape = ModelShape(**{**sh, "linears": [LinearShape(**l) for l in sh["linears"]],
                          "lm_head": tuple(sh["lm_head"]) if sh["lm_head"] else None})
    return ModelSizes(shape, int(d["params"]), int(d["frozen"]), int(d["largest_block"]))


def model_counts(model: str, run: "RunSettings") -> tuple[ModelSizes, Activations, Activations]:
    """``(sizes, activations at run.precision, float32 activations)`` of ``model`` at ``run.max_length``: read from
    ``$IPROX_CACHE/plan/<digest>.json`` when the same config, sequence length, precision, attention implementation and
    torch / transformers versions were counted before; else counted (the config read by transformers, the model built on
    the meta device, the activations on fake tensors: tens of seconds) and saved there. A hub id's config is read
    each time (its contents are the key)."""
    config = None
    ckey = _config_key(model)
    if ckey is None:
        config = load_config(model)
        ckey = {"config": config.to_json_string(use_diff=False)}
    key = {"v": PLAN_CACHE_VERSION, "model": ckey, "seq_len": run.max_length, "precision": run.precision,
           "attn": run.attn_implementation, "torch": torch.__version__, "transformers": version("transformers")}
    path = cache_root() / "plan" / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32] + ".json")
    try:
        d = read_json(path)
        if d.get("key") == key:
            return (_sizes_from_dict(d["sizes"]), Activations(**d["activations"]), Activations(**d["activations32"]))
    except (OSError, UserInputError, ValueError, KeyError, TypeError):
        pass  # not counted yet (or an unreadable entry): count it
    config = config if config is not None else load_config(model)
    sizes = ModelSizes.from_config(config, name=model)
    acts, acts32 = run_activations(config, run)
    try:
        write_json(path, {"key": key, "sizes": dataclasses.asdict(sizes), "activations": dataclasses.asdict(acts),
                                 "activations32": dataclasses.asdict(acts32)})
    except OSError:
        pass  # a read-only cache: counted again next time
    return sizes, acts, acts32


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSettings:
    """What the plan needs to know about a run (each stage's option of the same meaning in brackets)."""

    pool_size: int = 16000
    max_length: int = 512  # data.max_length
    batch_size: int = 8  # data.batch_size of warm-up / fine-tune / scoring / store (per device)
    align_batch_size: int = 4  # build_proxy's data.batch_size
    align_checkpointing: bool = False  # ProxyAlignModule activation_checkpointing (Stage 2)
    align_micro_batch_size: int | None = None  # ProxyAlignModule micro_batch_size (Stage 2; None: the whole batch)
    align_reshard_proxy: bool = False  # ProxyAlignModule reshard_proxy (Stage 2 under FSDP: the proxy per block)
    response_share: float = 1.0  # share of a batch's tokens that are scored (the LM head's rows); 1 = upper bound
    precision: str = "32-true"  # trainer.precision
    devices: int = 1  # trainer.devices × trainer.num_nodes
    strategy: str = "ddp"  # ddp | fsdp (ModelParallelStrategy, FSDP2)
    device_kind: str = "cuda"  # cuda | cpu (CPU AdamW has no foreach temporaries)
    attn_implementation: str = "eager"  # the project loads models with eager attention
    gradient_checkpointing: bool = False  # model.gradient_checkpointing (warm-up, fine-tune)
    micro_batch_size: int | None = None  # model.micro_batch_size (warm-up, fine-tune; None: the whole batch)
    fsdp_cpu_offload: bool = False  # model.fsdp_cpu_offload (warm-up, fine-tune under strategy fsdp)
    store_gradient_checkpointing: bool = False  # build_store gradient_checkpointing
    sparsity: float = 0.5  # IPSVDCallback sparsity ρ
    num_probe_tokens: int = 1024  # IPSVDCallback num_probe_tokens
    probe_group_layers: int | None = None  # IPSVDCallback probe_group_layers (None: every layer in one probe pass)
    warmup_fraction: float = 0.05
    construction_fraction: float = 0.01
    probe_fraction: float = 0.1
    align_epochs: int = 2
    validation_examples: int = 300
    validation_batch_size: int | None = None  # scoring model.validation_batch_size (validation pass; None: batch_size)
    proxy_validation: str = "target"  # pipeline --proxy_validation: the proxy scored against whose validation gradients
    tasks: int = 3  # validation tasks (V holds one gradient per task)
    method: str = "tracin"  # scoring method (tracin | kfac | ekfac)
    validation_gradients: Mapping[str, Any] | None = None  # ScoringConfig.validation_gradients (None: the defaults)
    kfac_examples: int = 1024
    kfac_dtype: str = "float32"  # scoring kfac_dtype (K-FAC / EK-FAC factor sums and eigenvectors)
    kfac_partitions: int = 1  # scoring kfac_partitions (one group of layers' factor sums per pass)
    kfac_offload: bool = False  # scoring kfac_offload (fitted factors on the host, one layer on the device)
    shard_layers: bool = False  # scoring shard_layers (each rank holds its share of the weights' factors and V)
    store_k: int = 16  # build_store k
    write_every_n_batches: int = 50
    select_k: int = 800  # examples the fine-tune trains on
    warmup_epochs: int = 1  # the warm-up's trainer.max_epochs (configs/warmup.yaml; LESS's configs/less/warmup.yaml: 4)
    finetune_epochs: int = 4  # the fine-tune's trainer.max_epochs (configs/finetune.yaml)
    lora: Mapping[str, Any] | None = None  # warm-up / fine-tune model.lora {r, alpha, dropout, target_modules}
    checkpoints: int = 1  # scoring model.checkpoints: checkpoints summed (LESS: 4), each held while the pool is scored
    checkpoints_in_turn: bool = False  # scoring model.checkpoints_in_turn: one checkpoint held at a time, a pass each

    def __post_init__(self) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("strategy", self.strategy, STRATEGIES)

        _check_choice("method", self.method, metric_registry())
        if getattr(metric_registry()[self.method], "needs_optimizer_state", False) and self.lora is None:
            raise UserInputError(f"method {self.method} scores a LoRA checkpoint's adapter gradients: give the "
                                 "adapters' settings (plan --lora '{r: 8, target_modules: [q_proj, v_proj]}')")
        _check_choice("device_kind", self.device_kind, ("cuda", "cpu"))
        for name in ("pool_size", "max_length", "batch_size", "align_batch_size", "devices", "num_probe_tokens",
                     "tasks", "store_k", "select_k", "write_every_n_batches", "validation_examples", "kfac_examples",
                     "warmup_epochs", "finetune_epochs", "checkpoints"):
            if int(getattr(self, name)) < 1:
                raise UserInputError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if int(self.align_epochs) < 0:  # 0: the IPSVD-only proxy, no alignment
            raise UserInputError(f"align_epochs must be >= 0, got {self.align_epochs!r}")
        for name in ("warmup_fraction", "construction_fraction", "probe_fraction"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise UserInputError(f"{name} must be in (0, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.response_share <= 1.0:
            raise UserInputError(f"response_share must be in (0, 1], got {self.response_share!r}")
        if self.validation_batch_size is not None and int(self.validation_batch_size) < 1:
            raise UserInputError(f"validation_batch_size must be >= 1 or None, got {self.validation_batch_size!r}")
        _check_choice("proxy_validation", self.proxy_validation, PROXY_VALIDATIONS)
        if self.align_micro_batch_size is not None and int(self.align_micro_batch_size) < 1:
            raise UserInputError(f"align_micro_batch_size must be >= 1 or None, got {self.align_micro_batch_size!r}")
        if self.probe_group_layers is not None and int(self.probe_group_layers) < 1:
            raise UserInputError(f"probe_group_layers must be >= 1 or None, got {self.probe_group_layers!r}")
        if not 0.0 < self.sparsity < 1.0:
            raise UserInputError(f"sparsity must be in (0, 1), got {self.sparsity!r}")
        if self.micro_batch_size is not None and int(self.micro_batch_size) < 1:
            raise UserInputError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size!r}")
        if self.fsdp_cpu_offload and self.strategy != "fsdp":
            raise UserInputError("fsdp_cpu_offload offloads FSDP2's sharded state: it needs strategy fsdp, got "
                                 f"strategy {self.strategy!r}")

        object.__setattr__(self, "validation_gradients", check_validation_gradients(self.validation_gradients))
        if self.lora is not None:
            LoraSettings.of(self.lora)
            if self.strategy == "fsdp":
                raise UserInputError("lora: LoRA warm-up and fine-tuning run under strategy ddp (not fsdp)")

    @property
    def validation_batch(self) -> int:
        """The validation pass's batch: ``validation_batch_size``, else the scoring batch."""
        return int(self.validation_batch_size or self.batch_size)

    @property
    def shards(self) -> int:
        return self.devices if self.strategy == "fsdp" else 1


@dataclass
class StagePlan:
    """One stage's peak bytes per device (``parts``: what makes it up, summing to ``peak``), its time and the settings
    that lower its largest parts."""

    stage: str
    parts: dict[str, float]
    peak: float
    flops: float
    seconds: float | None = None
    time_source: str = ""
    levers: list[str] = field(default_factory=list)

    def fits(self, device_memory: float | None) -> bool | None:
        return None if device_memory is None else self.peak <= device_memory

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# the settings that lower each part, in the words of the stage configs
_LEVERS = {
    "activations": "model.micro_batch_size (the same batch in smaller pieces), or data.max_length, or activation "
                   "checkpointing (model.gradient_checkpointing)",
    "lm_head": "data.batch_size / data.max_length (the [N, V] logits of the scored tokens)",
    "weights": "strategy fsdp over more devices, or precision bf16-true",
    "gradients": "strategy fsdp over more devices, or precision bf16-true",
    "adamw": "strategy fsdp over more devices, or precision bf16-true",
    "ddp_buckets": "strategy fsdp (DDP keeps a second copy of the gradients)",
    "teacher": "precision bf16-true (Stage 1 runs unsharded on every rank: FSDP does not help it)",
    "proxy": "precision bf16-true, or a higher sparsity",
    "probes": "IPSVDCallback probe_group_layers (the float32 columns of that many layers at a time), or num_probe_tokens",
    "decompositions": "IPSVDCallback probe_group_layers (the kept decompositions fit in one group's probe bytes)",
    "ipsvd_float64": "a device with more memory for Stage 1 (its float64 per-layer work is fixed by the layer shape)",
    "teacher_tokens": "data.batch_size / data.max_length of build_proxy (the teacher's (h, δ) of every token)",
    "validation_gradients": "scoring validation_gradients {dtype: bfloat16, device: cpu, column_groups: N}, fewer "
                            "validation tasks, or scoring the proxy / a gradient store (build_store)",
    "validation_layer": "scoring validation_gradients column_groups (one layer's group of columns is widened on the "
                        "device)",
    "features": "data.batch_size of scoring",
    "store_vectors": "store k or write_every_n_batches",
    "projections": "store k",
}


def _stage(stage: str, parts: Mapping[str, float], flops: float, own_levers: Mapping[str, str] = {}) -> StagePlan:
    """``own_levers``: the stage's own parts' levers (a metric's ``memory_levers``), beside :data:`_LEVERS`."""
    parts = {k: float(v) for k, v in parts.items() if v}
    order = sorted(parts, key=parts.get, reverse=True)
    training = stage in ("warm-up", "fine-tune")
    levers = []
    for k in order[:2]:
        lever = own_levers.get(k, _LEVERS.get(k))
        if k == "teacher" and stage.startswith("build_proxy: Stage 2"):
            lever = "strategy fsdp over more devices (Stage 2 shards the teacher per decoder block), or precision bf16-true"
        if k == "activations" and stage.startswith("build_proxy: Stage 2"):
            lever = "ProxyAlignModule micro_batch_size (rows per pass, the batch kept; plan --align_micro_batch_size)"
        if k in ("teacher", "proxy") and stage.startswith("build_proxy: Stage 1"):
            lever = ("precision bf16-true, or a device with more memory: Stage 1 holds the teacher and the proxy's "
                     "factors unsharded on every rank (FSDP does not shard them)")
        if k == "activations" and not training and not stage.startswith("build_proxy: Stage 2"):
            lever = f"data.batch_size / data.max_length of {stage.split(':')[0].split(' (')[0]}"
            if stage == "store build":
                lever += ", or build_store gradient_checkpointing"
        if lever and lever not in levers:
            levers.append(lever)
    return StagePlan(stage, parts, sum(parts.values()), flops, levers=levers)


def _head_rows(run: RunSettings, batch_size: int) -> float:
    return batch_size * run.max_length * run.response_share


def _optimizer_temp(run: RunSettings, n: float) -> float:
    return n if run.device_kind == "cuda" else 0.0


def lora_params(sizes: ModelSizes, lora: Mapping[str, Any]) -> int:
    """The LoRA adapters' parameters, ``r · (in + out)`` per adapted linear of the decoder blocks (peft's rule: which
    layers ``target_modules`` names; resolved ones: :func:`with_lora_targets`)."""
    settings = LoraSettings.of(lora)
    if settings.target_modules is None:
        raise ValueError("lora_params needs resolved target_modules (with_lora_targets)")
    return sum(settings.r * (l.in_features + l.out_features) for l in sizes.shape.linears
               if matches_target(settings, "", l.name))


def with_lora_targets(lora: Mapping[str, Any], model: str) -> dict:
    """``lora`` with ``target_modules`` resolved: as given, or peft's default for ``model``'s architecture."""
    settings = LoraSettings.of(lora)
    if settings.target_modules is not None:
        return settings.to_dict()
    model_type = NAMED_SHAPES[model]["model_type"] if model in NAMED_SHAPES else load_config(model).model_type
    return {**settings.to_dict(), "target_modules": settings.resolved_targets(model_type)}


def training_plan(sizes: ModelSizes, acts: Activations, run: RunSettings, *, stage: str, n_examples: int,
                  epochs: int = 1) -> StagePlan:
    """Warm-up / fine-tune: full fine-tuning (embeddings and head frozen) with AdamW, per device. From the second
    step on, weights and moments live throughout; the backward allocates the gradients (the last layers' first) while
    the earlier layers' activations are still held, and begins at the head, whose backward holds three ``[N, V]``
    float32 tensors (the saved log-softmax, its gradient, the logits' gradient): the plan adds them all (an upper
    bound; measured on CPU within 20% of the peak, ``bench/results/plan/``). ``micro_batch_size``: the activations
    and LM-head rows of one micro-batch; ``fsdp_cpu_offload``: the sharded state in host memory (module docstring).

    With ``run.lora``: the base weights frozen in the run's weights dtype (no gradient, no AdamW state), the adapters
    (:func:`lora_params`) trained: their weights, gradients and two moments; the activations and the head as in full
    fine-tuning (the backward still runs through every layer); the backward's FLOPs without the base weights'
    gradients."""
    if run.lora is not None:
        return _lora_training_plan(sizes, acts, run, stage=stage, n_examples=n_examples, epochs=epochs)
    wb, S = weight_bytes(run.precision), run.shards
    weights = sizes.params * wb / S + (2 * sizes.largest_block * wb if S > 1 else 0)
    grads = sizes.trainable * wb / S
    adamw = 2 * sizes.trainable * wb / S
    if run.fsdp_cpu_offload:  # on the device: the root's weights, two gathered blocks, one block's full gradients
        in_blocks = sizes.shape.num_layers * sizes.largest_block
        weights = (max(sizes.params - in_blocks, 0) + 2 * sizes.largest_block) * wb
        grads, adamw = (max(sizes.trainable - in_blocks, 0) + sizes.largest_block) * wb, 0.0
    mb = min(run.micro_batch_size or run.batch_size, run.batch_size)
    head = 3 * _head_rows(run, mb) * sizes.shape.vocab_size * 4
    activations = acts.total(sizes.shape.num_layers, mb, checkpointing=run.gradient_checkpointing)
    if run.gradient_checkpointing:  # the head's backward ends before the last block is recomputed: the larger of the
        activations -= min(mb * acts.per_layer, head)  # two is held with the blocks' inputs, not both
    parts = {
        "weights": weights,
        "adamw": adamw,
        "gradients": grads + (0.0 if run.fsdp_cpu_offload else _optimizer_temp(run, grads)),
        "activations": activations,
        "lm_head": head,
        "ddp_buckets": grads if run.strategy == "ddp" and run.devices > 1 else 0,
    }
    n = n_examples * epochs / run.devices
    f = sizes.shape.forward_flops(1, run.max_length, head_share=run.response_share)["total"]
    f += sizes.shape.backward_flops(1, run.max_length, weight_grads="all", head_share=run.response_share)["total"]
    return _stage(stage, parts, f * n)


def _lora_training_plan(sizes: ModelSizes, acts: Activations, run: RunSettings, *, stage: str, n_examples: int,
                        epochs: int) -> StagePlan:
    wb = weight_bytes(run.precision)
    n_lora = lora_params(sizes, run.lora)
    grads = n_lora * wb
    parts = {
        "weights": (sizes.params + n_lora) * wb,
        "adamw": 2 * n_lora * wb,
        "gradients": grads + _optimizer_temp(run, grads),
        "activations": acts.total(sizes.shape.num_layers, run.batch_size, checkpointing=run.gradient_checkpointing),
        "lm_head": 3 * _head_rows(run, run.batch_size) * sizes.shape.vocab_size * 4,
        "ddp_buckets": grads if run.devices > 1 else 0,
    }
    n = n_examples * epochs / run.devices
    f = sizes.shape.forward_flops(1, run.max_length, head_share=run.response_share)["total"]
    f += sizes.shape.backward_flops(1, run.max_length, weight_grads="none", head_share=run.response_share)["total"]
    frozen = "precision bf16-true (LoRA keeps the frozen base weights whole on every device)"
    return _stage(stage, parts, f * n, {"weights": frozen, "adamw": "a smaller lora.r or fewer lora.target_modules",
                                        "gradients": "a smaller lora.r or fewer lora.target_modules"})


def stage_one_share(sizes: ModelSizes, run: RunSettings) -> dict[str, float]:
    """Per rank, the largest of what :func:`~iprox_lightning.compression.apply.compress` holds for its share of the
    layers (:mod:`iprox_lightning.compression.schedule`, the same functions on the model's shapes): ``probes`` — the
    float32 columns of its largest probe group; ``decompositions`` — its kept
    :class:`~iprox_lightning.compression.ipsvd.WhitenedSVD` (float64); ``ipsvd_float64`` — the float64 work of its
    largest layer's :func:`~iprox_lightning.compression.ipsvd.ipsvd_factors` (mode exact)."""

    N, group = run.num_probe_tokens, run.probe_group_layers
    shapes = {l.name: (l.out_features, l.in_features) for l in sizes.shape.linears if l.tracked}
    owner = assign_layers(shapes, run.devices)
    kept = kept_whitened(shapes, list(shapes), whitened_room(shapes, list(shapes), N, group))
    out = {"probes": 0.0, "decompositions": 0.0, "ipsvd_float64": 0.0}
    for rank in range(run.devices):
        mine = [n for n in shapes if owner[n] == rank]
        groups = probe_groups(mine, group)
        out["probes"] = max([out["probes"]] + [4.0 * N * sum(sum(shapes[n]) for n in g) for g in groups])
        out["decompositions"] = max(out["decompositions"], float(sum(
            whitened_bytes(shapes[n][1], shapes[n][0], whitened_keep(*shapes[n])) for n in mine if n in kept)))
        for n in mine:
            o, i = shapes[n]
            work = (i + o) * N + min(i, N) ** 2 + min(o, N) ** 2 + 4 * o * i + 2 * min(o, i) ** 2
            out["ipsvd_float64"] = max(out["ipsvd_float64"], 8.0 * work)
    return out


def proxy_sizes(sizes: ModelSizes, sparsity: float) -> tuple[ModelShape, int]:
    """The proxy's shapes at a uniform rank per layer keeping ``1 - sparsity`` of each targeted layer's weights, and
    its parameter count (the frozen ones unchanged)."""
    ranks = {}
    for l in sizes.shape.linears:
        if l.tracked:
            ranks[l.name] = max(1, int(round((1 - sparsity) * l.in_features * l.out_features
                                             / (l.in_features + l.out_features))))
    proxy = sizes.shape.with_ranks(ranks)
    return proxy, sizes.params - sizes.shape.tracked_params + proxy.tracked_params


STAGE2_FORWARDS = 5.4  # Stage 2's proxy activations at its peak, in forwards' worth (measured, stage_two_parts)
STAGE2_HEAD_LOGITS = 8  # [N, V] float32 logits of the scored tokens at Stage 2's peak (measured, stage_two_parts)


def stage_two_parts(sizes: ModelSizes, acts: Activations, run: RunSettings, proxy_params: int, factors: int,
                    io_sum: int) -> dict[str, float]:
    """Stage 2's parts per device (see the module docstring). One pass holds ``b`` rows: the batch, or the micro-batch
    (``align_micro_batch_size``; then the batch's summed proxy gradients and target projections and the summed
    shares of the gradient, three factor-sized float32 tensors, live through the step, a micro-batch's tensors going
    into them one at a time; under FSDP each rank keeps its rows of the three,
    :class:`~iprox_lightning.alignment.fsdp.FactorShards`).
    Under FSDP the proxy is sharded and gathered whole for the step (both are held), or with ``align_reshard_proxy``
    one decoder block at a time: its shard and, gathered, the larger of two blocks and the embedding / LM head matrix
    (regathered one at a time in the double backward; measured on 2 gloo ranks, the 512-wide shape with 4 layers:
    the proxy's gathered share fell from 0.0606 GiB to ~0.0125); the teacher is sharded per decoder block, its largest block gathered
    twice (FSDP2's prefetch). The proxy's activations: the forward's, the
    ``create_graph`` graph and the double backward's transients, measured at 5.4 forwards' worth (SmolLM2 shapes
    with 2 and 4 layers, bench/results/plan/stage2_*.json), the same with ``align_checkpointing`` (measured on CPU: the
    recomputed tensors the ``create_graph`` graph references stay in it, and the double backward recomputes beside
    it); the weight copies ``bf16-mixed`` saves (``fixed``) once. The logits of the scored tokens: eight ``[N, V]``
    float32 tensors at the peak (the teacher's and the proxy's, their softmaxes at τ, the graph over them; measured)."""
    wb, ab, S = weight_bytes(run.precision), activation_bytes(run.precision), run.shards
    L, V = sizes.shape.num_layers, sizes.shape.vocab_size
    b = min(run.align_micro_batch_size or run.align_batch_size, run.align_batch_size)
    fixed = acts.fixed_outside + L * acts.fixed_per_layer
    # align_checkpointing lowers nothing here (measured: the same peak, bench/results/plan/stage2_*.json): the
    # create_graph graph keeps the recomputed tensors its backward formulas reference, and the double backward
    # recomputes the blocks again beside it
    activations = fixed + STAGE2_FORWARDS * (acts.total(L, b) - fixed)
    micro = b < run.align_batch_size
    proxy = proxy_params * wb / S + (proxy_params * wb if S > 1 else 0)
    if S > 1 and run.align_reshard_proxy:
        outside = max(sizes.params - L * sizes.largest_block, 0)  # embeddings, LM head, final norm (the root's)
        block = max(proxy_params - outside, 0) / L
        proxy = proxy_params * wb / S + max(2 * block, V * sizes.shape.hidden_size) * wb
    return {
        "teacher": sizes.params * wb / S + (2 * sizes.largest_block * wb if S > 1 else 0),
        "proxy": proxy,
        "gradients": factors * wb / S + _optimizer_temp(run, factors * wb / S),
        "adamw": 2 * factors * wb / S,
        "teacher_tokens": b * run.max_length * io_sum * ab,
        "activations": activations,
        "lm_head": STAGE2_HEAD_LOGITS * _head_rows(run, b) * V * 4,
        "accumulation": 3 * factors * 4 / S if micro else 0,
    }


def build_proxy_plan(sizes: ModelSizes, acts: Activations, run: RunSettings,
                     acts_float32: Activations | None = None) -> tuple[StagePlan, StagePlan]:
    """``(Stage 1, Stage 2)`` of build_proxy, per device (see the module docstring). Stage 1 runs in
    ``IPSVDCallback.setup`` on the weights as the run holds them (the precision plugin's conversion applied first:
    bfloat16 under ``bf16-true``, else float32) with no autocast, so its activations are those of ``acts`` under
    ``bf16-true`` and ``acts_float32`` (the 32-true count) otherwise; its teacher is on the device, and the proxy is
    the teacher's tensors plus the factors. Stage 2's teacher is converted with the module (``bf16-true``:
    bfloat16)."""
    wb, ab, S = weight_bytes(run.precision), activation_bytes(run.precision), run.shards
    L, B, V = sizes.shape.num_layers, run.align_batch_size, sizes.shape.vocab_size
    io_sum = sum(l.in_features + l.out_features for l in sizes.shape.linears if l.tracked)
    act = acts.total(L, B)
    act1 = (acts if run.precision == "bf16-true" else (acts_float32 or acts)).total(L, B)
    proxy_shape, proxy_params = proxy_sizes(sizes, run.sparsity)
    factors = proxy_shape.tracked_params
    share = stage_one_share(sizes, run)
    work = share.pop("ipsvd_float64")
    stage1 = {
        "teacher": sizes.params * wb,
        "proxy": factors * wb,  # the factors; every other tensor is the teacher's until Stage 1 ends
        **share,
        # the probe pass, then the factors: the larger of the two
        ("activations" if act1 >= work else "ipsvd_float64"): max(act1, work),
    }
    n_construct = run.pool_size * run.construction_fraction
    n_probe = max(1, round(n_construct * run.probe_fraction))
    n_align = max(1, round(n_construct - n_probe))
    stage2 = stage_two_parts(sizes, acts, run, proxy_params, factors, io_sum)
    f1 = probe_flops(sizes.shape, proxy_shape, n_examples=n_probe, seq_len=run.max_length, n_vectors=run.num_probe_tokens,
                     head_share=run.response_share)["total"]
    f2 = alignment_flops(sizes.shape, proxy_shape, n_examples=n_align, seq_len=run.max_length,
                         epochs=run.align_epochs, head_share=run.response_share)["total"] / run.devices
    return _stage("build_proxy: Stage 1 (IPSVD)", stage1, f1), _stage("build_proxy: Stage 2 (alignment)", stage2, f2)


def planned_metrics() -> dict:
    """The influence metrics ``plan`` prices, by name: every registered one (each class declares its memory,
    ``memory_parts`` / ``memory_levers``, and its factor passes) but those that score a LoRA checkpoint's adapter
    gradients with its optimiser state (``needs_optimizer_state``: LESS), which do not score the dense model."""

    return {n: c for n, c in metric_registry().items() if not getattr(c, "needs_optimizer_state", False)}


def lora_metrics() -> list[str]:
    """The registered metrics ``plan`` prices over a LoRA checkpoint's adapters (:func:`less_scoring_plan`): those that
    read its optimiser state (``needs_optimizer_state``: LESS)."""

    return [n for n, c in metric_registry().items() if getattr(c, "needs_optimizer_state", False)]


def validation_gradient_bytes(linears: Iterable[tuple[int, int]], columns: int,
                               holding: Mapping[str, Any] | None = None, scoring_bytes: int = 4) -> dict[str, float]:
    """What the exact scorer's validation gradients take (:class:`~iprox_lightning.scoring.influence.InfluenceScorer`,
    ``ScoringConfig.validation_gradients``) for tracked weights ``(in_features, out_features)`` and ``columns`` score
    columns: ``device`` (held on the device), ``host`` (held in host memory), ``layer`` (one layer's widened copy on
    the device while a batch is scored: held on the host or in bfloat16), ``passes`` (column groups: passes over the
    validation set and the pool; at most one per column), ``group_columns`` (the largest group's columns) and
    ``held`` (the bytes of the validation gradients as held while the pool is scored, wherever). Held on the host or
    in bfloat16, the sums are accumulated on the host in the scoring precision (``host`` counts them: the host's peak)
    and reach the device one layer at a time."""
    h = {**VALIDATION_DEFAULTS, **dict(holding or {})}
    passes = min(int(h["column_groups"]), max(int(columns), 1))
    kg = -(-int(columns) // passes)  # the largest group (groups differ by at most one column)
    sizes = [int(i) * int(o) for i, o in linears]
    held = kg * sum(sizes) * (2 if h["dtype"] == "bfloat16" else scoring_bytes)
    host_sums = h["device"] == "cpu" or h["dtype"] == "bfloat16"
    return {"device": float(held) if h["device"] == "same" else 0.0,
            "host": float(kg * sum(sizes) * scoring_bytes) if host_sums else 0.0,
            "layer": float(scoring_bytes * kg * max(sizes, default=0)) if host_sums else 0.0, "passes": passes,
            "group_columns": kg, "held": float(held)}


def _metric_settings(metric, run: RunSettings) -> tuple:
    """``(config,)``: the scoring settings of the run for a metric whose ``memory_parts`` takes them (K-FAC's, by its
    ``kfac_*`` options), else ``()`` (``memory_parts(linears)`` of a metric that takes none)."""
    if "config" not in inspect.signature(metric.memory_parts).parameters:
        return ()

    return (ScoringConfig(method=metric.name, kfac_examples=run.kfac_examples, kfac_dtype=run.kfac_dtype,
                          kfac_partitions=run.kfac_partitions, kfac_offload=run.kfac_offload and run.device_kind != "cpu",
                          shard_layers=run.shard_layers),)


FIT_PARTS = ("kfac_factor_sums", "kfac_eigh")
"""A metric's memory parts held only while it is fitted (before the pool is scored; ``memory_parts`` gives their
largest): :func:`scoring_plan` counts the fit's moments (``fit_moments``) or the scoring, whichever holds more."""


def _layer_shares(linears: list[tuple[int, int]], run: RunSettings) -> list[list[int]]:
    """The tracked weights (indexes into ``linears``) each rank holds: all on one rank, or under ``shard_layers`` on
    several ranks each rank's owned ones (:func:`~iprox_lightning.scoring.metrics.owners_by_size`, the scorer's)."""
    if not (run.shard_layers and run.devices > 1):
        return [list(range(len(linears)))]

    owner = owners_by_size({str(j): i * i + o * o for j, (i, o) in enumerate(linears)}, run.kfac_partitions,
                           run.devices)
    return [[j for j in range(len(linears)) if owner[str(j)] == r] for r in range(run.devices)]


def scoring_plan(sizes: ModelSizes, acts: Activations, run: RunSettings, method: str) -> StagePlan:
    """Scoring the pool with the (dense) model and ``method``, per device; the validation gradients as
    ``run.validation_gradients`` holds them (:func:`validation_gradient_bytes`: column groups score one group's columns
    per pass, each pass over the validation set and the pool).

    Under strategy ``fsdp`` the scored model is sharded per decoder block (``InfluenceScoringModule`` under
    ``ModelParallelStrategy``): its shard, the root's weights (embeddings, head, norm: FSDP2's root stays gathered
    through the step) and two gathered blocks. With ``shard_layers`` on several devices each rank holds its owned
    weights' validation gradients and K-FAC state (the rank holding the most is counted), the features are computed
    for every rank's rows (``devices × B``), and one weight's pairs of every rank are gathered
    (``layer_exchange``: the sent copy, the received parts and their concatenation, ``(1 + 2·devices)·B·T·(in + out)``
    float32 for the widest weight). A metric fitted on data (K-FAC, EK-FAC) runs its fit before the scoring: of its
    moments (``fit_moments``: a pass's sums beside one batch's activations, then the sums beside one decomposition,
    when FSDP's gathered root and blocks are freed; each with the factors made before it) the largest is counted if
    it exceeds the scoring's parts (the fitted state, activations, validation gradients, features, exchange). On a
    CPU (``device_kind``) ``kfac_offload`` moves nothing: the host is the device."""
    metric = planned_metrics()[method]

    wb, T, B, K = weight_bytes(run.precision), run.max_length, run.batch_size, run.tasks
    tracked = [l for l in sizes.shape.linears if l.tracked]
    linears = [(l.in_features, l.out_features) for l in tracked]
    shares = _layer_shares(linears, run)
    vg = max((validation_gradient_bytes([linears[j] for j in r], K, run.validation_gradients) for r in shares),
             key=lambda v: v["device"] + v["layer"])
    Kg = vg["group_columns"]
    sharded = len(shares) > 1
    rows = B * (run.devices if sharded else 1)  # the features of every rank's rows on an owner
    feat = 0.0
    for l in tracked:
        mode = choose_mode(T, l.in_features, l.out_features, Kg)
        size = rows * l.out_features * l.in_features if mode == "materialize" else rows * T * Kg * l.out_features
        feat = max(feat, 4.0 * size)
    weights, gathered = sizes.params * wb, 0.0
    if run.strategy == "fsdp" and run.devices > 1:  # the shard, and while the model runs the gathered root and blocks
        weights, gathered = sizes.params * wb / run.devices, fsdp_frozen_gathered_bytes(sizes, wb)
    parts = {
        "weights": weights + gathered,
        "activations": acts.total(sizes.shape.num_layers, max(B, run.validation_batch)),  # the larger pass's
        "validation_gradients": vg["device"],
        "validation_layer": vg["layer"],
        "features": feat,
        "layer_exchange": ((1 + 2 * run.devices) * B * T * max((i + o for i, o in linears), default=0) * 4.0
                           if sharded else 0.0),
    }

    settings = _metric_settings(metric, run)
    world = {"world": run.devices} if "world" in inspect.signature(metric.memory_parts).parameters else {}
    own = metric.memory_parts(linears, *settings, **world)
    parts.update({k: v for k, v in own.items() if k not in FIT_PARTS})
    # the fit, then the scoring: the larger of the two is the peak (the other phase's parts are not held). A pass
    # holds one batch's activations (and FSDP's gathered root and blocks); the decompositions run after it
    moments = [{**{k: v for k, v in m.items() if k != "phase"},
                **({"activations": parts["activations"], "weights": weights + gathered} if m["phase"] == "pass"
                   else {"weights": weights})} for m in metric.fit_moments(linears, *settings, **world)]
    fit_phase = max(moments, key=lambda m: sum(m.values()), default=None)
    fit_larger = fit_phase is not None and sum(fit_phase.values()) > sum(parts.values())
    if fit_larger:
        parts = fit_phase
    passes = vg["passes"]
    n_val = run.validation_examples * (passes + 1 if passes > 1 else 1)  # column groups: the norm's pass, then each
    f = scoring_flops(sizes.shape, n_train=run.pool_size * passes, n_val=n_val, seq_len=T,
                      head_share=run.response_share)["total"] / run.devices
    if metric.factor_passes:  # the metric's passes over the factor data (EK-FAC: 2) per K-FAC partition
        f *= 1 + metric.factor_passes * run.kfac_partitions * run.kfac_examples / (run.pool_size * passes)
    parts, f = with_checkpoints(parts, f, run)
    if not fit_larger:
        parts = with_validation_preparation(parts, vg, run)
    return _stage(f"scoring ({method})", parts, f, metric.memory_levers)


def validation_preparation(parts: dict[str, float], vg: Mapping[str, float], run: RunSettings) -> dict[str, float]:
    """The last checkpoint's preparation of its validation gradients as a moment of the scoring stage (``parts``
    after :func:`with_checkpoints`): its sums, accumulated in the scoring precision (:func:`validation_gradient_bytes`'
    ``host``: float32 before a bfloat16 holding narrows them), beside the earlier checkpoints' validation gradients
    as held and one batch's activations, without the scoring's transients."""
    prep = {k: v for k, v in parts.items() if k not in ("features", "validation_layer", "layer_exchange")}
    prep["validation_gradients"] = vg["held"] * (held_checkpoints(run) - 1)
    prep["validation_sums"] = vg["host"] or vg["held"]
    return prep


def with_validation_preparation(parts: dict[str, float], vg: Mapping[str, float], run: RunSettings) -> dict[str, float]:
    """On a CPU (``device_kind``: the host is the device) the validation gradients count where they are held, host
    or not, and the peak is the larger of the scoring's ``parts`` (after :func:`with_checkpoints`) and
    :func:`validation_preparation`. Measured on SmolLM2-135M's LESS scoring (4 checkpoints, 93 columns, bfloat16):
    the fourth checkpoint's preparation is the peak."""
    if run.device_kind != "cpu":
        return parts
    scoring = {**parts, "validation_gradients": vg["held"] * held_checkpoints(run)}
    prep = validation_preparation(scoring, vg, run)
    return prep if sum(prep.values()) > sum(scoring.values()) else scoring


CHECKPOINT_HELD = ("weights", "validation_gradients", "kfac_factors", "ekfac_corrections", "adam_moments")
"""The parts of a scoring stage that each checkpoint holds while the pool is scored (``InfluenceScoringModule``'s
``checkpoints``: one scorer per checkpoint, each with its model, metric state and validation gradients); the
activations, features and transients are one checkpoint's at a time (the checkpoints score a batch in turn)."""


def held_checkpoints(run: RunSettings) -> int:
    """How many checkpoints' scorers (metric state, validation gradients) are held at once: every one of
    ``run.checkpoints``, or one with ``checkpoints_in_turn``."""
    return 1 if run.checkpoints_in_turn else run.checkpoints


def with_checkpoints(parts: dict[str, float], flops: float, run: RunSettings,
                     adapters: float | None = None) -> tuple[dict[str, float], float]:
    """``(parts, flops)`` of a scoring stage over ``run.checkpoints`` checkpoints: :data:`CHECKPOINT_HELD` parts and
    the FLOPs times the checkpoints. Every checkpoint's model is loaded whole (dense checkpoints), unless
    ``adapters`` (the bytes of one checkpoint's adapter weights, in ``parts["weights"]``) says the checkpoints are
    peft adapters over one base (a LoRA warm-up's epochs): the base is loaded once and each checkpoint holds its
    adapters (``InfluenceScoringModule``'s ``checkpoint_adapters``), so the weights are one base and ``checkpoints``
    adapters.

    ``run.checkpoints_in_turn`` (the module's ``checkpoints_in_turn``: a pass over the pool per checkpoint): one
    checkpoint's metric state and validation gradients at a time; the weights the first checkpoint's model and the
    one in turn (dense: two models; adapters over one base: the base, the first's adapters kept aside and the ones in
    place); and on a CPU (host memory elsewhere) the earlier checkpoints' scores of this process's rows
    (``earlier_scores``: a float64 score and per-task scores and two flags per row and checkpoint). The same FLOPs."""
    c = run.checkpoints
    if c == 1:
        return parts, flops
    if run.checkpoints_in_turn:
        out = dict(parts)
        out["weights"] = parts["weights"] + (adapters if adapters is not None else parts["weights"])
        if run.device_kind == "cpu":
            rows = math.ceil(run.pool_size / run.devices)
            out["earlier_scores"] = float((c - 1) * rows * (8 * (run.tasks + 1) + 2))
        return out, flops * c
    out = {k: v * c if k in CHECKPOINT_HELD else v for k, v in parts.items()}
    if adapters is not None:
        out["weights"] = parts["weights"] + (c - 1) * adapters
    return out, flops * c


def lora_weights(sizes: ModelSizes, lora: Mapping[str, Any]) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of every LoRA adapter matrix (``lora_A: in -> r``, ``lora_B: r -> out``) of the
    adapted linears (:func:`lora_params`' layers): the weights LoRA-gradient scoring tracks."""

    settings = LoraSettings.of(lora)
    r = settings.r
    return [w for l in sizes.shape.linears if matches_target(settings, "", l.name)
            for w in ((l.in_features, r), (r, l.out_features))]


def less_scoring_plan(sizes: ModelSizes, acts: Activations, run: RunSettings, method: str = "less") -> StagePlan:
    """Scoring a LoRA checkpoint's adapter gradients with a metric that reads its optimiser state (LESS,
    ``scoring/less.py``), per device, at ``run.checkpoints`` checkpoints (:func:`with_checkpoints`: adapters over one
    base, loaded once). The base model once; per checkpoint: its adapters (the run's weights dtype), the metric's own
    parts (LESS's ``memory_parts``: the Adam moments ``m``, ``v`` of every adapter matrix, float32), the validation
    gradients of the adapter matrices (:func:`lora_weights`, held as ``run.validation_gradients`` says); once: one
    batch's activations and LESS's per-example transient (``[B, out, in]`` per adapter matrix, and the Adam
    direction's four temporaries of that size: ``adam_direction``)."""

    metric = metric_registry()[method]
    if run.lora is None:
        raise UserInputError(f"method {method} scores LoRA adapters: plan it with --lora")
    wb, B, K = weight_bytes(run.precision), run.batch_size, run.tasks
    linears = lora_weights(sizes, run.lora)
    vg = validation_gradient_bytes(linears, K, run.validation_gradients)
    adapters = lora_params(sizes, run.lora) * wb
    parts = {"weights": sizes.params * wb + adapters,
             "activations": acts.total(sizes.shape.num_layers, B),
             "validation_gradients": vg["device"], "validation_layer": vg["layer"],
             "features": 5 * 4.0 * B * max((i * o for i, o in linears), default=0)}
    parts.update(metric.memory_parts(linears))
    f = scoring_flops(sizes.shape, n_train=run.pool_size, n_val=run.validation_examples, seq_len=run.max_length,
                      head_share=run.response_share)["total"] / run.devices
    parts, f = with_checkpoints(parts, f, run, adapters=adapters)  # the checkpoints share one base
    parts = with_validation_preparation(parts, vg, run)
    return _stage(f"scoring ({method})", parts, f, metric.memory_levers)


def tracin_or_store(sizes: ModelSizes, acts: Activations, run: RunSettings,
                    device_memory: float | None) -> dict[str, Any]:
    """For exact TracIn: its validation gradients at the run's holding, the fewest column groups that fit
    ``device_memory`` (at the run's dtype and device), and whether the gradient store (``build_store`` + ``query``:
    one pass over the pool, projected gradients, no dense validation gradient) is the better path, by how much
    (peak bytes per device, passes over the pool ≈ time). ``better``: ``"exact"`` (fits in one pass: exact scores
    at the store's cost), ``"store"`` (exact TracIn needs more passes, or does not fit even one column per pass,
    or its host copy exceeds ``host_memory`` when held on the host)."""
    tracked = [(l.in_features, l.out_features) for l in sizes.shape.linears if l.tracked]
    K = run.tasks
    holding = validation_holding_dict(run)
    dense = {"float32": validation_gradient_bytes(tracked, K, {"dtype": "float32"})["device"],
             "bfloat16": validation_gradient_bytes(tracked, K, {"dtype": "bfloat16"})["device"]}
    exact = scoring_plan(sizes, acts, run, "tracin")
    store = store_plan(sizes, acts, run)
    out: dict[str, Any] = {"columns": K, "holding": holding, "dense_validation_gradients": dense,
                           "exact_peak": exact.peak, "exact_passes": exact_passes(run), "store_peak": store.peak,
                           "store_passes": 1, "store_disk": store_disk_bytes(sizes, run)}
    fewest = None
    if device_memory is not None:
        for n in range(1, K + 1):
            r = dataclasses.replace(run, validation_gradients={**holding, "column_groups": n})
            if scoring_plan(sizes, acts, r, "tracin").peak <= device_memory:
                fewest = n
                break
        out["fewest_column_groups"] = fewest
        out["store_fits"] = store.peak <= device_memory
    host = dataclasses.replace(run, validation_gradients={**holding, "device": "cpu", "column_groups": 1})
    out["host_one_pass_peak"] = scoring_plan(sizes, acts, host, "tracin").peak  # held on the host, one pass
    on_host = validation_gradient_bytes(tracked, K, {**holding, "device": "cpu"})
    out["host_bytes"] = on_host["host"]  # the float32 sums, the host's peak
    out["host_transfer_per_batch"] = on_host["held"]  # every layer's moved to the device once per scored batch
    passes = fewest if device_memory is not None else exact_passes(run)
    if device_memory is None:
        out["better"] = None
        out["why"] = (f"exact TracIn needs {gib(exact.peak)} per device in {passes} pass(es) over the pool, the store's "
                      f"build {gib(store.peak)} in one (give the device memory to choose)")
    elif passes is None and not out["store_fits"]:
        out["better"] = "neither"
        out["why"] = (f"neither fits {gib(device_memory)}: exact TracIn not even one column per pass, the store's "
                      f"build needs {gib(store.peak)} per device (its weights and activations)")
    elif passes is None:
        out["better"] = "store"
        out["why"] = (f"exact TracIn does not fit even one column per pass ({K} passes); the store's build needs "
                      f"{gib(store.peak)} per device in one pass")
    elif passes > 1:
        out["better"] = "store"
        out["why"] = (f"exact TracIn needs {passes} passes over the pool (column groups, about {passes}x the store "
                      f"build's time) to fit; the store builds in one pass ({gib(store.peak)} per device)")
    else:
        out["better"] = "exact"
        one = scoring_plan(sizes, acts, dataclasses.replace(run, validation_gradients={**holding, "column_groups": 1}),
                           "tracin")
        out["why"] = (f"one pass fits ({gib(one.peak)} per device): exact scores for about the store "
                      "build's time")
    out["time_ratio"] = float(passes) if passes else None  # exact TracIn's passes over the pool / the store's one
    return out


def validation_holding_dict(run: RunSettings) -> dict[str, Any]:
    """``run.validation_gradients`` with every key (the defaults where not given)."""
    return {**VALIDATION_DEFAULTS, **dict(run.validation_gradients or {})}


def exact_passes(run: RunSettings) -> int:
    """Passes exact scoring makes over the pool at the run's holding (column groups, at most one per column)."""
    return min(int(validation_holding_dict(run)["column_groups"]), max(run.tasks, 1))


def store_disk_bytes(sizes: ModelSizes, run: RunSettings) -> float:
    """A gradient store's vectors on disk: one ``Σ k_out·k_in`` vector per pool example in the store's default
    float16 (``GradientStoreWriter`` ``store_dtype``)."""
    k = run.store_k
    dim = sum(min(k, l.out_features) * min(k, l.in_features) for l in sizes.shape.linears if l.tracked)
    return 2.0 * dim * run.pool_size


def fsdp_frozen_gathered_bytes(sizes: ModelSizes, wb: float) -> float:
    """Beside its shard, what a rank holds gathered while a model sharded per decoder block by FSDP2
    (``engine/fsdp.shard_frozen_per_block``: scoring and the store build under strategy ``fsdp``) runs: the root's
    weights (embeddings, head, norm: gathered through the step), two blocks (the one running and the next, prefetched),
    and a gather's transient: FSDP2 all-gathers a group into one buffer and copies it out into the group's unsharded
    weights, so the group is held twice until the copy is done (the root's, at the step's start, when it is the
    larger; else a block's). Measured on 2 gloo ranks: an embedding alone peaks at twice its size over the shard; an
    embedding and head of 256 MiB with 32 MiB blocks at 585 MiB over the shards, this count 576; the store build at
    width 2048 / vocabulary 32k 0.77 of the plan without the transient."""
    root = max(sizes.params - sizes.shape.num_layers * sizes.largest_block, 0)
    return (root + 2 * sizes.largest_block + max(root, sizes.largest_block)) * wb


_DDP_SYNC_BUCKET = 250 * 2**20  # lightning.pytorch.overrides.distributed._sync_module_states's bucket (bytes)


def ddp_state_broadcast_bytes(sizes: ModelSizes, wb: float) -> float:
    """The transient of Lightning's DDP outside ``fit`` (a predict: ``build_store --devices N``): before the loop it
    broadcasts rank 0's parameters to the other ranks (``_sync_module_states``: torch's ``_broadcast_coalesced``),
    the parameters in order in buckets closed once they reach 250 MiB, two buckets in flight, each a flat copy on
    every rank (measured at 4 blocks of width 1024, 2 gloo ranks: the whole 304 MiB of weights a second time). The
    parameters' order is the model's: the embedding, each block's linears (a factorised layer's two factors), the
    head if untied; the norms are too small to count."""
    s = sizes.shape
    tensors = [s.vocab_size * s.hidden_size]
    for l in s.linears:
        tensors += [l.in_features * l.out_features] if l.rank is None else [l.rank * l.out_features,
                                                                           l.in_features * l.rank]
    if sizes.params - sum(tensors) >= s.vocab_size * s.hidden_size:  # an untied head (a tied one is the embedding)
        tensors.append(s.vocab_size * s.hidden_size)
    buckets, size = [], 0.0
    for n in tensors:
        size += n * wb
        if size >= _DDP_SYNC_BUCKET:
            buckets, size = buckets + [size], 0.0
    buckets += [size] if size else []
    return max((a + b for a, b in zip(buckets, buckets[1:])), default=sum(buckets))


def store_plan(sizes: ModelSizes, acts: Activations, run: RunSettings) -> StagePlan:
    """A gradient store's build (TracIn, random projections of ``k`` rows per side), per device. On several devices
    (DDP ranks, each its share of the pool with the whole model) the build starts with rank 0's weights broadcast to
    the others (:func:`ddp_state_broadcast_bytes`), beside the weights alone: the larger of it and the loop's parts
    is counted. Under strategy ``fsdp`` (``build_store --strategy fsdp``: ``GradientStoreModule`` under
    ``ModelParallelStrategy``) the model is sharded per decoder block, as :func:`scoring_plan` counts it: the shard,
    the root's weights and two gathered blocks; no broadcast."""
    wb, B, k = weight_bytes(run.precision), run.batch_size, run.store_k
    tracked = [l for l in sizes.shape.linears if l.tracked]
    dim = sum(min(k, l.out_features) * min(k, l.in_features) for l in tracked)
    weights = sizes.params * wb
    fsdp = run.strategy == "fsdp" and run.devices > 1
    if fsdp:  # the shard, and while the model runs the gathered root and blocks (as scoring_plan)
        weights = sizes.params * wb / run.devices + fsdp_frozen_gathered_bytes(sizes, wb)
    parts = {
        "weights": weights,
        "activations": acts.total(sizes.shape.num_layers, B, checkpointing=run.store_gradient_checkpointing,
                                  hold_tracked=True),
        "projections": 4.0 * sum(min(k, l.out_features) * l.out_features + min(k, l.in_features) * l.in_features
                                 for l in tracked),
        "store_vectors": 4.0 * B * dim * run.write_every_n_batches,
    }
    broadcast = ddp_state_broadcast_bytes(sizes, wb) if run.devices > 1 and not fsdp else 0.0
    if broadcast > sum(parts.values()) - parts["weights"]:  # the broadcast, before the loop holds anything else
        parts = {"weights": parts["weights"], "weights_broadcast": broadcast}
    f = scoring_flops(sizes.shape, n_train=run.pool_size, n_val=0, seq_len=run.max_length,
                      head_share=run.response_share)["total"] / run.devices
    return _stage("store build", parts, f, {"weights_broadcast": "devices 1, or precision bf16-true (Lightning "
                                                                 "broadcasts rank 0's weights before a predict)"})


# --------------------------------------------------------------------------------------------
# with the proxy: scoring, the store build and the query (issue 64: 8B on one device)
# --------------------------------------------------------------------------------------------
def proxy_model(sizes: ModelSizes, acts: Activations, run: RunSettings) -> tuple[ModelSizes, Activations]:
    """The proxy of ``sizes`` at ``run.sparsity`` (:func:`proxy_sizes`: the rank per layer that keeps ``1 - sparsity``
    of its weights, the shapes Stage 2 is planned with) as a model of its own: its sizes (its tracked weights are
    the factors ``A: [out, r]``, ``B: [r, in]``, :func:`tracked_weights`) and its saved activations: the dense
    model's, plus per factorised layer its rank-``r`` bottleneck ``B h`` (the input of ``A``, saved for its backward),
    the weight copies ``bf16-mixed`` saves scaled to the factors."""
    shape, params = proxy_sizes(sizes, run.sparsity)
    L = max(sizes.shape.num_layers, 1)
    bottleneck = sum(l.rank for l in shape.linears if l.rank is not None) / L  # per layer, per token
    ab = activation_bytes(run.precision)
    ratio = shape.tracked_params / max(sizes.shape.tracked_params, 1)
    pacts = dataclasses.replace(acts, per_layer=int(acts.per_layer + run.max_length * bottleneck * ab),
                                fixed_per_layer=int(acts.fixed_per_layer * ratio),
                                tracked_input=int(acts.tracked_input + run.max_length * bottleneck * ab))
    block = sizes.largest_block - (sizes.shape.tracked_params - shape.tracked_params) // L
    return ModelSizes(shape, params, sizes.frozen, max(block, 0)), pacts


def tracked_weights(shape: ModelShape) -> list[tuple[int, int]]:
    """``(in_features, out_features)`` of every weight matrix scoring tracks in ``shape``: a dense layer's ``W``, a
    factorised layer's ``A: (r -> out)`` and ``B: (in -> r)`` (:func:`~iprox_lightning.scoring.features.virtual_linears`)."""
    out: list[tuple[int, int]] = []
    for l in shape.linears:
        if not l.tracked:
            continue
        out += [(l.in_features, l.out_features)] if l.rank is None else [(l.rank, l.out_features),
                                                                          (l.in_features, l.rank)]
    return out


def _features_bytes(linears: Iterable[tuple[int, int]], T: int, rows: int, columns: int) -> float:
    """The per-layer feature transient of scoring (the larger over the layers: per-example gradients where
    :func:`~iprox_lightning.scoring.features.choose_mode` materialises them, else the ghost ``[B, T, K, out]``)."""

    feat = 0.0
    for i, o in linears:
        size = rows * o * i if choose_mode(T, i, o, columns) == "materialize" else rows * T * columns * o
        feat = max(feat, 4.0 * size)
    return feat


def fused_head_bytes(sizes: ModelSizes, run: RunSettings, batch_size: int) -> float:
    """The backward-pairs engine's fused LM head + cross-entropy transient: one row chunk of logits (about ``2²⁵``
    logits, :func:`~iprox_lightning.engine.batch.linear_cross_entropy`) in float32, plus the bfloat16 matmul output it
    is widened from under ``bf16-mixed``."""
    V = sizes.shape.vocab_size
    rows = min(_head_rows(run, batch_size), max(1, (1 << 25) // max(V, 1)))
    return rows * V * (4.0 + (2.0 if run.precision == "bf16-mixed" else 0.0))


def proxy_scoring_phases(sizes: ModelSizes, acts: Activations, run: RunSettings) -> tuple[dict[str, float],
                                                                                         dict[str, float]]:
    """``(preparation, pool pass)``: the parts of each phase of :func:`proxy_scoring_plan` (the peak is the larger).
    The preparation's backward runs on a validation batch (``run.validation_batch``: ``validation_batch_size``, else
    the scoring batch), the pool pass's on a scoring batch (``run.batch_size``). ``run.proxy_validation``
    ``"target"``: the preparation holds the proxy and the dense target, the target's backward; ``"proxy"``
    (``pipeline --proxy_validation proxy``): the proxy's own validation gradients, no target."""
    wb, T, B, Bv, K = weight_bytes(run.precision), run.max_length, run.batch_size, run.validation_batch, run.tasks
    psizes, pacts = proxy_model(sizes, acts, run)
    linears = tracked_weights(psizes.shape)
    vg = validation_gradient_bytes(linears, K, run.validation_gradients)
    proxy_w = psizes.params * wb
    pool = {"proxy": proxy_w, "activations": pacts.total(psizes.shape.num_layers, B),
            "validation_gradients": vg["device"], "validation_layer": vg["layer"],
            "features": _features_bytes(linears, T, B, vg["group_columns"]),
            "lm_head_chunk": fused_head_bytes(psizes, run, B)}
    # the preparation: Σ over a batch's tokens of δᵀh per proxy weight and task (float32; a batch whose rows are each
    # its own task's, possible only when B <= K, as one batched [B, out, in] product: ValidationGradientTracker)
    features = 4.0 * max((i * o * (Bv if 1 < Bv <= K else 1) for i, o in linears), default=0)
    if run.proxy_validation == "proxy":  # the proxy's own backward on the validation batch
        prep = {"proxy": proxy_w, "activations": pacts.total(psizes.shape.num_layers, Bv),
                "validation_gradients": vg["device"], "features": features,
                "lm_head_chunk": fused_head_bytes(psizes, run, Bv)}
    else:
        prep = {"proxy": proxy_w, "target": sizes.params * wb,
                "target_activations": acts.total(sizes.shape.num_layers, Bv),
                "validation_gradients": vg["device"], "features": features,
                "lm_head_chunk": fused_head_bytes(sizes, run, Bv)}
    return prep, pool


def proxy_scoring_plan(sizes: ModelSizes, acts: Activations, run: RunSettings) -> StagePlan:
    """Scoring the pool with the proxy against its target's validation gradients (TracIn;
    ``InfluenceScoringModule(model=<proxy>, validation_model=<target>)``, the pipeline's proxy scoring), per device,
    one process. Two phases, as the code runs them (:func:`proxy_scoring_phases`): the preparation (the proxy and the
    dense target on the device, the target's backward on one validation batch, ``model.validation_batch_size`` or the
    scoring batch, its pairs projected into the proxy's factor coordinates by
    :class:`~iprox_lightning.scoring.features.FactorSpaceView` and summed into the validation gradients of the proxy's
    tracked weights, :func:`tracked_weights`); then the pool pass (the proxy alone: the scorer drops the target once
    every column is prepared, ``InfluenceScorer.release_validation_model``, and the module its own reference; the
    proxy's activations, its validation gradients as ``run.validation_gradients`` holds them, the feature transient).
    The peak is the larger phase. Column groups keep the target through every pass's preparation: counted by the
    preparation's phase, which holds it. On several devices: DDP, each rank holding both models (a proxy sharded by
    FSDP cannot be scored against another model's validation gradients: ``FactorSpaceView`` refuses it). With
    ``run.proxy_validation`` ``"proxy"`` the proxy is scored against its own validation gradients (no target)."""
    T = run.max_length
    psizes, _ = proxy_model(sizes, acts, run)
    vg = validation_gradient_bytes(tracked_weights(psizes.shape), run.tasks, run.validation_gradients)
    prep, pool = proxy_scoring_phases(sizes, acts, run)
    parts = prep if sum(prep.values()) >= sum(pool.values()) else pool
    n_val = run.validation_examples * (vg["passes"] + 1 if vg["passes"] > 1 else 1)
    val_shape = psizes.shape if run.proxy_validation == "proxy" else sizes.shape
    f = (scoring_flops(psizes.shape, n_train=run.pool_size * vg["passes"], n_val=0, seq_len=T,
                       head_share=run.response_share)["total"]
         + scoring_flops(val_shape, n_train=0, n_val=n_val, seq_len=T, head_share=run.response_share)["total"])
    return _stage(PROXY_SCORING, parts, f / run.devices,
                  {"target": "model.validation_batch_size of scoring (the target's validation batch), or precision "
                             "bf16-true",
                   "target_activations": "model.validation_batch_size of scoring (the target's backward on a "
                                         "validation batch)",
                   "activations": "data.batch_size of scoring (the pool pass), or model.validation_batch_size (the "
                                  "proxy's own validation pass)",
                   "proxy": "a higher sparsity, or precision bf16-true"})


def proxy_store_plan(sizes: ModelSizes, acts: Activations, run: RunSettings) -> StagePlan:
    """A gradient store's build with the proxy (``build_store --model <proxy>``): :func:`store_plan` of the proxy's
    own sizes and activations (:func:`proxy_model`): the projections and vectors of its tracked factors. The target
    is not read."""
    psizes, pacts = proxy_model(sizes, acts, run)
    s = store_plan(psizes, pacts, run)
    s.stage = PROXY_STORE
    return s


def query_plan(sizes: ModelSizes, acts: Activations, run: RunSettings, *, proxy: bool = False) -> StagePlan:
    """``train.py query`` of a gradient store, per device (one process): the validation examples' projected
    gradients (``batch_size`` per backward: the run's), summed per task (``[K, D]`` float64, ``D`` the store's
    dimension; the per-example vectors of every validation example only with ``neighbours``, not counted), then the
    pool's stored vectors streamed shard by shard (``write_every_n_batches · B`` rows, widened to float64 for the
    cosines), never the pool's gradients. ``proxy``: a proxy's store queried with its target's validation gradients
    (``--validation_model``): the target's backward, the proxy held beside it (its factors map the pairs, its
    projections); else the store's own model."""
    wb, B, k, K = weight_bytes(run.precision), run.batch_size, run.store_k, run.tasks
    model, macts = proxy_model(sizes, acts, run) if proxy else (sizes, acts)
    linears = tracked_weights(model.shape)
    dim = sum(min(k, o) * min(k, i) for i, o in linears)
    rows = B * run.write_every_n_batches
    # the validation gradients: the models, one batch's backward (on the dense model), the projections, a batch's
    # projected rows (float32) and the per-task sums (float64)
    val = {"weights": model.params * wb, "target": sizes.params * wb if proxy else 0.0,
           "activations": acts.total(sizes.shape.num_layers, B),
           "projections": 4.0 * sum(min(k, o) * o + min(k, i) * i for i, o in linears),
           "store_vectors": 4.0 * B * dim + 8.0 * K * dim, "lm_head_chunk": fused_head_bytes(sizes, run, B)}
    # then the models are dropped: a shard's rows (float16 as stored, widened to float64) and the table's columns
    table = {"store_vectors": (2.0 + 8.0) * rows * dim + 8.0 * K * dim, "scores": 2 * 8.0 * run.pool_size * (K + 1)}
    parts = val if sum(val.values()) >= sum(table.values()) else table
    f = scoring_flops(sizes.shape, n_train=0, n_val=run.validation_examples, seq_len=run.max_length,
                      head_share=run.response_share)["total"] + 2.0 * run.pool_size * dim * (K + 1)
    return _stage(PROXY_QUERY if proxy else QUERY, parts, f,
                  {"target": "precision bf16-true (the target's weights beside the proxy's)",
                   "activations": "query --batch_size (validation examples per backward)"})


PROXY_SCORING = "scoring with the proxy (tracin)"
PROXY_STORE = "store build (proxy)"
QUERY = "query"
PROXY_QUERY = "query (proxy store)"


def run_activations(config, run: "RunSettings") -> tuple[Activations, Activations]:
    """``(activations at run.precision, float32 activations)`` of ``config`` at ``run.max_length`` (counted on fake
    tensors; the float32 ones are the same count under ``32-true``)."""
    acts = saved_activation_bytes(config, seq_len=run.max_length, precision=run.precision,
                                  attn_implementation=run.attn_implementation)
    acts32 = acts if run.precision == "32-true" else saved_activation_bytes(
        config, seq_len=run.max_length, precision="32-true", attn_implementation=run.attn_implementation)
    return acts, acts32


def plan_stages(sizes: ModelSizes, config, run: RunSettings, *, acts: Activations | None = None,
                acts32: Activations | None = None) -> list[StagePlan]:
    """Every stage's :class:`StagePlan`, in run order (``acts`` / ``acts32``: counted already, e.g. by
    :func:`model_counts`; else counted from ``config``)."""
    if acts is None or acts32 is None:
        acts, acts32 = run_activations(config, run)
    n_warm = max(1, round(run.pool_size * run.warmup_fraction))
    stages = [training_plan(sizes, acts, run, stage="warm-up", n_examples=n_warm, epochs=run.warmup_epochs)]
    stages += list(build_proxy_plan(sizes, acts, run, acts32))
    # over the dense model's layers: LESS (a LoRA checkpoint's adapter gradients and Adam moments) is not planned here
    stages += [scoring_plan(sizes, acts, run, m) for m in planned_metrics()]
    stages.append(store_plan(sizes, acts, run))
    if run.lora is not None:  # LESS: the LoRA checkpoint's adapter gradients with its Adam moments
        stages += [less_scoring_plan(sizes, acts, run, m) for m in lora_metrics()]
    stages += [proxy_scoring_plan(sizes, acts, run), proxy_store_plan(sizes, acts, run), query_plan(sizes, acts, run),
               query_plan(sizes, acts, run, proxy=True)]
    stages.append(training_plan(sizes, acts, run, stage="fine-tune", n_examples=run.select_k,
                                epochs=run.finetune_epochs))
    return stages


# --------------------------------------------------------------------------------------------
# measured throughput
# --------------------------------------------------------------------------------------------
# which timed way of bench/speed.py measures each stage's work (tokens/s of a forward + backward)
_SPEED_KEYS = {"warm-up": "c2", "fine-tune": "c2", "scoring (tracin)": "a", "store build": "s"}


def measured_throughput(params: int, device_kind: str, results_dir: str | Path) -> dict[str, tuple[float, str]]:
    """``{speed key: (tokens/s, file)}`` from the ``speed_*.json`` files of ``bench/speed.py`` measured on a model
    of ``params`` parameters (within 1%) on ``device_kind``; the newest file per key wins (sorted by name)."""
    out: dict[str, tuple[float, str]] = {}
    for f in sorted(Path(results_dir).glob("speed_*.json")):
        d = read_json(f, what="a bench/speed.py measurement",
                      fix="measure again, remove the file or pass another --speed_results")
        fields = Fields(f)
        device = fields.get(d, "device", "str|null", default=None)
        n = fields.get(d, "params", "number|null", default=None)
        speeds = fields.get(d, "tokens_per_s", "object|null", default=None) or {}
        for k, v in speeds.items():
            fields.check(f"tokens_per_s.{k}", v, "number|null")
        if device != device_kind or not n or abs(n - params) > 0.01 * params:
            continue
        for k, v in speeds.items():
            if v is not None and v > 0:
                out[k] = (float(v), f.name)
    return out


def attach_times(stages: list[StagePlan], sizes: ModelSizes, run: RunSettings,
                 speeds: Mapping[str, tuple[float, str]]) -> None:
    """Seconds per stage where a measured throughput applies: a stage with its own timed way converts its tokens at
    that rate; the others (build_proxy, K-FAC) convert FLOPs at the FLOP rate the scoring measurement implies."""
    rate = None
    if "a" in speeds:
        per_token = scoring_flops(sizes.shape, n_train=1, n_val=0, seq_len=run.max_length,
                                  head_share=run.response_share)["total"] / run.max_length
        rate = (per_token * speeds["a"][0], speeds["a"][1])
    for s in stages:
        key = _SPEED_KEYS.get(s.stage)
        if key in speeds:
            tokens = s.flops / _flops_per_token(s.stage, sizes, run)
            s.seconds, s.time_source = tokens / speeds[key][0], f"measured {speeds[key][0]:.0f} tok/s ({speeds[key][1]})"
        elif rate is not None:
            s.seconds, s.time_source = s.flops / rate[0], f"FLOPs at the measured scoring rate ({rate[1]})"


def _flops_per_token(stage: str, sizes: ModelSizes, run: RunSettings) -> float:
    T, h = run.max_length, run.response_share
    if stage in ("warm-up", "fine-tune"):
        f = sizes.shape.forward_flops(1, T, head_share=h)["total"]
        f += sizes.shape.backward_flops(1, T, weight_grads="all", head_share=h)["total"]
        return f / T
    return scoring_flops(sizes.shape, n_train=1, n_val=0, seq_len=T, head_share=h)["total"] / T


# --------------------------------------------------------------------------------------------
# sizes as text
# --------------------------------------------------------------------------------------------
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3,
          "TIB": 1024**4}


def parse_bytes(text: str | int | float, option: str = "device_memory") -> float:
    """``"80GB"`` / ``"141 GiB"`` / ``"24e9"`` → bytes (GB = 10⁹, GiB = 2³⁰)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise UserInputError(f"{option}: cannot read {text!r} as a size (e.g. 80GB, 141GiB, 24e9)")
    return float(m.group(1)) * _UNITS[unit]


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"
