"""Full fine-tuning of a Hugging Face causal LM with the response-token SFT loss — the shared base of
:class:`~iprox_lightning.modules.WarmupModule` and :class:`~iprox_lightning.modules.FinetuneModule`.

* Loss: token-mean cross-entropy over the response tokens (``labels != -100``) of the **global**
  batch. Under DDP/FSDP each rank divides its summed token loss by the response-token count of all
  ranks (one ``all_reduce`` of a scalar) and multiplies by the world size, so the gradient average
  the strategy performs equals the gradient of the token-mean over the concatenated batch —
  single-device training on the concatenated batch and ``N``-rank training give the same step.
  (With ``accumulate_grad_batches > 1`` each micro-batch is normalised by its own token count; ``micro_batch_size``
  splits each batch into micro-batches weighted by the batch's token count instead, exactly:
  :mod:`~iprox_lightning.training.memory_levers`.)
* Optimiser: AdamW; weight decay on matrices only (biases and norm weights get none, as the
  Hugging Face ``Trainer`` does); linear warm-up over ``warmup_ratio`` of the steps then linear decay
  to 0 (``lr_schedule="linear"``), or a constant rate.
* ``freeze_embeddings``: the input embeddings and the LM head (tied or not) are frozen.
* FSDP2: under Lightning's ``ModelParallelStrategy`` every decoder block (``model._no_split_modules``)
  and then the root are wrapped with ``fully_shard`` over the data-parallel mesh in ``configure_model``
  (``fsdp_cpu_offload``: the sharded weights, gradients and AdamW moments in host memory).
* At the end of ``fit`` the model is written with ``save_pretrained`` (safetensors) + the tokenizer
  into ``save_dir`` by rank 0 (under FSDP2 the full state dict is gathered first on every rank).
* ``lora`` (``{r, alpha, dropout, target_modules}``, :class:`~iprox_lightning.models.lora.LoraSettings`): LoRA through
  peft instead of full fine-tuning: the base weights frozen, the adapters trained; the adapters are saved at the end
  of every epoch into ``save_dir/adapters/epoch_<n>`` and at the end of ``fit`` into ``save_dir/adapters/final``
  (peft's format, safetensors), and ``save_dir`` itself gets the merged dense model (what the next stage reads).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..console import transformers_bars_off
from ..engine.batch import check_batch, micro_batches, scored_logits
from ..engine.fsdp import apply_fully_shard, is_sharded  # noqa: F401  (used here and by alignment/)
from ..errors import UserInputError
from ..io.atomic import named_os_errors
from ..io.output_guard import check_output_not_input
from ..io.ownership import make_owned_dir
from ..models.loading import load_model
from ..models.lora import LoraSettings
from .lora import note_step_lr, save_epoch_adapter, save_final_and_merge, with_adapters
from .memory_levers import cpu_offload_policy, enable_checkpointing, response_tokens

log = logging.getLogger(__name__)

LR_SCHEDULES = ("linear", "constant")


def resolve_model(model: Union[str, nn.Module], dtype: str = "float32", attn_implementation: Optional[str] = "eager"):
    """``(model, tokenizer)`` from a name/path (:func:`~iprox_lightning.models.loading.load_model`) or a module."""
    if isinstance(model, nn.Module):
        return model, None
    return load_model(model, dtype=dtype, attn_implementation=attn_implementation)


def freeze_embeddings_and_head(model: nn.Module) -> list[str]:
    """Freeze the input embeddings and the LM head (one call covers tied weights). Returns frozen param names."""
    frozen = []
    ids = set()
    for mod in (model.get_input_embeddings(), model.get_output_embeddings()):
        if mod is None:
            continue
        for p in mod.parameters():
            p.requires_grad_(False)
            ids.add(id(p))
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in ids:
            frozen.append(n)
    return frozen


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: trainable params of dim ≥ 2 decayed, biases / norm weights (dim < 2) not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def linear_warmup_decay(optimizer, total_steps: int, warmup_ratio: float, schedule: str = "linear"):
    """``LambdaLR``: linear warm-up over ``ceil(warmup_ratio·total)`` steps, then linear decay to 0
    (``"linear"``) or constant (``"constant"``)."""
    if schedule not in LR_SCHEDULES:
        raise UserInputError(f"lr_schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    total = max(int(total_steps), 1)
    warm = int(math.ceil(warmup_ratio * total))

    def factor(step: int) -> float:
        if warm > 0 and step < warm:
            return (step + 1) / (warm + 1)
        if schedule == "constant":
            return 1.0
        return max(0.0, (total - step) / max(total - warm, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full (unsharded, CPU) state dict; a collective under FSDP2 — call it on every rank."""
    if not is_sharded(model):
        return None

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class CausalLMModule(L.LightningModule):
    """Full fine-tuning of a causal LM on the SFT batch format (see the module docstring).

    Args:
        model: hub id, local directory, ``.gguf`` file, saved proxy dir or ``"builtin"``
            (:func:`~iprox_lightning.models.loading.load_model`); an ``nn.Module`` also works from Python.
        lr: AdamW learning rate (paper: 1e-5).
        weight_decay: AdamW weight decay, on matrices only (paper: 0.01).
        freeze_embeddings: freeze input embeddings and LM head.
        save_dir: where ``save_pretrained`` writes the trained model + tokenizer at the end of ``fit``.
        warmup_ratio: share of the steps with a linear learning-rate warm-up.
        lr_schedule: after the warm-up, ``"linear"`` (decay to 0) or ``"constant"``.
        gradient_checkpointing: HF gradient checkpointing (``use_reentrant=False``).
        dtype: weights dtype when loading by name (``"float32"``, ``"bfloat16"``, ...).
        fsdp_reshard_after_forward: FSDP2 ``reshard_after_forward`` (only under ``ModelParallelStrategy``).
        micro_batch_size: split each batch into micro-batches of at most this many examples, each one's forward and
            backward in turn, one optimiser step per batch: the same step (the loss is weighted by the whole batch's
            response tokens), steps and schedule as the whole batch, with one micro-batch's activations
            (:mod:`~iprox_lightning.training.memory_levers`). ``None``: the whole batch at once.
        fsdp_cpu_offload: under ``ModelParallelStrategy`` (FSDP2), keep the sharded weights, gradients and AdamW
            moments in host memory (the optimiser steps there).
        lora: LoRA adapters ``{r, alpha, dropout, target_modules}`` instead of full fine-tuning (default: none);
            see the module docstring.
    """

    def __init__(
        self,
        model: Union[str, nn.Module] = "builtin",
        lr: float = 1e-5,
        weight_decay: float = 0.01,
        freeze_embeddings: bool = True,
        save_dir: Optional[str] = None,
        warmup_ratio: float = 0.03,
        lr_schedule: str = "linear",
        gradient_checkpointing: bool = False,
        dtype: str = "float32",
        fsdp_reshard_after_forward: bool = True,
        micro_batch_size: Optional[int] = None,
        fsdp_cpu_offload: bool = False,
        lora: Optional[dict] = None,
    ) -> None:
        super().__init__()
        if micro_batch_size is not None and (type(micro_batch_size) is not int or micro_batch_size < 1):
            raise UserInputError(f"micro_batch_size must be an integer >= 1 or null, got {micro_batch_size!r}")

        self.lora_settings = LoraSettings.of(lora)  # checked before any training
        if lr_schedule not in LR_SCHEDULES:
            raise UserInputError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
        if not 0.0 <= warmup_ratio < 1.0:
            raise UserInputError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
        if save_dir:  # before any training: the trained model never replaces the model it starts from
            check_output_not_input(save_dir, {"model": model}, "save_dir")
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        object.__setattr__(self, "model_source", model)  # never a registered submodule
        self.model: Optional[nn.Module] = None
        self.tokenizer: Any = None
        if micro_batch_size is not None:  # the module steps the optimiser itself, once per batch
            self.automatic_optimization = False

    # ------------------------------------------------------------------------------------- model
    def configure_model(self) -> None:
        """Load the model (idempotent), freeze embeddings/head, shard under ``ModelParallelStrategy``."""
        if self.model is not None:
            return
        model, tok = resolve_model(self.model_source, self.hparams.dtype)
        self.tokenizer = tok
        model.train()
        model.requires_grad_(True)
        if self.hparams.freeze_embeddings:
            frozen = freeze_embeddings_and_head(model)
            log.info("frozen embeddings / LM head: %s", frozen)
        if self.lora_settings is not None:
            model = with_adapters(model, self.lora_settings, self.model_source, self._device_mesh)
        if self.hparams.gradient_checkpointing:
            enable_checkpointing(model)
        if hasattr(model, "config"):
            model.config.use_cache = False
        mesh = self._device_mesh
        if mesh is not None:
            dp = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
            if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
                raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                                 "tensor_parallel_size=1) for FSDP2")

            apply_fully_shard(model, dp, reshard_after_forward=self.hparams.fsdp_reshard_after_forward,
                              offload_policy=cpu_offload_policy() if self.hparams.fsdp_cpu_offload else None)
        self.model = model

    # ------------------------------------------------------------------------------------- steps
    def _global_token_count(self, n_local: torch.Tensor) -> torch.Tensor:
        n = n_local.detach().float().clone()
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.trainer.world_size > 1:
            torch.distributed.all_reduce(n)
        return n

    def sft_step(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss for backward, local token-mean loss for logging)`` — see the module docstring."""
        check_batch(batch)
        logits, scored = scored_logits(self.model, batch, use_cache=False)  # the LM head on response tokens only
        ce_sum, n = scored.ce_sums(logits)
        local_sum, local_n = ce_sum.sum(), n.sum()
        world = self.trainer.world_size if self._trainer is not None else 1
        global_n = self._global_token_count(local_n) if world > 1 else local_n.float()
        loss = local_sum * world / global_n.clamp_min(1)
        return loss, (local_sum / local_n.clamp_min(1)).detach()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if not self.automatic_optimization:
            return self._micro_batch_step(batch)
        loss, local = self.sft_step(batch)
        self.log("train/loss", local, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def _micro_batch_step(self, batch: dict) -> torch.Tensor:
        """One optimiser step over ``batch`` in micro-batches of ``micro_batch_size`` (see the module docstring)."""
        check_batch(batch)
        world = self.trainer.world_size
        local_n = response_tokens(batch).float()
        global_n = (self._global_token_count(local_n) if world > 1 else local_n).clamp_min(1)
        opt = self.optimizers()
        total = torch.zeros((), device=local_n.device)
        for micro in micro_batches(batch, int(self.hparams.micro_batch_size)):
            logits, scored = scored_logits(self.model, micro, use_cache=False)
            ce_sum = scored.ce_sums(logits)[0].sum()
            self.manual_backward(ce_sum * world / global_n)
            total += ce_sum.detach()
        opt.step()
        opt.zero_grad()
        sched = self.lr_schedulers()
        if sched is not None:
            sched.step()
        local = total / local_n.clamp_min(1)
        self.log("train/loss", local, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return local

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        check_batch(batch)
        if self.hparams.get("micro_batch_size") is not None:  # the LM head's [N, V] logits of one micro-batch at a time
            sums = []
            for micro in micro_batches(batch, self.hparams.micro_batch_size):
                logits, scored = scored_logits(self.model, micro, use_cache=False)
                sums.append(scored.ce_sums(logits))
            ce_sum, n = torch.cat([c for c, _ in sums]), torch.cat([k for _, k in sums])
        else:
            logits, scored = scored_logits(self.model, batch, use_cache=False)
            ce_sum, n = scored.ce_sums(logits)
        self.log("val/loss", ce_sum.sum() / n.sum().clamp_min(1), prog_bar=True, sync_dist=True,
                 batch_size=batch["input_ids"].shape[0])

    # ------------------------------------------------------------------------------------- optim
    def configure_optimizers(self):
        groups = decay_param_groups(self.model, self.hparams.weight_decay)
        if not any(g["params"] for g in groups):
            raise ValueError("no trainable parameter: everything is frozen")
        opt = torch.optim.AdamW(groups, lr=self.hparams.lr)
        if self.hparams.lr_schedule == "constant" and self.hparams.warmup_ratio == 0:
            return opt
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise UserInputError("the linear schedule needs a finite number of steps (set max_epochs or max_steps)")
        sched = linear_warmup_decay(opt, int(total), self.hparams.warmup_ratio, self.hparams.lr_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------------------------- saving
    def on_before_optimizer_step(self, optimizer) -> None:
        if self.lora_settings is not None:  # each step's learning rate: an epoch's mean is its LESS weight
            note_step_lr(self, optimizer)

    def on_train_epoch_end(self) -> None:
        if self.lora_settings is not None and self.hparams.save_dir:
            save_epoch_adapter(self, f"epoch_{self.current_epoch + 1}")

    def on_fit_end(self) -> None:
        if self.hparams.save_dir:
            if self.lora_settings is not None:
                save_final_and_merge(self)  # the adapters, then self.model the merged dense model
            self.save_model(self.hparams.save_dir)

    def save_model(self, save_dir: str) -> Optional[Path]:
        """``save_pretrained`` (safetensors) + tokenizer into ``save_dir`` on rank 0; all ranks must call it."""
        sd = full_state_dict(self.model)  # collective under FSDP2
        path = Path(save_dir)
        if self.trainer.is_global_zero if self._trainer is not None else True:
            make_owned_dir(path, "model")  # marked when created (or found empty): ours to replace
            kwargs: dict[str, Any] = {"safe_serialization": True}
            if sd is not None:
                kwargs["state_dict"] = sd

            # a full disk in safetensors' writer (SafetensorError '(os error 28)') is an OSError naming the directory:
            # one line on the command line, and the pipeline redoes the stage (issue 61)
            with transformers_bars_off(), named_os_errors(path):
                self.model.save_pretrained(path, **kwargs)
                if self.tokenizer is not None:
                    self.tokenizer.save_pretrained(path)
            rank_zero_info(f"{type(self).__name__}: saved the model ({type(self.model).__name__}) to {path}")
        if self._trainer is not None:
            self.trainer.strategy.barrier("save_model")
        return path
