"""A checkpoint's Adam state: the only reader and writer of ``optimizer_state.safetensors``, which a LoRA warm-up saves
beside each epoch's adapters (``<save_dir>/adapters/epoch_<n>/``) and LESS's training gradients read
(:class:`~iprox_lightning.scoring.metrics.LESS`).

The file holds, per trained parameter (named as in the model the optimiser trained, e.g. peft's
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``), its first and second moments,
``<name>|exp_avg`` and ``<name>|exp_avg_sq`` (safetensors, never a pickle), and in the metadata ``schema_version``,
``optimizer`` (``"AdamW"``), and ``state`` (JSON): ``{step: {name: int}, betas: [β1, β2], eps, lr, weight_decay}``,
``lr`` the mean learning rate of the steps of the epoch the checkpoint ends (what LESS weights the checkpoint by;
the group's current one where not known). A file whose tensors are not the ones written is refused (``content_sha256``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from ..errors import InputNotFoundError, UserInputError
from .fingerprint import tensors_digest
from .gradient_store import StoreFormatError, load_tensors, save_tensors
from .jsonfile import read_safetensors_header

OPTIMIZER_STATE = "optimizer_state.safetensors"
SCHEMA_VERSION = 1


@dataclass
class AdamState:
    """The Adam moments of each trained parameter and the optimiser's settings (see the module docstring)."""

    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: dict[str, int]
    betas: tuple[float, float]
    eps: float
    lr: float
    weight_decay: float = 0.0
    path: str | None = None

    def moments(self, name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(m, v, step)`` of parameter ``name``; one the file does not hold is refused naming both."""
        if name not in self.exp_avg:
            raise UserInputError(f"{self.path or 'the optimizer state'}: holds no Adam moments for {name!r} (it holds "
                                 f"{len(self.exp_avg)} parameters, e.g. {sorted(self.exp_avg)[:2]}): score the model "
                                 "the optimiser trained (the adapter directory the state was saved with)")
        return self.exp_avg[name], self.exp_avg_sq[name], self.step[name]


def adam_state_of(named_parameters: Mapping[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> AdamState:
    """The :class:`AdamState` of ``optimizer`` (``torch.optim.Adam`` / ``AdamW``) over ``named_parameters`` (the names
    recorded); a parameter it has no state for yet (never stepped) is left out."""
    names = {id(p): n for n, p in named_parameters.items()}
    m, v, step, group_of = {}, {}, {}, None
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st or "exp_avg" not in st or id(p) not in names:
                continue
            n = names[id(p)]
            m[n], v[n], step[n] = st["exp_avg"], st["exp_avg_sq"], int(st["step"])
            group_of = group_of or group
    if group_of is None:
        raise UserInputError("the optimizer holds no Adam moments (no step was taken): nothing to save")
    return AdamState(m, v, step, tuple(float(b) for b in group_of["betas"]), float(group_of["eps"]),
                     float(group_of["lr"]), float(group_of.get("weight_decay", 0.0)))


def save_adam_state(path: str | os.PathLike, state: AdamState) -> Path:
    """Write ``state`` to ``path`` (an ``optimizer_state.safetensors``), atomically."""
    tensors = {**{f"{n}|exp_avg": t for n, t in state.exp_avg.items()},
               **{f"{n}|exp_avg_sq": t for n, t in state.exp_avg_sq.items()}}
    meta = {"step": dict(sorted(state.step.items())), "betas": list(state.betas), "eps": state.eps, "lr": state.lr,
            "weight_decay": state.weight_decay}
    return save_tensors(path, tensors, {"schema_version": str(SCHEMA_VERSION), "optimizer": "AdamW",
                                        "state": json.dumps(meta, sort_keys=True),
                                        "content_sha256": tensors_digest(tensors)})


def read_adam_state(path: str | os.PathLike) -> AdamState:
    """The :class:`AdamState` of a checkpoint: ``path`` the file or the directory holding it (an epoch's adapter
    directory). A missing or damaged file is refused naming it."""
    p = Path(path)
    if p.is_dir():
        p = p / OPTIMIZER_STATE
    if not p.is_file():
        raise InputNotFoundError(f"{p}: no Adam optimizer state (LESS's training gradients need the one a LoRA warm-up "
                                 f"saves beside each epoch's adapters, {OPTIMIZER_STATE})")
    try:
        tensors, meta = load_tensors(p)
    except StoreFormatError as e:
        raise UserInputError(str(e)) from None
    if meta.get("schema_version") != str(SCHEMA_VERSION) or "state" not in meta:
        raise UserInputError(f"{p}: not an optimizer state file of this version (schema_version "
                             f"{meta.get('schema_version')!r}, expected {SCHEMA_VERSION})")
    if meta.get("content_sha256") != tensors_digest(tensors):
        raise UserInputError(f"{p}: its tensors are not the ones written (content_sha256 differs): save it again")
    st = json.loads(meta["state"])
    m = {k.rsplit("|", 1)[0]: t for k, t in tensors.items() if k.endswith("|exp_avg")}
    v = {k.rsplit("|", 1)[0]: t for k, t in tensors.items() if k.endswith("|exp_avg_sq")}
    if set(m) != set(v) or set(m) != set(st["step"]):
        raise UserInputError(f"{p}: the first moments, second moments and steps name different parameters")
    return AdamState(m, v, {k: int(s) for k, s in st["step"].items()}, tuple(st["betas"]), float(st["eps"]),
                     float(st["lr"]), float(st.get("weight_decay", 0.0)), path=str(p))


def recorded_lr(path: str | os.PathLike, what: str = "the checkpoint") -> float:
    """The learning rate recorded in a checkpoint's optimiser state (``path``: the file or its directory), read from
    the header alone: LESS's weight of the checkpoint. A checkpoint without one is refused naming ``what``."""
    p = Path(path)
    if p.is_dir():
        p = p / OPTIMIZER_STATE
    if not p.is_file():
        raise InputNotFoundError(f"{what}: no weight given and no {OPTIMIZER_STATE} at {p} to take its learning rate "
                                 "from; give the weight")
    meta = read_safetensors_header(p).get("__metadata__") or {}
    try:
        return float(json.loads(meta["state"])["lr"])
    except (KeyError, TypeError, ValueError):
        raise UserInputError(f"{p}: no learning rate recorded (metadata 'state.lr'); give {what}'s weight") from None
