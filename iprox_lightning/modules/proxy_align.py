"""``ProxyAlignModule``: Stage 2 of IProX — train only the proxy's low-rank factors so its gradients
follow the target's (paper §4.2). The math lives in :mod:`iprox_lightning.alignment`:

``L = L_GA + λ_KL · L_KL`` with
``L_GA = mean_ℓ [1 − cos(∇_{A_ℓ} L_proxy, sg(∇_{W_ℓ} L) B_ℓᵀ) + 1 − cos(∇_{B_ℓ} L_proxy, A_ℓᵀ sg(∇_{W_ℓ} L))]`` and
``L_KL = τ² · mean over response tokens of KL(softmax(f_target/τ) ‖ softmax(f_proxy/τ))``.

Models:

* ``self.teacher`` — the target, loaded from ``target``; frozen (``requires_grad=False``), always in
  eval mode, kept **outside** the module tree: it is in no ``state_dict``/checkpoint, in no optimiser,
  and DDP/FSDP never wrap it; ``.to()``/``.cuda()``/``.half()`` of this module move it along.
* ``self.proxy`` — a deep copy of the target (then compressed in place by
  :class:`~iprox_lightning.callbacks.IPSVDCallback`, which calls ``configure_model()`` in its
  ``setup("fit")``), or a saved proxy directory given as ``proxy``. Only the ``A``/``B`` factors of its
  :class:`~iprox_lightning.lowrank.LowRankLinear` layers train; every other tensor (biases, norms,
  embeddings, LM head, layers kept dense) is frozen and stays bit-identical. Both models run in eval
  mode (dropout off) so their gradients are comparable.

One training step: teacher forward+backward (hooks project ``∇_W L`` to ``(P_A, P_B)`` without forming
it) → proxy forward → ``autograd.grad(L_proxy, factors, create_graph=True)`` → ``L`` → **one** backward
(Lightning's automatic optimisation). Attention must support double backward (eager attention; the
loader's default).

Distributed semantics (DDP): each rank aligns on its local micro-batch — its own teacher projections,
its own proxy gradients, its own cosines — and the single backward all-reduces (averages) the gradient
of its local ``L``. The step therefore equals single-process training on the **mean of the per-micro-batch
losses** ``(L(b_0) + … + L(b_{N-1}))/N`` — the same as gradient accumulation over the micro-batches — and
not ``L`` of the concatenated batch (cosines of summed gradients do not decompose over examples).
Ranks end with identical factors.

Ablations: ``kl_weight=0`` (no KL anchor), ``align=False`` (IPSVD only: fit trains nothing and only
saves the proxy), SVD instead of IPSVD init is ``IPSVDCallback(method="svd")``.

At the end of ``fit`` the aligned proxy is written to ``save_dir`` with
:func:`iprox_lightning.compress.save_proxy` (rank 0), its manifest extended with the alignment settings.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import nn

from ..alignment import AlignmentOutput, alignment_losses, proxy_factor_layers
from ..lowrank import LowRankLinear
from .causal_lm import apply_fully_shard, full_state_dict, is_sharded, linear_warmup_decay, resolve_model

log = logging.getLogger(__name__)


def _is_proxy_dir(source: Any) -> bool:
    from ..models.loading import PROXY_MANIFEST

    return isinstance(source, str) and (Path(source) / PROXY_MANIFEST).is_file()


@dataclass(frozen=True)
class AlignConfig:
    """The settings of Stage 2 (the alignment objective and its optimisation), checked when built.

    ``ProxyAlignModule`` builds it from its options (same names) and keeps it as ``module.config``; it is
    written verbatim into the ``"alignment"`` block of the proxy manifest.

    Args:
        lr: AdamW learning rate over the factors (paper grid {1e-5, 5e-5, 1e-4}).
        weight_decay: AdamW weight decay (paper: 0.01).
        kl_weight: λ_KL, the weight of the logits anchor (paper grid {0, 0.1, 0.01, 0.001}); 0 disables it.
        temperature: τ of the KL term.
        align: ``False`` → the IPSVD-only ablation: no alignment step, ``fit`` just saves the proxy.
        grad_through_projection: keep the projections of ``∇_W L`` onto the factors differentiable (the paper's
            formula) rather than constants.
        layers: restrict alignment to these proxy layer paths (default: every ``LowRankLinear``).
        warmup_ratio: share of the steps with a linear learning-rate warm-up.
        lr_schedule: ``"constant"`` or ``"linear"`` (decay to 0 after the warm-up).
        keep_best: keep the factors with the best held-out ``monitor`` and restore them before saving.
        monitor: the held-out metric of ``keep_best`` (a logged ``val/*`` metric, lower is better).
    """

    lr: float = 5e-5
    weight_decay: float = 0.01
    kl_weight: float = 0.1
    temperature: float = 2.0
    align: bool = True
    grad_through_projection: bool = True
    layers: Optional[tuple[str, ...]] = None
    warmup_ratio: float = 0.0
    lr_schedule: str = "constant"
    keep_best: bool = True
    monitor: str = "val/loss"

    def __post_init__(self) -> None:
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        if self.kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {self.kl_weight}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


class ProxyAlignModule(L.LightningModule):
    """Stage 2 alignment of a low-rank proxy to its target (see the module docstring).

    Args:
        target: the (warmed-up) target model — hub id, directory, ``.gguf`` or ``"builtin"``; or an ``nn.Module``.
        proxy: a saved proxy directory (or module) to start from; ``None``: a deep copy of the target that
            ``IPSVDCallback`` compresses before training.
        lr: AdamW learning rate over the factors (paper grid {1e-5, 5e-5, 1e-4}).
        weight_decay: AdamW weight decay (paper: 0.01).
        kl_weight: λ_KL (paper grid {0, 0.1, 0.01, 0.001}, default 0.1); ``0`` disables the KL anchor.
        temperature: τ of the KL term.
        align: ``False`` → IPSVD-only ablation: no alignment step, fit just saves the proxy.
        save_dir: where the aligned proxy is saved at the end of ``fit``.
        grad_through_projection: keep the projections ``sg(∇_W L)·Bᵀ``, ``Aᵀ·sg(∇_W L)`` differentiable in
            the factors (the paper's formula; keeps each layer's per-token ``h``/``δ`` for the step) —
            ``False`` treats them as constants (memory of the projections only).
        layers: restrict alignment to these proxy layer paths (default: every ``LowRankLinear``).
        warmup_ratio: share of the steps with a linear learning-rate warm-up.
        lr_schedule: ``"constant"`` (default: the paper states no schedule) or ``"linear"`` (decay to 0).
        dtype: dtype of both models when loaded by name.
        log_layer_cosines: log every layer's cosines (``align/cos_A/<layer>``, ``align/cos_B/<layer>``).
        keep_best: after every validation run, compare the held-out ``monitor`` (a logged ``val/*`` metric,
            lower is better; default ``val/loss`` = held-out ``L_GA + λ_KL·L_KL``) with the best so far and keep
            a copy of the factors that reached it; at the end of ``fit`` the best factors are restored before
            saving (the manifest records the step, the value and every validation result). Without a
            validation loader nothing is kept and the last factors are saved.
        monitor: the held-out metric of ``keep_best``.
    """

    def __init__(
        self,
        target: Union[str, nn.Module] = "builtin",
        proxy: Optional[Union[str, nn.Module]] = None,
        lr: float = 5e-5,
        weight_decay: float = 0.01,
        kl_weight: float = 0.1,
        temperature: float = 2.0,
        align: bool = True,
        save_dir: Optional[str] = None,
        grad_through_projection: bool = True,
        layers: Optional[list[str]] = None,
        warmup_ratio: float = 0.0,
        lr_schedule: str = "constant",
        dtype: str = "float32",
        log_layer_cosines: bool = True,
        keep_best: bool = True,
        monitor: str = "val/loss",
    ) -> None:
        super().__init__()
        self.config = AlignConfig(lr=lr, weight_decay=weight_decay, kl_weight=kl_weight, temperature=temperature,
                                  align=align, grad_through_projection=grad_through_projection, layers=layers,
                                  warmup_ratio=warmup_ratio, lr_schedule=lr_schedule, keep_best=keep_best,
                                  monitor=monitor)
        ignore = [k for k, v in (("target", target), ("proxy", proxy)) if isinstance(v, nn.Module)]
        self.save_hyperparameters(ignore=ignore or None)
        # plain attributes (never registered submodules, even when given as nn.Module)
        object.__setattr__(self, "target_source", target)
        object.__setattr__(self, "proxy_source", proxy)
        object.__setattr__(self, "_teacher", None)  # outside the module tree: no state_dict, no DDP/FSDP
        self.proxy: Optional[nn.Module] = None
        self.tokenizer: Any = None
        self.ipsvd_report: Any = None  # set by IPSVDCallback after compressing; goes into the saved manifest
        self._best: Optional[dict[str, Any]] = None  # keep_best: {"value", "step", "factors"}
        self.validation_history: list[dict[str, float]] = []

    # ------------------------------------------------------------------------------------- models
    @property
    def teacher(self) -> Optional[nn.Module]:
        """The frozen target (eval mode, no grad); not a registered submodule."""
        return self._teacher

    def configure_model(self) -> None:
        """Build teacher and proxy (idempotent) and (re)apply the trainable set: only ``LowRankLinear``
        factors. Safe to call again after ``IPSVDCallback`` swapped layers (Lightning does)."""
        if self.proxy is None:
            teacher, tok = resolve_model(self.target_source, self.hparams.dtype)
            teacher.eval().requires_grad_(False)
            object.__setattr__(self, "_teacher", teacher)
            if self.proxy_source is None:
                proxy = copy.deepcopy(teacher)
            else:
                proxy, ptok = resolve_model(self.proxy_source, self.hparams.dtype)
                tok = tok if tok is not None else ptok
            self.tokenizer = tok
            if hasattr(proxy, "config"):
                proxy.config.use_cache = False
            self.proxy = proxy
        self._set_trainable()
        if self._device_mesh is not None and not is_sharded(self.proxy) and any(
                isinstance(m, LowRankLinear) for m in self.proxy.modules()):
            self._shard_proxy()

    def _shard_proxy(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): shard the proxy per decoder block, keeping the unsharded
        parameters alive through both backward passes (``reshard_after_forward=False`` and
        ``set_reshard_after_backward(False)``); they are freed after each optimiser step
        (:meth:`on_train_batch_end`) so the next forward all-gathers the updated shards.
        The gradients are taken w.r.t. the unsharded factors the forward used (see
        :func:`~iprox_lightning.alignment.alignment_losses`). The teacher stays replicated."""
        from torch.distributed.fsdp import FSDPModule

        mesh = self._device_mesh
        dp = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            raise ValueError("tensor parallelism is not supported: use ModelParallelStrategy(data_parallel_size=N, "
                             "tensor_parallel_size=1) for FSDP2")
        apply_fully_shard(self.proxy, dp, reshard_after_forward=False)
        for m in self.proxy.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_backward(False)

    def _reshard(self) -> None:
        if self.proxy is None or not is_sharded(self.proxy):
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.proxy.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def on_fit_start(self) -> None:
        # The proxy runs in eval mode (no dropout; alignment_step switches it before every forward). Hand it
        # to the fit loop in train mode so Lightning's "modules in eval mode at the start of training" check,
        # meant for accidental eval mode, stays quiet for this intentional one.
        if self.proxy is not None:
            self.proxy.train()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._reshard()  # FSDP2: drop the stale unsharded factors after the optimiser step

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._reshard()

    def _set_trainable(self) -> None:
        self.proxy.eval()
        self.proxy.requires_grad_(False)
        only = set(self.config.layers) if self.config.layers is not None else None
        for name, m in self.proxy.named_modules():
            if isinstance(m, LowRankLinear) and (only is None or name in only):
                m.A.requires_grad_(True)
                m.B.requires_grad_(True)

    def factor_parameters(self) -> list[nn.Parameter]:
        """The trainable ``A``/``B`` of the aligned layers, in model order."""
        return [p for m in proxy_factor_layers(self.proxy, self.config.layers).values() for p in (m.A, m.B)]

    def _apply(self, fn, *args, **kwargs):
        # ``.to(device)``, ``.cuda()``, ``.double()`` … also reach the unregistered teacher
        super()._apply(fn, *args, **kwargs)
        if self._teacher is not None:
            self._teacher._apply(fn, *args, **kwargs)
        return self

    # ------------------------------------------------------------------------------------- steps
    def alignment_step(self, batch: dict, *, create_graph: bool = True) -> AlignmentOutput:
        """``L_GA + λ_KL·L_KL`` on ``batch`` (see :func:`iprox_lightning.alignment.alignment_losses`)."""
        if self.proxy.training:
            self.proxy.eval()
        if self._teacher.training:
            self._teacher.eval()
        return alignment_losses(
            self._teacher, self.proxy, batch,
            kl_weight=self.config.kl_weight, temperature=self.config.temperature,
            grad_through_projection=self.config.grad_through_projection,
            create_graph=create_graph, layers=self.config.layers,
        )

    def _log_output(self, out: AlignmentOutput, prefix: str, batch_size: int, per_layer: bool) -> None:
        cos_a, cos_b = out.mean_cosines()
        on_step = prefix == "align"
        sync = prefix != "align"
        self.log(f"{prefix}/l_ga", out.l_ga, prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 batch_size=batch_size, sync_dist=sync)
        self.log_dict({f"{prefix}/loss": out.loss.detach(), f"{prefix}/l_kl": out.l_kl,
                       f"{prefix}/cos_A_mean": cos_a, f"{prefix}/cos_B_mean": cos_b,
                       f"{prefix}/proxy_sft": out.proxy_sft, f"{prefix}/teacher_sft": out.teacher_sft},
                      on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=sync)
        if per_layer:
            d = {f"{prefix}/cos_A/{n}": c for n, c in out.cos_a.items()}
            d.update({f"{prefix}/cos_B/{n}": c for n, c in out.cos_b.items()})
            self.log_dict(d, on_step=on_step, on_epoch=not on_step, batch_size=batch_size, sync_dist=sync)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        if not self.config.align:
            return -1  # IPSVD-only ablation: skip the epoch, on_fit_end still saves
        return None

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.alignment_step(batch, create_graph=True)
        self._log_output(out, "align", batch["input_ids"].shape[0], self.hparams.log_layer_cosines)
        return out.loss

    def validation_step(self, batch: dict, batch_idx: int, dataloader_idx: int = 0) -> None:
        # cosines on held-out data need gradients: leave inference mode; clone inference tensors
        with torch.inference_mode(False), torch.enable_grad():
            batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            out = self.alignment_step(batch, create_graph=False)
        self._log_output(out, "val", batch["input_ids"].shape[0], self.hparams.log_layer_cosines)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        if not metrics:
            return
        self.validation_history.append({"step": int(self.global_step), **metrics})
        if not self.config.keep_best:
            return
        if self.config.monitor not in metrics:
            raise KeyError(f"ProxyAlignModule(monitor={self.config.monitor!r}): not among the logged held-out "
                           f"metrics {sorted(metrics)}")
        value = metrics[self.config.monitor]
        if self._best is None or value < self._best["value"]:
            factors = [p.detach().clone() for p in self.factor_parameters()]
            self._best = {"value": value, "step": int(self.global_step), "factors": factors}

    def restore_best(self) -> Optional[dict[str, Any]]:
        """Copy the kept best factors back into the proxy (``keep_best``); returns ``{"value", "step"}``
        or ``None`` when nothing was kept."""
        if self._best is None:
            return None
        with torch.no_grad():
            for p, q in zip(self.factor_parameters(), self._best["factors"]):
                p.copy_(q)
        return {"value": self._best["value"], "step": self._best["step"]}

    # ------------------------------------------------------------------------------------- optim
    def configure_optimizers(self):
        params = self.factor_parameters()
        ids = {id(p) for p in params}
        extra = [n for n, p in self.proxy.named_parameters() if p.requires_grad and id(p) not in ids]
        if extra:
            raise RuntimeError(f"ProxyAlignModule: only LowRankLinear factors may train, but {extra[:5]} require grad")
        if self._teacher is not None and any(p.requires_grad for p in self._teacher.parameters()):
            raise RuntimeError("ProxyAlignModule: the teacher must be frozen")
        opt = torch.optim.AdamW(params, lr=self.config.lr, weight_decay=self.config.weight_decay)
        if self.config.lr_schedule == "constant" and self.config.warmup_ratio == 0:
            return opt
        total = self.trainer.estimated_stepping_batches
        sched = linear_warmup_decay(opt, int(total), self.config.warmup_ratio, self.config.lr_schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ------------------------------------------------------------------------------------- saving
    def on_fit_end(self) -> None:
        best = self.restore_best() if self.config.keep_best else None
        if best is not None:
            log.info("restored the best held-out factors: %s = %.6g at step %d", self.config.monitor,
                     best["value"], best["step"])
        if self.hparams.save_dir:
            self.save_proxy(self.hparams.save_dir)

    def save_proxy(self, save_dir: str) -> Path:
        """Write the proxy directory (:func:`iprox_lightning.compress.save_proxy`) on rank 0."""
        from ..compress import read_manifest, save_proxy

        path = Path(save_dir)
        zero = self.trainer.is_global_zero if self._trainer is not None else True
        full = full_state_dict(self.proxy)  # collective under FSDP2 (full tensors on rank 0)
        if zero:
            proxy = self.proxy if full is None else self._unsharded_copy(full)
            manifest = self.ipsvd_report
            if manifest is None and _is_proxy_dir(self.proxy_source):
                manifest = {k: v for k, v in read_manifest(self.proxy_source).items()
                            if k not in ("format_version", "layers", "dtype", "params_after")}
            extra: dict[str, Any] = {"alignment": {
                **asdict(self.config),
                "aligned": bool(self.config.align),
                "steps": int(self.global_step) if self._trainer is not None else 0,
                "best": ({"value": self._best["value"], "step": self._best["step"]}
                         if self._best is not None else None),
                "validation_history": self.validation_history,
            }}
            if isinstance(self.target_source, str) and not (isinstance(manifest, dict) and manifest.get("target_model")):
                extra["target_model"] = self.target_source
            save_proxy(proxy, self.tokenizer, path, manifest, **extra)
            log.info("saved aligned proxy to %s", path)
        if self._trainer is not None:
            self.trainer.strategy.barrier("save_proxy")
        return path

    def _unsharded_copy(self, state_dict: dict) -> nn.Module:
        """A plain (unsharded) proxy holding ``state_dict``: the teacher's architecture with the same
        ``LowRankLinear`` layers (ranks read from the factor shapes)."""
        from ..models.targets import set_submodule

        model = copy.deepcopy(self._teacher).to("cpu")
        for name, m in self.proxy.named_modules():
            if isinstance(m, LowRankLinear):
                A = state_dict[f"{name}.A"]
                set_submodule(model, name, LowRankLinear(m.in_features, m.out_features, A.shape[1],
                                                          bias=m.bias is not None, dtype=A.dtype))
        model.load_state_dict(state_dict, strict=True)
        return model
